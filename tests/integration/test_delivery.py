"""The delivery engine, driven through run_once with an injected clock (no sleeping)."""

import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import text

from delaysvc import store
from delaysvc.errors import NotStuck
from delaysvc.maintenance import delivery
from delaysvc.schema.tables import TIMER_LANE
from tests.support.unmovable import make_unmovable


def topic_queue(engine):
    with engine.connect() as conn:
        return conn.execute(text("SELECT message_id FROM topic_queue ORDER BY seq")).scalars().all()


def offsets(engine):
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT lane, schedule_offset FROM schedule_offset"))
        return {row.lane: row.schedule_offset for row in rows}


def tick(engine, lane, now, batch=1000):
    with engine.connect() as conn:
        return delivery.run_once(conn, lane, batch, now)


def db_now(engine):
    with engine.connect() as conn:
        return store.clock_now(conn)


def test_a_timer_lane_message_is_not_delivered_before_its_time_and_is_after(producer, engine):
    """The timer lane's twin of the level's test (found by the mutation review: a move 20 ms
    early passed every test here)."""
    message = producer.send("t", 1, delay="4s")
    assert tick(engine, TIMER_LANE, message.deliver_at - timedelta(milliseconds=1)).moved == 0
    assert tick(engine, TIMER_LANE, message.deliver_at).moved == 1
    assert topic_queue(engine) == [message.id]


def test_a_levels_schedule_offset_advances_in_the_moves_own_transaction(producer, engine):
    """The design's rule: the rows moved and the level's schedule_offset commit together (a
    crash between two commits would lose the offset and the counts). Every test looked at the
    state after the move, and `delaysvc check` flags an offset ahead of its rows, not one
    behind them: an offset advanced in a second transaction passed (the mutation review). A
    deferred trigger checks, at the commit that puts a level's row into its topic's queue,
    that the level's offset has reached it."""
    with engine.begin() as conn:
        conn.execute(
            text(
                """CREATE FUNCTION offset_reached() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM commit_log c JOIN schedule_offset s ON s.lane = c.lane
               WHERE c.id = NEW.message_id AND c.lane > 0
                 AND s.schedule_offset < c.queue_offset) THEN
        RAISE EXCEPTION 'message % moved before its level''s offset', NEW.message_id;
    END IF;
    RETURN NULL;
END $$"""
            )
        )
        conn.execute(
            text(
                "CREATE CONSTRAINT TRIGGER offset_reached AFTER INSERT ON topic_queue "
                "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION offset_reached()"
            )
        )
    sent = [producer.send("t", n, delay_level=1) for n in range(3)]
    result = tick(engine, 1, sent[-1].deliver_at)
    assert (result.moved, result.stuck) == (3, False)
    assert offsets(engine)[1] == 3


def test_a_levels_head_due_later_than_its_level_goes_to_the_timer_lane(producer, engine):
    """A head due later than its level's delay allows (sent with a longer delay just before a
    level change, or stored so by an older release) goes to the timer lane with its due time;
    only a clock that went back delivers a head now
    (`test_clock_moved_back_delivers_a_head_beyond_one_level_delay`). Only that branch was
    tested: a move of every such head now, up to its delay early, passed (the mutation
    review)."""
    message = producer.send("t", 1, delay_level=1)  # 1 s
    with engine.begin() as conn:  # as if sent with 61 s into level 1
        conn.execute(
            text(
                "UPDATE consume_queue SET deliver_ts = deliver_ts + interval '60 s' "
                "WHERE message_id = :id"
            ),
            {"id": message.id},
        )
        due = conn.execute(
            text(
                "UPDATE commit_log SET deliver_ts = deliver_ts + interval '60 s' WHERE id = :id "
                "RETURNING deliver_ts"
            ),
            {"id": message.id},
        ).scalar_one()
    assert tick(engine, 1, message.deliver_at).moved == 0
    assert topic_queue(engine) == []
    with engine.connect() as conn:
        held = conn.execute(text("SELECT message_id, deliver_ts FROM timer_queue")).all()
    assert held == [(message.id, due)]


