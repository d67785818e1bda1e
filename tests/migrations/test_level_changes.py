"""Changing the delay levels with messages waiting: the database is the one truth for a level's
delay, and no waiting message is delivered before its time, whatever the settings of the
producers and workers say (issue: a message sent at a 1h level ran within seconds after the
level was shortened to 10m)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import Engine, text

from delaysvc import store
from delaysvc.config.levels import DelayLevels
from delaysvc.config.settings import Settings
from delaysvc.errors import SchemaNotReady
from delaysvc.maintenance import delivery
from delaysvc.maintenance.check import run_check
from delaysvc.producer.sending import Producer
from delaysvc.schema.migrate import upgrade
from delaysvc.schema.tables import TIMER_LANE
from tests.conftest import ROOT, TEST_LEVELS, outside_env  # "1s 2s 3s 5s 8s"


def tick(engine: Engine, lane: int, now=None):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return delivery.run_once(conn, lane, 1000, now)


def where(engine: Engine, message_id: int):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return store.get_message(conn, message_id)


def pending(engine: Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return {row.lane: row.pending for row in store.lane_stats(conn)}


def stored_levels(engine: Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return store.stored_levels(conn)


def test_a_shortened_level_does_not_deliver_its_waiting_messages_early(settings, engine):
    """The issue's reproduction: level 5 is 1h, a message waits in it, the level becomes 10m."""
    upgrade(engine, DelayLevels.parse("1s 2s 3s 5s 1h"))
    hour = Producer(
        Settings(database_url=settings.database_url, delay_levels="1s 2s 3s 5s 1h"), engine
    )
    message = hour.send("order.cancel", {"order_id": 42}, delay_level=5)
    assert message.deliver_at - message.stored_at == timedelta(hours=1)

    changes = upgrade(engine, DelayLevels.parse("1s 2s 3s 5s 10m"))
    assert [(c.level, c.old_ms, c.new_ms, c.relocated) for c in changes] == [
        (5, 3_600_000, 600_000, 1)
    ]
    # workers with either setting move nothing now: the level is empty, the timer lane's
    # head is due in an hour
    for lane in (5, TIMER_LANE):
        assert tick(engine, lane).moved == 0
    waiting = where(engine, message.id)
    assert (waiting.status, waiting.lane, waiting.deliver_ts) == (
        "scheduled",
        TIMER_LANE,
        message.deliver_at,
    )
    assert tick(engine, TIMER_LANE, message.deliver_at).moved == 1
    assert pending(engine)[TIMER_LANE] == 0
    # and the level takes its new delay
    ten = Producer(
        Settings(database_url=settings.database_url, delay_levels="1s 2s 3s 5s 10m"), engine
    )
    fresh = ten.send("order.cancel", {"order_id": 43}, delay_level=5)
    assert fresh.deliver_at - fresh.stored_at == timedelta(minutes=10)
    assert where(engine, fresh.id).lane == 5


def test_a_lengthened_level_keeps_its_messages_in_order_and_on_time(producer, settings, engine):
    first = producer.send("t", 1, delay_level=4)  # 5 s
    assert upgrade(engine, DelayLevels.parse("1s 2s 3s 7s 8s"))[0].relocated == 0
    longer = Producer(
        Settings(database_url=settings.database_url, delay_levels="1s 2s 3s 7s 8s"), engine
    )
    second = longer.send("t", 2, delay_level=4)  # 7 s
    assert second.deliver_at - second.stored_at == timedelta(seconds=7)
    assert [where(engine, m.id).lane for m in (first, second)] == [4, 4]
    assert tick(engine, 4, first.deliver_at - timedelta(milliseconds=1)).moved == 0
    assert tick(engine, 4, first.deliver_at).moved == 1
    assert tick(engine, 4, second.deliver_at - timedelta(milliseconds=1)).moved == 0
    assert tick(engine, 4, second.deliver_at).moved == 1


def test_an_added_level_leaves_waiting_messages_alone(producer, engine):
    waiting = producer.send("t", 1, delay_level=5)
    assert upgrade(engine, DelayLevels.parse(TEST_LEVELS + " 13s")) == []
    assert stored_levels(engine)[6] == 13_000
    assert where(engine, waiting.id).lane == 5
    assert pending(engine)[5] == 1


