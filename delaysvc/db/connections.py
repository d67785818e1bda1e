"""Joining the caller's transaction: whatever connection the caller holds, adapted to what the
store runs its statements on.

`joined(held)` takes what a caller passes as `connection=` and gives a `Joined`: the store's
statements (the same SQL for every driver) run through it in the caller's transaction, which
the caller commits or rolls back, and the driver's errors come out as SQLAlchemy's
`DBAPIError`s, as `Connection.execute` raises them, so the producer turns them into domain
errors in one place whatever the driver; one that stands for none is raised to the caller as
its own driver raised it (`raised_to_caller`). A caller may hold:

- a SQLAlchemy `Connection` or `Session`, on any PostgreSQL driver (a plain `postgresql://`
  URL selects psycopg2);
- a psycopg 3 `Connection`, or a psycopg2 connection;
- Django's `django.db.connection` or `connections[alias]` (see `delaysvc.contrib.django`);
- from asyncio (`run_async`): a SQLAlchemy `AsyncConnection` or `AsyncSession` (through their
  `run_sync`), or a psycopg `AsyncConnection` (its coroutines awaited from the greenlet
  SQLAlchemy's own `run_sync` uses).

A psycopg 3 connection (and a SQLAlchemy one on psycopg 3) also lends a cursor of its own
(`psycopg_cursor`): a single send is then a prepared statement and a batch is COPYed in;
other drivers run the same statements through `execute`, a batch staged from one JSON document.
A psycopg 3 connection the caller has in pipeline mode (`with conn.pipeline():`) lends none,
since psycopg has no COPY there: its batches are staged too, and each statement is synced
(`_synced`), so its rows are read as anywhere else.

A connection in autocommit mode with no transaction open (Django outside `atomic()`, a psycopg
connection with `autocommit=True`) commits each statement by itself: a single send is one
statement and is stored by it; a write of more statements (a batch, a capped send, a cancel)
gets a transaction of its own there (`transaction()`). In the caller's transaction it simply
runs: no savepoint, and an error delaysvc raises before writing (`BacklogFull`, a
`ValidationError`) leaves that transaction usable.
"""

from __future__ import annotations

import json
import sys
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import UTC, datetime, timezone
from functools import cache
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg.pq import PipelineStatus, TransactionStatus
from psycopg.rows import tuple_row
from sqlalchemy import Connection, Engine, TextClause
from sqlalchemy.exc import DBAPIError, MultipleResultsFound, NoResultFound
from sqlalchemy.orm import Session

from delaysvc.config import extras
from delaysvc.db.engines import driver_errors
from delaysvc.db.names import driver_sql
from delaysvc.errors import ValidationError

_T = TypeVar("_T")

ALLOWED = (
    "a SQLAlchemy Connection or Session, a psycopg or psycopg2 connection, or Django's "
    "django.db.connection; from asyncio (delaysvc.asend), a SQLAlchemy AsyncConnection or "
    "AsyncSession, or a psycopg AsyncConnection"
)


class Joined(Protocol):
    """A connection the caller holds, as the producer writes through it."""

    def execute(
        self, statement: TextClause, parameters: Mapping[str, Any] | None = None, /
    ) -> Any: ...

    def psycopg_cursor(self) -> AbstractContextManager[psycopg.Cursor[Any] | None]:
        """A psycopg 3 cursor in this transaction (errors as `execute`'s), or None."""
        ...

    def transaction(self) -> AbstractContextManager[None]:
        """Around a write of more than one statement: a transaction of its own if the
        connection is autocommitting, else nothing (the caller's transaction holds it)."""
        ...

    def autocommits(self) -> bool:
        """Statements commit by themselves: the caller has no transaction open."""
        ...


