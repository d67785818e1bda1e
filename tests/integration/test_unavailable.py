"""A database that goes away under a producer: a clear `DatabaseUnavailable` naming what became
of the write, or success after reconnecting; never a duplicate, never a silent loss. The HTTP
API answers 503 with Retry-After. (A real server restart under load is in
tests/faults/test_faults.py; here the connections are cut with pg_terminate_backend.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, text

from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.errors import DatabaseUnavailable
from delaysvc.producer.sending import Producer
from delaysvc.web import create_app


def _cut_connections(engine: Engine) -> int:
    """Terminate every other backend of this database (what a restart does to a pool), and
    wait until they are gone."""
    with engine.connect() as conn:
        return len(
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).all()
        )


def _count(engine: Engine, topic: str) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM commit_log WHERE topic = :t"), {"t": topic}
        ).scalar_one()


@pytest.fixture
def killer(settings: Settings) -> Iterator[Engine]:
    engine = make_engine(settings)
    yield engine
    engine.dispose()


def test_a_send_on_a_pool_whose_connections_were_cut_reconnects_and_stores_once(
    producer: Producer, engine: Engine, killer: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    producer.send("svc.cut", {"n": 1})  # the pool now holds a connection
    assert _cut_connections(killer) >= 1
    with caplog.at_level(logging.WARNING):
        again = producer.send("svc.cut", {"n": 2}, key="after-cut")
    assert again.status == "ready"  # no delay: straight to its topic queue
    # the dead connection was seen at checkout (its socket held the server's goodbye) and
    # replaced before the statement was sent: no error, no retry, nothing in doubt
    assert [r.message for r in caplog.records if r.name.startswith("delaysvc")] == []
    assert _count(killer, "svc.cut") == 2
    batch = producer.send_batch([{"topic": "svc.cut", "body": {"n": n}} for n in (3, 4)])
    assert len(batch) == 2 and _count(killer, "svc.cut") == 4


def test_a_send_to_a_database_that_does_not_answer_says_nothing_was_stored(
    settings: Settings,
) -> None:
    down = settings.model_copy(
        update={"database_url": "postgresql://root@127.0.0.1:9/delaysvc?connect_timeout=2"}
    )
    engine = make_engine(down)
    try:
        with pytest.raises(DatabaseUnavailable) as raised:
            Producer(down, engine).send("svc.down", {"n": 1})
    finally:
        engine.dispose()
    assert raised.value.maybe_stored is False
    assert str(raised.value).startswith("the database is unavailable (")
    assert str(raised.value).endswith("nothing was stored")


def _cut_own_backend(killer: Engine) -> Any:
    """An engine event listener that terminates the backend of the connection it fires on."""

    def cut(conn: Any, *_: Any) -> None:
        # an engine event passes a Connection, a pool event the driver's connection
        driver = conn.connection.driver_connection if isinstance(conn, Connection) else conn
        pid = driver.info.backend_pid
        with killer.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": pid})

    return cut


@pytest.mark.parametrize(
    "when, send",
    [
        # cut once the pooled connection was checked out (and found alive): the send's one
        # statement goes out on it and its answer never comes
        ("checkout", lambda p: p.send("svc.lost", {"n": 1}, key="order-7")),
        ("commit", lambda p: p.send_batch([{"topic": "svc.lost", "body": {}, "key": "order-7"}])),
    ],
    ids=["single-send-statement", "batch-commit"],
)
def test_a_connection_lost_after_the_write_was_sent_says_send_again_with_the_key(
    producer: Producer, engine: Engine, killer: Engine, when: str, send: Any
) -> None:
    """A single send commits with its one statement (autocommit), a batch at COMMIT: a loss
    there leaves the write in doubt, and the error says what to do about it."""
    cut = _cut_own_backend(killer)
    event.listen(engine, when, cut)
    try:
        with pytest.raises(DatabaseUnavailable) as raised:
            send(producer)
    finally:
        event.remove(engine, when, cut)
    assert raised.value.maybe_stored is True
    assert "send again with the same key" in str(raised.value)
    # the advice works: the resend stores it once, whatever became of the first try
    resent = producer.send("svc.lost", {}, key="order-7")
    assert producer.send("svc.lost", {}, key="order-7").id == resent.id
    assert _count(killer, "svc.lost") == 1


def test_a_send_in_the_callers_transaction_is_never_retried_behind_its_back(
    producer: Producer, engine: Engine, killer: Engine
) -> None:
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
        _cut_connections(killer)
        with pytest.raises(DatabaseUnavailable):  # said, never retried inside the caller's
            producer.send("svc.joined", {"n": 1}, connection=conn)
    assert _count(killer, "svc.joined") == 0


def test_the_api_answers_503_with_retry_after_when_the_database_is_down(
    settings: Settings,
) -> None:
    down = settings.model_copy(
        update={"database_url": "postgresql://root@127.0.0.1:9/delaysvc?connect_timeout=2"}
    )
    app = create_app(down)
    response = app.test_client().post(
        "/api/v1/messages",
        json={"topic": "svc.down", "body": {}},
        headers={"Authorization": "Bearer not-checked-before-the-database"},
    )
    app.extensions["delaysvc"]["engine"].dispose()
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert response.get_json()["error"]["code"] == "unavailable"
