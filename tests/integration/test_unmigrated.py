"""A database delaysvc has not migrated (a new one, before `delaysvc migrate`): a send through
the Python API, in a transaction of its own or the caller's, singly or in a batch, raises
`SchemaNotReady` saying to run `delaysvc migrate`, and the commands print that on one line,
not a traceback of the missing table. The long-lived processes refuse to start the same way
(`store.check_levels`: tests/migrations/test_level_changes.py)."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator

import psycopg
import psycopg2
import pytest

from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.errors import SchemaNotReady
from delaysvc.producer.sending import Producer
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