def test_a_removed_level_hands_its_messages_to_the_timer_lane(producer, engine):
    kept = [producer.send("t", i, delay_level=5) for i in range(3)]
    changes = upgrade(engine, DelayLevels.parse("1s 2s 3s"))
    assert [(c.level, c.new_ms, c.relocated) for c in changes] == [(4, None, 0), (5, None, 3)]
    assert sorted(stored_levels(engine)) == [1, 2, 3]
    assert pending(engine)[TIMER_LANE] == 3
    for message in kept:
        assert (where(engine, message.id).lane, where(engine, message.id).status) == (
            0,
            "scheduled",
        )
    assert tick(engine, TIMER_LANE, kept[-1].deliver_at).moved == 3
    with engine.connect() as conn:
        moved = conn.execute(text("SELECT message_id FROM topic_queue ORDER BY seq")).scalars()
        assert list(moved) == [m.id for m in kept]


def test_a_producer_with_old_levels_never_puts_a_message_in_a_level_of_another_delay(
    producer, engine
):
    upgrade(engine, DelayLevels.parse("1s 2s 3s 5s 6s"))  # level 5: 8 s -> 6 s
    stale = producer.send("t", "old settings", delay_level=5)  # this producer still says 8 s
    row = where(engine, stale.id)
    assert (row.lane, row.deliver_ts - row.stored_at) == (TIMER_LANE, timedelta(seconds=8))
    batch = producer.send_batch([{"topic": "t", "body": 1, "delay": "8s"}])
    assert where(engine, batch[0].id).lane == TIMER_LANE
    # a producer whose levels agree with the database's uses the level
    assert where(engine, producer.send("t", 2, delay_level=3).id).lane == 3


def test_processes_with_other_levels_are_refused_with_the_difference_named(engine):
    with engine.connect() as conn, pytest.raises(SchemaNotReady) as refused:
        store.check_levels(conn, DelayLevels.parse("1s 2s 3s 5s 1h"))
    assert "level 5: 1h configured, 8s in the database" in str(refused.value)
    assert "delaysvc migrate" in str(refused.value)


def test_the_lane_delay_is_the_databases_not_the_runners(settings, engine):
    """A lane runner takes its lane's delay from the database, whatever the levels of the
    process it runs in: after level 3 went from 3 s to 4 s, a runner moves a message sent at
    the new level when it is due by the database's 4 s, not by the 3 s this process has.
    (Level 3, not the last: the test waits the level's delay for real.)"""
    upgrade(engine, DelayLevels.parse("1s 2s 4s 5s 8s"))
    new_levels = Settings(database_url=settings.database_url, delay_levels="1s 2s 4s 5s 8s")
    message = Producer(new_levels, engine).send("t", 1, delay_level=3)
    assert message.deliver_at - message.stored_at == timedelta(seconds=4)
    assert Settings(delay_levels=TEST_LEVELS).levels.delay_ms(3) == 3000  # this process's
    runner = delivery.LaneRunner(engine, 3, 1000, 0.05)
    assert runner.run(budget_seconds=5.0) == 1
    with engine.connect() as conn:
        enqueued_at = conn.execute(
            text("SELECT enqueued_at FROM topic_queue WHERE message_id = :id"), {"id": message.id}
        ).scalar_one()
    # moved when due by the database's delay: not at 3 s, and promptly at 4 s
    assert message.deliver_at <= enqueued_at < message.deliver_at + timedelta(seconds=0.5)


def test_a_level_change_waits_for_a_producer_transaction_and_then_relocates_its_message(
    settings, engine
):
    producer = Producer(settings, engine)
    with engine.connect() as conn:
        conn.begin()
        message = producer.send("t", "in flight", delay_level=5, connection=conn)
        migrated = threading.Event()
        changes: list = []

        def migrate() -> None:
            changes.extend(upgrade(engine, DelayLevels.parse("1s 2s 3s 5s 6s")))
            migrated.set()

        migrating = threading.Thread(target=migrate)
        migrating.start()
        time.sleep(0.5)
        assert not migrated.is_set()  # the change waits for the producer's transaction
        conn.commit()
    migrating.join(timeout=30)
    assert migrated.is_set() and changes[0].relocated == 1
    row = where(engine, message.id)
    assert (row.lane, row.deliver_ts) == (TIMER_LANE, message.deliver_at)


