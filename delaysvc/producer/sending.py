"""The producer: `send`, `send_batch`, `cancel` (and `asend`, `asend_batch`, `acancel`).

Each call joins the caller's transaction when given `connection=`: a SQLAlchemy Connection or
Session (any driver), a psycopg 3 or psycopg2 connection, Django's connection; from asyncio a
SQLAlchemy AsyncConnection or AsyncSession or a psycopg AsyncConnection (`delaysvc.db.connections`).
A web app creates an order and schedules its cancellation atomically, and a rollback leaves no
trace of either. Without it, the call runs in a transaction of its own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

import psycopg
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from delaysvc import store
from delaysvc.config import logs, tracing
from delaysvc.config.settings import Settings
from delaysvc.config.validation import (
    MESSAGE_FIELDS,
    encode_body,
    validate_key,
    validate_priority,
    validate_tags,
    validate_topic,
)
from delaysvc.db import connections as joining
from delaysvc.db.held import HeldConnections
from delaysvc.errors import (
    DatabaseUnavailable,
    DuplicateKey,
    NotCancellable,
    NotFound,
    ValidationError,
    one_line,
)
from delaysvc.producer import batching, caps, grouping
from delaysvc.producer.message import Message as Message
from delaysvc.producer.message import SentBatch as SentBatch
from delaysvc.producer.placement import Placement as Placement
from delaysvc.producer.placement import resolve_schedule
from delaysvc.schema.tables import TIMER_LANE, WAITING

log = logging.getLogger("delaysvc.producer")  # the producer's logger, as before the package
logs.guard_unconfigured()  # its warnings with their fields in a program that set up no logging
_T = TypeVar("_T")
Joinable = object  # what a caller may pass as `connection=`: see `delaysvc.db.connections`
MAX_BATCH = 10_000
"""Items in one HTTP batch (`POST /api/v1/messages/batch`)."""
MAX_SEND_BATCH = 100_000
"""Items in one `send_batch` call (streamed into the tables: `delaysvc.producer.batching`)."""
GONE = (
    " (a finished message is kept until DELAYSVC_HISTORY_RETENTION, if set, drops its day, or "
    "`delaysvc pipeline archive` takes it)"
)
"""Said of an id not found: it may have been there (the same words for every id)."""


OnDuplicate = Literal["keep", "replace", "debounce"]
ON_DUPLICATE: tuple[OnDuplicate, ...] = ("keep", "replace", "debounce")


def validate_on_duplicate(value: object) -> OnDuplicate:
    if value not in ON_DUPLICATE:
        raise ValidationError(
            "on_duplicate", f"{value!r}: use 'keep' (the default), 'replace' or 'debounce'"
        )
    return value


def _keyed(policy: OnDuplicate, key: str | None) -> OnDuplicate:
    """`policy`, which only "keep" may be without a key: "replace" and "debounce" act on the
    message holding the same key, and one without any would be a plain new message (a
    debounced burst run once for each send)."""
    if policy != "keep" and key is None:
        raise ValidationError(
            "on_duplicate",
            f"{policy!r} needs a key: it replaces the unfinished message holding the send's "
            "key; give a key, or leave on_duplicate 'keep' (the default)",
        )
    return policy


def _not_earlier(conn: Any, new: store.NewMessage, due: datetime) -> store.NewMessage:
    """`new`, due at `due` instead if it would be due before it (a debounce never makes a
    message due earlier)."""
    if store.due_before(conn, new, due):
        return dataclasses.replace(
            new, lane=TIMER_LANE, delay_level=None, delay_ms=None, deliver_at=due
        )
    return new


class Producer:
    """Validates and stores messages. Build one per process with the settings and an engine."""

    def __init__(self, settings: Settings, engine: Engine, group_writers: int | None = None):
        """`group_writers`: single sends of this process's threads that come while this many
        are being written wait and are written together (`delaysvc.producer.grouping`); None
        (the default): each is written at once, alone."""
        self.settings = settings
        self.engine = engine
        # a single send is one autocommitted statement on the driver's cursor (psycopg 3);
        # an engine of another driver (an application's psycopg2 one) sends in a transaction
        self._autocommitted_sends = (
            engine.dialect.driver == "psycopg" and not engine.dialect.is_async
        )
        self._write_single: Callable[[store.NewMessage], Any] = self._insert_autocommitted
        self._held = HeldConnections(engine)  # used by autocommitted sends only
        if group_writers is not None:
            self._sends = grouping.Grouped(
                self._insert_autocommitted, self._insert_group, group_writers
            )
            self._write_single = self._sends.write

    def sends_autocommitted(self) -> bool:
        """Whether a single send of its own is one autocommitted statement (psycopg 3)."""
        return self._autocommitted_sends

    # -- building -------------------------------------------------------------

    def prepare(
        self,
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
        now: datetime | None = None,
    ) -> store.NewMessage:
        """Validate everything and decide the lane; nothing is written."""
        topic = validate_topic(topic)
        data, is_json = encode_body(body, self.settings.max_body_bytes)
        schedule = resolve_schedule(
            self.settings.levels,
            delay_level=delay_level,
            delay=delay,
            delay_ms=delay_ms,
            deliver_at=deliver_at,
            default_delay_ms=self.settings.default_delays_ms.get(topic),
            max_delay_ms=self.settings.max_delay_ms,
            now=now,
        )
        return store.NewMessage(
            topic=topic,
            body=data,
            body_is_json=is_json,
            lane=schedule.lane,
            delay_level=schedule.delay_level,
            delay_ms=schedule.delay_ms,
            deliver_at=schedule.deliver_at,
            key=validate_key(key),
            tags=validate_tags(list(tags) if isinstance(tags, tuple) else tags),
            properties=tracing.validated_properties(
                dict(properties) if isinstance(properties, Mapping) else properties,
                tracing.context_fields(),  # the trace context's: not counted (tracing on)
            ),
            priority=validate_priority(priority),
        )

    # -- writing --------------------------------------------------------------

    def send(
        self,
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
        connection: Joinable | None = None,
    ) -> Message:
        """Schedule `body` for `topic`: at most one of delay_level, delay (`"45m"` or a
        timedelta), delay_ms, deliver_at; none means the topic's default delay, else now.

        `on_duplicate` says what a send does when an unfinished message of the topic holds its
        key: `"keep"` returns that message (`created=False`); `"replace"` puts this body and
        due time in its place; `"debounce"` does too, but never makes it due earlier than it
        was. A replaced message is cancelled and the new one stored in the same transaction,
        so exactly one of them ever runs; one that is already running is returned as it is."""
        policy = validate_on_duplicate(on_duplicate)
        new = self.prepare(
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
        )
        return self._send_traced(new, _keyed(policy, new.key), connection)

    def send_item(self, item: Mapping[str, Any], *, connection: Joinable | None = None) -> Message:
        """`send` with its arguments as one mapping, as an HTTP body holds them
        (`{"topic": ..., "body": ..., "delay": "5m"}`); unknown fields are refused."""
        new, policy = self.prepare_item(item)
        return self._send_traced(new, policy, connection)

    def prepare_item(self, item: Mapping[str, Any]) -> tuple[store.NewMessage, OnDuplicate]:
        """`send_item`'s checks: the message it would store, and its key's policy."""
        options = dict(item) if isinstance(item, Mapping) else item
        policy: OnDuplicate = "keep"
        if isinstance(options, dict):
            policy = validate_on_duplicate(options.pop("on_duplicate", "keep"))
        new = self._prepare_item(options, None)
        return new, _keyed(policy, new.key)

    def _send_traced(
        self, new: store.NewMessage, policy: OnDuplicate, connection: Joinable | None
    ) -> Message:
        """A single send; while the application traces, in a `send <topic>` span whose context
        the message carries (`delaysvc.config.tracing`)."""
        with tracing.sending(new.topic) as span:
            if span is not None:
                context = tracing.context_properties()
                new = dataclasses.replace(new, properties=tracing.carried(new.properties, context))
            if policy != "keep":  # with a key (`_keyed`)
                message = self._send_replacing(new, policy, connection)
            else:
                message = self._send_one(new, connection)
            if span is not None:
                tracing.sent(span, message.id, message.created, message.deliver_at)
        return message

    def _send_replacing(
        self, new: store.NewMessage, policy: OnDuplicate, connection: Joinable | None
    ) -> Message:
        """A send whose key may be held: store it, or put it in the holder's place (see
        `send`'s `on_duplicate`), in one transaction."""

        def write(conn: joining.Joined) -> tuple[Any, bool, int | None, store.NewMessage]:
            with conn.transaction():
                # replaces of one key wait for each other: each read, cancelled and stored
                # while others cancelled what it had read, and ran out of tries
                store.lock_key(conn, new.topic, new.key)
                for _ in range(5):
                    ((row, created, _),) = self._store(conn, [new])
                    if created:
                        return row, True, None, new
                    holder = row
                    if holder.status not in (*WAITING, "ready"):
                        return holder, False, None, new  # running: it runs with its own body
                    placed = new
                    if policy == "debounce":
                        placed = _not_earlier(conn, new, holder.deliver_ts)
                    try:
                        ((row, created, _),) = self._store(conn, [placed], replacing=holder)
                    except NotCancellable:
                        continue  # it started meanwhile: the next insert finds it running
                    if created:
                        store.note_replaced(conn, holder.id, row.id)
                        return row, True, holder.id, placed
                raise NotCancellable(f"the message holding key {new.key!r} keeps changing state")

        row, created, replaced, placed = self._write(connection, write)
        if not created:
            log.info("message.duplicate_key", extra={"message_id": row.id, "topic": new.topic})
            return Message.from_row(row, created=False)
        # as placed: a debounce that kept the holder's later due time put it in the timer lane
        sent = Message.sent(placed, row.id, row.stored_at, row.deliver_ts)
        message = dataclasses.replace(sent, replaced_id=replaced)
        log.info(
            "message.replaced" if replaced else "message.sent",
            extra={"message_id": message.id, "topic": message.topic, "replaced": replaced},
        )
        return message

    def _send_one(self, new: store.NewMessage, connection: Joinable | None) -> Message:
        inserted = None
        if connection is None and not self.settings.caps and self._autocommitted_sends:
            inserted = self._write_single(new)
        if inserted is not None:
            row, created, _ = inserted
        else:  # in a transaction, or a cap covers it (nothing was stored)
            capped = connection is None and not self.settings.caps and self._autocommitted_sends
            ((row, created, _),) = self._write(
                connection, lambda conn: self._store(conn, [new], capped=capped)
            )
        return self.message_sent(new, row, created)

    def message_sent(self, new: store.NewMessage, row: Any, created: bool) -> Message:
        """The Message of a single send just written (`row`: what the database decided, or
        the message holding its key), logged."""
        if created:
            message = Message.sent(new, row.id, row.stored_at, row.deliver_ts)
        else:
            message = Message.from_row(row, created=False)
        if created and new.lane > 0 and row.lane == TIMER_LANE:
            log.warning(
                "message.level_differs",
                extra={
                    "message_id": message.id,
                    "delay_level": new.lane,
                    "delay_ms": new.delay_ms,
                    "hint": "this process's DELAYSVC_DELAY_LEVELS differ from the database's; "
                    "the message went to the timer lane, due as computed here",
                },
            )
        log.info(
            "message.sent" if created else "message.duplicate_key",
            extra={"message_id": message.id, "topic": message.topic, "lane": new.lane},
        )
        return message

    def send_batch(
        self, messages: Sequence[Mapping[str, Any]], *, connection: Joinable | None = None
    ) -> SentBatch:
        """Store all of them or none: each item is `send`'s keyword arguments as a mapping
        (`{"topic": ..., "body": ..., "delay": "5m"}`), at most `MAX_SEND_BATCH`. Item errors
        name the item's index. On psycopg 3 the batch is COPYed into the tables, each body
        encoded as its row is sent (`delaysvc.producer.batching`). -> a Message per item, in
        order, each made when read (`SentBatch`; its `ids` without)."""
        if not messages:
            return SentBatch.of([])
        if len(messages) > MAX_SEND_BATCH:
            raise ValidationError("messages", f"{len(messages)} items, at most {MAX_SEND_BATCH}")
        now = datetime.now().astimezone()
        with batching.collector_paused(), tracing.sending(None, len(messages)) as span:

            def checked() -> list[batching.Item]:
                items = batching.prepare(messages, self.settings, now)
                return items if span is None else _carrying_context(span, items)

            def first() -> batching.Item:  # where the batch most likely goes
                return batching.prepare(messages[:1], self.settings, now)[0]

            sent = self._write(
                connection, lambda conn: self._store_batch(conn, len(messages), first, checked)
            )
        log.info("messages.sent", extra={"count": len(sent)})
        return sent

    def _store_batch(
        self,
        conn: joining.Joined,
        count: int,
        first: Callable[[], batching.Item],
        checked: Callable[[], list[batching.Item]],
    ) -> SentBatch:
        """A batch of `count` items by COPY on a psycopg 3 connection, its items checked
        (`checked`) while the database draws their ids and the offsets of the lane its first
        item goes to (`first`), else checked, then stored through the staged insert
        (`_store`)."""
        with conn.transaction():
            with conn.psycopg_cursor() as cursor:
                if cursor is not None:
                    return batching.store_copied(
                        conn, cursor, count, first(), checked, self.settings
                    )
            items = checked()
            results = self._store(conn, batching.encoded(items, self.settings.max_body_bytes))
            return batching.messages(items, results)

    async def asend(
        self, topic: str, body: Any, *, connection: Joinable | None = None, **options: Any
    ) -> Message:
        """`send` from asyncio; `connection=` a SQLAlchemy AsyncConnection or AsyncSession, or
        a psycopg AsyncConnection (`joining.run_async`)."""
        return await joining.run_async(
            connection, lambda held: self.send(topic, body, connection=held, **options)
        )

    async def asend_batch(
        self, messages: Sequence[Mapping[str, Any]], *, connection: Joinable | None = None
    ) -> SentBatch:
        return await joining.run_async(
            connection, lambda held: self.send_batch(messages, connection=held)
        )

    async def acancel(
        self, message_id: int | None = None, *, connection: Joinable | None = None, **options: Any
    ) -> Message:
        return await joining.run_async(
            connection, lambda held: self.cancel(message_id, connection=held, **options)
        )

    async def aget(self, message_id: int, *, connection: Joinable | None = None) -> Message:
        return await joining.run_async(
            connection, lambda held: self.get(message_id, connection=held)
        )

    def _write(self, joined: Joinable | None, write: Callable[[joining.Joined], _T]) -> _T:
        """`write` in the caller's transaction, or in one of ours (`_retried`)."""

        def attempt() -> _T:
            with self._connection(joined) as conn:
                return write(conn)

        return attempt() if joined is not None else self._retried(attempt)

    @staticmethod
    def _retried(attempt: Callable[[], _T]) -> _T:
        """A write of our own, tried a second time if the first could not reach the database:
        nothing was stored, and the pool has reconnected since, so a database restart costs a
        producer no error. A write that may be stored is never repeated behind the caller's
        back (`DatabaseUnavailable.maybe_stored`: they resend with the same key)."""
        try:
            return attempt()
        except DatabaseUnavailable as exc:
            if exc.maybe_stored:
                raise
            log.warning("producer.reconnecting", extra={"error": str(exc)})
        return attempt()

    def _insert_autocommitted(self, new: store.NewMessage) -> tuple[Any, bool, int | None] | None:
        """A single send: one statement committing by itself, so one round trip instead of
        three (BEGIN, statement, COMMIT). None: a cap covers it, nothing was stored
        (`store.insert_message`)."""
        return self._autocommitted(lambda cursor: store.insert_message(cursor, new, False))

    def _insert_group(
        self, group: Sequence[store.NewMessage]
    ) -> Sequence[tuple[Any, bool, int | None] | None]:
        """Single sends of several threads in one autocommitted statement
        (`store.insert_group`; None: one it did not store, to be sent alone)."""

        def write(cursor: Any) -> Sequence[tuple[Any, bool, int | None] | None]:
            try:
                return store.insert_group(cursor, group)
            except psycopg.Error as exc:
                if not store.rolled_back(exc):
                    raise
                # a deadlock with another writer's keys (or a serialization failure) rolled the
                # statement back, nothing of it stored: each is sent alone, as it came (one
                # row's statement waits on a key, and deadlocks on none)
                return [None] * len(group)

        return self._autocommitted(write)

    def _autocommitted(self, write: Callable[[Any], _T]) -> _T:
        """`write(cursor)` on a driver cursor whose statement commits by itself, of a
        connection this producer keeps for single sends (`db.held`), tried again if the first
        could not reach the database (`_retried`)."""

        def attempt() -> _T:
            sent = False
            try:
                with self._held.cursor() as cursor:
                    sent = True  # from here on, a statement sent may have committed
                    return write(cursor)
            except DBAPIError as exc:
                _raise_domain_error(exc, "send", connected=sent, maybe_stored=sent)
                raise

        return self._retried(attempt)

    def _store(
        self,
        conn: joining.Joined,
        messages: Sequence[store.NewMessage],
        replacing: Any | None = None,
        capped: bool = False,
    ) -> list[tuple[Any, bool, int | None]]:
        """Insert, within the backlog caps (see `delaysvc.producer.caps`), after cancelling
        `replacing` (the holder of the message's key, as `_locate` reads it) if given. A single send
        is one statement, unless a cap covers it (`capped`: known already) or this producer has
        caps of its own (DELAYSVC_BACKLOG_CAPS); anything more is one transaction
        (`Joined.transaction`) that reads the caps first. A cap counts what the write adds to
        its backlog: a held key adds nothing, a replacement takes its holder's place; a
        refusal comes before anything is written, the holder's cancel included."""
        if len(messages) == 1 and replacing is None and not capped and not self.settings.caps:
            inserted = self._insert_one(conn, messages[0], caps_held=False)
            if inserted is not None:
                return [inserted]
        leaving = [] if replacing is None else [replacing]
        with conn.transaction():
            covering = caps.covering(conn, self.settings.caps, messages)
            caps.before_insert(conn, covering, messages, leaving)
            if replacing is not None:
                self._cancel(conn, replacing.id, None, None, None)
            if len(messages) == 1:
                results = [self._insert_held(conn, messages[0])]
            else:
                with conn.psycopg_cursor() as cursor:
                    results = store.insert_messages(conn, messages, cursor)
            if covering:
                created = [m for m, (_, new, _) in zip(messages, results, strict=True) if new]
                caps.after_insert(conn, covering, created, leaving)
        return results

    @staticmethod
    def _insert_one(
        conn: joining.Joined, message: store.NewMessage, caps_held: bool
    ) -> tuple[Any, bool, int | None] | None:
        """One statement; None if a cap covers the message and `caps_held` is false."""
        with conn.psycopg_cursor() as cursor:
            if cursor is not None:
                return store.insert_message(cursor, message, caps_held)
        return store.insert_uncapped_on(conn, message, caps_held)

    @classmethod
    def _insert_held(
        cls, conn: joining.Joined, message: store.NewMessage
    ) -> tuple[Any, bool, int | None]:
        """`_insert_one` under the caps' locks: never left to them."""
        inserted = cls._insert_one(conn, message, caps_held=True)
        assert inserted is not None
        return inserted

    def _prepare_item(self, item: Mapping[str, Any], now: datetime | None) -> store.NewMessage:
        if not isinstance(item, Mapping):
            raise ValidationError("item", "must be an object with topic and body")
        allowed = {*MESSAGE_FIELDS, "priority"}
        unknown = sorted(set(item) - allowed)
        if unknown:  # on_duplicate was taken out already (`prepare_item`)
            named = sorted({*allowed, "on_duplicate"})
            raise ValidationError(unknown[0], f"unknown field; allowed: {named}")
        if "topic" not in item or "body" not in item:
            raise ValidationError("topic" if "topic" not in item else "body", "is required")
        options = {k: v for k, v in item.items() if k not in ("topic", "body")}
        return self.prepare(item["topic"], item["body"], now=now, **options)

    def cancel(
        self,
        message_id: int | None = None,
        *,
        topic: str | None = None,
        key: str | None = None,
        connection: Joinable | None = None,
        topics: Collection[str] | None = None,
    ) -> Message:
        """Cancel a scheduled, retrying or ready message; it will never run. Running or
        finished -> NotCancellable; unknown -> NotFound. `topics` (an API token's): a message
        of any other topic is NotFound too."""
        with self._connection(connection, "cancel") as conn, conn.transaction():
            return Message.from_row(self._cancel(conn, message_id, topic, key, topics))

    def _cancel(
        self,
        conn: joining.Joined,
        message_id: int | None,
        topic: str | None,
        key: str | None,
        topics: Collection[str] | None,
    ) -> Any:
        for _ in range(5):
            row = self._locate(conn, message_id, topic, key, topics)
            if row.status in WAITING:
                taken = store.take_out_of_lane(conn, row.lane, row.queue_offset, row.deliver_ts)
            elif row.status == "ready":
                taken = store.take_out_of_topic_queue(conn, row.id)
            else:
                raise NotCancellable(f"message {row.id} is {row.status}; it cannot be cancelled")
            if taken:
                cancelled = store.mark_cancelled(conn, row.id)
                log.info("message.cancelled", extra={"message_id": row.id})
                return cancelled
            # It moved on between reading and deleting: read its new state and try again.
        raise NotCancellable(f"message {row.id} is changing state; try again")

    def get(
        self,
        message_id: int,
        *,
        connection: Joinable | None = None,
        topics: Collection[str] | None = None,
    ) -> Message:
        """`topics` (an API token's): a message of any other topic is NotFound."""
        with self._connection(connection, "read") as conn:
            return Message.from_row(self._locate(conn, message_id, None, None, topics))

    def find(
        self,
        topic: str,
        key: str,
        *,
        connection: Joinable | None = None,
        topics: Collection[str] | None = None,
    ) -> Message:
        """`topics` (an API token's): a message of any other topic is NotFound."""
        with self._connection(connection, "read") as conn:
            return Message.from_row(self._locate(conn, None, topic, key, topics))

    @staticmethod
    def _locate(
        conn: store.Statements,
        message_id: int | None,
        topic: str | None,
        key: str | None,
        topics: Collection[str] | None,
    ) -> Any:
        """The message by id, or by topic and key. Not found, or of a topic outside `topics`
        -> NotFound, with the same words either way: a token limited to topics learns
        nothing about the messages of others."""
        if message_id is not None and (topic is not None or key is not None):
            raise ValidationError("id", "give a message id, or topic and key, not both")
        if message_id is not None:
            row = store.get_message(conn, message_id)
            missing = f"no message with id {message_id}{GONE}"
        elif topic is None or key is None:
            raise ValidationError("id", "give a message id, or both topic and key")
        else:
            row = store.find_message_by_key(conn, validate_topic(topic), _lookup_key(key))
            missing = f"no message with topic {topic!r} and key {key!r}"
        if row is None or (topics is not None and row.topic not in topics):
            raise NotFound(missing)
        return row

    @contextmanager
    def _connection(
        self, joined: Joinable | None, doing: Doing = "send"
    ) -> Iterator[joining.Joined]:
        """The caller's connection (their transaction, their commit) or a fresh transaction;
        a database error raised as the domain error it stands for, said of what it was `doing`."""
        if joined is not None:
            with joining.joined(joined) as conn:
                autocommits = False
                try:
                    autocommits = conn.autocommits()
                    yield conn
                except DBAPIError as exc:
                    # in the caller's transaction nothing is stored until they commit; on an
                    # autocommitting connection, a statement sent may have stored itself
                    _raise_domain_error(exc, doing, connected=True, maybe_stored=autocommits)
                    own = joining.raised_to_caller(exc)
                    if own is not None:  # the caller's driver's (or Django's) own error
                        raise own from own.__cause__
                    raise
            return
        started = maybe_stored = False
        try:
            with self.engine.connect() as conn:
                started = True
                with conn.begin():
                    yield joining.SqlAlchemyJoined(conn)
                    maybe_stored = True  # committing
        except DBAPIError as exc:
            _raise_domain_error(exc, doing, connected=started, maybe_stored=maybe_stored)
            raise


