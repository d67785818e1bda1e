"""The module-level producer: `delaysvc.send` and friends write with it, configured from the
`DELAYSVC_*` environment on first use, or by `delaysvc.configure`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from delaysvc.producer.sending import Message, SentBatch

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from delaysvc.config.settings import Settings
    from delaysvc.producer.sending import OnDuplicate, Producer

_producer: Producer | None = None


def configure(settings: Settings | None = None, engine: Engine | None = None) -> Producer:
    """Set up the module-level producer. Optional: the first call to `send` does it from the
    `DELAYSVC_*` environment. Pass `engine` to share your application's engine."""
    global _producer
    from delaysvc.config.settings import Settings
    from delaysvc.db.engines import make_engine
    from delaysvc.producer.sending import Producer

    settings = settings or Settings.from_env()
    _producer = Producer(settings, engine or make_engine(settings))
    return _producer


def default_producer() -> Producer:
    """The module-level producer `send` and friends use (configured on first use); its
    `.engine` is the engine it writes with."""
    return _producer or configure()


def send(
    topic: str,
    body: Any,
    *,
    delay_level: int | None = None,
    delay: str | timedelta | None = None,
    delay_ms: int | None = None,
    deliver_at: datetime | None = None,
    key: str | None = None,
    tags: Sequence[str] | None = None,
    properties: Mapping[str, str] | None = None,
    priority: int = 0,
    on_duplicate: OnDuplicate = "keep",
    connection: Any = None,
) -> Message:
    """Schedule `body` for `topic`: at most one of delay_level, delay (`"45m"` or a
    timedelta), delay_ms, deliver_at. `connection` joins the caller's transaction: a
    SQLAlchemy Connection or Session, a psycopg or psycopg2 connection, Django's connection."""
    return default_producer().send(
        topic,
        body,
        delay_level=delay_level,
        delay=delay,
        delay_ms=delay_ms,
        deliver_at=deliver_at,
        key=key,
        tags=tags,
        properties=properties,
        priority=priority,
        on_duplicate=on_duplicate,
        connection=connection,
    )


def send_batch(messages: list[dict[str, Any]], **options: Any) -> SentBatch:
    return default_producer().send_batch(messages, **options)


def cancel(message_id: int | None = None, **options: Any) -> Message:
    return default_producer().cancel(message_id, **options)


def get(message_id: int, **options: Any) -> Message:
    return default_producer().get(message_id, **options)


async def asend(topic: str, body: Any, **options: Any) -> Message:
    """`send` from asyncio. `connection=`: a SQLAlchemy AsyncConnection or AsyncSession, or a
    psycopg AsyncConnection, whose transaction it joins; without one the send runs on the
    producer's own engine in a worker thread."""
    return await default_producer().asend(topic, body, **options)


async def asend_batch(messages: list[dict[str, Any]], **options: Any) -> SentBatch:
    return await default_producer().asend_batch(messages, **options)


async def acancel(message_id: int | None = None, **options: Any) -> Message:
    return await default_producer().acancel(message_id, **options)


async def aget(message_id: int, **options: Any) -> Message:
    return await default_producer().aget(message_id, **options)
