"""Joining the caller's transaction on whatever connection it holds: SQLAlchemy on psycopg 3
and on psycopg2, a plain psycopg 3 connection (in a transaction, or autocommitting), a plain
psycopg2 connection. Each: a rollback stores nothing, a commit stores once, the key dedupes
across transactions, the message then runs like any other; batches, cancels, caps and a lost
connection behave as on our own connections."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg2
import psycopg2.errors
import psycopg2.extras
import pytest
import sqlalchemy.exc
from psycopg.rows import dict_row
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.orm import Session

from delaysvc.config.settings import Settings
from delaysvc.db.engines import libpq_url
from delaysvc.errors import BacklogFull, DatabaseUnavailable, NotFound, ValidationError
from delaysvc.producer.sending import Producer
from tests.support.joined_checks import (
    BODY,
    NOTHING,
    Rollback,
    clean_registry,  # noqa: F401  (a fixture)
    psycopg2_url,
    runs_like_any_other,
    stored,
)


@dataclass(frozen=True)
class Held:
    """One way a caller holds a connection: `transaction()` yields what it passes as
    `connection=`, commits when the block ends, rolls back when it raises."""

    name: str
    transaction: Callable[[], AbstractContextManager[Any]]


@pytest.fixture
def psycopg2_engine(database_url: str) -> Iterator[Engine]:
    engine = create_engine(psycopg2_url(database_url))
    assert engine.dialect.driver == "psycopg2"
    yield engine
    engine.dispose()


def _ways(database_url: str, engine: Engine, psycopg2_engine: Engine) -> dict[str, Held]:
    dsn = libpq_url(database_url)

    @contextmanager
    def sa_connection(on: Engine) -> Iterator[Any]:
        with on.connect() as conn, conn.begin():
            yield conn

    @contextmanager
    def sa_session(on: Engine) -> Iterator[Any]:
        with Session(on) as session, session.begin():
            yield session

    @contextmanager
    def psycopg3() -> Iterator[Any]:
        # rows as dicts on the caller's connection: delaysvc's cursors read tuples anyway
        with psycopg.connect(dsn, row_factory=dict_row) as conn:  # commit or rollback at exit
            yield conn

    @contextmanager
    def psycopg3_autocommit_in_transaction() -> Iterator[Any]:
        with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
            yield conn

    @contextmanager
    def psycopg3_pipeline() -> Iterator[Any]:
        # the caller's statements and delaysvc's sent in psycopg's pipeline mode
        with psycopg.connect(dsn) as conn, conn.pipeline():
            yield conn

    @contextmanager
    def psycopg2_plain() -> Iterator[Any]:
        conn = psycopg2.connect(dsn, cursor_factory=psycopg2.extras.RealDictCursor)
        try:
            with conn:  # commit or rollback at exit
                yield conn
        finally:
            conn.close()

    return {
        way.name: way
        for way in (
            Held("sqlalchemy-psycopg3-connection", lambda: sa_connection(engine)),
            Held("sqlalchemy-psycopg3-session", lambda: sa_session(engine)),
            Held("sqlalchemy-psycopg2-connection", lambda: sa_connection(psycopg2_engine)),
            Held("sqlalchemy-psycopg2-session", lambda: sa_session(psycopg2_engine)),
            Held("psycopg3", psycopg3),
            Held("psycopg3-autocommit-transaction", psycopg3_autocommit_in_transaction),
            Held("psycopg3-pipeline", psycopg3_pipeline),
            Held("psycopg2", psycopg2_plain),
        )
    }


WAYS = [
    "sqlalchemy-psycopg3-connection",
    "sqlalchemy-psycopg3-session",
    "sqlalchemy-psycopg2-connection",
    "sqlalchemy-psycopg2-session",
    "psycopg3",
    "psycopg3-autocommit-transaction",
    "psycopg3-pipeline",
    "psycopg2",
]


@pytest.fixture(params=WAYS)
def held(request, database_url: str, engine: Engine, psycopg2_engine: Engine) -> Held:
    return _ways(database_url, engine, psycopg2_engine)[request.param]


def test_a_rollback_stores_nothing(producer: Producer, engine: Engine, held: Held) -> None:
    with pytest.raises(Rollback), held.transaction() as conn:
        message = producer.send("shop.cancel", BODY, delay_level=2, key="o-1", connection=conn)
        assert message.created is True
        seen = producer.get(message.id, connection=conn)  # visible in the caller's transaction
        assert (seen.status, seen.body) == ("scheduled", BODY)
        batch = producer.send_batch(
            [{"topic": "shop.cancel", "body": n, "delay": "7s"} for n in range(3)],
            connection=conn,
        )
        assert [m.created for m in batch] == [True, True, True]
        raise Rollback
    assert stored(engine, "shop.cancel") == NOTHING
    with pytest.raises(NotFound):
        producer.get(message.id)


@pytest.mark.usefixtures("clean_registry")
def test_a_commit_stores_once_and_the_key_then_returns_it(
    settings: Settings, producer: Producer, engine: Engine, held: Held
) -> None:
    with held.transaction() as conn:
        first = producer.send("shop.cancel", BODY, delay_level=2, key="o-42%", connection=conn)
    assert stored(engine, "shop.cancel") == {
        **NOTHING,
        "commit_log": [first.id],
        "levels": [(2, first.id)],
    }
    with held.transaction() as conn:
        again = producer.send("shop.cancel", {"other": 1}, delay="7s", key="o-42%", connection=conn)
    assert (again.id, again.created, again.body, again.status) == (
        first.id,
        False,
        BODY,
        "scheduled",
    )
    assert again.properties == {} and again.tags == []
    assert stored(engine, "shop.cancel")["commit_log"] == [first.id]
    assert producer.get(first.id).body == BODY
    runs_like_any_other(settings, engine, first)


def test_a_batch_commits_with_the_caller_and_dedupes_its_keys(
    producer: Producer, engine: Engine, held: Held
) -> None:
    existing = producer.send("shop.batch", "old", delay_level=1, key="dup", properties={"a": "b"})
    with held.transaction() as conn:
        sent = producer.send_batch(
            [
                {"topic": "shop.batch", "body": b"\x00\xff", "delay_level": 3, "tags": ["x"]},
                {"topic": "shop.batch", "body": {"n": 2}, "delay": "7s", "key": "new"},
                {"topic": "shop.batch", "body": 3, "key": "dup"},
                {"topic": "shop.batch", "body": 4, "key": "new"},
                {"topic": "shop.batch", "body": 5, "properties": {"p": "v"}},
            ],
            connection=conn,
        )
    assert [m.created for m in sent] == [True, True, False, False, True]
    assert (sent[2].id, sent[2].properties, sent[2].body) == (existing.id, {"a": "b"}, "old")
    assert sent[3].id == sent[1].id
    assert stored(engine, "shop.batch") == {
        "commit_log": sorted([existing.id, sent[0].id, sent[1].id, sent[4].id]),
        "levels": [(1, existing.id), (3, sent[0].id)],
        "timer": [sent[1].id],
        "ready": [sent[4].id],
    }
    kept = producer.get(sent[0].id)
    assert (kept.body, kept.tags) == (b"\x00\xff", ["x"])
    assert producer.get(sent[4].id).properties == {"p": "v"}


def test_a_cancel_commits_or_rolls_back_with_the_caller(
    producer: Producer, engine: Engine, held: Held
) -> None:
    waiting = producer.send("shop.cancel", 1, delay_level=2, key="c-1")
    with pytest.raises(Rollback), held.transaction() as conn:
        assert producer.cancel(waiting.id, connection=conn).status == "cancelled"
        raise Rollback
    assert producer.get(waiting.id).status == "scheduled"
    with held.transaction() as conn:
        cancelled = producer.cancel(topic="shop.cancel", key="c-1", connection=conn)
        assert producer.find("shop.cancel", "c-1", connection=conn).status == "cancelled"
    assert (cancelled.id, producer.get(waiting.id).status) == (waiting.id, "cancelled")
    assert stored(engine, "shop.cancel")["levels"] == []


def test_a_refused_send_leaves_the_callers_transaction_usable(
    database_url: str, engine: Engine, held: Held
) -> None:
    """A `reject` cap refuses before writing anything: the caller's transaction goes on, and
    what it did and sent before commits."""
    capped = Producer(
        Settings(
            database_url=database_url,
            delay_levels="1s 2s 3s 5s 8s",
            backlog_caps="level:2=1:reject",
        ),
        engine,
    )
    with held.transaction() as conn:
        kept = capped.send("shop.capped", 1, delay_level=2, connection=conn)
        with pytest.raises(BacklogFull, match="level 2 holds 1 waiting messages"):
            capped.send("shop.capped", 2, delay_level=2, connection=conn)
        also = capped.send("shop.capped", 3, delay_level=1, connection=conn)
    assert stored(engine, "shop.capped")["commit_log"] == [kept.id, also.id]


@pytest.mark.parametrize(
    "autocommit",
    [
        "psycopg3",
        "psycopg3-pipeline",
        "psycopg3-pipeline-queued",
        "psycopg2",
        "sqlalchemy-psycopg3",
        "sqlalchemy-psycopg2",
    ],
)
def test_on_an_autocommitting_connection_each_call_commits_by_itself(
    producer: Producer,
    engine: Engine,
    psycopg2_engine: Engine,
    database_url: str,
    autocommit: str,
) -> None:
    """No transaction open: a send is one statement and commits by itself; a batch and a
    cancel each get a transaction of their own (a batch's staging table is emptied at commit:
    without one it would store nothing). Each is stored before the connection closes. In
    pipeline mode with a statement of the caller's queued (`-queued`), the connection reads as
    busy, not idle: the batch took it for the caller's transaction, autocommitted its staging
    rows away, stored nothing and raised a DuplicateKey for key None; a cancel was two
    transactions."""
    dsn = libpq_url(database_url)
    pipeline: AbstractContextManager[Any] = nullcontext()
    if autocommit.startswith("psycopg3"):
        conn: Any = psycopg.connect(dsn, autocommit=True)
        driver = conn
        if autocommit.startswith("psycopg3-pipeline"):
            pipeline = conn.pipeline()
    elif autocommit == "psycopg2":
        conn = driver = psycopg2.connect(dsn)
        conn.autocommit = True
    else:
        on = engine if autocommit == "sqlalchemy-psycopg3" else psycopg2_engine
        conn = on.connect().execution_options(isolation_level="AUTOCOMMIT")
        driver = conn.connection.dbapi_connection

    def queue() -> None:  # a statement of the caller's, waiting in the pipeline
        if autocommit == "psycopg3-pipeline-queued":
            driver.execute("SELECT 1")

    try:
        with pipeline:
            queue()
            one = producer.send("shop.auto", 1, delay_level=2, key="k", connection=conn)
            assert producer.send("shop.auto", 9, key="k", connection=conn).id == one.id
            queue()
            batch = producer.send_batch(
                [{"topic": "shop.auto", "body": n, "delay_level": 1} for n in range(3)],
                connection=conn,
            )
            queue()
            producer.cancel(batch[0].id, connection=conn)
            assert driver.autocommit is True  # as the caller left it
        assert stored(engine, "shop.auto") == {
            **NOTHING,
            "commit_log": [one.id, *(m.id for m in batch)],
            "levels": [(1, batch[1].id), (1, batch[2].id), (2, one.id)],
        }
    finally:
        conn.close()


def test_our_own_engine_on_psycopg2_sends_batches_and_cancels(
    settings: Settings, psycopg2_engine: Engine, engine: Engine
) -> None:
    """`delaysvc.configure(engine=...)` with an application's psycopg2 engine: no connection
    given, each call is a transaction of its own on it."""
    producer = Producer(settings, psycopg2_engine)
    one = producer.send("shop.own", BODY, delay="7s", key="k")
    assert producer.send("shop.own", 2, key="k").id == one.id
    batch = producer.send_batch([{"topic": "shop.own", "body": n} for n in range(2)])
    assert producer.cancel(one.id).status == "cancelled"
    assert stored(engine, "shop.own") == {
        **NOTHING,
        "commit_log": [one.id, *(m.id for m in batch)],
        "ready": [m.id for m in batch],
    }


@pytest.mark.parametrize("driver", ["psycopg3", "psycopg2", "sqlalchemy-psycopg2"])
def test_a_lost_connection_is_database_unavailable_and_nothing_stored(
    producer: Producer, engine: Engine, database_url: str, psycopg2_engine: Engine, driver: str
) -> None:
    dsn = libpq_url(database_url)
    if driver == "psycopg3":
        conn: Any = psycopg.connect(dsn)
        pid = conn.info.backend_pid
    elif driver == "psycopg2":
        conn = psycopg2.connect(dsn)
        pid = conn.get_backend_pid()
    else:
        conn = psycopg2_engine.connect()
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    try:
        producer.send("shop.lost", 0, connection=conn)  # the caller's transaction is open
        with engine.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(DatabaseUnavailable, match="nothing was stored") as lost:
            producer.send("shop.lost", 1, connection=conn)
        assert lost.value.maybe_stored is False
    finally:
        conn.close()
    assert stored(engine, "shop.lost") == NOTHING


def test_a_thing_that_cannot_be_joined_is_refused_by_name(
    producer: Producer, engine: Engine
) -> None:
    with pytest.raises(ValidationError, match="an Engine has no transaction to join") as error:
        producer.send("t", 1, connection=engine)
    assert error.value.field == "connection"
    with pytest.raises(
        ValidationError, match=r"cannot join a builtins\.dict; allowed: a SQLAlchemy"
    ):
        producer.send("t", 1, connection={})
    assert stored(engine, "t") == NOTHING


def test_a_database_error_delaysvc_does_not_name_is_the_callers_drivers_own(
    producer: Producer, held: Held
) -> None:
    """A send in a transaction an earlier statement aborted: PostgreSQL refuses it. A psycopg
    or psycopg2 caller got SQLAlchemy's InternalError, which its `except psycopg.Error` (or
    `psycopg2.Error`) does not catch; it now gets its driver's own error, and a SQLAlchemy
    caller SQLAlchemy's, as each would from its own statement."""
    with held.transaction() as conn:
        if isinstance(conn, Connection | Session):
            expected: type[Exception] = sqlalchemy.exc.DBAPIError
            with pytest.raises(sqlalchemy.exc.DBAPIError):
                conn.execute(text("SELECT 1/0"))
        elif isinstance(conn, psycopg.Connection):
            # in pipeline mode, psycopg's PipelineAborted until the caller syncs
            expected = psycopg.Error if held.name.endswith("pipeline") else (
                psycopg.errors.InFailedSqlTransaction
            )  # fmt: skip
            with pytest.raises(psycopg.errors.DivisionByZero):
                conn.execute("SELECT 1/0").fetchall()
        else:
            expected = psycopg2.errors.InFailedSqlTransaction
            with pytest.raises(psycopg2.errors.DivisionByZero):
                conn.cursor().execute("SELECT 1/0")
        with pytest.raises(expected) as raised:
            producer.send("shop.aborted", 1, connection=conn)
        assert "sqlalche.me" not in str(raised.value) or expected is sqlalchemy.exc.DBAPIError


@pytest.mark.parametrize("driver", ["psycopg3", "psycopg2"])
def test_a_connection_the_caller_closed_is_named_not_the_database_unavailable(
    producer: Producer, database_url: str, driver: str
) -> None:
    """It said "the database is unavailable": the outage an application retries or answers
    with a 503, where the database is fine and the caller's connection was closed."""
    dsn = libpq_url(database_url)
    conn: Any = psycopg.connect(dsn) if driver == "psycopg3" else psycopg2.connect(dsn)
    conn.close()
    for call in (
        lambda: producer.send("shop.closed", 1, connection=conn),
        lambda: producer.send_batch([{"topic": "shop.closed", "body": 1}], connection=conn),
    ):
        with pytest.raises(ValidationError, match="connection: is closed; pass an open one"):
            call()
