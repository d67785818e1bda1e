"""The delivery engine with real Celery workers and beat: on time and never early, exactly once
and in order with several workers and beats, nothing lost or duplicated when a worker is
killed in the middle of a drain (RocketMQ's ScheduleMessageService scenarios, ported)."""

from __future__ import annotations

import time

import pytest

from delaysvc import store
from delaysvc.producer.sending import Producer
from tests.e2e.conftest import Service, restart_postgres, send_many, tolerant, wait_for
from tests.support.passes import second_pass_only

pytestmark = pytest.mark.e2e


def _topic_queue_order(service: Service, level: int | None) -> list[int]:
    return [
        row.message_id
        for row in service.rows(
            "SELECT q.message_id FROM topic_queue q JOIN message m ON m.id = q.message_id "
            "WHERE m.delay_level IS NOT DISTINCT FROM :level ORDER BY q.seq",
            level=level,
        )
    ]


def test_a_level_2_message_is_not_delivered_before_its_time_and_is_after(
    service: Service, producer: Producer
) -> None:
    service.delivery_worker()
    service.consume_worker()
    service.beat()
    message = producer.send("e2e.record", {"hello": 1}, delay_level=2)  # "1s 2s ..." -> 2 s
    clamped = producer.send("e2e.record", {"hello": 2}, delay_level=99)
    assert clamped.delay_level == 5

    wait_for(lambda: service.count_status("succeeded") == 1, 60, "the level-2 message to run")
    row = service.rows("SELECT * FROM message WHERE id = :id", id=message.id)[0]
    assert row.delivered_at >= row.deliver_ts  # never early
    assert row.started_at >= row.delivered_at
    assert (row.deliver_ts - row.stored_at).total_seconds() == 2.0
    wait_for(lambda: service.count_status("succeeded") == 2, 60, "the clamped message to run")
    runs = service.rows("SELECT message_id, attempt FROM e2e_run ORDER BY message_id")
    assert [(r.message_id, r.attempt) for r in runs] == [(message.id, 1), (clamped.id, 1)]


def test_100_messages_at_each_of_levels_1_to_4_are_all_delivered_within_their_window(
    service: Service, producer: Producer
) -> None:
    service.delivery_worker()
    service.beat()
    sent = {
        level: [
            m.id
            for m in producer.send_batch(
                [
                    {"topic": "e2e.unhandled", "body": {"n": n}, "delay_level": level}
                    for n in range(100)
                ]
            )
        ]
        for level in (1, 2, 3, 4)
    }
    wait_for(lambda: service.count_status("ready") == 400, 60, "400 messages to be delivered")
    delivered = service.rows(f"SELECT {store.DELIVERED_AT} AS at, c.deliver_ts FROM message c")
    assert len(delivered) == 400 and all(row.at is not None for row in delivered)
    assert [row for row in delivered if row.at < row.deliver_ts] == []  # none early
    for level, ids in sent.items():
        assert _topic_queue_order(service, level) == ids  # send order kept per level
    stats = {
        row.lane: row
        for row in service.rows("SELECT lane, schedule_offset, moved_total FROM schedule_offset")
    }
    assert [stats[level].moved_total for level in (1, 2, 3, 4)] == [100, 100, 100, 100]
    assert [stats[level].schedule_offset for level in (1, 2, 3, 4)] == [100, 100, 100, 100]


def test_exactly_once_and_in_order_with_4_delivery_workers_and_2_beats(
    service: Service, producer: Producer
) -> None:
    for _ in range(4):
        service.delivery_worker()
    service.beat()
    service.beat()
    by_level = {level: send_many(producer, 1500, delay_level=level) for level in (1, 2, 3)}
    timer = send_many(producer, 1500, delay_ms=1500)
    total = 6000
    wait_for(lambda: service.count_status("ready") == total, 120, f"{total} deliveries")
    assert service.scalar("SELECT count(*) FROM topic_queue") == total
    assert service.scalar("SELECT count(DISTINCT message_id) FROM topic_queue") == total
    for level, ids in by_level.items():
        assert _topic_queue_order(service, level) == ids
    assert sorted(_topic_queue_order(service, None)) == sorted(timer)
    moved = service.scalar("SELECT sum(moved_total) FROM schedule_offset")
    assert moved == total
    assert service.scalar("SELECT count(*) FROM consume_queue") == 0
    assert service.scalar("SELECT count(*) FROM timer_queue") == 0
    stuck = service.scalar("SELECT count(*) FROM schedule_offset WHERE stuck_error IS NOT NULL")
    assert stuck == 0


def test_kill_9_of_the_worker_during_a_100k_drain_loses_and_duplicates_nothing(
    service: Service, producer: Producer
) -> None:
    total = 100_000
    ids = send_many(producer, total, delay_level=1)
    wait_for(
        lambda: (
            service.scalar("SELECT count(*) FROM consume_queue WHERE deliver_ts <= now()") == total
        ),
        30,
        "the backlog to fall due",
    )
    first = service.delivery_worker()
    service.beat()
    wait_for(
        lambda: service.scalar("SELECT moved_total FROM schedule_offset WHERE lane = 1") >= 5000,
        120,
        "the drain to start",
        every=0.01,
    )
    service.kill(first)
    moved_at_kill = service.scalar("SELECT moved_total FROM schedule_offset WHERE lane = 1")
    assert 0 < moved_at_kill < total, "the kill must land in the middle of the drain"
    assert service.scalar("SELECT count(*) FROM topic_queue") == moved_at_kill

    service.delivery_worker()
    wait_for(lambda: service.count_status("ready") == total, 300, "the drain to finish")
    assert service.scalar("SELECT count(*) FROM topic_queue") == total
    assert _topic_queue_order(service, 1) == ids
    offset = service.rows("SELECT schedule_offset, moved_total FROM schedule_offset WHERE lane=1")
    assert (offset[0].schedule_offset, offset[0].moved_total) == (total, total)