def test_a_level_message_is_not_delivered_before_its_time_and_is_after(producer, engine):
    # RocketMQ's ScheduleMessageServiceTest with levels "1s 2s ...": level 2 = 2 s.
    message = producer.send("order.cancel", {"id": 1}, delay_level=2)
    due = message.deliver_at
    assert tick(engine, 2, due - timedelta(milliseconds=1)).moved == 0
    assert topic_queue(engine) == []
    result = tick(engine, 2, due)
    assert (result.moved, result.topics) == (1, ("order.cancel",))
    assert topic_queue(engine) == [message.id]
    stored = producer.get(message.id)
    assert stored.status == "ready"
    assert stored.delivered_at is not None


def test_a_move_writes_the_topic_queue_not_the_commit_log_and_the_claim_writes_it_down(
    producer, engine
):
    """The commit log is written once per delivery, by the claim: between the move and the
    claim, readers see the message as ready, delivered when it entered the topic queue."""
    from delaysvc.store import dashboard as store_dashboard

    first, second = (producer.send("t.moved", i, delay_level=2) for i in range(2))

    def raw_row(message_id):
        with engine.connect() as conn:
            return conn.execute(
                text("SELECT xmin, status, lane, delivered_at FROM commit_log WHERE id = :id"),
                {"id": message_id},
            ).one()

    before = raw_row(first.id)
    assert tick(engine, 2, second.deliver_at).moved == 2
    assert raw_row(first.id) == before  # not a single write
    with engine.connect() as conn:
        entered = conn.execute(
            text("SELECT enqueued_at FROM topic_queue WHERE message_id = :id"), {"id": first.id}
        ).scalar_one()
        found = store_dashboard.search_messages(
            conn, store_dashboard.MessageSearch(topic="t.moved", status="ready")
        )
        waiting = store_dashboard.search_messages(
            conn, store_dashboard.MessageSearch(topic="t.moved", status="scheduled")
        )
        seen = store.get_message(conn, first.id)
    assert (seen.status, seen.lane, seen.queue_offset, seen.delivered_at) == (
        "ready",
        -1,
        None,
        entered,
    )
    assert producer.get(first.id).status == "ready"
    assert sorted(row.id for row in found.rows) == [first.id, second.id]
    assert [row.status for row in found.rows] == ["ready", "ready"]
    assert waiting.rows == []

    with engine.begin() as conn:
        [claimed] = store.claim_ready(conn, "t.moved", 1, lease_seconds=60)
    assert claimed.id == first.id
    after = raw_row(first.id)
    assert (after.status, after.lane, after.delivered_at) == ("running", -1, entered)
    assert producer.cancel(second.id).status == "cancelled"  # out of the topic queue
    assert topic_queue(engine) == []


def test_order_within_a_level_is_send_order_and_offset_advances(producer, engine):
    sent = [producer.send("t", i, delay_level=1).id for i in range(25)]
    now = db_now(engine) + timedelta(seconds=2)
    for _ in range(5):
        assert tick(engine, 1, now, batch=5).moved == 5
    assert tick(engine, 1, now, batch=5).moved == 0
    assert topic_queue(engine) == sent
    assert offsets(engine)[1] == 25


def test_only_the_due_prefix_moves(producer, engine):
    first = producer.send("t", 1, delay_level=3)
    now = first.deliver_at
    second = producer.send("t", 2, delay_level=3)  # due later than `now`
    assert tick(engine, 3, now).moved == 1
    assert topic_queue(engine) == [first.id]
    assert tick(engine, 3, second.deliver_at).moved == 1


def test_clock_moved_back_delivers_a_head_beyond_one_level_delay(producer, engine):
    message = producer.send("t", 1, delay_level=1)  # due in 1 s
    # The database clock "goes back" 10 minutes: the head is now 10 min + 1 s ahead,
    # more than one level delay, so it must not block the level.
    result = tick(engine, 1, message.stored_at - timedelta(minutes=10))
    assert result.moved == 1
    assert topic_queue(engine) == [message.id]


