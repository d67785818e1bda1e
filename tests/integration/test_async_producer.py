"""`await asend(...)` (and `asend_batch`, `acancel`, `aget`) from asyncio, joining a SQLAlchemy
AsyncConnection or AsyncSession or a plain psycopg AsyncConnection; without a connection, on
the producer's own engine. Each: a rollback stores nothing, a commit stores once, the key
dedupes across transactions, the message then runs like any other."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

import delaysvc
import delaysvc.producer.default
from delaysvc.config.settings import Settings
from delaysvc.db.engines import libpq_url, sqlalchemy_url
from delaysvc.errors import DatabaseUnavailable, NotFound, ValidationError
from delaysvc.producer.sending import Producer
from tests.support.joined_checks import (
    BODY,
    NOTHING,
    Rollback,
    clean_registry,  # noqa: F401  (a fixture)
    runs_like_any_other,
    stored,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def async_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(sqlalchemy_url(database_url))
    assert (engine.dialect.driver, engine.dialect.is_async) == ("psycopg", True)
    yield engine
    await engine.dispose()


Transaction = Callable[[], AbstractAsyncContextManager[Any]]


@pytest.fixture(
    params=["sqlalchemy-async-connection", "sqlalchemy-async-session", "psycopg3-async"]
)
def transaction(request, database_url: str, async_engine: AsyncEngine) -> Transaction:
    """What the caller holds, in a transaction that commits when the block ends and rolls back
    when it raises."""

    @asynccontextmanager
    async def sa_connection() -> AsyncIterator[Any]:
        async with async_engine.connect() as conn, conn.begin():
            yield conn

    @asynccontextmanager
    async def sa_session() -> AsyncIterator[Any]:
        async with AsyncSession(async_engine) as session, session.begin():
            yield session

    @asynccontextmanager
    async def psycopg3() -> AsyncIterator[Any]:
        conn = await psycopg.AsyncConnection.connect(libpq_url(database_url), row_factory=dict_row)
        async with conn:  # commit or rollback, then close
            yield conn

    return {
        "sqlalchemy-async-connection": sa_connection,
        "sqlalchemy-async-session": sa_session,
        "psycopg3-async": psycopg3,
    }[request.param]


async def test_a_rollback_stores_nothing(
    producer: Producer, engine: Engine, transaction: Transaction
) -> None:
    with pytest.raises(Rollback):
        async with transaction() as conn:
            message = await producer.asend("shop.cancel", BODY, delay_level=2, connection=conn)
            assert (await producer.aget(message.id, connection=conn)).body == BODY
            batch = await producer.asend_batch(
                [{"topic": "shop.cancel", "body": n} for n in range(3)], connection=conn
            )
            assert len(batch) == 3
            raise Rollback
    assert stored(engine, "shop.cancel") == NOTHING
    with pytest.raises(NotFound):
        await producer.aget(message.id)


@pytest.mark.usefixtures("clean_registry")
async def test_a_commit_stores_once_and_the_key_then_returns_it(
    settings: Settings, producer: Producer, engine: Engine, transaction: Transaction
) -> None:
    async with transaction() as conn:
        first = await producer.asend("shop.cancel", BODY, delay="7s", key="o-42", connection=conn)
    assert stored(engine, "shop.cancel") == {
        **NOTHING,
        "commit_log": [first.id],
        "timer": [first.id],
    }
    async with transaction() as conn:
        again = await producer.asend("shop.cancel", 2, delay_level=1, key="o-42", connection=conn)
    assert (again.id, again.created, again.body) == (first.id, False, BODY)
    assert stored(engine, "shop.cancel")["commit_log"] == [first.id]
    runs_like_any_other(settings, engine, first)


async def test_a_batch_and_a_cancel_commit_with_the_caller(
    producer: Producer, engine: Engine, transaction: Transaction
) -> None:
    async with transaction() as conn:
        sent = await producer.asend_batch(
            [
                {"topic": "shop.batch", "body": b"\x01", "delay_level": 3, "key": "a"},
                {"topic": "shop.batch", "body": 2, "key": "a"},
                {"topic": "shop.batch", "body": 3, "properties": {"p": "v"}},
            ],
            connection=conn,
        )
    assert [m.created for m in sent] == [True, False, True]
    assert stored(engine, "shop.batch") == {
        **NOTHING,
        "commit_log": [sent[0].id, sent[2].id],
        "levels": [(3, sent[0].id)],
        "ready": [sent[2].id],
    }
    assert (await producer.aget(sent[0].id)).body == b"\x01"
    async with transaction() as conn:
        cancelled = await producer.acancel(topic="shop.batch", key="a", connection=conn)
    assert (cancelled.id, cancelled.status) == (sent[0].id, "cancelled")
    assert stored(engine, "shop.batch")["levels"] == []


async def test_without_a_connection_asend_uses_the_producers_engine(
    producer: Producer, engine: Engine
) -> None:
    sent = await producer.asend("shop.own", BODY, delay_level=2, key="k")
    assert (await producer.asend("shop.own", 1, key="k")).id == sent.id
    batch = await producer.asend_batch([{"topic": "shop.own", "body": n} for n in range(2)])
    assert (await producer.acancel(sent.id)).status == "cancelled"
    assert stored(engine, "shop.own") == {
        **NOTHING,
        "commit_log": [sent.id, *(m.id for m in batch)],
        "ready": [m.id for m in batch],
    }


@pytest.fixture
def module_producer(producer: Producer) -> Iterator[Producer]:
    saved = delaysvc.producer.default._producer
    delaysvc.producer.default._producer = producer
    yield producer
    delaysvc.producer.default._producer = saved


async def test_the_module_level_functions(
    module_producer: Producer, engine: Engine, async_engine: AsyncEngine
) -> None:
    async with async_engine.begin() as conn:
        sent = await delaysvc.asend("shop.module", 1, delay_level=1, connection=conn)
        batch = await delaysvc.asend_batch([{"topic": "shop.module", "body": 2}], connection=conn)
    assert (await delaysvc.aget(sent.id)).status == "scheduled"
    assert (await delaysvc.acancel(sent.id)).status == "cancelled"
    assert stored(engine, "shop.module")["commit_log"] == [sent.id, batch[0].id]


async def test_a_lost_async_connection_is_database_unavailable(
    producer: Producer, engine: Engine, database_url: str
) -> None:
    conn = await psycopg.AsyncConnection.connect(libpq_url(database_url))
    try:
        await producer.asend("shop.lost", 0, connection=conn)
        with engine.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": conn.info.backend_pid})
        with pytest.raises(DatabaseUnavailable, match="nothing was stored"):
            await producer.asend("shop.lost", 1, connection=conn)
    finally:
        await conn.close()
    assert stored(engine, "shop.lost") == NOTHING


async def test_an_async_connection_given_to_the_sync_send_is_refused_by_name(
    producer: Producer, database_url: str, async_engine: AsyncEngine
) -> None:
    conn = await psycopg.AsyncConnection.connect(libpq_url(database_url))
    try:
        with pytest.raises(ValidationError, match=r"needs `await delaysvc.asend\(...\)`"):
            producer.send("t", 1, connection=conn)
    finally:
        await conn.close()
    async with async_engine.connect() as sa_conn:
        with pytest.raises(ValidationError, match=r"needs `await delaysvc.asend\(...\)`"):
            producer.send("t", 1, connection=sa_conn)
    with pytest.raises(ValidationError, match=r"cannot join a builtins\.object from asyncio"):
        await producer.asend("t", 1, connection=object())


async def test_an_autocommitting_async_connection_in_pipeline_mode_with_a_statement_queued(
    producer: Producer, engine: Engine, database_url: str
) -> None:
    """Busy with the caller's queued statement, it read as a transaction open: the batch's
    statements each committed alone, its staged rows went with their commit, it stored
    nothing and raised a DuplicateKey for key None."""
    conn = await psycopg.AsyncConnection.connect(libpq_url(database_url), autocommit=True)
    async with conn, conn.pipeline():
        await conn.execute("SELECT 1")
        sent = await producer.asend_batch(
            [{"topic": "shop.piped", "body": n} for n in range(3)], connection=conn
        )
        assert conn.autocommit is True
    assert stored(engine, "shop.piped") == {
        **NOTHING,
        "commit_log": [m.id for m in sent],
        "ready": [m.id for m in sent],
    }


def test_a_psycopg_async_connection_without_greenlet_names_delaysvcs_extra(
    database_url: str,
) -> None:
    """Without greenlet (`delaysvc[asyncio]`), SQLAlchemy's asyncio module failed to import
    first, its long traceback ending in `pip install sqlalchemy[asyncio]`."""
    import subprocess
    import sys

    from tests.conftest import TEST_SCHEMA, outside_env

    script = """
import asyncio, sys
sys.modules["greenlet"] = None  # as where it is not installed
import psycopg, delaysvc
from delaysvc.errors import MissingPart

async def main():
    async with await psycopg.AsyncConnection.connect(sys.argv[1]) as conn:
        try:
            await delaysvc.asend("t.async", 1, connection=conn)
        except MissingPart as exc:
            print(exc)

asyncio.run(main())
"""
    env = outside_env() | {"DELAYSVC_DATABASE_URL": database_url, "DELAYSVC_SCHEMA": TEST_SCHEMA}
    result = subprocess.run(
        [sys.executable, "-c", script, libpq_url(database_url)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "await delaysvc.asend(connection=<a psycopg AsyncConnection>) needs greenlet, not "
        "installed: pip install 'delaysvc[asyncio]'"
    )
