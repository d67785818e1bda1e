"""`delaysvc check`: clean on a database with a message in every state, and each invariant
broken on its own is reported, naming the message, with a non-zero exit (through the command
for some, through `run_check` for the rest); the check blocks no writer."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.db.names import qualify
from delaysvc.errors import DeadLetter
from delaysvc.maintenance import delivery, history
from delaysvc.maintenance.check import (
    CheckOptions,
    CheckResult,
    check_snapshot,
    run_check,
    snapshot,
)
from delaysvc.maintenance.periodic import Schedules, schedule
from delaysvc.producer.sending import Producer
from delaysvc.store.check import unfinished_out_of_place
from delaysvc.store.history import COLUMNS
from delaysvc.worker import consumer as consumption
from delaysvc.worker.consumer import Consumer, handler
from tests.conftest import ROOT, TEST_LEVELS, outside_env


@dataclass(frozen=True)
class World:
    """One message in each state (ids)."""

    at_level: int  # scheduled in level 5's queue (8 s)
    timer: int  # scheduled in the timer queue (45 min)
    moved: int  # delivered by its level: in its topic queue, commit_log row still scheduled
    ready: int  # sent with no delay: ready
    running: int  # claimed under a lease
    retrying: int  # failed once: in level 3's queue
    succeeded: int  # moved to the history
    dead: int  # moved to the history, with its dead letter
    cancelled: int  # still in commit_log
    keyed: int  # scheduled, holding key 'k1' of topic 'keys'


@pytest.fixture(autouse=True)
def own_registry(own_handlers: None) -> Iterator[None]:
    consumption._registry.clear()
    yield


@pytest.fixture
def world(producer: Producer, settings: Settings, engine: Engine) -> World:
    consumer = Consumer(settings, engine)
    handler("ok")(lambda message: None)

    @handler("fails")
    def fails(message):  # type: ignore[no-untyped-def]
        raise ValueError("boom")

    @handler("dies")
    def dies(message):  # type: ignore[no-untyped-def]
        raise DeadLetter("no")

    at_level = producer.send("t", "level", delay_level=5)
    timer = producer.send("t", "timer", delay="45m")
    moved = producer.send("t", "moved", delay_level=1)
    with engine.connect() as conn:
        now = moved.deliver_at + timedelta(seconds=1)
        assert delivery.run_once(conn, 1, 100, now).moved == 1
    ready = producer.send("t", "ready", delay_level=0)
    running = producer.send("run", "running", delay_level=0)
    with engine.begin() as conn:
        assert len(store.claim_ready(conn, "run", 1, 30)) == 1
    retrying = producer.send("fails", "retrying", delay_level=0)
    succeeded = producer.send("ok", "succeeded", delay_level=0)
    dead = producer.send("dies", "dead", delay_level=0)
    for topic in ("fails", "ok", "dies"):
        assert consumer.run_once(topic).claimed == 1
    assert history.sweep(engine, retention_ms=None).moved == 2
    cancelled = producer.send("t", "cancelled", delay="1h")
    producer.cancel(cancelled.id)
    keyed = producer.send("keys", "keyed", delay="1h", key="k1")
    Schedules(engine).put(schedule("hourly", "every 1h", topic="t"))
    return World(
        at_level.id,
        timer.id,
        moved.id,
        ready.id,
        running.id,
        retrying.id,
        succeeded.id,
        dead.id,
        cancelled.id,
        keyed.id,
    )


def execute(engine: Engine, *statements: str, **params: object) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement), params)


def found(result: CheckResult) -> list[tuple[str, str]]:
    """(check, subject) of every violation."""
    return [(v.check, v.subject) for v in result.violations]


def only(engine: Engine, check: str, subject: str, **options: float) -> str:
    """Check; exactly one violation, of `check` about `subject`: -> its problem."""
    result = run_check(engine, **options)  # type: ignore[arg-type]
    assert found(result) == [(check, subject)], result.lines()
    assert (result.ok, result.exit_code, result.total) == (False, 1, 1)
    return result.violations[0].problem


def delaysvc_check(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = outside_env() | {"DELAYSVC_DATABASE_URL": database_url}
    env["DELAYSVC_DELAY_LEVELS"] = TEST_LEVELS
    return subprocess.run(
        [sys.executable, "-m", "delaysvc", "check", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ---------------------------------------------------------------- clean


def test_a_database_with_a_message_in_every_state_is_clean(
    world: World, engine: Engine, database_url: str
) -> None:
    with engine.connect() as conn:
        states = {
            row.id: row.status
            for row in conn.execute(
                text(qualify(f"SELECT {store.STATUS} AS status, c.id FROM message c"))
            )
        }
    assert states == {
        world.at_level: "scheduled",
        world.timer: "scheduled",
        world.moved: "ready",
        world.ready: "ready",
        world.running: "running",
        world.retrying: "retrying",
        world.succeeded: "succeeded",
        world.dead: "dead",
        world.cancelled: "cancelled",
        world.keyed: "scheduled",
    }
    result = run_check(engine)
    assert result.violations == [] and result.total == 0 and result.ok
    # unfinished: at_level, timer, moved, ready, running, retrying, keyed; 5 levels + timer
    summary = result.summary
    assert (summary.unfinished, summary.running, summary.lanes, summary.topic_queues) == (
        7,
        1,
        6,
        1,
    )
    done = delaysvc_check(database_url)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        "delaysvc check: ok — 7 unfinished messages in 6 lanes, 1 topic queues, 1 running; "
        "0 violations\n"
    )


def test_an_empty_database_is_clean(engine: Engine) -> None:
    result = run_check(engine)
    assert (result.ok, result.total, result.summary.unfinished, result.summary.lanes) == (
        True,
        0,
        0,
        6,
    )


# ---------------------------------------------------------------- each invariant broken


def test_a_waiting_message_whose_queue_row_is_gone_is_in_no_queue(
    world: World, engine: Engine, database_url: str
) -> None:
    execute(
        engine,
        "DELETE FROM consume_queue WHERE message_id = :id",
        "INSERT INTO lane_count (lane, delta) VALUES (5, -1)",  # the count follows: one fault
        id=world.at_level,
    )
    done = delaysvc_check(database_url)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        f"message {world.at_level}: status scheduled, level 5, in no queue",
        "delaysvc check: FAILED — 7 unfinished messages in 6 lanes, 1 topic queues, 1 running; "
        "1 violation",
    ]


def test_a_retrying_message_out_of_its_queue_is_named_with_its_level(
    world: World, engine: Engine
) -> None:
    execute(
        engine,
        "DELETE FROM consume_queue WHERE message_id = :id",
        "INSERT INTO lane_count (lane, delta) VALUES (3, -1)",
        id=world.retrying,
    )
    problem = only(engine, "unfinished_out_of_place", f"message {world.retrying}")
    assert problem == "status retrying, level 3, in no queue"


def test_a_message_in_two_places(world: World, engine: Engine) -> None:
    execute(
        engine,
        "INSERT INTO topic_queue (message_id, topic, deliver_ts) VALUES (:id, 't', now())",
        id=world.timer,
    )
    problem = only(engine, "unfinished_out_of_place", f"message {world.timer}")
    assert (
        problem == "status scheduled, timer lane, in 2 places: its topic queue and the timer queue"
    )


def test_a_running_job_without_a_lease(world: World, engine: Engine) -> None:
    execute(engine, "UPDATE commit_log SET lease_until = NULL WHERE id = :id", id=world.running)
    problem = only(engine, "unfinished_out_of_place", f"message {world.running}")
    assert problem == "status running, running without a lease (lease_until is NULL)"


def test_a_ready_message_gone_from_its_topic_queue(world: World, engine: Engine) -> None:
    execute(engine, "DELETE FROM topic_queue WHERE message_id = :id", id=world.ready)
    problem = only(engine, "unfinished_out_of_place", f"message {world.ready}")
    assert problem == "status ready, in no queue"


def test_an_orphan_queue_row_through_the_command(
    world: World, engine: Engine, database_url: str
) -> None:
    execute(
        engine,
        "INSERT INTO topic_queue (message_id, topic, deliver_ts) VALUES (987654, 't', now())",
    )
    done = delaysvc_check(database_url)
    assert done.returncode == 1
    assert done.stdout.splitlines()[0] == (
        "message 987654: in topic queue 't', without its message in commit_log"
    )
    assert done.stdout.splitlines()[-1].endswith("; 1 violation")


def test_a_queue_row_of_another_topic(world: World, engine: Engine) -> None:
    execute(
        engine, "UPDATE consume_queue SET topic = 'other' WHERE message_id = :id", id=world.at_level
    )
    problem = only(engine, "queue_rows_without_their_message", f"message {world.at_level}")
    assert problem.endswith("but the message's topic is 't'")
    assert problem.startswith("in level 5's queue (offset ")


def test_a_lane_row_at_another_offset_than_its_message(world: World, engine: Engine) -> None:
    execute(
        engine,
        "UPDATE commit_log SET queue_offset = queue_offset + 100 WHERE id = :id",
        id=world.at_level,
    )
    problem = only(engine, "queue_rows_without_their_message", f"message {world.at_level}")
    assert "but the message's offset is " in problem


def test_a_queue_row_of_a_finished_message(world: World, engine: Engine) -> None:
    execute(
        engine,
        "INSERT INTO topic_queue (message_id, topic, deliver_ts) VALUES (:id, 't', now())",
        id=world.cancelled,
    )
    problem = only(engine, "queue_rows_without_their_message", f"message {world.cancelled}")
    assert problem == "in topic queue 't', but the message is cancelled"


def test_a_message_in_commit_log_and_in_the_history(world: World, engine: Engine) -> None:
    execute(
        engine,
        f"INSERT INTO message_history ({COLUMNS}) SELECT {COLUMNS} FROM commit_log WHERE id = :id",
        id=world.cancelled,
    )
    problem = only(engine, "messages_in_log_and_history", f"message {world.cancelled}")
    assert problem.startswith("in commit_log (cancelled) and in the history (cancelled, ")


def test_a_message_twice_in_the_history(world: World, engine: Engine) -> None:
    execute(
        engine,
        "INSERT INTO message_history SELECT * FROM message_history WHERE id = :id",
        id=world.succeeded,
    )
    assert only(engine, "messages_twice_in_history", f"message {world.succeeded}") == (
        "2 times in the history"
    )


def test_an_unfinished_message_in_the_history(world: World, engine: Engine) -> None:
    execute(
        engine, "UPDATE message_history SET status = 'retrying' WHERE id = :id", id=world.succeeded
    )
    problem = only(engine, "unfinished_or_misfiled_history", f"message {world.succeeded}")
    assert problem.startswith("in the history (message_history_")
    assert problem.endswith(") with status retrying")


def test_a_finished_status_without_finished_at(world: World, engine: Engine) -> None:
    execute(
        engine,
        "UPDATE commit_log SET finished_at = NULL WHERE id = :id",
        id=world.cancelled,
    )
    problem = only(engine, "finished_at_disagrees_with_status", f"message {world.cancelled}")
    assert problem == "status cancelled without finished_at"


def test_a_dead_letter_without_its_message_and_one_of_a_live_message(
    world: World, engine: Engine
) -> None:
    execute(
        engine,
        "INSERT INTO dead_letter (message_id, topic, reason, attempts, error) "
        "VALUES (987654, 't', 'r', 1, 'e'), (:id, 't', 'r', 1, 'e')",
        id=world.timer,
    )
    result = run_check(engine)
    assert [(v.check, v.message_id, v.problem) for v in result.violations] == [
        (
            "dead_letters_without_a_dead_message",
            world.timer,
            "dead letter, but the message is scheduled",
        ),
        ("dead_letters_without_a_dead_message", 987654, "dead letter without its message"),
    ]


def test_a_purged_dead_letter_is_no_violation(world: World, engine: Engine) -> None:
    execute(engine, "DELETE FROM dead_letter WHERE message_id = :id", id=world.dead)
    assert run_check(engine).ok


def test_a_key_held_by_two_unfinished_messages(
    world: World, engine: Engine, producer: Producer
) -> None:
    other = producer.send("keys", "other", delay="1h", key="k2")
    execute(
        engine,
        "DROP INDEX uq_commit_log_topic_key",
        "UPDATE commit_log SET key = 'k1' WHERE id = :id",
        id=other.id,
    )
    result = run_check(engine)
    assert [(v.check, v.message_id, v.problem) for v in result.violations] == [
        (
            "keys_held_twice",
            world.keyed,
            "status scheduled, key 'k1' of topic 'keys' also held by unfinished message "
            f"{other.id}",
        ),
        (
            "keys_held_twice",
            other.id,
            f"status scheduled, key 'k1' of topic 'keys' also held by unfinished message "
            f"{world.keyed}",
        ),
    ]


def test_a_skewed_lane_count_through_the_command(
    world: World, engine: Engine, database_url: str
) -> None:
    execute(engine, "INSERT INTO lane_count (lane, delta) VALUES (2, 3)")
    done = delaysvc_check(database_url)
    assert done.returncode == 1
    assert done.stdout.splitlines()[0] == "lane 2: lane_count says 3 waiting, its queue holds 0"


def test_a_folded_lane_count_is_still_exact(world: World, engine: Engine) -> None:
    with engine.begin() as conn:
        assert store.fold_lane_counts(conn) > 0
    assert run_check(engine).ok


def test_a_schedule_offset_past_a_row_not_yet_due(world: World, engine: Engine) -> None:
    execute(
        engine,
        "UPDATE schedule_offset SET schedule_offset = "
        "(SELECT queue_offset FROM commit_log WHERE id = :id) WHERE lane = 5",
        id=world.at_level,
    )
    problem = only(engine, "rows_behind_the_schedule_offset_not_due", f"message {world.at_level}")
    assert problem.startswith("level 5, offset 1, behind the schedule offset 1 but not due for ")


def test_a_row_behind_the_schedule_offset_that_is_due_is_no_violation(
    producer: Producer, engine: Engine
) -> None:
    """A send committed after later offsets of its level were moved (tests/test_exact_counts)."""
    with engine.connect() as long_transaction:
        long_transaction.begin()
        held = producer.send("t", "held", delay_level=1, connection=long_transaction)
        later = producer.send("t", "later", delay_level=1)
        with engine.connect() as conn:
            assert delivery.run_once(conn, 1, 100, later.deliver_at).moved == 1
        long_transaction.commit()
    with engine.connect() as conn:
        behind = conn.execute(
            text("SELECT schedule_offset FROM schedule_offset WHERE lane = 1")
        ).scalar_one()
    assert behind == 2  # the offset passed the held row (offset 1), which is due by now
    assert store_offset_of(engine, held.id) == 1
    wait_until_due(engine, held.deliver_at)
    assert run_check(engine).ok


def store_offset_of(engine: Engine, message_id: int) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT queue_offset FROM consume_queue WHERE message_id = :id"),
            {"id": message_id},
        ).scalar_one()


def wait_until_due(engine: Engine, due) -> None:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        conn.execute(
            text(
                "SELECT pg_sleep(GREATEST(extract(epoch FROM CAST(:due AS timestamptz) "
                "- clock_timestamp()), 0))"
            ),
            {"due": due},
        )


def test_a_schedule_offset_beyond_its_sequence(world: World, engine: Engine) -> None:
    execute(engine, "UPDATE schedule_offset SET schedule_offset = 1000 WHERE lane = 2")
    problem = only(engine, "schedule_offset_beyond_its_sequence", "lane 2")
    assert problem == "schedule offset 1000 is beyond the last offset its sequence gave out (0)"


def test_a_lease_expired_long_ago_through_the_command(
    world: World, engine: Engine, database_url: str
) -> None:
    execute(
        engine,
        "UPDATE commit_log SET lease_until = now() - interval '10 minutes' WHERE id = :id",
        id=world.running,
    )
    done = delaysvc_check(database_url, "--lease-tolerance", "60")
    assert done.returncode == 1
    (line,) = done.stdout.splitlines()[:-1]
    assert line.startswith(f"message {world.running}: status running (claim ")
    assert re.search(r"lease expired 6[01][0-9] s ago at ", line), line
    assert line.endswith(
        " and not rescued (the rescue runs on a worker, fired by beat: are both running?)"
    )
    assert delaysvc_check(database_url, "--lease-tolerance", "900").returncode == 0


def test_a_lease_expired_within_the_tolerance_is_no_violation(world: World, engine: Engine) -> None:
    execute(
        engine,
        "UPDATE commit_log SET lease_until = now() - interval '30 seconds' WHERE id = :id",
        id=world.running,
    )
    assert run_check(engine, lease_tolerance_s=60).ok
    assert not run_check(engine, lease_tolerance_s=10).ok


def test_messages_in_a_level_no_lane_serves(world: World, engine: Engine) -> None:
    """A level's schedule_offset row gone: no runner serves it and its messages are never
    delivered, and the check said ok."""
    execute(engine, "DELETE FROM schedule_offset WHERE lane = 5")
    problem = only(engine, "messages_no_lane_serves", f"message {world.at_level}")
    assert problem.startswith("in level 5's queue, which no lane serves"), problem


def test_a_lease_further_ahead_than_any_worker_takes(world: World, engine: Engine) -> None:
    """A lease 100 years ahead is never rescued if its worker is gone: not flagged before."""
    execute(
        engine,
        "UPDATE commit_log SET lease_until = now() + interval '100 years' WHERE id = :id",
        id=world.running,
    )
    problem = only(engine, "leases_beyond_the_longest", f"message {world.running}")
    assert "more than the longest lease a worker takes (604800 s) ahead" in problem, problem
    execute(
        engine,
        "UPDATE commit_log SET lease_until = now() + interval '6 days' WHERE id = :id",
        id=world.running,
    )
    assert run_check(engine).ok


def test_a_cancelled_message_started_after_its_cancel(world: World, engine: Engine) -> None:
    """DESIGN's "nothing runs after its cancel was acknowledged" was not checked."""
    execute(
        engine,
        "UPDATE commit_log SET started_at = finished_at + interval '1 second' WHERE id = :id",
        id=world.cancelled,
    )
    problem = only(engine, "runs_after_their_cancel", f"message {world.cancelled}")
    assert problem.startswith("cancelled at ") and ", after its cancel" in problem, problem


