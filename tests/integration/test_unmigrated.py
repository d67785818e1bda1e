"""A database delaysvc has not migrated (a new one, before `delaysvc migrate`): a send through
the Python API, in a transaction of its own or the caller's, singly or in a batch, raises
`SchemaNotReady` saying to run `delaysvc migrate`, and the commands print that on one line,
not a traceback of the missing table. The long-lived processes refuse to start the same way
(`migrate.check_schema`; the levels: tests/migrations/test_level_changes.py). So does a
database an older release migrated, where what this release added is missing (a deploy that
restarted its processes before `delaysvc migrate`)."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator

import psycopg
import psycopg2
import pytest

from delaysvc import auth
from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.errors import SchemaNotReady
from delaysvc.producer.sending import Producer
from delaysvc.schema import migrate
from delaysvc.web import create_app
from tests.conftest import Server
from tests.support.commands import run_delaysvc

_counter = itertools.count()


@pytest.fixture
def empty_url(pg_server: Server) -> Iterator[str]:
    """A new database, never migrated."""
    name = f"delaysvc_empty{os.getpid()}_{next(_counter)}"
    with pg_server.janitor(name):
        yield pg_server.url(name)


@pytest.fixture
def producer(empty_url: str) -> Iterator[Producer]:
    settings = Settings(database_url=empty_url)
    engine = make_engine(settings)
    yield Producer(settings, engine)
    engine.dispose()


def test_a_send_to_an_unmigrated_database_says_to_migrate(producer: Producer) -> None:
    with pytest.raises(SchemaNotReady, match=r"not migrated .*; run `delaysvc migrate`"):
        producer.send("orders.cancel", {"id": 1}, delay="5m")
    with pytest.raises(SchemaNotReady, match=r"run `delaysvc migrate`"):
        producer.send_batch([{"topic": "orders.cancel", "body": {"id": n}} for n in range(3)])
    with pytest.raises(SchemaNotReady, match=r"run `delaysvc migrate`"):
        producer.get(1)


def test_a_send_in_the_callers_transaction_says_so_too(producer: Producer) -> None:
    with (
        producer.engine.connect() as conn,
        conn.begin(),
        pytest.raises(SchemaNotReady, match=r"run `delaysvc migrate`"),
    ):
        producer.send("orders.cancel", {"id": 1}, delay="5m", connection=conn)


def test_a_send_on_the_callers_own_driver_connection_says_so_too(
    producer: Producer, empty_url: str
) -> None:
    """A plain psycopg 3 connection (a batch COPYs there), a psycopg2 one, an asyncio one."""
    batch = [{"topic": "orders.cancel", "body": {"id": n}} for n in range(3)]
    with psycopg.connect(empty_url) as conn:
        for send in (
            lambda: producer.send("orders.cancel", {"id": 1}, connection=conn),
            lambda: producer.send_batch(batch, connection=conn),
        ):
            with pytest.raises(SchemaNotReady, match=r"run `delaysvc migrate`"):
                send()
            conn.rollback()
    old = psycopg2.connect(empty_url)
    try:
        with pytest.raises(SchemaNotReady, match=r"run `delaysvc migrate`"):
            producer.send_batch(batch, connection=old)
    finally:
        old.close()

    async def on_asyncio() -> None:
        async with await psycopg.AsyncConnection.connect(empty_url) as conn:
            with pytest.raises(SchemaNotReady, match=r"run `delaysvc migrate`"):
                await producer.asend_batch(batch, connection=conn)

    asyncio.run(on_asyncio())


@pytest.mark.parametrize(
    "args",
    [
        ("send", "orders.cancel", '{"id": 1}', "--delay", "5m"),
        ("stats",),
        ("dead", "list"),
        ("schedules", "list"),
    ],
    ids=lambda args: " ".join(args[:2]),
)
def test_a_command_on_an_unmigrated_database_says_to_migrate(
    empty_url: str, args: tuple[str, ...]
) -> None:
    done = run_delaysvc(*args, DELAYSVC_DATABASE_URL=empty_url)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: the database is not migrated"), line
    assert line.endswith("run `delaysvc migrate`"), line


def test_the_check_of_an_unmigrated_database_cannot_finish_and_says_why(empty_url: str) -> None:
    done = run_delaysvc("check", DELAYSVC_DATABASE_URL=empty_url)
    assert done.returncode == 2, done.stderr  # it could not finish: not a violation (1)
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: delaysvc check could not finish: the database is not migrated")
    assert line.endswith("run `delaysvc migrate`"), line


@pytest.fixture
def older_url(empty_url: str) -> Iterator[tuple[str, str]]:
    """A database an older release migrated, to 0022 (before tokens had an expiry), with a
    token made by this release before it went back. -> (its URL, the token)."""
    settings = Settings(database_url=empty_url)
    engine = make_engine(settings)
    try:
        migrate.upgrade(engine, settings.levels)
        token = auth.create_token(engine, "shop")
        migrate.downgrade(engine, "0022")
    finally:
        engine.dispose()
    yield empty_url, token


def test_a_database_an_older_release_migrated_is_refused_at_start_and_said_by_the_api(
    older_url: tuple[str, str],
) -> None:
    """A deploy whose web app restarted before `delaysvc migrate` answered 500 to every API
    call (a column this release added missing), `/healthz` 200, and the processes started."""
    url, token = older_url
    settings = Settings(database_url=url)
    engine = make_engine(settings)
    try:
        with engine.connect() as conn, pytest.raises(SchemaNotReady) as refused:
            migrate.check_schema(conn, settings.levels)
        head = migrate.heads()[0]
        assert str(refused.value) == (
            f"the database's schema is at revision 0022, this delaysvc's at {head}; "
            "run `delaysvc migrate`"
        )
        client = create_app(settings).test_client()
        answer = client.get("/api/v1/topics", headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 503, answer.json
        assert answer.json["error"]["code"] == "schema_not_ready"
        assert answer.json["error"]["message"].endswith("run `delaysvc migrate`")
        migrate.upgrade(engine, settings.levels)
        with engine.connect() as conn:
            migrate.check_schema(conn, settings.levels)  # migrated: no more refused
    finally:
        engine.dispose()


def test_a_command_on_a_database_an_older_release_migrated_says_to_migrate(
    older_url: tuple[str, str],
) -> None:
    done = run_delaysvc("tokens", DELAYSVC_DATABASE_URL=older_url[0])
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: the database is not migrated (column "), line
    assert line.endswith("run `delaysvc migrate`"), line