def test_a_level_change_waiting_for_its_lock_holds_other_sends_a_moment_at_most(settings, engine):
    """A change waiting for the levels' lock behind a producer's open transaction queued every
    later send behind it, for the whole 10 s it waited (found by a reviewer: a send of 9.75 s).
    It tries in steps of LEVEL_CHANGE_LOCK_STEP now, and sends go on between them."""
    producer = Producer(settings, engine)
    with engine.connect() as conn:
        conn.begin()
        producer.send("t", "in flight", delay_level=5, connection=conn)
        migrated = threading.Event()
        migrating = threading.Thread(
            target=lambda: (upgrade(engine, DelayLevels.parse("1s 2s 3s 5s 6s")), migrated.set())
        )
        migrating.start()
        try:
            time.sleep(0.5)
            took = []
            for n in range(3):
                started = time.monotonic()
                producer.send("other", n, delay="1h")
                took.append(time.monotonic() - started)
            assert not migrated.is_set()  # still waiting for the producer's transaction
            assert max(took) < 1.5, took
        finally:
            conn.commit()
            migrating.join(timeout=30)
    assert migrated.is_set()


def test_a_level_change_leaves_the_transactions_lock_timeout_as_it_was(engine: Engine) -> None:
    """The change waits at most LEVEL_CHANGE_LOCK_STEP at a time for the levels' tables, and only
    there (it set 0 after it, whatever the transaction had)."""
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL lock_timeout = '3s'"))
        changes = store.ensure_levels(conn, DelayLevels.parse("1s 2s 3s 5s 6s"))
        assert [change.level for change in changes] == [5]
        assert conn.execute(text("SHOW lock_timeout")).scalar_one() == "3s"


def test_cli_migrate_names_each_change(tmp_path, database_url, engine, producer):
    from click.testing import CliRunner

    from delaysvc.cli import cli

    producer.send("t", 1, delay_level=5)
    result = CliRunner().invoke(
        cli,
        ["migrate"],
        env={"DELAYSVC_DATABASE_URL": database_url, "DELAYSVC_DELAY_LEVELS": "1s 2s 3s 5s 6s"},
    )
    assert result.exit_code == 0, result.output
    assert (
        "level 5: 8s -> 6s; its 1 waiting messages moved to the timer lane, due when they were due"
        in result.output
    )


def test_cli_migrate_dry_run_says_each_change_and_changes_nothing(database_url, engine, producer):
    """A migrate run from a shell without the service's DELAYSVC_DELAY_LEVELS reset custom
    levels with no way to look first (found by a reviewer)."""
    from click.testing import CliRunner

    from delaysvc.cli import cli

    message = producer.send("t", 1, delay_level=5)
    env = {"DELAYSVC_DATABASE_URL": database_url, "DELAYSVC_DELAY_LEVELS": "1s 2s 3s 5s 6s"}
    result = CliRunner().invoke(cli, ["migrate", "--dry-run"], env=env)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "would change level 5: 8s -> 6s; its 1 waiting messages moved to the timer lane, due "
        "when they were due",
        "dry run: nothing changed; 1 level change(s) for DELAYSVC_DELAY_LEVELS=1s 2s 3s 5s 6s",
    ]
    with engine.connect() as conn:
        assert store.stored_levels(conn)[5] == 8000
    assert where(engine, message.id).lane == 5