def test_a_head_just_beyond_one_delay_waits_a_send_racing_a_move_is_not_taken_for_clock_back(
    producer, engine
):
    """A send whose statement began a moment after the move's computed its due time from a
    later clock: up to the margin beyond one delay is not a clock that went back."""
    message = producer.send("t", 1, delay_level=1)  # due 1 s after it was stored
    result = tick(engine, 1, message.stored_at - timedelta(milliseconds=500))
    assert result.moved == 0
    assert topic_queue(engine) == []
    assert producer.get(message.id).status == "scheduled"


def test_head_within_one_delay_still_waits(producer, engine):
    message = producer.send("t", 1, delay_level=4)  # 5 s
    assert tick(engine, 4, message.deliver_at - timedelta(seconds=4)).moved == 0


def test_timer_lane_is_delivered_in_due_order(producer, engine):
    late = producer.send("t", "late", delay="7s")
    early = producer.send("t", "early", delay="4s")
    assert tick(engine, TIMER_LANE, early.deliver_at).moved == 1
    assert tick(engine, TIMER_LANE, late.deliver_at).moved == 1
    assert topic_queue(engine) == [early.id, late.id]


def test_cancelled_messages_are_never_delivered(producer, engine):
    keep = producer.send("t", 1, delay_level=1)
    drop = producer.send("t", 2, delay_level=1)
    producer.cancel(drop.id)
    tick(engine, 1, keep.deliver_at + timedelta(seconds=5))
    assert topic_queue(engine) == [keep.id]
    assert producer.get(drop.id).status == "cancelled"


def test_a_tick_on_a_lane_another_mover_holds_moves_nothing_and_waits_for_nothing(producer, engine):
    """Movers of one lane never overlap (`store.lock_lane`: the lane's schedule_offset row,
    FOR UPDATE SKIP LOCKED). The test below passed without that lock (the mutation review):
    a tick beside a held lane moves nothing, at once, and the lane's rows wait for the next."""
    sent = producer.send("t", 1, delay_level=1)
    with engine.connect() as mover, mover.begin():  # a mover holds the lane
        mover.execute(text("SELECT FROM schedule_offset WHERE lane = 1 FOR UPDATE"))
        with engine.connect() as beside:  # waiting on the held lane would fail in a second
            beside.execute(text("SET lock_timeout = '1s'"))
            beside.commit()
            assert delivery.run_once(beside, 1, 1000, sent.deliver_at).moved == 0
    assert tick(engine, 1, sent.deliver_at).moved == 1


def test_concurrent_movers_move_each_message_once_in_order(producer, engine):
    sent = [
        m.id
        for m in producer.send_batch(
            [{"topic": "t", "body": i, "delay_level": 1} for i in range(2000)]
        )
    ]
    now = db_now(engine) + timedelta(seconds=2)
    errors = []
    moved = [0]
    counting = threading.Lock()
    deadline = time.monotonic() + 60

    def mover():
        # until all are moved, not a fixed number of ticks: a tick that finds the lane held
        # by another mover moves nothing, and on a loaded machine most of them do (200 ticks
        # a mover once moved 1,700 of the 2,000 in a parallel CI run)
        try:
            while moved[0] < len(sent) and time.monotonic() < deadline:
                done = tick(engine, 1, now, batch=50).moved
                with counting:
                    moved[0] += done
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=mover) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert topic_queue(engine) == sent
    assert offsets(engine)[1] == 2000


def test_a_head_that_cannot_be_moved_is_retried_marked_stuck_and_skippable(producer, engine):
    bad = producer.send("t", 1, delay_level=1)
    good = producer.send("t", 2, delay_level=1)
    with engine.begin() as conn:  # a row already in the topic queue makes the move fail
        conn.execute(
            text(
                "INSERT INTO topic_queue (message_id, topic, deliver_ts) VALUES (:id, 'x', now())"
            ),
            {"id": bad.id},
        )
    now = good.deliver_at
    for _ in range(2):
        result = tick(engine, 1, now)
        assert result.stuck and result.moved == 0
    with engine.connect() as conn:
        lane = next(s for s in store.lane_stats(conn) if s.lane == 1)
        head = store.lane_head(conn, 1)
    assert lane.stuck_offset == head.queue_offset
    assert "UniqueViolation" in lane.stuck_error
    assert head.message_id == bad.id  # never skipped, never dropped
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM topic_queue"))
        assert store.skip_stuck_head(conn, 1) == bad.id
    assert producer.get(bad.id).status == "dead"
    assert tick(engine, 1, now).moved == 1
    assert topic_queue(engine) == [good.id]
    with engine.connect() as conn:
        lane = next(s for s in store.lane_stats(conn) if s.lane == 1)
    assert lane.stuck_offset is None


