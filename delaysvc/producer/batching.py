"""A batch send's two halves: its items checked (`prepare`), then stored (`store_copied`).

On a psycopg 3 connection a batch is COPYed straight into the commit log and its lanes
(`delaysvc.store.batches`), at the speed the tables take rows. Each body is encoded as its row
is written, so PostgreSQL stores one part of the batch while Python encodes the next, and no
encoded body is held after its row is sent: a batch of 100,000 is streamed, not held a second
time. Everything else about an item is checked before anything is written (`prepare`); a body
that cannot be encoded stops the COPY, and the rows already COPYed are deleted, so the caller's
transaction is left as it was, with nothing of the batch in it.

The rules are the single send's: lanes (a level only while the database agrees on its delay),
offsets and due times on the database clock; a key held by an unfinished message of its topic
gives that message, a key repeated in the batch the first item's; backlog caps count what the
batch adds (`delaysvc.producer.caps`). A COPY fails whole if a key it writes is taken by another
transaction after the batch looked (the key's unique index); a batch with keys therefore COPYs
inside a savepoint, and after such a race is stored again through the staged insert
(`store.insert_messages`), which skips the keys taken. Other drivers (psycopg2, Django's
cursor, asyncio connections) have no COPY here, nor has a psycopg 3 connection in pipeline mode:
their batches take that staged insert too.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from operator import itemgetter
from typing import Any, NamedTuple

from psycopg import Cursor
from psycopg.errors import UniqueViolation

from delaysvc import store
from delaysvc.config import tracing
from delaysvc.config.levels import DelayLevels
from delaysvc.config.settings import BacklogCap, Settings
from delaysvc.config.validation import (
    MESSAGE_FIELDS,
    encode_body,
    validate_key,
    validate_priority,
    validate_tags,
    validate_topic,
)
from delaysvc.errors import ValidationError
from delaysvc.producer import caps
from delaysvc.producer.message import Message, SentBatch
from delaysvc.producer.placement import Placement, elapsed_after, resolve_schedule
from delaysvc.schema.tables import NO_LANE, level_partition
from delaysvc.store import batches

Result = tuple[Any, bool, int | None]
"""What the staged insert gives per item (`store.insert_messages`): (row, created, origin)."""

ALLOWED = frozenset({*MESSAGE_FIELDS, "priority"})
_ACCEPTED = ALLOWED | {"on_duplicate"}  # "keep" only: checked on its own
_TIMING = frozenset({"delay_level", "delay", "delay_ms", "deliver_at"})
_REMEMBERED = (str, int, timedelta, datetime)  # timing values a batch resolves once each


class Item(NamedTuple):
    """A batch item checked, all but its body, which is encoded as its row is written."""

    topic: str
    body: Any
    lane: int
    delay_level: int | None
    delay_ms: int | None
    deliver_at: datetime | None
    key: str | None
    tags: list[str] | None
    properties: dict[str, str] | None
    priority: int


# ---------------------------------------------------------------- checking


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a batch is checked and written. A
    batch keeps a few objects per message until it ends, and every collection its allocations
    set off walks them all again: a third of a 10,000 batch's time (docs/benchmarks/
    2026-11-27-batch-gc-encoder). A batch makes no cycles; those other threads make meanwhile are
    collected when it is on again. Left as it is when the application had turned it off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def prepare(messages: Sequence[Any], settings: Settings, now: datetime) -> list[Item]:
    """Check every item as `Producer.prepare` does, but for its body (encoded as it is written:
    `store`); errors name the item (`messages[3].topic`). A topic, a timing option
    (`"delay": "5m"`) and a set of field names are checked once per batch however many items
    repeat them: an item like one seen takes a few lookups, half the time of every check
    (docs/benchmarks/2026-11-28-batch-checks-compare)."""
    checker = _Checker(settings, now)
    items = []
    for index, item in enumerate(messages):
        try:
            items.append(checker.item(item))
        except ValidationError as exc:
            raise type(exc)(f"messages[{index}].{exc.field}", exc.detail) from None
    return items


class _Shape(NamedTuple):
    """What an item's field names (in their order) say about it, worked out once a batch for
    each order of names met (a batch's items mostly have one): the one timing option it
    names, if any, and whether it names any of the fields checked one by one."""

    timing: str | None
    key: bool
    rest: bool  # tags, properties or priority


class _Checker:
    """One batch's checks, remembering the topics, timings and field names it has seen: an
    item like one seen before (a plain dict whose names come in an order seen, its topic and
    its timing's value seen) is checked by `item`'s few lookups; any other goes through every
    check (`checked`), which gives the same Item, or the same error."""

    def __init__(self, settings: Settings, now: datetime):
        self.settings = settings
        self.now = now
        self.topics: dict[str, int | None] = {}  # a valid topic -> its default delay
        self.placements: dict[tuple[Any, ...], Placement] = {}
        self.context_fields = tracing.context_fields()  # not counted (tracing.validated_properties)
        self.shapes: dict[tuple[str, ...], _Shape | None] = {}  # None: not for the quick way

    def item(self, item: object) -> Item:
        if type(item) is not dict:
            return self.checked(item)
        names = tuple(item)
        shape = self.shapes.get(names, _UNSEEN)
        if shape is _UNSEEN:
            shape = self.shapes[names] = _shape_of(names)
        if shape is None:
            return self.checked(item)
        topic = item["topic"]
        if type(topic) is not str or topic not in self.topics:
            return self.checked(item)
        timing = shape.timing
        value = None if timing is None else item[timing]
        if value is None:
            remembered: tuple[Any, ...] = ("default", topic)
        elif type(value) in _REMEMBERED:
            remembered = (timing, value)
        else:
            return self.checked(item)
        placed = self.placements.get(remembered)
        if placed is None:
            return self.checked(item)
        if shape.rest:
            key, tags, properties, priority = self.rest(item)
        else:
            key = validate_key(item["key"]) if shape.key else None
            tags = properties = None
            priority = 0
        # the tuple made straight, not through Item's own `__new__` (a Python function, given
        # its arguments spread from a tuple): the checks 1.7 against 2.0 us an item
        # (docs/benchmarks/2026-12-02-batch-ids-while-checked)
        return _new_tuple(Item, (topic, item["body"], placed.lane, placed.delay_level,
                                 placed.delay_ms, placed.deliver_at, key, tags, properties,
                                 priority))  # fmt: skip

    def checked(self, item: object) -> Item:
        """`item` through every check."""
        if type(item) is not dict and not isinstance(item, Mapping):
            raise ValidationError("item", "must be an object with topic and body")
        if item.get("on_duplicate", "keep") != "keep":
            raise ValidationError(
                "on_duplicate", "is for single sends; in a batch a held key is kept"
            )
        if not item.keys() <= _ACCEPTED:
            unknown = sorted(set(item) - _ACCEPTED)
            raise ValidationError(unknown[0], f"unknown field; allowed: {sorted(ALLOWED)}")
        if "topic" not in item or "body" not in item:
            raise ValidationError("topic" if "topic" not in item else "body", "is required")
        topic = self.topic(item["topic"])
        placed = self.placement(topic, item)
        return Item(topic, item["body"], placed.lane, placed.delay_level, placed.delay_ms,
                    placed.deliver_at, *self.rest(item))  # fmt: skip

    def rest(
        self, item: Mapping[str, Any]
    ) -> tuple[str | None, list[str] | None, dict[str, str] | None, int]:
        """An item's key, tags, properties and priority, checked."""
        tags = item.get("tags")
        properties = item.get("properties")
        if properties is not None and type(properties) is not dict:
            properties = dict(properties) if isinstance(properties, Mapping) else properties
        return (
            validate_key(item.get("key")),
            validate_tags(list(tags) if isinstance(tags, tuple) else tags),
            tracing.validated_properties(properties, self.context_fields),
            validate_priority(item.get("priority", 0)),
        )

    def topic(self, topic: object) -> str:
        if type(topic) is str and topic in self.topics:
            return topic
        valid = validate_topic(topic)
        self.topics[valid] = self.settings.default_delays_ms.get(valid)
        return valid

    def placement(self, topic: str, item: Mapping[str, Any]) -> Placement:
        names = item.keys() & _TIMING
        given = {name: item[name] for name in names if item[name] is not None} if names else {}
        remembered: tuple[Any, ...] | None = None  # several options or an odd value: no
        if not given:
            remembered = ("default", topic)
        elif len(given) == 1:
            ((name, value),) = given.items()
            if type(value) in _REMEMBERED:  # exact types: True is no 1 here, nor 1.0
                remembered = (name, value)
        if remembered is not None and remembered in self.placements:
            return self.placements[remembered]
        placed = resolve_schedule(
            self.settings.levels,
            **given,
            default_delay_ms=self.topics[topic],
            max_delay_ms=self.settings.max_delay_ms,
            now=self.now,
        )
        if remembered is not None:
            self.placements[remembered] = placed
        return placed


_new_tuple = tuple.__new__
_UNSEEN = _Shape(None, False, False)  # a marker: names not met before in this batch
_REST = frozenset({"tags", "properties", "priority"})


def _shape_of(names: tuple[str, ...]) -> _Shape | None:
    """The shape of an item with these field names; None where the quick way would miss a
    check: a name not allowed (or `on_duplicate`), topic or body missing, two timings."""
    given = set(names)
    if not given <= ALLOWED or not {"topic", "body"} <= given:
        return None
    timings = given & _TIMING
    if len(timings) > 1:
        return None
    return _Shape(next(iter(timings), None), "key" in given, bool(given & _REST))


def encoded(items: Sequence[Item], max_body_bytes: int) -> list[store.NewMessage]:
    """The items with their bodies encoded, as the staged insert takes them."""
    messages = []
    for index, item in enumerate(items):
        data, is_json = _body(index, item, max_body_bytes)
        messages.append(
            store.NewMessage(
                topic=item.topic,
                body=data,
                body_is_json=is_json,
                lane=item.lane,
                delay_level=item.delay_level,
                delay_ms=item.delay_ms,
                deliver_at=item.deliver_at,
                key=item.key,
                tags=item.tags,
                properties=item.properties,
                priority=item.priority,
            )
        )
    return messages


def _body(index: int, item: Item, max_body_bytes: int) -> tuple[bytes, bool]:
    try:
        return encode_body(item.body, max_body_bytes)
    except ValidationError as exc:
        raise type(exc)(f"messages[{index}].{exc.field}", exc.detail) from None


# ---------------------------------------------------------------- storing


def messages(items: Sequence[Item], results: Sequence[Result]) -> SentBatch:
    """The Messages of a batch stored through the staged insert (its (row, created, origin)
    per item)."""
    return SentBatch.of(
        [
            Message.sent(items[origin], row.id, row.stored_at, row.deliver_ts, created)
            if origin is not None
            else Message.from_row(row, created=False)
            for row, created, origin in results
        ]
    )


class _Plan(NamedTuple):
    """What each item of a batch does: create a message (`creating`, indexes in order), give
    the message holding its key (`holders`: index -> its row), or the message an earlier item
    of the batch creates with the same key (`repeats`: index -> that item's index)."""

    creating: list[int]
    holders: dict[int, Any]
    repeats: dict[int, int]
    lanes: dict[int, int]  # lane (>= 0) -> messages created into it, in order of first use


def store_copied(
    conn: store.Statements,
    cursor: Cursor[Any],
    count: int,
    first: Item,
    checked: Callable[[], Sequence[Item]],
    settings: Settings,
) -> SentBatch:
    """Store a batch of `count` items by COPY on `cursor` (a psycopg 3 cursor of `conn`'s
    connection), in the caller's transaction, which the caller holds open around this
    (`Joined.transaction`); `first` is its first item checked alone, `checked` gives them all
    checked (`prepare`), called while the database draws their ids and the offsets of the
    first item's lane (`batches.drawing`; docs/benchmarks/2026-12-02-batch-ids-while-checked,
    2026-12-04-batch-offsets-while-checked). -> a Message per item, in order (made as read:
    `SentBatch`): created, or (created=False) the message holding its key, or the one the
    first item with its key created."""
    with batches.drawing(cursor, count, first.lane, first.delay_ms or 0) as drawn:
        items = checked()
        spread = _spread(items, settings.levels)
    reserved = _reserved_while_checked(drawn, spread)
    if reserved is None:  # not all in the first item's lane, or its level's delay changed
        items, spread = _placed(cursor, items, spread, settings.levels)
    covering: list[BacklogCap] = []
    if drawn.capped or settings.caps:  # else no cap covers any batch: none looked for
        covering = caps.covering(conn, settings.caps, [_Spot(*spot) for spot in spread.spots])
    caps.before_insert(conn, covering, items)
    plan = _plan(conn, items, spread)
    for index in (*plan.holders, *plan.repeats):  # stores nothing, but is checked all the same
        _body(index, items[index], settings.max_body_bytes)
    created: Sequence[Item] = items
    if spread.keyed:
        created = [items[index] for index in plan.creating]
        try:
            with batches.savepoint(cursor):
                sent = _copied(cursor, items, plan, drawn.ids, reserved, settings.max_body_bytes)
        except UniqueViolation as exc:
            if exc.diag.constraint_name != batches.KEY_INDEX:
                raise
            # a key was taken after the batch looked: store it the way that skips taken keys
            results = store.insert_messages(conn, encoded(items, settings.max_body_bytes), cursor)
            created = [items[origin] for _, new, origin in results if new and origin is not None]
            sent = messages(items, results)
    else:
        sent = _copied(cursor, items, plan, drawn.ids, reserved, settings.max_body_bytes)
    if covering:
        caps.after_insert(conn, covering, created)
    return sent


class _Spread(NamedTuple):
    """Where a batch's items go, from one pass over them (`_spread`): how many go to each
    (topic, lane), the delay of each level they use, and whether any has a key. The steps
    after the checks read it instead of passing over the items again each (the lanes' delays,
    the caps' targets, the keys, the lanes' counts: five passes, 2.9 against 1.3 ms for
    10,000 items, ad hoc: docs/benchmarks/2026-12-04-batch-offsets-while-checked)."""

    spots: dict[tuple[str, int], int]  # (topic, lane) -> items, in order of first use
    delays: dict[int, int]  # level (> 0) -> its delay (ms), as the items were placed
    keyed: bool


class _Spot(NamedTuple):
    """A (topic, lane) a batch sends to, as the caps read a message (`caps.Adding`)."""

    topic: str
    lane: int
    key: None = None


def _spread(items: Sequence[Item], levels: DelayLevels) -> _Spread:
    spots = Counter(map(_TOPIC_AND_LANE, items))
    delays = {lane: levels.delay_ms(lane) for _, lane in spots if lane > 0}
    return _Spread(spots, delays, any(map(_KEY, items)))  # a key is never ""


_TOPIC_AND_LANE = itemgetter(0, 2)  # an Item's (topic, lane)
_KEY = itemgetter(6)  # an Item's key


def _reserved_while_checked(drawn: batches.Drawn, spread: _Spread) -> batches.Reserved | None:
    """The store time and offsets `drawing` drew, when every item goes to the lane it drew
    them for, as the database placed it (a level only while it agrees on its delay): they are
    the batch's, as a `reserve` after the checks would draw them. None otherwise."""
    if any(lane != drawn.lane for _, lane in spread.spots):
        return None
    offsets = [] if drawn.offsets is None else [drawn.offsets]
    return batches.Reserved(drawn.stored_at, offsets)


def _placed(
    cursor: Cursor[Any], items: Sequence[Item], spread: _Spread, levels: DelayLevels
) -> tuple[Sequence[Item], _Spread]:
    """The items with the lanes the database gives their levels (the timer lane for a level
    whose delay it does not agree on), and their spread."""
    if not spread.delays:
        return items, spread
    lanes = batches.place_levels(cursor, spread.delays)
    if all(lane == level for level, lane in lanes.items()):
        return items, spread
    moved = [item._replace(lane=lanes[item.lane]) if item.lane > 0 else item for item in items]
    return moved, _spread(moved, levels)


def _plan(conn: store.Statements, items: Sequence[Item], spread: _Spread) -> _Plan:
    """Which items create a message: not one whose key an unfinished message holds, nor a
    key's repeat in the batch."""
    if not spread.keyed:  # each item creates one
        lanes: dict[int, int] = {}
        for (_, lane), n in spread.spots.items():
            if lane >= 0:
                lanes[lane] = lanes.get(lane, 0) + n
        return _Plan(list(range(len(items))), {}, {}, lanes)
    keys = [(item.topic, item.key) for item in items if item.key is not None]
    plan = _Plan([], {}, {}, {})
    holders = store.find_unfinished_by_keys(conn, keys)
    first: dict[tuple[str, str], int] = {}
    for index, item in enumerate(items):
        if item.key is not None:
            pair = (item.topic, item.key)
            if pair in holders:
                plan.holders[index] = holders[pair]
                continue
            if pair in first:
                plan.repeats[index] = first[pair]
                continue
            first[pair] = index
        plan.creating.append(index)
    plan.lanes.update(Counter(items[i].lane for i in plan.creating if items[i].lane >= 0))
    return plan


def _copied(
    cursor: Cursor[Any],
    items: Sequence[Item],
    plan: _Plan,
    drawn: list[int],
    reserved: batches.Reserved | None,
    max_body_bytes: int,
) -> SentBatch:
    """COPY the plan's messages into the commit log, then into their lanes, and count them;
    their ids are the first of `drawn` (one an item, ascending), in order, their store time and
    offsets `reserved`'s, else drawn now (`batches.reserve`). A body that cannot be encoded
    ends the COPY there: the rows sent are deleted, and the error raised. -> the batch's
    Messages, each made when it is read (`_sent`)."""
    if not plan.creating:
        return _sent(items, plan, [], [], None)
    ids = drawn[: len(plan.creating)]
    if reserved is None:
        reserved = batches.reserve(cursor, list(plan.lanes.items()))
    stored_at, offsets = reserved
    stored = batches.wire_time(stored_at)
    lane_offsets = {lane: iter(drawn) for lane, drawn in zip(plan.lanes, offsets, strict=True)}
    due_after: dict[int, tuple[datetime, int]] = {}  # delay (ms) -> stored_at + delay, twice
    dues: list[datetime] = []  # each created message's due time
    wire_dues: list[int] = []  # and the same for its lane's row (`batches.wire_time`)
    taken: list[int | None] = []  # and its queue offset (None: due now)
    refused: ValidationError | None = None
    with batches.copying(cursor, "commit_log", batches.MESSAGE_ROW) as copy:
        write = copy.write_row
        for index, message_id in zip(plan.creating, ids, strict=True):
            # the item's fields unpacked at once, not read one by one (a property each)
            topic, body, lane, level, delay, deliver_at, key, tags, properties, priority = items[
                index
            ]
            try:
                data, is_json = encode_body(body, max_body_bytes)
            except ValidationError as exc:
                refused = type(exc)(f"messages[{index}].{exc.field}", exc.detail)
                break
            if deliver_at is not None:  # a time already past: the store time (`store._DUE`)
                due = max(deliver_at.astimezone(stored_at.tzinfo), stored_at)
                wire_due = batches.wire_time(due)
            else:
                if delay is None:
                    delay = 0
                if delay not in due_after:
                    after = elapsed_after(stored_at, delay)
                    due_after[delay] = after, batches.wire_time(after)
                due, wire_due = due_after[delay]
            offset = next(lane_offsets[lane]) if lane >= 0 else None
            write(
                (
                    message_id,
                    topic,
                    key,
                    tags,
                    data,
                    is_json,
                    properties,
                    level,
                    priority,
                    lane,
                    offset,
                    "scheduled" if lane >= 0 else "ready",
                    stored,
                    wire_due,
                    None if lane >= 0 else stored,
                )
            )
            dues.append(due)
            wire_dues.append(wire_due)
            taken.append(offset)
    if refused is not None:
        if dues:
            batches.unsend(cursor, ids[: len(dues)])
        raise refused
    created = items if len(plan.creating) == len(items) else [items[i] for i in plan.creating]
    lanes = set(plan.lanes)
    if sum(plan.lanes.values()) < len(plan.creating):
        lanes.add(NO_LANE)  # some are due now: straight into their topics' queues
    _copy_lanes(cursor, created, ids, wire_dues, taken, lanes)
    if plan.lanes:
        batches.count_into_lanes(cursor, plan.lanes)
    return _sent(items, plan, ids, dues, stored_at)


def _copy_lanes(
    cursor: Cursor[Any],
    created: Sequence[Item],
    ids: Sequence[int],
    dues: Sequence[int],
    taken: Sequence[int | None],
    lanes: Collection[int],
) -> None:
    """COPY the lanes' rows of the messages just COPYed into the commit log (`dues`: their due
    times as `batches.wire_time`s; `lanes`: the lanes they go to): a level's queue, the timer
    lane or (due now) the topic's queue, a COPY each."""

    def rows() -> Iterator[tuple[int, int | None, int, str, int, int]]:
        """(lane, offset, id, topic, due, priority) of each message, in order."""
        for item, message_id, due, offset in zip(created, ids, dues, taken, strict=True):
            topic, _, lane, _, _, _, _, _, _, priority = item  # no list made for a `*_`
            yield lane, offset, message_id, topic, due, priority

    copies: list[tuple[str, Sequence[tuple[str, str]], Iterable[tuple[Any, ...]]]] = []
    levels = [lane for lane in lanes if lane > 0]
    if levels:
        level_rows = rows() if min(lanes) > 0 else (row for row in rows() if row[0] > 0)
        # one level: straight into its partition, which spares PostgreSQL routing each row
        # (0.06-0.16 us a row, 5-11% of the lane's COPY: docs/benchmarks/2026-12-06-batch-partition)
        table = level_partition(levels[0]) if len(levels) == 1 else "consume_queue"
        copies.append((table, batches.LEVEL_ROW, level_rows))
    if 0 in lanes:
        timer_rows = (
            (due, offset, message_id, topic, priority)
            for lane, offset, message_id, topic, due, priority in rows()
            if lane == 0
        )
        copies.append(("timer_queue", batches.TIMER_ROW, timer_rows))
    if any(lane < 0 for lane in lanes):
        ready_rows = (
            (message_id, topic, due, priority)
            for lane, _, message_id, topic, due, priority in rows()
            if lane < 0
        )
        copies.append(("topic_queue", batches.READY_ROW, ready_rows))
    for table, row, values in copies:
        batches.copy_rows(cursor, table, row, values)


def _sent(
    items: Sequence[Item],
    plan: _Plan,
    ids: list[int],
    dues: Sequence[datetime],
    stored_at: datetime | None,
) -> SentBatch:
    """A Message per item, in order, each made when read: for an item that created a message,
    from the item, its id and due time (`ids`, `dues`: in the order of `plan.creating`) and the
    store time; for a key's repeat, its first item's, `created` False; for a key held, its
    holder's row."""
    sent = Message.sent
    if stored_at is not None and len(plan.creating) == len(items):  # each item created one
        at = stored_at
        # `ids` given a list of its own: the caller may change it, the Messages are made from these
        return SentBatch(list(ids), lambda i: sent(items[i], ids[i], at, dues[i], True))
    position = {index: p for p, index in enumerate(plan.creating)}  # item -> its created one
    position.update((index, position[origin]) for index, origin in plan.repeats.items())

    def make(index: int) -> Message:
        if index in plan.holders:
            return Message.from_row(plan.holders[index], created=False)
        p = position[index]
        origin = plan.creating[p]
        assert stored_at is not None  # a message was created
        return sent(items[origin], ids[p], stored_at, dues[p], origin == index)

    held = plan.holders
    item_ids = [held[i].id if i in held else ids[position[i]] for i in range(len(items))]
    return SentBatch(item_ids, make)