def test_cli_migrate_without_levels_set_keeps_the_databases_own(database_url, engine, producer):
    """`delaysvc migrate` from a shell without the service's DELAYSVC_DELAY_LEVELS applied the
    18 default levels over the database's five, unasked; the service's workers then refused to
    start (found by a reviewer). It refuses, naming both; the defaults are applied when asked
    for by name, and levels set to the database's own migrate as before."""
    from click.testing import CliRunner

    from delaysvc.cli import cli
    from delaysvc.config.levels import DEFAULT_LEVELS

    message = producer.send("t", 1, delay_level=5)
    unset = {"DELAYSVC_DATABASE_URL": database_url, "DELAYSVC_DELAY_LEVELS": None}
    refused = CliRunner().invoke(cli, ["migrate"], env=unset)
    assert refused.exit_code == 2, refused.output
    assert refused.output.startswith(
        "error: DELAYSVC_DELAY_LEVELS is not set, and the database's levels (1s 2s 3s 5s 8s) "
        f"are not the default ones: migrating would change them to {DEFAULT_LEVELS}. Set "
        "DELAYSVC_DELAY_LEVELS to the service's levels (DELAYSVC_DELAY_LEVELS='1s 2s 3s 5s 8s')"
    )
    with engine.connect() as conn:
        assert len(store.stored_levels(conn)) == 5
    assert where(engine, message.id).lane == 5

    same = dict(unset, DELAYSVC_DELAY_LEVELS="1s 2s 3s 5s 8s")
    assert CliRunner().invoke(cli, ["migrate"], env=same).exit_code == 0
    defaults = dict(unset, DELAYSVC_DELAY_LEVELS=DEFAULT_LEVELS)
    applied = CliRunner().invoke(cli, ["migrate"], env=defaults)
    assert applied.exit_code == 0, applied.output
    with engine.connect() as conn:
        assert len(store.stored_levels(conn)) == 18


def test_a_celery_worker_started_directly_with_other_levels_exits_naming_the_difference(
    settings, tmp_path
):
    """`celery -A delaysvc.tasks worker` refuses as `delaysvc worker` does (Celery itself only
    logs an exception raised in its worker_init signal, and went on running)."""
    done = _celery_worker(settings, tmp_path, DELAYSVC_DELAY_LEVELS="1s 2s 3s 5s 1h")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "level 5: 1h configured, 8s in the database" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_consume_worker_without_a_bound_task_exits_naming_it(settings, tmp_path):
    """A task `DELAYSVC_TOPIC_TASKS` binds comes to the consume queue: a worker that did not
    have it started all the same, and each of its jobs was "unregistered", retried until dead
    (found by a reviewer)."""
    done = _celery_worker(
        settings,
        tmp_path,
        "-Q",
        "delaysvc.consume",
        DELAYSVC_TOPIC_TASKS="order.cancel=shop.tasks.cancel_unpaid_order",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        "error: DELAYSVC_TOPIC_TASKS binds order.cancel to shop.tasks.cancel_unpaid_order, a "
        "task this worker does not have: list the module that defines it in DELAYSVC_HANDLERS"
    ) in done.stderr


def _celery_worker(
    settings, tmp_path, *args: str, **variables: str
) -> subprocess.CompletedProcess[str]:
    """`celery -A delaysvc.tasks worker -P threads ARGS` with these DELAYSVC_* variables, run
    to its end (a refusal: at most two minutes)."""
    env = outside_env() | {
        "DELAYSVC_DATABASE_URL": settings.database_url,
        "DELAYSVC_VAR_DIR": str(tmp_path),
        **variables,
    }
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "delaysvc.tasks", "worker", "-P", "threads", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _a_session_waits_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                )
            ).scalar()
        )


def test_a_retry_written_into_a_level_while_it_is_removed_is_relocated_not_dropped(
    producer, settings, engine
):
    """The issue's defect 1: a worker of the running release (levels up to 5) schedules a
    retry at level 5 while `migrate` removes level 5. The retry's transaction commits after the
    relocation has read the level; before the fix `DROP TABLE` then dropped its queue row and
    the message said `retrying`, level 5, in no queue, forever."""
    message = producer.send("t", "to retry")  # no delay: ready at once
    with engine.begin() as conn:
        (claimed,) = store.claim_ready(conn, "t", 1, lease_seconds=60)
    failure = store.Failure(claimed.id, claimed.claim_id, "boom", "", 1)
    with engine.connect() as worker:
        worker.begin()
        assert store.schedule_retry(worker, failure, lane=5, delay_level=5, delay_ms=8000)
        changes: list = []
        migrating = threading.Thread(
            target=lambda: changes.extend(upgrade(engine, DelayLevels.parse("1s 2s 3s 5s")))
        )
        migrating.start()
        # the change must wait for the retry's transaction (before the fix it waited only at
        # the DROP, after relocating without the retry's row)
        deadline = time.monotonic() + 30
        while not _a_session_waits_on_a_lock(engine):
            assert time.monotonic() < deadline, "the level change never waited for the retry"
            time.sleep(0.05)
        worker.commit()
    migrating.join(timeout=30)
    assert [(c.level, c.new_ms, c.relocated) for c in changes] == [(5, None, 1)]
    row = where(engine, message.id)
    assert (row.status, row.lane) == ("retrying", TIMER_LANE)
    with engine.connect() as conn:
        timer = conn.execute(text("SELECT message_id FROM timer_queue")).scalars().all()
    assert timer == [message.id]
    assert pending(engine)[TIMER_LANE] == 1


