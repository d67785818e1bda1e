"""Priorities within a topic: a higher priority is claimed first, FIFO within a priority, and a
message keeps its priority through every lane it passes (a level, the timer lane, a retry, a
lost lease, a redrive). The claim's plan at 1M ready jobs is in
tests/integration/test_tick_cost.py."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import Engine, text

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.errors import DeadLetter, RetryLater, ValidationError
from delaysvc.maintenance import delivery
from delaysvc.producer.dead_letters import DeadLetters
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import TIMER_LANE
from delaysvc.worker.consumer import Consumer, handler

pytestmark = pytest.mark.usefixtures("own_handlers")


def _queued_priority(engine: Engine, message_id: int) -> int | None:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT priority FROM topic_queue WHERE message_id = :id"), {"id": message_id}
        ).scalar()


def test_a_higher_priority_is_claimed_first_and_fifo_within_a_priority(
    producer: Producer, engine: Engine
) -> None:
    sent = [
        (producer.send("prio.t", {"n": n}, priority=priority).id, priority)
        for n, priority in enumerate([0, 5, -1, 5, 0, 1])
    ]
    with engine.begin() as conn:
        claimed = [row.id for row in store.claim_ready(conn, "prio.t", 3, 60)]
    by_priority = [i for i, _ in sorted(sent, key=lambda item: (-item[1], item[0]))]
    assert claimed == by_priority[:3]  # the two 5s in the order sent, then the 1
    with engine.begin() as conn:
        rest = [row.id for row in store.claim_ready(conn, "prio.t", 10, 60)]
    assert rest == by_priority[3:]
    assert producer.get(sent[1][0]).priority == 5


def test_priority_is_validated_naming_the_field(producer: Producer) -> None:
    for bad in (1001, -1001, 1.5, "high", True):
        with pytest.raises(ValidationError) as caught:
            producer.send("prio.t", 1, priority=bad)  # type: ignore[arg-type]
        assert caught.value.field == "priority"


def test_a_message_keeps_its_priority_through_levels_timer_retries_leases_and_redrives(
    producer: Producer, engine: Engine, settings: Settings
) -> None:
    leveled = producer.send("prio.move", {"n": 1}, delay_level=1, priority=7)
    timed = producer.send("prio.move", {"n": 2}, delay_ms=1200, priority=-3)
    batch = producer.send_batch(
        [{"topic": "prio.move", "body": 3, "delay_level": 1, "priority": 4}]
    )[0]
    time.sleep(1.3)
    with engine.connect() as conn:
        delivery.run_once(conn, 1, batch=100)
        delivery.run_once(conn, TIMER_LANE, batch=100)
    assert _queued_priority(engine, leveled.id) == 7
    assert _queued_priority(engine, timed.id) == -3
    assert _queued_priority(engine, batch.id) == 4

    failures: list[int] = []

    @handler("prio.retry", max_retries=1)
    def fails_once(message: Any) -> None:
        if message.attempts == 1:
            failures.append(message.id)
            raise RetryLater(delay_ms=1000)  # level 1 again

    retried = producer.send("prio.retry", {}, priority=9)
    consumer = Consumer(settings, engine)
    consumer.run_once("prio.retry")
    assert failures == [retried.id]
    with engine.connect() as conn:
        assert store.get_message(conn, retried.id).lane == 1
    time.sleep(1.1)
    with engine.connect() as conn:
        delivery.run_once(conn, 1, batch=100)
    assert _queued_priority(engine, retried.id) == 9

    lost = producer.send("prio.lease", {}, priority=2)
    with engine.begin() as conn:
        store.claim_ready(conn, "prio.lease", 1, lease_seconds=0)
    with engine.begin() as conn:
        assert [r.id for r in store.rescue_expired_leases(conn, 10, 30)] == [lost.id]
    assert _queued_priority(engine, lost.id) == 2

    @handler("prio.dead")
    def dies(message: Any) -> None:
        raise DeadLetter("no")

    dead = producer.send("prio.dead", {}, priority=6)
    consumer.run_once("prio.dead")
    assert producer.get(dead.id).status == "dead"
    DeadLetters(engine).redrive(dead.id)
    assert _queued_priority(engine, dead.id) == 6