def _stuck_offset(engine, lane):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return next(s for s in store.lane_stats(conn) if s.lane == lane).stuck_offset


def test_a_lane_is_no_longer_stuck_once_the_head_it_was_stuck_on_has_left_it(producer, engine):
    """The flag was cleared only by a move that moved something: after an operator cancelled
    the stuck head (or a level change took it to the timer lane), an idle lane stayed STUCK in
    stats, the API and /metrics, and skip-head refused to clear it."""
    bad = producer.send("t", 1, delay_level=1)
    later = producer.send("t", 2, delay="1h")  # the timer lane's, for the second case
    producer.send("t", 3, delay_level=1)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO topic_queue (message_id, topic, deliver_ts) VALUES (:id, 'x', now())"
            ),
            {"id": bad.id},
        )
    assert tick(engine, 1, bad.deliver_at).stuck
    assert _stuck_offset(engine, 1) is not None
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM topic_queue"))
    producer.cancel(bad.id)
    # the next head is not due yet: nothing moves, and the lane is not stuck any more
    assert tick(engine, 1, bad.deliver_at).moved == 0  # the next was sent after it
    assert _stuck_offset(engine, 1) is None
    # an empty lane the same: the timer lane stuck on a message cancelled since
    with engine.begin() as conn:
        store.mark_stuck(conn, TIMER_LANE, store.lane_head(conn, TIMER_LANE).queue_offset, "x")
    producer.cancel(later.id)
    assert tick(engine, TIMER_LANE, later.deliver_at).moved == 0
    assert _stuck_offset(engine, TIMER_LANE) is None


def test_rows_ahead_of_one_that_cannot_be_moved_are_moved_without_waiting(producer, engine):
    """A batch failing on its 200th row moved one row per tick, and the runner slept up to a
    second between ticks: the rows ahead of the bad one (and the lane's stuck mark) came one a
    second."""
    sent = producer.send_batch([{"topic": "t", "body": n, "delay_level": 1} for n in range(300)])
    bad = sent[200]
    make_unmovable(engine, bad.id)
    time.sleep(max(0.0, (sent[-1].deliver_at - db_now(engine)).total_seconds()) + 0.05)
    runner = delivery.LaneRunner(engine, 1, 1000, idle_poll_seconds=0.05)
    assert runner.run(budget_seconds=3.0) == 200
    assert _stuck_offset(engine, 1) is not None
    with engine.connect() as conn:
        error = next(s for s in store.lane_stats(conn) if s.lane == 1).stuck_error
    # one line (PL/pgSQL's CONTEXT line broke `delaysvc stats`' table)
    assert error.startswith("RaiseException: refused") and "\n" not in error, error
    assert producer.get(bad.id).status == "scheduled"


def test_a_row_held_by_an_open_cancel_does_not_slow_its_level(producer, engine):
    """The level's head window kept the held row, each tick moved one row fewer than the batch,
    and the runner took that for a drained level and slept: a level moved one batch a second
    while a caller's transaction held one of its rows."""
    sent = producer.send_batch([{"topic": "t", "body": n, "delay_level": 1} for n in range(3000)])
    assert _moved_while_one_row_is_held(producer, engine, 1, sent) == 2999
    assert producer.get(sent[10].id).status == "cancelled"