def test_a_schedule_whose_next_tick_is_long_past(world: World, engine: Engine) -> None:
    execute(engine, "UPDATE periodic_schedule SET next_tick = now() - interval '1 hour'")
    problem = only(engine, "schedules_overdue", "schedule 'hourly'")
    assert problem.endswith(" is 3600 s in the past (is beat running?)")
    execute(engine, "UPDATE periodic_schedule SET paused = true")
    assert run_check(engine).ok  # a paused schedule's tick waits for its resume


def test_output_is_bounded_with_and_n_more(world: World, engine: Engine, database_url: str) -> None:
    execute(
        engine,
        "INSERT INTO topic_queue (message_id, topic, deliver_ts) "
        "SELECT 1000000 + n, 't', now() FROM generate_series(1, 150) n",
    )
    result = run_check(engine, limit=100)
    assert (len(result.violations), result.total) == (100, 150)
    assert result.lines()[-2] == "and 50 more"
    done = delaysvc_check(database_url, "--limit", "5")
    assert done.returncode == 1
    assert done.stdout.splitlines()[5:] == [
        "and 145 more",
        "delaysvc check: FAILED — 7 unfinished messages in 6 lanes, 1 topic queues, 1 running; "
        "150 violations",
    ]


# ---------------------------------------------------------------- safe under load