@contextmanager
def joined(held: object) -> Iterator[Joined]:
    """The `Joined` for what the caller holds (see the module's docstring); a thing delaysvc
    cannot join is a ValidationError naming what it can."""
    if isinstance(held, Session):
        yield SqlAlchemyJoined(held.connection())
    elif isinstance(held, Connection):
        yield SqlAlchemyJoined(held)
    else:
        driver = _driver(held)
        if driver.closed_by_caller():
            # not "the database is unavailable": the outage an application retries
            raise ValidationError("connection", "is closed; pass an open one")
        adapter = DriverJoined(driver)
        try:
            yield adapter
        finally:
            adapter.close()


async def run_async(held: object, call: Callable[[Any], _T]) -> _T:
    """`call(connection)` from asyncio. With a SQLAlchemy AsyncConnection or AsyncSession,
    through its `run_sync` (`call` gets the sync Connection or Session); with a psycopg
    AsyncConnection, in the same kind of greenlet, which awaits its coroutines. With none, the
    call runs in a worker thread, on the producer's own engine: the same one-statement send,
    pool and retry as `send`, at the cost of a thread hop."""
    if held is None:
        import asyncio

        return await asyncio.to_thread(call, None)
    if isinstance(held, psycopg.AsyncConnection):
        # said before SQLAlchemy's asyncio module is imported: without greenlet, its import
        # fails naming `sqlalchemy[asyncio]`, not delaysvc's extra
        extras.require("await delaysvc.asend(connection=<a psycopg AsyncConnection>)", "asyncio")
        from sqlalchemy.util import greenlet_spawn

        return await greenlet_spawn(call, held)
    if not extras.missing("asyncio"):  # else no SQLAlchemy AsyncConnection can have been made
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

        if isinstance(held, AsyncConnection | AsyncSession):
            return await held.run_sync(call)
    raise ValidationError(
        "connection", f"cannot join a {_name(held)} from asyncio; allowed: {ALLOWED}"
    )


# ---------------------------------------------------------------- SQLAlchemy


class SqlAlchemyJoined:
    """A SQLAlchemy Connection: its own `execute` (any driver); SQLAlchemy begins the
    transaction with the first statement, as it would for the caller's."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def execute(self, statement: TextClause, parameters: Mapping[str, Any] | None = None, /) -> Any:
        return self.conn.execute(statement, parameters)

    def psycopg_cursor(self) -> AbstractContextManager[psycopg.Cursor[Any] | None]:
        dialect = self.conn.dialect
        if dialect.driver == "psycopg" and not dialect.is_async:  # under run_sync: no cursor
            return driver_errors(self.conn)
        return nullcontext(None)

    def transaction(self) -> AbstractContextManager[Any]:
        if self.autocommits():  # isolation_level="AUTOCOMMIT"
            return _autocommit_off(self.conn.connection.dbapi_connection)
        return nullcontext()

    def autocommits(self) -> bool:
        return _autocommitting(self.conn.connection.dbapi_connection)


def _autocommitting(dbapi_connection: Any) -> bool:
    """In autocommit mode with no transaction open: psycopg 3 and psycopg2 connections and
    SQLAlchemy's adapters of async ones."""
    if not getattr(dbapi_connection, "autocommit", False):
        return False
    info = getattr(dbapi_connection, "info", None)
    if isinstance(info, psycopg.ConnectionInfo):
        if info.transaction_status == TransactionStatus.ACTIVE and _in_pipeline(dbapi_connection):
            # busy with what the caller queued in pipeline mode: sent, the status is its own
            # (taken for the caller's transaction, a batch's statements each committed alone)
            _sync_pipeline(dbapi_connection)
        return info.transaction_status == TransactionStatus.IDLE
    status = getattr(dbapi_connection, "get_transaction_status", None)  # psycopg2
    return status is None or status() == 0  # TRANSACTION_STATUS_IDLE


@contextmanager
def _autocommit_off(dbapi_connection: Any) -> Iterator[None]:
    """A transaction of its own on an autocommitting DBAPI connection: autocommit off until it
    commits (or rolls back on an error), then on again, as the caller had it."""
    dbapi_connection.autocommit = False
    try:
        yield
    except BaseException:
        if not dbapi_connection.closed:
            dbapi_connection.rollback()
        raise
    else:
        dbapi_connection.commit()
    finally:
        if not dbapi_connection.closed:
            dbapi_connection.autocommit = True