def _moved_while_one_row_is_held(producer, engine, lane, sent):  # type: ignore[no-untyped-def]
    """What `lane`'s runner moves of `sent`, once all are due, in a budget of 2 s while a
    caller's open transaction cancels (so holds) one of them; None: it waited on that row."""
    time.sleep(max(0.0, (sent[-1].deliver_at - db_now(engine)).total_seconds()) + 0.05)
    moved = []
    with engine.connect() as holder, holder.begin():
        producer.cancel(sent[10].id, connection=holder)  # not committed while the lane runs
        runner = delivery.LaneRunner(engine, lane, 100, idle_poll_seconds=0.05)
        thread = threading.Thread(target=lambda: moved.append(runner.run(budget_seconds=2.0)))
        thread.start()
        thread.join(timeout=10)
        waited = thread.is_alive()
    thread.join()
    return None if waited else moved[0]


def test_a_timer_row_held_by_an_open_cancel_does_not_stop_the_timer_lane(producer, engine):
    """The timer lane's twin of the test above: its move takes due rows `FOR UPDATE SKIP
    LOCKED` too, so a caller's open transaction holding one row holds that row alone. Without
    SKIP LOCKED the lane waited on it (found by the mutation review: no test noticed)."""
    sent = producer.send_batch([{"topic": "t", "body": n, "delay": "1100ms"} for n in range(300)])
    assert _moved_while_one_row_is_held(producer, engine, TIMER_LANE, sent) == 299


def test_lane_stats_pending_is_max_offset_minus_schedule_offset(producer, engine):
    for i in range(7):
        producer.send("t", i, delay_level=2)
    producer.send("t", "x", delay="9s")
    with engine.connect() as conn:
        stats = {s.lane: s for s in store.lane_stats(conn)}
    assert stats[2].pending == 7 and stats[2].max_offset == 7
    assert stats[2].next_due is not None
    assert stats[1].pending == 0 and stats[1].next_due is None
    tick(engine, 2, db_now(engine) + timedelta(seconds=3), batch=3)
    with engine.connect() as conn:
        stats = {s.lane: s for s in store.lane_stats(conn)}
    assert (stats[2].pending, stats[2].schedule_offset, stats[2].moved_total) == (4, 3, 3)


def test_lane_runner_delivers_on_time_without_polling_blindly(producer, engine):
    message = producer.send("t", 1, delay="300ms")
    woken = []
    runner = delivery.LaneRunner(engine, TIMER_LANE, 100, 0.05, on_moved=woken.append)
    runner.run(budget_seconds=1.0)
    assert runner.moved_total == 1
    assert woken == [("t",), ("t",)]  # by its move, and by the next look (no consumer here)
    stored = producer.get(message.id)
    lateness = (stored.delivered_at - stored.deliver_at).total_seconds()
    assert 0 <= lateness < 0.2


def _a_new_process() -> None:
    """The runners' process-wide memory as in a new process (another test's database of the
    same name, dropped since, left its mark)."""
    delivery._last_looks.clear()
    delivery._moved_into.clear()


def test_the_timer_lanes_runner_wakes_the_topics_sends_due_at_once_reached(producer, engine):
    """A send due at once goes straight to its topic's queue, which no lane moves: the timer
    lane's runner looks at the topic queues each idle poll and wakes a topic that had no ready
    job at its last look (only beat's 1 s sweep did, behind the consume tasks)."""
    _a_new_process()
    producer.send("before", 1)  # ready before the run: noted at its first look, not woken
    woken: list[tuple[tuple[str, ...], float]] = []
    runner = delivery.LaneRunner(
        engine, TIMER_LANE, 100, 0.05, on_moved=lambda t: woken.append((t, time.monotonic()))
    )
    level = delivery.LaneRunner(engine, 1, 100, 0.05, on_moved=woken.append)
    thread = threading.Thread(target=runner.run, args=(1.5,))
    thread.start()
    try:
        level.run(0.2)  # a level's runner does not look: nothing of its own moved
        time.sleep(0.3)
        sent_at = time.monotonic()
        producer.send("now", 1)  # into an empty topic queue
        producer.send("before", 2)  # its topic had ready jobs already: not woken again
        producer.send("later", 3, delay="300ms")  # woken by its move
        time.sleep(0.4)
        with engine.begin() as conn:  # "before" consumed: its next head is no new job
            assert len(store.claim_ready(conn, "before", 1, lease_seconds=60)) == 1
    finally:
        thread.join()
    # "later" by its move, then once more by the look after it (a send due at once may have
    # come in behind the move: it looks again against the older mark), then no more
    assert [topics for topics, _ in woken] == [("now",), ("later",), ("later",)]
    assert woken[0][1] - sent_at < 0.5  # within a look (50 ms here), on a loaded machine
    assert not delivery._moved_into or min(delivery._moved_into.values()) >= sent_at