def test_the_check_takes_only_access_share_locks_and_blocks_no_writer(
    world: World, producer: Producer, settings: Settings, engine: Engine
) -> None:
    with engine.connect() as checking, snapshot(checking):
        assert unfinished_out_of_place(checking, 100) == []
        assert check_snapshot(checking, CheckOptions()).ok
        pid = checking.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with engine.connect() as other:
            modes = set(
                other.execute(
                    text(
                        "SELECT DISTINCT mode FROM pg_locks "
                        "WHERE pid = :pid AND locktype = 'relation'"
                    ),
                    {"pid": pid},
                ).scalars()
            )
        assert modes == {"AccessShareLock"}
        # every writer runs to its end while the check's transaction is open, none waiting
        errors: list[BaseException] = []
        handler("t")(lambda message: None)

        def writers() -> None:
            try:
                sent = producer.send("t", "during", delay_level=1)
                producer.send("t", "timer", delay="10m")
                with engine.connect() as conn:
                    assert delivery.run_once(conn, 1, 100, sent.deliver_at).moved >= 1
                Consumer(settings, engine).run_once("t")
                with engine.begin() as conn:
                    store.fold_lane_counts(conn)
                history.sweep(engine, retention_ms=None)
                producer.cancel(world.timer)
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        thread = threading.Thread(target=writers)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive() and errors == []
    assert run_check(engine).ok


