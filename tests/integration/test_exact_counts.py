"""Backlog figures and caps are exact counts (`lane_count`), not offset arithmetic: offsets pass
a row sent in a transaction still open while later offsets of its level were moved, and
rolled-back sends and cancels leave holes in them. Each race here runs in real concurrent
sessions."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import Engine, text

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.errors import BacklogFull
from delaysvc.maintenance import delivery
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import TIMER_LANE
from tests.conftest import TEST_LEVELS


def pending(engine: Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return {row.lane: row.pending for row in store.lane_stats(conn)}


def waiting_rows(engine: Engine, lane: int) -> int:
    table = "timer_queue" if lane == TIMER_LANE else f"consume_queue_{lane}"
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()


def move(engine: Engine, lane: int, now) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return delivery.run_once(conn, lane, 1000, now).moved


def schedule_offset(engine: Engine, lane: int) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT schedule_offset FROM schedule_offset WHERE lane = :lane"), {"lane": lane}
        ).scalar_one()


def test_a_send_in_a_long_transaction_behind_the_schedule_offset_is_counted(
    producer: Producer, engine: Engine
) -> None:
    with engine.connect() as long_transaction:
        long_transaction.begin()
        held = producer.send("t", "held", delay_level=1, connection=long_transaction)
        later = [producer.send("t", i, delay_level=1) for i in range(3)]
        assert move(engine, 1, later[-1].deliver_at) == 3  # the held row is not visible yet
        assert schedule_offset(engine, 1) > 1  # the offset passed the held row
        long_transaction.commit()
    assert waiting_rows(engine, 1) == 1
    assert pending(engine)[1] == 1  # offsets said 0
    assert move(engine, 1, held.deliver_at + timedelta(seconds=1)) == 1
    assert pending(engine)[1] == 0


def test_rolled_back_sends_and_cancels_leave_no_phantom_backlog(
    producer: Producer, engine: Engine
) -> None:
    kept = [producer.send("t", i, delay_level=2) for i in range(3)]
    with engine.connect() as conn:
        conn.begin()
        producer.send("t", "gone", delay_level=2, connection=conn)
        producer.send("t", "gone too", delay="7s", connection=conn)
        conn.rollback()
    producer.cancel(kept[0].id)
    timed = producer.send("t", "timed", delay="7s")
    assert pending(engine)[2] == 2 == waiting_rows(engine, 2)
    assert pending(engine)[TIMER_LANE] == 1 == waiting_rows(engine, TIMER_LANE)
    producer.cancel(timed.id)
    assert pending(engine)[TIMER_LANE] == 0


def test_folding_keeps_counts_exact_with_a_send_uncommitted_meanwhile(
    producer: Producer, engine: Engine
) -> None:
    for i in range(5):
        producer.send("t", i, delay_level=3)
    with engine.connect() as open_send:
        open_send.begin()
        producer.send("t", "open", delay_level=3, connection=open_send)
        with engine.begin() as conn:
            assert store.fold_lane_counts(conn) == 5
        assert pending(engine)[3] == 5
        open_send.commit()
    assert pending(engine)[3] == 6
    with engine.begin() as conn:
        store.fold_lane_counts(conn)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT lane, delta FROM lane_count ORDER BY lane")).all()
    assert [tuple(r) for r in rows] == [(3, 6)]


def test_a_reject_cap_is_never_exceeded_when_offsets_passed_a_waiting_row(
    producer: Producer, settings: Settings, engine: Engine
) -> None:
    capped = Producer(
        Settings(
            database_url=settings.database_url,
            delay_levels=TEST_LEVELS,
            backlog_caps="level:1=2:reject",
        ),
        engine,
    )
    with engine.connect() as long_transaction:
        long_transaction.begin()
        # a message that takes no cap lock (a retry, a bulk load, a process without the cap)
        producer.send("t", "held", delay_level=1, connection=long_transaction)
        later = capped.send("t", "later", delay_level=1)
        assert move(engine, 1, later.deliver_at) == 1
        long_transaction.commit()
    # one waits (behind the schedule offset); the cap of 2 leaves room for one more
    capped.send("t", "fits", delay_level=1)
    with pytest.raises(BacklogFull, match="holds 2 waiting messages and its cap is 2"):
        capped.send("t", "over", delay_level=1)
    assert waiting_rows(engine, 1) == 2


def test_moves_deliver_early_and_skips_count_out_of_their_lane(
    producer: Producer, engine: Engine
) -> None:
    messages = [producer.send("t", i, delay_level=4) for i in range(4)]
    with engine.begin() as conn:
        assert store.deliver_now(conn, [messages[0].id]) == 1
    assert pending(engine)[4] == 3
    assert move(engine, 4, messages[1].deliver_at) == 1
    assert pending(engine)[4] == 2
    with engine.begin() as conn:
        store.mark_stuck(conn, 4, store.lane_head(conn, 4).queue_offset, "test")
        assert store.skip_stuck_head(conn, 4) == messages[2].id
    assert pending(engine)[4] == 1 == waiting_rows(engine, 4)