def test_a_send_due_at_once_between_two_runs_is_woken_by_the_next_runs_first_look(producer, engine):
    _a_new_process()
    woken = []
    delivery.LaneRunner(engine, TIMER_LANE, 100, 0.05, on_moved=woken.append).run(0.2)
    producer.send("gap", 1)  # while no runner holds the timer lane (a run's hand-over)
    delivery.LaneRunner(engine, TIMER_LANE, 100, 0.05, on_moved=woken.append).run(0.2)
    assert woken == [("gap",)]


def test_a_send_due_at_once_committed_after_looks_its_seq_preceded_is_woken(producer, engine):
    """A send due at once in a caller's long transaction draws its `seq` when it is made and
    shows when it commits, after looks whose mark passed it: its topic, empty at the last
    look, is woken all the same."""
    _a_new_process()
    producer.send("busy", 1)  # ready at every look: its old head is no news
    woken = []
    runner = delivery.LaneRunner(engine, TIMER_LANE, 100, 0.05, on_moved=woken.append)
    with engine.connect() as caller:
        with caller.begin():
            producer.send("long", 1, connection=caller)
            producer.send("busy", 2, connection=caller)
            runner.run(0.3)  # looks whose mark is past both sends' seq
            assert woken == []
        runner.run(0.3)
    assert woken == [("long",)]


def test_a_tick_reports_when_the_next_head_is_due(producer, engine):
    first = producer.send("t", 1, delay_level=2)
    assert tick(engine, 2, first.deliver_at - timedelta(seconds=1)).moved == 0
    waiting = tick(engine, 1, db_now(engine))  # an empty level: nothing to wait for
    assert (waiting.moved, waiting.next_due_seconds) == (0, None)
    not_yet = tick(engine, 2, db_now(engine))
    assert 0 < not_yet.next_due_seconds <= 2.0  # the head is due within its 2 s
    second = producer.send("t", 2, delay_ms=1500)
    timer = tick(engine, TIMER_LANE, db_now(engine))
    assert timer.moved == 0 and 0 < timer.next_due_seconds <= 1.5
    moved = tick(engine, 2, first.deliver_at)
    assert (moved.moved, moved.next_due_seconds) == (1, None)
    assert second.id


def test_moves_are_counted_in_the_lateness_histogram(producer, engine):
    from delaysvc.schema.tables import LATENESS_BUCKETS_MS

    for n in range(3):
        producer.send("t", n, delay_level=1)
    with engine.begin() as conn:  # as if they fell due 1.5 s ago and the lane was late
        conn.execute(
            text("UPDATE consume_queue SET deliver_ts = clock_timestamp() - interval '1500 ms'")
        )
    result = tick(engine, 1, None)
    # bucket "1000 <= ms < 2000"
    assert result.lateness_buckets == {LATENESS_BUCKETS_MS.index(1000) + 1: 3}
    histogram = delivery.LatenessHistogram()
    histogram.add(result)
    histogram.add(result)
    with engine.connect() as conn:
        histogram.flush(conn, 1)
        histogram.add(result)
        histogram.flush(conn, 1)
        row = conn.execute(text("SELECT lane, counts FROM lateness_histogram")).one()
    assert row.lane == 1
    assert sum(row.counts) == 9
    assert row.counts[LATENESS_BUCKETS_MS.index(1000) + 1] == 9