def test_a_level_removed_while_a_check_runs_waits_for_it_and_the_check_sees_one_state(
    world: World, producer: Producer, engine: Engine
) -> None:
    """The check took its snapshot before it locked a table: a level removal that committed
    after the snapshot but before the check read the levels showed its moved messages "in no
    queue", its count off and its sequence missing (false violations on a consistent
    database); and one that began after the check's first statement deadlocked with it (the
    check locked consume_queue first, schedule_offset later; the change the other way)."""
    from delaysvc.config.levels import DelayLevels
    from delaysvc.schema.migrate import upgrade

    for n in range(3):
        producer.send("t", n, delay_level=5)
    changes: list[object] = []
    errors: list[BaseException] = []

    def remove_level_5() -> None:
        try:
            changes.extend(upgrade(engine, DelayLevels.parse("1s 2s 3s 5s")))
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    with engine.connect() as checking, snapshot(checking):
        migrate = threading.Thread(target=remove_level_5)
        migrate.start()
        with engine.connect() as watching:  # until the change waits for the check's locks
            for _ in range(500):
                waiting = watching.execute(
                    text("SELECT count(*) FROM pg_locks WHERE NOT granted")
                ).scalar_one()
                if waiting or not migrate.is_alive():
                    break
                time.sleep(0.01)
        result = check_snapshot(checking, CheckOptions())
        assert result.ok, result.lines()
    migrate.join(timeout=60)
    assert errors == [] and len(changes) == 1
    after = run_check(engine)
    assert after.ok, after.lines()
    upgrade(engine, DelayLevels.parse(TEST_LEVELS))