@second_pass_only("~10 s; a cancel is the database's, the same on either server and broker")
def test_cancelled_messages_are_never_delivered(service: Service, producer: Producer) -> None:
    keep = producer.send("e2e.record", {"n": 1}, delay_level=1)
    drop = producer.send("e2e.record", {"n": 2}, delay_level=1)
    timer_drop = producer.send("e2e.record", {"n": 3}, delay_ms=1200)
    producer.cancel(drop.id)
    producer.cancel(timer_drop.id)
    service.delivery_worker()
    service.consume_worker()
    service.beat()
    wait_for(lambda: service.count_status("succeeded") == 1, 60, "the kept message to run")
    last = producer.send("e2e.record", {"n": 4}, delay_ms=1300)  # after the cancelled ones
    wait_for(lambda: service.count_status("succeeded") == 2, 60, "a later timer message")
    runs = sorted(r.message_id for r in service.rows("SELECT message_id FROM e2e_run"))
    assert runs == [keep.id, last.id]
    assert service.count_status("cancelled") == 2


def test_a_postgresql_crash_restart_during_a_drain_loses_and_duplicates_nothing(
    service: Service, producer: Producer
) -> None:
    total = 60_000
    ids = send_many(producer, total, delay_level=1)
    service.delivery_worker()
    service.beat()
    wait_for(
        lambda: service.scalar("SELECT moved_total FROM schedule_offset WHERE lane = 1") >= 3000,
        120,
        "the drain to start",
        every=0.01,
    )
    moved_before = service.scalar("SELECT moved_total FROM schedule_offset WHERE lane = 1")
    restart_postgres()
    assert moved_before < total, "the restart must land in the middle of the drain"
    wait_for(tolerant(lambda: service.count_status("ready") == total), 300, "the drain to resume")
    assert service.scalar("SELECT count(*) FROM topic_queue") == total
    assert _topic_queue_order(service, 1) == ids
    row = service.rows("SELECT schedule_offset, moved_total FROM schedule_offset WHERE lane = 1")
    assert (row[0].schedule_offset, row[0].moved_total) == (total, total)


def test_lanes_run_from_the_delivery_workers_start_and_a_dead_run_is_rearmed_at_once(
    service: Service, producer: Producer
) -> None:
    """No beat at all: a delivery worker starts every lane itself when it is ready, so a deploy
    leaves no lane asleep until beat's first interval; a lane whose run dies (its connection
    cut) runs again at once, not at beat's next firing."""
    service.delivery_worker()
    _wait_for_every_lane(service)
    first = producer.send("e2e.unhandled", {"n": 1}, delay_level=1)
    wait_for(lambda: service.count_status("ready") == 1, 10, "the level-1 message, without beat")
    assert _late_ms(service, first.id) < 100

    cut = service.scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_locks "
        "WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid() "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    assert cut == service.settings.levels.max_level + 1  # every lane's runner lost its session
    second = producer.send("e2e.unhandled", {"n": 2}, delay_level=1)
    wait_for(lambda: service.count_status("ready") == 2, 10, "a message after the cut")
    assert _late_ms(service, second.id) < 1500


def _wait_for_every_lane(service: Service) -> None:
    """Until every lane's runner has written its heartbeat."""
    wait_for(
        lambda: (
            service.scalar("SELECT count(*) FROM heartbeat WHERE component LIKE 'lane %'")
            == service.settings.levels.max_level + 1
        ),
        60,
        "every lane's heartbeat",
    )


def _late_ms(service: Service, message_id: int) -> float:
    """How late the message entered its topic queue."""
    return float(
        service.scalar(
            f"SELECT extract(epoch FROM {store.DELIVERED_AT} - c.deliver_ts) * 1000 "
            "FROM message c WHERE id = :id",
            id=message_id,
        )
    )


def test_a_delivery_worker_stopped_for_a_deploy_hands_its_lanes_to_the_new_one(
    service: Service, producer: Producer
) -> None:
    """A rolling restart without beat: the new worker starts while the old one holds every
    lane; SIGTERM to the old one hands each lane over as it stops, so messages due from then on
    are delivered on time by the new one (before: nothing until beat's next firing)."""
    old = service.delivery_worker()
    _wait_for_every_lane(service)
    service.delivery_worker()
    time.sleep(8)  # the new worker boots; its lanes find each lane held and return
    old.terminate()
    old.wait(timeout=60)
    sent = [producer.send("e2e.unhandled", {"n": n}, delay_level=1).id for n in range(5)]
    wait_for(lambda: service.count_status("ready") == len(sent), 10, "delivery by the new worker")
    worst = service.scalar(
        f"SELECT max(extract(epoch FROM {store.DELIVERED_AT} - c.deliver_ts)) FROM message c"
    )
    assert worst < 0.5, f"a message was delivered {worst:.2f} s late"