# ---------------------------------------------------------------- DBAPI connections


class _Driver(Protocol):
    """What `DriverJoined` needs of one kind of DBAPI connection."""

    dbapi_error: type[Exception]  # the driver's base error class

    def cursor(self) -> Any:
        """A cursor giving rows as tuples: `execute(sql, params)`, `fetchall`, `description`,
        `rowcount`, `close`."""
        ...

    def caught(self, exc: BaseException) -> BaseException | None:
        """The driver's error behind `exc`, if `exc` is one (or wraps one)."""
        ...

    def lost(self) -> bool:
        """The connection is gone (after an error)."""
        ...

    def autocommits(self) -> bool: ...

    def closed_by_caller(self) -> bool:
        """The caller closed the connection (not lost: that is the database unavailable)."""
        ...

    def own_transaction(self) -> AbstractContextManager[Any]:
        """BEGIN ... COMMIT (ROLLBACK on an error) on an autocommitting connection."""
        ...

    def psycopg_cursor(self) -> psycopg.Cursor[Any] | None: ...


class DriverJoined:
    """A DBAPI connection: each statement compiled once to `%(name)s` form (psycopg 3,
    psycopg2 and Django's cursors all take it) and run on one cursor; rows read back by name
    and position, as SQLAlchemy's; json parsed whatever the driver was told (`_read_rows`)."""

    def __init__(self, driver: _Driver):
        self.driver = driver
        self._cursor: Any = None

    def execute(self, statement: TextClause, parameters: Mapping[str, Any] | None = None, /) -> Any:
        sql = driver_sql(statement.text)
        with self._errors(sql):
            if self._cursor is None:
                self._cursor = self.driver.cursor()
            cursor = self._cursor
            with _synced(cursor):
                cursor.execute(sql, dict(parameters or {}))  # a mapping: `%%` is read as `%`
            description = cursor.description
            rows = cursor.fetchall() if description is not None else []
            return Rows(_read_rows(description, rows), cursor.rowcount)

    @contextmanager
    def psycopg_cursor(self) -> Iterator[psycopg.Cursor[Any] | None]:
        with self._errors(None):
            cursor = self.driver.psycopg_cursor()
            if cursor is None:
                yield None
                return
            with cursor:
                yield cursor

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._errors(None):
            autocommits = self.driver.autocommits()
        if not autocommits:
            yield
            return
        with self._errors(None), self.driver.own_transaction():
            yield

    def autocommits(self) -> bool:
        with self._errors(None):
            return self.driver.autocommits()

    def close(self) -> None:
        if self._cursor is not None:
            cursor, self._cursor = self._cursor, None
            try:
                cursor.close()
            except Exception as exc:  # a cursor of a lost connection
                if self.driver.caught(exc) is None:
                    raise

    @contextmanager
    def _errors(self, sql: str | None) -> Iterator[None]:
        """The driver's errors as SQLAlchemy's (`connection_invalidated`: it was lost)."""
        try:
            yield
        except Exception as exc:
            error = self.driver.caught(exc)
            if not isinstance(error, self.driver.dbapi_error):
                raise
            wrapped = DBAPIError.instance(
                sql, None, error, self.driver.dbapi_error, connection_invalidated=self.driver.lost()
            )
            wrapped.raised_to_caller = exc  # type: ignore[attr-defined]  # (`raised_to_caller`)
            raise wrapped from exc


def raised_to_caller(exc: DBAPIError) -> BaseException | None:
    """What the caller's own driver (or Django) raised behind `exc`, when delaysvc ran its
    statement on a connection the caller holds that is not SQLAlchemy's: the error a database
    error delaysvc does not name is raised as, so the caller's `except psycopg.Error` (or
    psycopg2's, or Django's `DatabaseError`) catches it, as it would its own statement's."""
    return getattr(exc, "raised_to_caller", None)


