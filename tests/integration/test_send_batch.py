"""The batch send's COPY path and the single send's one-statement path: what they return is
exactly what is stored, keys dedup inside a batch and against stored rows, caps hold, and the
caller's transaction decides."""

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, text

from delaysvc.config.settings import Settings
from delaysvc.errors import BacklogFull, NotFound
from delaysvc.producer.sending import Message, Producer

COMPARED = (
    "id",
    "topic",
    "key",
    "status",
    "delay_level",
    "deliver_at",
    "stored_at",
    "tags",
    "properties",
    "delivered_at",
    "attempts",
)


def _same_as_stored(producer: Producer, message: Message) -> None:
    stored = producer.get(message.id)
    assert {f: getattr(message, f) for f in COMPARED} == {f: getattr(stored, f) for f in COMPARED}


def _lanes(engine: Engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        return sorted(
            conn.execute(
                text(
                    "SELECT 'level' || level, message_id FROM consume_queue "
                    "UNION ALL SELECT 'timer', message_id FROM timer_queue "
                    "UNION ALL SELECT 'ready', message_id FROM topic_queue"
                )
            ).all()
        )


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM commit_log")).scalar_one()


def test_single_sends_return_what_is_stored_in_every_kind_of_lane(
    producer: Producer, engine: Engine
) -> None:
    level = producer.send("t", {"a": 1}, delay_level=2, tags=["x"], properties={"p": "v"})
    timer = producer.send("t", [1, 2], delay="7s", key="k1")
    ready = producer.send("t", "now")
    at = producer.send("t", 1, deliver_at=datetime.now(UTC) + timedelta(minutes=5))
    for message in (level, timer, ready, at):
        assert message.created is True
        _same_as_stored(producer, message)
    assert (level.status, ready.status, ready.delivered_at) == (
        "scheduled",
        "ready",
        ready.stored_at,
    )
    assert timer.deliver_at - timer.stored_at == timedelta(seconds=7)
    assert _lanes(engine) == sorted(
        [("level2", level.id), ("timer", timer.id), ("ready", ready.id), ("timer", at.id)]
    )
    again = producer.send("t", "other", key="k1")
    assert (again.created, again.id, again.body) == (False, timer.id, [1, 2])


def test_a_batch_dedups_keys_inside_itself_and_against_stored_rows(
    producer: Producer, engine: Engine
) -> None:
    held = producer.send("t", "old", delay="1h", key="held")
    finished = producer.send("t", "done", key="finished")
    producer.cancel(finished.id)
    items = [
        {"topic": "t", "body": 0, "key": "held"},
        {"topic": "t", "body": 1, "key": "a", "delay_level": 1},
        {"topic": "t", "body": 2, "key": "a", "delay": "1h"},
        {"topic": "u", "body": 3, "key": "a"},
        {"topic": "t", "body": 4, "key": "finished", "delay": "7s"},
        {"topic": "t", "body": 5},
        {"topic": "t", "body": 6},
        {"topic": "t", "body": 7, "key": "held"},
    ]
    results = producer.send_batch(items)
    assert [m.created for m in results] == [False, True, False, True, True, True, True, False]
    assert results[0].id == results[7].id == held.id and results[0].body == "old"
    assert results[2].id == results[1].id and results[2].delay_level == 1
    assert results[4].id != finished.id
    created = [m for m in results if m.created]
    assert [m.id for m in created] == sorted(m.id for m in created)  # ids in batch order
    for message in created:
        _same_as_stored(producer, message)
    assert [producer.get(m.id).body for m in created] == [1, 3, 4, 5, 6]
    assert _count(engine) == 2 + len(created)
    lanes = _lanes(engine)
    assert ("level1", results[1].id) in lanes and ("timer", results[4].id) in lanes
    assert len(lanes) == 1 + len(created)  # `held` waits too; `finished` nowhere


def test_a_batch_stores_awkward_values_exactly(producer: Producer) -> None:
    bodies = [b"\\N", b"a\tb\nc\\d\r", "tab\there \\ \u00e9\u4e2d\U0001f600", {"q": 'x"y'}, b""]
    results = producer.send_batch(
        [
            {
                "topic": "t.x-y_z",
                "body": body,
                "key": f"k\\{i} \u00e9\u2603",
                "tags": ["a:b", "c.d"],
                "properties": {"back\\slash": "tab\there", "quote": '"', "nl": "a\nb"},
            }
            for i, body in enumerate(bodies)
        ]
    )
    for body, message in zip(bodies, results, strict=True):
        stored = producer.get(message.id)
        assert stored.body == body
        assert stored.key == message.key and stored.properties == message.properties
        _same_as_stored(producer, message)


def test_batches_in_the_callers_transaction_roll_back_to_nothing(
    producer: Producer, engine: Engine
) -> None:
    with engine.connect() as conn:
        trans = conn.begin()
        first = producer.send_batch(
            [{"topic": "t", "body": n, "delay": "1h"} for n in range(3)], connection=conn
        )
        second = producer.send_batch(
            [{"topic": "t", "body": n, "key": f"k{n}"} for n in range(3)], connection=conn
        )
        assert len({m.id for m in first + second}) == 6
        trans.rollback()
    for message in first + second:
        with pytest.raises(NotFound):
            producer.get(message.id)
    assert _count(engine) == 0 and _lanes(engine) == []
    with engine.begin() as conn:
        kept = producer.send_batch(
            [{"topic": "t", "body": n, "key": f"k{n}"} for n in range(3)], connection=conn
        )
        repeated = producer.send_batch(
            [{"topic": "t", "body": 9, "key": "k1"}, {"topic": "t", "body": 3}], connection=conn
        )
    assert [m.created for m in kept + repeated] == [True, True, True, False, True]
    assert repeated[0].id == kept[1].id
    assert _count(engine) == 4


def test_a_batch_over_a_reject_cap_stores_nothing_and_deliver_early_moves_the_oldest(
    settings: Settings, engine: Engine
) -> None:
    capped = Producer(
        settings.model_copy(update={"backlog_caps": "level:2=3:reject,level:1=2:deliver-early"}),
        engine,
    )
    with pytest.raises(BacklogFull):
        capped.send_batch([{"topic": "t", "body": n, "delay_level": 2} for n in range(4)])
    assert _count(engine) == 0
    stored = capped.send_batch([{"topic": "t", "body": n, "delay_level": 1} for n in range(5)])
    lanes = _lanes(engine)
    assert [m for lane, m in lanes if lane == "level1"] == [m.id for m in stored[3:]]
    assert sorted(m for lane, m in lanes if lane == "ready") == [m.id for m in stored[:3]]