def _carrying_context(span: Any, items: Sequence[batching.Item]) -> list[batching.Item]:
    """A traced batch's items, each carrying the context of the batch's `send` span (named for
    their topic when they share one)."""
    topics = {item.topic for item in items}
    if len(topics) == 1:
        tracing.sent_to(span, topics.pop())
    context = tracing.context_properties()
    return [
        item._replace(
            properties=tracing.carried(item.properties, context) if item.properties else context
        )
        for item in items
    ]


Doing = Literal["send", "cancel", "read"]
_UNDONE: dict[Doing, tuple[str, str]] = {
    # (nothing was sent: what it means, the connection was lost at the commit: what it means)
    "send": (
        "; nothing was stored",
        "; the connection was lost after the write was sent, so it may be stored: send again "
        "with the same key to be sure",
    ),
    "cancel": (
        "; nothing was cancelled",
        "; the connection was lost after the cancel was sent, so it may be cancelled: look the "
        "message up to be sure",
    ),
    "read": ("", ""),
}


def unavailable(error: object, doing: Doing, *, maybe_stored: bool) -> DatabaseUnavailable:
    """The database could not be reached (`error`: the driver's), in one line, saying whether
    what it was `doing` may be done."""
    reason = one_line(error)
    return DatabaseUnavailable(
        f"the database is unavailable ({reason}){_UNDONE[doing][maybe_stored]}",
        maybe_stored=maybe_stored,
    )


def _raise_domain_error(
    exc: DBAPIError, doing: Doing, *, connected: bool, maybe_stored: bool
) -> None:
    """Raise the domain error a database error on one of our own connections stands for, if
    it stands for one: a lost connection (or none to be had) -> `DatabaseUnavailable`, in one
    line, saying whether what it was `doing` may be done; the key rule -> `DuplicateKey`;
    delaysvc's schema, a table or a function missing in the database (not migrated) ->
    `SchemaNotReady`."""
    if exc.connection_invalidated or (isinstance(exc, OperationalError) and not connected):
        raise unavailable(exc.orig, doing, maybe_stored=maybe_stored) from exc
    if isinstance(exc, IntegrityError) and store.unique_violation(exc, "uq_commit_log_topic_key"):
        raise DuplicateKey(str(exc.orig)) from None
    missing = store.not_migrated(exc)
    if missing is not None:
        raise missing from exc


def _lookup_key(key: object) -> str:
    """A key to look a message up by: required, and valid like a key on send."""
    found = validate_key(key)
    if found is None:
        raise ValidationError("key", "is required to look a message up by key")
    return found
