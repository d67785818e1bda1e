"""A batch's items checked before anything is written (`batching.prepare`), with a timing and a
topic resolved once per batch, and the Messages a batch returns made without `__init__`."""

import struct
from datetime import UTC, datetime, timedelta, timezone
from random import Random
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from psycopg.adapt import PyFormat, Transformer

from delaysvc.config.settings import Settings
from delaysvc.errors import TooLarge, ValidationError
from delaysvc.producer import batching
from delaysvc.producer.message import Message
from delaysvc.schema.tables import NO_LANE, TIMER_LANE
from delaysvc.store import NewMessage, batches

SETTINGS = Settings(database_url="postgresql://u@h/d", topic_delays="t.slow=5s")
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _prepare(*items: object) -> list[batching.Item]:
    return batching.prepare(list(items), SETTINGS, NOW)


def test_items_are_placed_as_a_single_send_places_them() -> None:
    at = NOW + timedelta(hours=3)
    items = _prepare(
        {"topic": "t", "body": 1, "delay_level": 2},
        {"topic": "t", "body": 2, "delay": "5s"},  # level 2's delay: its FIFO queue
        {"topic": "t", "body": 3, "delay_ms": 7000},
        {"topic": "t", "body": 4, "deliver_at": at},
        {"topic": "t", "body": 5},
        {"topic": "t.slow", "body": 6},  # the topic's default delay
        {"topic": "t", "body": 7, "delay_level": 0},
        {"topic": "t", "body": 8, "delay": timedelta(seconds=7), "key": "k", "priority": 3},
    )
    assert [(i.lane, i.delay_level, i.delay_ms, i.deliver_at) for i in items] == [
        (2, 2, 5000, None),
        (2, 2, 5000, None),
        (TIMER_LANE, None, 7000, None),
        (TIMER_LANE, None, None, at),
        (NO_LANE, 0, 0, None),
        (2, 2, 5000, None),
        (NO_LANE, 0, 0, None),
        (TIMER_LANE, None, 7000, None),
    ]
    assert (items[7].key, items[7].priority, items[0].body) == ("k", 3, 1)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"topic": "bad topic!", "body": 1}, "topic"),
        ({"topic": "t"}, "body"),
        ({"topic": "t", "body": 1, "color": "red"}, "color"),
        ({"topic": "t", "body": 1, "on_duplicate": "replace"}, "on_duplicate"),
        ({"topic": "t", "body": 1, "delay_level": True}, "delay_level"),  # after level 1 passed
        ({"topic": "t", "body": 1, "delay_ms": 1.0}, "delay_ms"),
        ({"topic": "t", "body": 1, "delay": "5s", "delay_ms": 5000}, "delay_ms"),
        ({"topic": "t", "body": 1, "key": ""}, "key"),
        ({"topic": "t", "body": 1, "tags": "a"}, "tags"),
        ({"topic": "t", "body": 1, "properties": {"p": 1}}, "properties"),
        ({"topic": "t", "body": 1, "priority": 5000}, "priority"),
        ("not an item", "item"),
    ],
)
def test_a_bad_item_is_named_by_its_index_even_after_good_ones_like_it(
    bad: object, field: str
) -> None:
    good = [
        {"topic": "t", "body": 0, "delay_level": 1},
        {"topic": "t", "body": 0, "delay_ms": 1000},
        {"topic": "t", "body": 0, "delay": "5s"},
    ]
    with pytest.raises(ValidationError) as refused:
        _prepare(*good, bad)
    assert refused.value.field == f"messages[3].{field}"


def _mostly(good: list[object], bad: list[object]) -> list[object]:
    """A field's values to pick from: good ones three times in four (a bad one ends the quick
    way's use)."""
    return [*good * (3 * len(bad)), *bad * len(good)]


_VALUES = {  # good and bad values of each field, and a name no item may have
    "topic": _mostly(["t", "t.slow", "u"], ["bad topic!", 7, None, ["t"]]),
    "body": [1, {"a": 1}, b"x", None],
    "delay_level": _mostly([1, 2, 0, None], [99, True, 1.0, "2"]),
    "delay": _mostly(["5s", "7s", "1h", timedelta(seconds=5), None], ["soon", 5]),
    "delay_ms": _mostly([5000, 7000, 0, None], [-1, 1.0]),
    "deliver_at": _mostly([NOW + timedelta(hours=1), None], ["tomorrow", NOW - timedelta(1)]),
    "key": _mostly(["k", "j", None], ["", "a\x00b", 3]),
    "tags": _mostly([["a"], ("a", "b"), None], ["a", ["bad tag!"]]),
    "properties": _mostly([{"p": "v"}, [("p", "v")], None], [{"p": 1}, "p"]),
    "priority": _mostly([0, 3], [5000, True, None]),
    "on_duplicate": ["keep", "replace"],
    "color": ["red"],
}
_TIMINGS = ["delay_level", "delay", "delay_ms", "deliver_at"]
_NAMES = (  # parts of an item's names: mostly what the quick way takes, now and then not
    _mostly([("topic", "body")], [("topic",), ("body",)]),
    _mostly([(), *((name,) for name in _TIMINGS)],
            [("delay", "delay_ms"), ("deliver_at", "delay_level")]),
    _mostly([(), ("key",), ("tags",), ("properties",), ("priority",), ("key", "tags")],
            [("key", "priority", "properties")]),
    _mostly([()], [("on_duplicate",), ("color",)]),
)  # fmt: skip