def test_a_connection_in_a_transaction_is_refused(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
        with pytest.raises(ValueError, match="no transaction open"):
            run_check(conn)


def test_a_check_that_cannot_finish_in_time_says_why_in_its_own_words(
    database_url: str, engine: Engine
) -> None:
    """A table it reads held longer than its lock timeout (a level change, a history day
    dropped), or a statement longer than --timeout: exit 2 naming which, and what to do (it
    printed PostgreSQL's "canceling statement due to lock timeout")."""
    with engine.connect() as holder:
        holder.execute(
            text(qualify("LOCK TABLE delaysvc.schedule_offset IN ACCESS EXCLUSIVE MODE"))
        )
        done = delaysvc_check(database_url)
        holder.rollback()
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        "error: delaysvc check could not finish: another transaction held a table it reads for "
        "more than 5 s (a level change by delaysvc migrate, a history day dropped?); run it "
        "again once that is done"
    )
    with engine.connect() as holder:  # held again: a statement's timeout comes first now
        holder.execute(
            text(qualify("LOCK TABLE delaysvc.schedule_offset IN ACCESS EXCLUSIVE MODE"))
        )
        done = delaysvc_check(database_url, "--timeout", "1")
        holder.rollback()
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        "error: delaysvc check could not finish: a statement ran longer than --timeout (1 s); "
        "give it more"
    )