def test_skip_head_of_a_lane_no_longer_stuck_dead_letters_nothing(producer, engine):
    """An operator skips from a stale page: the stuck head was delivered meanwhile, and the
    lane's next message is healthy. Before, the next message was dead-lettered."""
    stuck = producer.send("t", 1, delay_level=1)
    healthy = producer.send("t", 2, delay_level=1)
    with engine.begin() as conn:
        store.mark_stuck(conn, 1, store.lane_head(conn, 1).queue_offset, "transient")
    assert tick(engine, 1, stuck.deliver_at).moved == 1  # the cause went away
    with engine.begin() as conn, pytest.raises(NotStuck, match="not stuck"):
        store.skip_stuck_head(conn, 1)
    with engine.begin() as conn:  # stuck flag set again on another offset: refused too
        store.mark_stuck(conn, 1, 999, "stale")
    with engine.begin() as conn, pytest.raises(NotStuck, match="no longer the message"):
        store.skip_stuck_head(conn, 1)
    assert [producer.get(m.id).status for m in (stuck, healthy)] == ["ready", "scheduled"]


def test_skip_head_while_a_move_holds_the_lane_waits_for_nothing_and_skips_nothing(
    producer, engine
):
    head = producer.send("t", 1, delay_level=1)
    with engine.begin() as conn:
        store.mark_stuck(conn, 1, store.lane_head(conn, 1).queue_offset, "transient")
    with engine.connect() as mover, mover.begin():  # a real concurrent mover holds the lane
        assert store.lock_lane(mover, 1) is not None
        assert store.move_due(mover, 1, 1000, 100, head.deliver_at).count == 1
        with engine.begin() as conn, pytest.raises(NotStuck, match="being delivered"):
            store.skip_stuck_head(conn, 1)
    assert producer.get(head.id).status == "ready"
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM dead_letter")).scalar_one() == 0


def test_a_queued_message_that_is_no_longer_waiting_is_never_claimed(producer, engine):
    """One message can never be both dead and running: the claim names the states it takes."""
    message = producer.send("t", 1)  # ready: in the topic queue
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE commit_log SET status = 'dead', finished_at = now() WHERE id = :id"),
            {"id": message.id},
        )
        assert store.claim_ready(conn, "t", 10, 60) == []
    assert producer.get(message.id).status == "dead"
    assert topic_queue(engine) == []  # the stray queue row is dropped


def test_a_deliver_at_already_past_is_due_at_its_send_not_counted_a_year_late(producer, engine):
    """A time already past is due at once: it went to the timer lane with that time, and its
    move was counted a year late in the lateness histogram and /metrics' totals."""
    a_year_ago = db_now(engine) - timedelta(days=365)
    before = db_now(engine)
    single = producer.send("t", 1, deliver_at=a_year_ago)
    (batched,) = producer.send_batch([{"topic": "t", "body": 2, "deliver_at": a_year_ago}])
    after = db_now(engine)
    for message in (single, batched):
        assert before - timedelta(seconds=1) <= message.deliver_at <= after, message
        assert producer.get(message.id).deliver_at == message.deliver_at
    moved = tick(engine, TIMER_LANE, None)
    assert moved.moved == 2
    assert moved.max_lateness_ms is not None and moved.max_lateness_ms < 5_000


def test_every_way_of_sending_stores_a_deliver_at_already_past_as_due_at_its_store(
    producer, engine
):
    """The single send, a group of them, the COPY batch and the staged insert (other drivers'
    batches, the bulk pipeline's) each decide it in the database, on its clock."""
    from delaysvc.producer.batching import encoded, prepare

    past = db_now(engine) - timedelta(days=2)
    ahead = db_now(engine) + timedelta(hours=1)
    new = [producer.prepare("t", n, deliver_at=at) for n, at in enumerate((past, ahead))]
    with engine.begin() as conn:
        cursor = conn.connection.driver_connection.cursor()
        group = store.insert_group(cursor, new)
        items = [{"topic": "t", "body": n, "deliver_at": at} for n, at in enumerate((past, ahead))]
        checked = prepare(items, producer.settings, db_now(engine))
        staged = store.insert_messages(conn, encoded(checked, producer.settings.max_body_bytes))
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, stored_at, deliver_ts FROM commit_log ORDER BY id")
        ).all()
    assert len(rows) == 4, (group, staged)
    for row in rows:
        assert row.deliver_ts in (row.stored_at, ahead), row
    assert sorted(row.deliver_ts == ahead for row in rows) == [False, False, True, True]
