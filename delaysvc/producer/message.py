"""What a send returns, and a read of a message: `Message`."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from delaysvc.config.validation import decode_body


class Sent(Protocol):
    """What a message was sent with, as `Message.sent` reads it (a `NewMessage`, a batch's
    item)."""

    @property
    def topic(self) -> str: ...

    @property
    def key(self) -> str | None: ...

    @property
    def lane(self) -> int: ...

    @property
    def delay_level(self) -> int | None: ...

    @property
    def tags(self) -> list[str] | None: ...

    @property
    def properties(self) -> dict[str, str] | None: ...

    @property
    def priority(self) -> int: ...


@dataclass(frozen=True)
class Message:
    """A stored message as the producer and the API return it."""

    id: int
    topic: str
    key: str | None
    status: str
    delay_level: int | None
    deliver_at: datetime
    stored_at: datetime
    created: bool = True
    tags: list[str] = field(default_factory=list)
    properties: dict[str, str] = field(default_factory=dict)
    delivered_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0
    duration_ms: int | None = None
    last_error: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    body: Any = None
    priority: int = 0
    replaced_id: int | None = None
    """The message this send replaced (`on_duplicate="replace"` or `"debounce"`): cancelled,
    its `last_error` naming this one."""

    @classmethod
    def from_row(cls, row: Any, created: bool = True) -> Message:
        return cls(
            id=row.id,
            topic=row.topic,
            key=row.key,
            status=row.status,
            delay_level=row.delay_level,
            deliver_at=row.deliver_ts,
            stored_at=row.stored_at,
            created=created,
            tags=row.tags or [],
            properties=row.properties or {},
            delivered_at=row.delivered_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            attempts=row.attempts,
            duration_ms=row.duration_ms,
            last_error=row.last_error,
            errors=getattr(row, "errors", None) or [],
            priority=getattr(row, "priority", 0),
            # rows returned by a send carry no body (the caller has it)
            body=decode_body(_bytes(row.body), row.body_is_json) if hasattr(row, "body") else None,
        )

    @classmethod
    def sent(
        cls, item: Sent, id: int, stored_at: datetime, deliver_ts: datetime, created: bool = True
    ) -> Message:
        """A message just stored: what the database decided (`id`, `stored_at`, `deliver_ts`)
        and what it was sent with (`item`: a single send's `NewMessage`, a batch's item); not
        its body (the caller has it).

        Made without `__init__`: a frozen dataclass's sets each of its 20 fields through
        `object.__setattr__`, 2.5 us a message (25 ms of a batch of 10,000); this sets them in
        a new instance's dict one by one, in half the time of
        `dict.update(zip(fields, values))` (1.5 against 2.7-3.0 us, side by side on a slow
        day of this 2-core machine). They go in in the fields' order, as
        `__init__` puts them, so the dict shares its keys with every other Message's (a third
        of the memory of a dict of its own; a dict merged in whole gets its own).
        tests/unit/test_batching.py checks that it makes what `__init__` makes."""
        message = object.__new__(cls)
        ready = item.lane < 0
        values = message.__dict__
        values["id"] = id
        values["topic"] = item.topic
        values["key"] = item.key
        values["status"] = "ready" if ready else "scheduled"
        values["delay_level"] = item.delay_level
        values["deliver_at"] = deliver_ts
        values["stored_at"] = stored_at
        values["created"] = created
        values["tags"] = list(item.tags) if item.tags else []
        values["properties"] = dict(item.properties) if item.properties else {}
        values["delivered_at"] = stored_at if ready else None
        values["started_at"] = None
        values["finished_at"] = None
        values["attempts"] = 0
        values["duration_ms"] = None
        values["last_error"] = None
        values["errors"] = []
        values["body"] = None  # the caller has it
        values["priority"] = item.priority
        values["replaced_id"] = None
        return message


def _bytes(data: bytes | memoryview) -> bytes:
    """A bytea as bytes (psycopg2 gives a memoryview, also under SQLAlchemy's text())."""
    return data.tobytes() if isinstance(data, memoryview) else data
