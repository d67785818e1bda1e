"""What a send returns, and a read of a message: `Message`; what a batch send returns:
`SentBatch`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from threading import Lock
from typing import Any, Protocol, overload

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


class SentBatch(Sequence[Message]):
    """What `send_batch` returns: a `Message` per item, in the items' order, each made the first
    time it is read, then kept (`batch[i] is batch[i]`). A batch's Messages made whole cost a
    tenth of its send (docs/benchmarks/2026-12-07-lazy-batch-result), and most callers read
    none of them, or only their ids: `ids` holds those from the start. It reads as a list
    does (index, slice, iterate, `len`, `in`, `==` and `+` with a list); it is not changed
    in place (`list(batch)` makes a list that can be).
    `ids`: each item's message id, in order (for an item that created none, that of the
    message holding its key), without a Message made."""

    __slots__ = ("_lock", "_made", "_make", "_unmade", "ids")

    def __init__(self, ids: list[int], make: Callable[[int], Message]):
        self.ids = ids
        self._made: list[Message | None] = [None] * len(ids)
        self._make: Callable[[int], Message] | None = make  # index -> its Message
        self._unmade = len(ids)  # once 0, `_make` (and what it holds: the items) is let go
        self._lock = Lock()  # threads reading one not yet made: it is made once

    @classmethod
    def of(cls, messages: Sequence[Message]) -> SentBatch:
        """A batch whose Messages are made already."""
        batch = cls([message.id for message in messages], messages.__getitem__)
        batch._made[:] = messages
        batch._make, batch._unmade = None, 0
        return batch

    def __len__(self) -> int:
        return len(self._made)

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...

    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self._made)))]
        message = self._made[index]  # an IndexError past either end, as a list's
        if message is None:
            with self._lock:
                message = self._made[index]  # made by another thread meanwhile?
                if message is None:
                    assert self._make is not None  # let go once every Message is made
                    position = index % len(self._made)
                    message = self._made[position] = self._make(position)
                    self._unmade -= 1
                    if not self._unmade:
                        self._make = None
        return message

    def __iter__(self) -> Iterator[Message]:
        for index in range(len(self._made)):
            yield self[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SentBatch | list):  # as a list's: not equal to a tuple
            return list(self) == list(other)
        return NotImplemented

    def __add__(self, other: Sequence[Message]) -> list[Message]:
        if isinstance(other, SentBatch | list):
            return [*self, *other]
        return NotImplemented

    def __radd__(self, other: Sequence[Message]) -> list[Message]:
        if isinstance(other, list):
            return [*other, *self]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a list's: it compares by its Messages

    def __repr__(self) -> str:
        return f"SentBatch({list(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:  # pickled and copied with its Messages made
        return SentBatch.of, (list(self),)


def _bytes(data: bytes | memoryview) -> bytes:
    """A bytea as bytes (psycopg2 gives a memoryview, also under SQLAlchemy's text())."""
    return data.tobytes() if isinstance(data, memoryview) else data
