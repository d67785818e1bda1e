"""What every way of joining the caller's transaction must show
(tests/integration/test_foreign_connections.py, tests/integration/test_async_producer.py,
tests/integration/test_django.py): where a message is stored, and that it then runs like any
other."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from delaysvc.config.settings import Settings
from delaysvc.db.engines import sqlalchemy_url
from delaysvc.maintenance import delivery
from delaysvc.producer.sending import Message
from delaysvc.schema.tables import TIMER_LANE
from delaysvc.worker import consumer as consumption
from delaysvc.worker.consumer import Consumer


class Rollback(Exception):
    """Raised inside a caller's transaction to roll it back."""


def psycopg2_url(database_url: str) -> str:
    """The database's SQLAlchemy URL on the psycopg2 driver."""
    return sqlalchemy_url(database_url).replace("postgresql+psycopg://", "postgresql+psycopg2://")


def stored(engine: Engine, topic: str) -> dict[str, list[Any]]:
    """The topic's commit_log rows and where they wait, read on a connection of our own (so
    only what is committed)."""
    queries = {
        "commit_log": "SELECT id FROM commit_log WHERE topic = :t ORDER BY id",
        "levels": "SELECT level, message_id FROM consume_queue WHERE topic = :t "
        "ORDER BY level, queue_offset",
        "timer": "SELECT message_id FROM timer_queue WHERE topic = :t ORDER BY message_id",
        "ready": "SELECT message_id FROM topic_queue WHERE topic = :t ORDER BY message_id",
    }
    with engine.connect() as conn:
        return {
            name: [
                tuple(row) if len(row) > 1 else row[0]
                for row in conn.execute(text(q), {"t": topic})
            ]
            for name, q in queries.items()
        }


NOTHING: dict[str, list[Any]] = {"commit_log": [], "levels": [], "timer": [], "ready": []}


@pytest.fixture
def clean_registry() -> Iterator[None]:
    saved = dict(consumption._registry)
    consumption._registry.clear()
    yield
    consumption._registry.clear()
    consumption._registry.update(saved)


def runs_like_any_other(settings: Settings, engine: Engine, message: Message) -> None:
    """Deliver the message when it is due (the delivery's clock set past its due time, so no
    waiting) and run it: its handler gets its body once, and it ends succeeded. Needs the
    `clean_registry` fixture."""
    seen: list[tuple[int, Any]] = []
    consumption.handler(message.topic)(lambda job: seen.append((job.id, job.body)))
    lane = message.delay_level or TIMER_LANE
    with engine.connect() as conn:
        tick = delivery.run_once(conn, lane, 100, now=message.deliver_at + timedelta(seconds=1))
    assert (tick.moved, tick.topics) == (1, (message.topic,))
    result = Consumer(settings, engine).run_once(message.topic)
    assert (result.claimed, result.succeeded) == (1, 1)
    with engine.connect() as conn:
        status = conn.execute(
            text("SELECT status FROM commit_log WHERE id = :id"), {"id": message.id}
        ).scalar_one()
    assert status == "succeeded"
    assert [job_id for job_id, _ in seen] == [message.id]
    assert seen[0][1] == BODY


BODY = {"order_id": 42, "items": ["a", "b"], "note": "100% sure"}