def test_a_retry_by_a_worker_with_a_removed_level_goes_to_the_timer_lane(
    producer, settings, engine
):
    """After level 5 is gone, a worker still configured with it retries there: the retry takes
    the timer lane, due when the worker meant (as a send does, `_PLACED_LANE`)."""
    message = producer.send("t", "to retry")
    upgrade(engine, DelayLevels.parse("1s 2s 3s 5s"))
    with engine.begin() as conn:
        (claimed,) = store.claim_ready(conn, "t", 1, lease_seconds=60)
        failure = store.Failure(claimed.id, claimed.claim_id, "boom", "", 1)
        assert store.schedule_retry(conn, failure, lane=5, delay_level=5, delay_ms=8000)
    row = where(engine, message.id)
    assert (row.status, row.lane) == ("retrying", TIMER_LANE)
    assert pending(engine)[TIMER_LANE] == 1


def test_a_level_removed_while_the_lane_counts_are_folded_keeps_no_count(producer, engine):
    """Beat folds the lanes' count deltas every second. A fold that had deleted level 5's
    deltas (uncommitted) made the removal's DELETE of them wait, then miss the folded total the
    fold committed: level 5 kept a count of 3 for a queue that was gone (`check` failed, and a
    level 5 added again was full for its cap at once)."""
    for n in range(3):
        producer.send("t", n, delay_level=5)
    fold = engine.connect()
    fold.begin()
    assert store.fold_lane_counts(fold) > 0  # beat's fold, not yet committed
    removed: list[store.LevelChange] = []
    migrate = threading.Thread(
        target=lambda: removed.extend(upgrade(engine, DelayLevels.parse("1s 2s 3s 5s")))
    )
    migrate.start()
    time.sleep(1.0)
    fold.commit()
    fold.close()
    migrate.join(30)
    assert [(c.level, c.new_ms, c.relocated) for c in removed] == [(5, None, 3)]
    with engine.connect() as conn:
        counts = dict(
            conn.execute(text("SELECT lane, sum(delta) FROM lane_count GROUP BY lane")).all()
        )
    assert counts.get(5, 0) == 0
    assert pending(engine)[TIMER_LANE] == 3
    checked = run_check(engine)
    assert checked.exit_code == 0, checked.lines()
    upgrade(engine, DelayLevels.parse(TEST_LEVELS))
    assert pending(engine)[5] == 0


def test_a_removed_levels_backlog_cap_goes_with_it(settings, engine):
    """The cap stayed: `caps list` showed it while `caps set` refused the level, and a level
    added later under that number (another delay) was bound by it unannounced."""
    from delaysvc.producer.caps import set_cap

    set_cap(engine, "level", 5, 1, "reject")
    set_cap(engine, "level", 3, 7, "reject")
    changes = upgrade(engine, DelayLevels.parse("1s 2s 3s 5s"))
    assert [c.describe() for c in changes] == [
        "level 5 removed (was 8s); its backlog cap (at most 1 waiting, reject) removed with it"
    ]
    with engine.connect() as conn:
        assert [(c.scope, c.target) for c in store.backlog_caps(conn)] == [("level", "3")]
    upgrade(engine, DelayLevels.parse("1s 2s 3s 5s 2h"))
    two_hours = Producer(
        Settings(database_url=settings.database_url, delay_levels="1s 2s 3s 5s 2h"), engine
    )
    for n in range(2):
        assert two_hours.send("t", n, delay_level=5).created
    upgrade(engine, DelayLevels.parse(TEST_LEVELS))