def _synced(cursor: Any) -> AbstractContextManager[Any]:
    """Around a statement on a psycopg 3 connection the caller has in pipeline mode
    (`with conn.pipeline():`): a pipeline block of its own, whose end sends it with whatever
    the caller queued before and waits for the results, so its rows (and its errors) are
    there to read, as on any other connection. Elsewhere nothing."""
    if isinstance(cursor, psycopg.Cursor) and _in_pipeline(cursor.connection):
        return cursor.connection.pipeline()
    return nullcontext()


def _in_pipeline(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    return conn.pgconn.pipeline_status != PipelineStatus.OFF


def _sync_pipeline(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Send what is queued in the pipeline and wait for its results: a pipeline block of its
    own ends so (`_synced`); an AsyncConnection's from the greenlet `run_async` runs in."""
    if isinstance(conn, psycopg.AsyncConnection):
        from sqlalchemy.util import await_only

        await_only(_sync_async_pipeline(conn))
        return
    with conn.pipeline():
        pass


async def _sync_async_pipeline(conn: psycopg.AsyncConnection[Any]) -> None:
    async with conn.pipeline():
        pass


class Rows:
    """A statement's result, read as the store reads SQLAlchemy's."""

    def __init__(self, rows: list[Any], rowcount: int):
        self._rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)

    def all(self) -> list[Any]:
        return list(self._rows)

    fetchall = all

    def first(self) -> Any:
        return self._rows[0] if self._rows else None

    def one(self) -> Any:
        if len(self._rows) != 1:
            raise (NoResultFound if not self._rows else MultipleResultsFound)(
                f"expected one row, got {len(self._rows)}"
            )
        return self._rows[0]

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        return self.one()[0]

    def scalars(self) -> list[Any]:
        return [row[0] for row in self._rows]


_JSON, _JSONB, _TIMESTAMPTZ = 114, 3802, 1184  # type OIDs


def _read_rows(description: Sequence[Any] | None, rows: Sequence[Sequence[Any]]) -> list[Any]:
    """Rows with their columns by name, json parsed (Django has its drivers give jsonb as text,
    for its JSONField to parse), times in UTC (a connection's session may have a time zone of
    its own: Django's `TIME_ZONE` with `USE_TZ=False`), as a `Message` has them everywhere. A
    bytea stays as the driver gives it, as under SQLAlchemy."""
    if description is None:
        return []
    row_type = _row_type(tuple(column[0] for column in description))
    json_columns = [i for i, column in enumerate(description) if column[1] in (_JSON, _JSONB)]
    time_columns = [i for i, column in enumerate(description) if column[1] == _TIMESTAMPTZ]
    if not json_columns and not time_columns:
        return [row_type(*row) for row in rows]
    read = []
    for row in rows:
        values = list(row)
        for i in json_columns:
            if isinstance(values[i], str):
                values[i] = json.loads(values[i])
        for i in time_columns:
            at = values[i]
            if isinstance(at, datetime) and at.tzinfo is not UTC:
                values[i] = at.astimezone(UTC)  # a naive one (not expected): the local zone's
        read.append(row_type(*values))
    return read


@cache
def _row_type(names: tuple[str, ...]) -> Any:
    return namedtuple("Row", names, rename=True)


def _driver(held: object) -> _Driver:
    if isinstance(held, psycopg.Connection):
        return _Psycopg(held)
    if isinstance(held, psycopg.AsyncConnection):
        from sqlalchemy.util.concurrency import in_greenlet

        if in_greenlet():
            return _AsyncPsycopg(held)
        raise ValidationError(
            "connection", "a psycopg AsyncConnection needs `await delaysvc.asend(...)`"
        )
    psycopg2 = sys.modules.get("psycopg2.extensions")  # not imported: cannot be held
    if psycopg2 is not None and isinstance(held, psycopg2.connection):
        return _Psycopg2(held)
    if "django.db" in sys.modules:
        wrapper = _django_connection(held)
        if wrapper is not None:
            return _Django(wrapper)
    raise ValidationError("connection", _why_not(held))


def _why_not(held: object) -> str:
    if isinstance(held, Engine):
        return (
            "an Engine has no transaction to join: pass a Connection of it in your "
            "transaction (engine.begin()), or leave connection out for one of delaysvc's own"
        )
    if type(held).__module__.startswith("sqlalchemy.ext.asyncio"):
        return f"a {_name(held)} needs `await delaysvc.asend(...)` (or asend_batch, acancel)"
    return f"cannot join a {_name(held)}; allowed: {ALLOWED}"


def _name(held: object) -> str:
    return f"{type(held).__module__}.{type(held).__qualname__}"


def _is_lost(driver_connection: Any) -> bool:
    """psycopg 3 (`broken`, `closed`) and psycopg2 (`closed` is 2 when broken) alike."""
    return driver_connection is None or bool(
        getattr(driver_connection, "broken", False) or driver_connection.closed
    )


class _Psycopg:
    dbapi_error: type[Exception] = psycopg.Error

    def __init__(self, conn: psycopg.Connection[Any]):
        self.conn = conn

    def cursor(self) -> Any:
        # server-side binding and tuples, whatever the connection's own factories
        return psycopg.Cursor(self.conn, row_factory=tuple_row)

    def psycopg_cursor(self) -> psycopg.Cursor[Any] | None:
        """None in pipeline mode, where psycopg has no COPY: a batch is then staged and
        inserted by `execute`'s statements, as on other drivers, each synced (`_synced`)."""
        if _in_pipeline(self.conn):
            return None
        return self.cursor()

    def caught(self, exc: BaseException) -> BaseException | None:
        return exc if isinstance(exc, psycopg.Error) else None

    def lost(self) -> bool:
        return _is_lost(self.conn)

    def autocommits(self) -> bool:
        return _autocommitting(self.conn)

    def closed_by_caller(self) -> bool:
        return self.conn.closed and not self.conn.broken

    def own_transaction(self) -> AbstractContextManager[Any]:
        return self.conn.transaction()  # BEGIN: the connection has no transaction open


class _Psycopg2:
    def __init__(self, conn: Any):
        import psycopg2
        import psycopg2.extensions

        self.conn = conn
        self.dbapi_error = psycopg2.Error
        self._extensions = psycopg2.extensions

    def cursor(self) -> Any:
        # the plain cursor, whatever the connection's factory (RealDictCursor...)
        return self.conn.cursor(cursor_factory=self._extensions.cursor)

    def psycopg_cursor(self) -> None:
        return None

    def caught(self, exc: BaseException) -> BaseException | None:
        return exc if isinstance(exc, self.dbapi_error) else None

    def lost(self) -> bool:
        return _is_lost(self.conn)

    def autocommits(self) -> bool:
        return _autocommitting(self.conn)

    def closed_by_caller(self) -> bool:
        return self.conn.closed == 1  # 2: lost

    def own_transaction(self) -> AbstractContextManager[Any]:
        return _autocommit_off(self.conn)


class _AsyncPsycopg:
    """A psycopg AsyncConnection, from a greenlet that awaits its coroutines."""

    dbapi_error: type[Exception] = psycopg.Error

    def __init__(self, conn: psycopg.AsyncConnection[Any]):
        self.conn = conn

    def cursor(self) -> Any:
        return _AwaitedCursor(psycopg.AsyncCursor(self.conn, row_factory=tuple_row))

    def psycopg_cursor(self) -> None:
        return None

    def caught(self, exc: BaseException) -> BaseException | None:
        return exc if isinstance(exc, psycopg.Error) else None

    def lost(self) -> bool:
        return _is_lost(self.conn)

    def autocommits(self) -> bool:
        return _autocommitting(self.conn)

    def closed_by_caller(self) -> bool:
        return self.conn.closed and not self.conn.broken

    @contextmanager
    def own_transaction(self) -> Iterator[None]:
        from sqlalchemy.util import await_only

        await_only(self.conn.set_autocommit(False))
        try:
            yield
        except BaseException:
            if not self.conn.closed:
                await_only(self.conn.rollback())
            raise
        else:
            await_only(self.conn.commit())
        finally:
            if not self.conn.closed:
                await_only(self.conn.set_autocommit(True))


class _AwaitedCursor:
    """An async psycopg cursor used like a sync one, from a greenlet."""

    def __init__(self, cursor: psycopg.AsyncCursor[Any]):
        self._cursor = cursor

    def execute(self, sql: str, params: Mapping[str, Any]) -> None:
        from sqlalchemy.util import await_only

        await_only(self._execute(sql, params))

    async def _execute(self, sql: str, params: Mapping[str, Any]) -> None:
        """In pipeline mode synced, as a sync cursor's statement is (`_synced`): unsynced, its
        rows were not there to read (a send read as one that stored nothing)."""
        if not _in_pipeline(self._cursor.connection):
            await self._cursor.execute(sql, params)
            return
        async with self._cursor.connection.pipeline():
            await self._cursor.execute(sql, params)

    def fetchall(self) -> list[Any]:
        from sqlalchemy.util import await_only

        return await_only(self._cursor.fetchall())

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    def close(self) -> None:
        from sqlalchemy.util import await_only

        await_only(self._cursor.close())


def _django_connection(held: object) -> Any:
    """Django's connection (`DatabaseWrapper`) if `held` is one, or `django.db.connection`
    (a proxy of the default alias's), else None."""
    from django.db import connections
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.utils.connection import ConnectionProxy

    if isinstance(held, ConnectionProxy):
        held = connections[held.alias]
    if not isinstance(held, BaseDatabaseWrapper):
        return None
    if held.vendor != "postgresql":
        raise ValidationError(
            "connection",
            f"Django's database {held.alias!r} is {held.vendor}; delaysvc needs PostgreSQL",
        )
    return held


class _Django:
    """Django's connection, through Django's own cursor (its execute wrappers, query logging and
    broken-transaction check apply); `atomic()` is the caller's transaction."""

    def __init__(self, wrapper: Any):
        self.wrapper = wrapper
        self.dbapi_error: type[Exception] = wrapper.Database.Error  # psycopg's or psycopg2's

    def cursor(self) -> Any:
        """Django's cursor, giving a timestamptz as an aware time whatever `USE_TZ` says
        (`_aware_times`)."""
        cursor = self.wrapper.cursor()
        _aware_times(cursor.cursor)
        return cursor

    def psycopg_cursor(self) -> None:
        return None

    def caught(self, exc: BaseException) -> BaseException | None:
        """Django re-raises a driver's error as its own, the driver's as the cause."""
        from django.db import Error as DjangoError

        if isinstance(exc, DjangoError) and isinstance(exc.__cause__, self.dbapi_error):
            return exc.__cause__
        return exc if isinstance(exc, self.dbapi_error) else None

    def lost(self) -> bool:
        return _is_lost(self.wrapper.connection)

    def autocommits(self) -> bool:
        return bool(self.wrapper.get_autocommit()) and not self.wrapper.in_atomic_block

    def closed_by_caller(self) -> bool:
        return False  # Django connects again by itself

    def own_transaction(self) -> AbstractContextManager[Any]:
        from django.db import transaction

        return transaction.atomic(using=self.wrapper.alias)


def _aware_times(cursor: Any) -> None:
    """Have a driver cursor of Django's give a timestamptz as an aware time, as the driver
    does by default. With `USE_TZ=False` Django has it give naive times of the connection's
    time zone (`TIME_ZONE`): psycopg 3 by a loader of its own, psycopg2 with no
    `tzinfo_factory`. Only this cursor is changed, not Django's others; `_read_rows` then
    gives the times in UTC."""
    if isinstance(cursor, psycopg.Cursor):
        from psycopg.types.datetime import TimestamptzBinaryLoader, TimestamptzLoader

        cursor.adapters.register_loader("timestamptz", TimestamptzLoader)
        cursor.adapters.register_loader("timestamptz", TimestamptzBinaryLoader)
    elif getattr(cursor, "tzinfo_factory", False) is None:  # psycopg2
        cursor.tzinfo_factory = timezone