def _batch(random: Random) -> list[object]:
    """An item list of a few sets of names (so names, topics and timings repeat: the quick
    way's condition), each item with values of its own, the names sometimes in another order;
    now and then not an item at all."""
    shapes = [[name for part in _NAMES for name in random.choice(part)] for _ in range(3)]
    batch: list[object] = []
    for _ in range(40):
        names = random.choice(shapes)
        if random.random() < 0.2:
            names = random.sample(names, len(names))
        batch.append({name: random.choice(_VALUES[name]) for name in names})
        if random.random() < 0.03:
            batch.append("not an item")
    return batch


@pytest.mark.parametrize("seed", range(20))
def test_an_item_like_one_seen_is_checked_the_quick_way_with_the_same_outcome(seed: int) -> None:
    """`prepare` checks an item like one already checked in its batch by a few lookups
    (`_Checker.item`): whatever the items, it gives what every check of every item gives, or
    the same error (the batch would stop at the first; the test goes on)."""
    random = Random(seed)
    for _ in range(25):
        batch = _batch(random)
        quick = batching._Checker(SETTINGS, NOW)
        everything = batching._Checker(SETTINGS, NOW)
        for item in batch:
            assert _outcome(quick.item, item) == _outcome(everything.checked, item), item


def _outcome(check: Any, item: object) -> object:
    try:
        return check(item)
    except ValidationError as exc:
        return type(exc), exc.field, exc.detail


def test_bodies_are_checked_when_encoded_and_named_by_their_index() -> None:
    items = _prepare({"topic": "t", "body": 1}, {"topic": "t", "body": b"x" * (5 << 20)})
    with pytest.raises(TooLarge) as refused:
        batching.encoded(items, SETTINGS.max_body_bytes)
    assert refused.value.field == "messages[1].body"
    (message,) = batching.encoded(items[:1], SETTINGS.max_body_bytes)
    assert (message.body, message.body_is_json) == (b"1", True)


def test_a_sent_message_is_the_message_init_makes() -> None:
    """`Message.sent` fills a new instance's dict itself (faster than `__init__`): the same
    fields, values and order, for a batch's item and for a single send's `NewMessage`."""
    (item,) = _prepare(
        {"topic": "t", "body": 1, "key": "k", "tags": ["a"], "properties": {"p": "v"}},
    )
    new = NewMessage(
        "t", b"1", True, item.lane, item.delay_level, item.delay_ms, None, "k", ["a"], {"p": "v"}, 0
    )
    ready = item.lane < 0
    for created in (True, False):
        expected = Message(
            id=7,
            topic="t",
            key="k",
            status="ready" if ready else "scheduled",
            delay_level=item.delay_level,
            deliver_at=NOW,
            stored_at=NOW,
            created=created,
            tags=["a"],
            properties={"p": "v"},
            delivered_at=NOW if ready else None,
        )
        for sent in (item, new):
            made = Message.sent(sent, 7, NOW, NOW, created)
            assert made == expected
            # in `__init__`'s order, so the dict shares its keys with other Messages'
            assert list(vars(made).items()) == list(vars(expected).items())
    one, two = (Message.sent(item, n, NOW, NOW) for n in (1, 2))
    assert one.tags is not two.tags and one.errors is not two.errors  # each its own
    with pytest.raises(AttributeError):
        one.id = 3  # type: ignore[misc]  # frozen as any Message


@pytest.mark.parametrize(
    "at",
    [
        datetime(2026, 11, 27, 18, 0, 0, 123456, tzinfo=UTC),
        datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=ZoneInfo("America/New_York")),
        datetime(2026, 3, 29, 2, 30, tzinfo=ZoneInfo("Europe/Berlin")),  # in a DST gap
        datetime(1970, 1, 1, tzinfo=timezone(timedelta(hours=5, minutes=30))),
    ],
)
def test_a_batch_row_carries_a_time_as_psycopg_would_send_the_datetime(at: datetime) -> None:
    """A batch COPYs its times as int8s (`batches.wire_time`): the same 8 bytes psycopg's own
    binary dumper sends for the aware datetime."""
    dumper = Transformer().get_dumper(at, PyFormat.BINARY)
    assert struct.pack(">q", batches.wire_time(at)) == bytes(dumper.dump(at))
