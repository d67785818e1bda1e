"""Periodic schedules (`delaysvc.maintenance.periodic`): validation, ticks in a time zone, one
message per tick however many fire at once, the policy after downtime, pause and resume,
schedules declared in code. The end-to-end test with several beats and workers is in
tests/e2e/test_periodic_e2e.py."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.errors import ConfigError, DeclaredInCode, NotFound, ValidationError
from delaysvc.maintenance import periodic
from delaysvc.maintenance.periodic import Schedules, fire_due, schedule
from delaysvc.store import schedules as store_schedules
from tests.conftest import TEST_LEVELS, outside_env

T0 = datetime(2026, 11, 25, 10, 0, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def no_declarations() -> Iterator[None]:
    saved = dict(periodic._declared)
    periodic._declared.clear()
    yield
    periodic._declared.clear()
    periodic._declared.update(saved)


def _put(engine: Engine, item: periodic.Schedule, next_tick: datetime) -> None:
    with engine.begin() as conn:
        store_schedules.put(conn, item, "api", next_tick)


def _messages(engine: Engine, name: str) -> list[tuple[str, str, dict[str, str]]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT key, status, properties FROM commit_log "
                "WHERE properties->>'periodic' = :name ORDER BY id"
            ),
            {"name": name},
        )
        return [(row.key, row.status, row.properties) for row in rows]


# ------------------------------------------------------------------ what a schedule is


@pytest.mark.parametrize(
    ("when", "field", "says"),
    [
        ("*/5 * * *", "schedule", "not a cron expression"),
        ("61 * * * *", "schedule", "not a cron expression"),
        ("500ms", "schedule", "at least 1s"),
        # its ticks would pass the year 9999 (was an OverflowError: a 500 through the API)
        ("every 3000000d", "schedule", "at most 3650d"),
        ("999999999999d", "schedule", "at most 3650d"),
        ("every 5x", "schedule", "not a duration"),
        ("", "schedule", "cron expression or an interval"),
    ],
)
def test_a_bad_schedule_is_refused_naming_what_is_allowed(when: str, field: str, says: str) -> None:
    with pytest.raises(ValidationError, match=says) as caught:
        schedule("s", when, topic="t")
    assert caught.value.field == field


def test_a_bad_name_time_zone_or_policy_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError, match="not a schedule name") as caught:
        schedule("has space", "1m", topic="t")
    assert caught.value.field == "name"
    with pytest.raises(ValidationError, match="IANA time zone") as caught:
        schedule("s", "0 3 * * *", topic="t", timezone="Mars/Olympus")
    assert caught.value.field == "timezone"
    # the zone of whichever host's beat computes the ticks (a file zoneinfo reads as a zone)
    with pytest.raises(ValidationError, match="'localtime' is not an IANA time zone"):
        schedule("s", "0 3 * * *", topic="t", timezone="localtime")
    with pytest.raises(ValidationError, match="'skip' or 'latest'") as caught:
        schedule("s", "1m", topic="t", on_missed="all")
    assert caught.value.field == "on_missed"


def test_an_interval_ticks_on_multiples_of_itself_from_the_epoch() -> None:
    every = schedule("s", "every 5m", topic="t")
    assert (every.cron, every.every_ms, every.spec) == (None, 300_000, "every 5m")
    at = T0 + timedelta(minutes=2, seconds=7)
    assert every.next_tick(at) == T0 + timedelta(minutes=5)
    assert every.latest_tick(at) == T0
    assert every.next_tick(T0) == T0 + timedelta(minutes=5)  # strictly after
    assert every.latest_tick(T0) == T0  # at or before
    assert schedule("s", timedelta(seconds=30), topic="t").every_ms == 30_000


def test_a_cron_expression_ticks_in_its_time_zone_across_daylight_saving() -> None:
    nightly = schedule("s", "30 2 * * *", topic="t", timezone="Europe/Berlin")
    # 2026-03-29: 02:30 does not exist in Berlin (clocks go 02:00 -> 03:00): cron runs at 03:00
    before = datetime(2026, 3, 28, 12, 0, tzinfo=UTC)
    first = nightly.next_tick(before)
    assert first == datetime(2026, 3, 29, 1, 0, tzinfo=UTC)  # 03:00 CEST
    assert nightly.next_tick(first) == datetime(2026, 3, 30, 0, 30, tzinfo=UTC)  # 02:30 CEST
    winter = datetime(2026, 1, 10, 12, 0, tzinfo=UTC)
    assert nightly.next_tick(winter) == datetime(2026, 1, 11, 1, 30, tzinfo=UTC)  # 02:30 CET
    assert nightly.latest_tick(winter) == datetime(2026, 1, 10, 1, 30, tzinfo=UTC)
    # 2026-10-25: 02:00-03:00 happens twice in Berlin; a daily 02:30 runs once, and a
    # half-hourly schedule runs in both, its ticks 30 minutes apart throughout
    autumn = datetime(2026, 10, 24, 12, 0, tzinfo=UTC)
    assert nightly.next_tick(autumn) == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # CEST
    assert nightly.next_tick(nightly.next_tick(autumn)) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)
    half_hourly = schedule("s", "*/30 * * * *", topic="t", timezone="Europe/Berlin")
    ticks = list(periodic.ticks(half_hourly, datetime(2026, 10, 24, 23, 50, tzinfo=UTC), 7))
    assert ticks == [datetime(2026, 10, 25, 0, 0, tzinfo=UTC) + timedelta(minutes=30 * n)
                     for n in range(7)]  # fmt: skip


@pytest.mark.parametrize(
    ("shorthand", "fields"),
    [("@daily", "0 0 * * *"), ("@HOURLY", "0 * * * *"), ("@weekly", "0 0 * * 0"),
     ("@monthly", "0 0 1 * *"), ("@yearly", "0 0 1 1 *"), ("@annually", "0 0 1 1 *")],
)  # fmt: skip
def test_cron_shorthands_are_the_five_fields_they_stand_for(shorthand: str, fields: str) -> None:
    """The documents promised them; cronsim reads none, so each was refused as 'Wrong number
    of fields' (and a handler module declaring one could not be imported)."""
    item = schedule("s", shorthand, topic="t")
    assert item.cron == fields
    after = datetime(2026, 3, 4, 5, 6, tzinfo=UTC)
    assert item.next_tick(after) == schedule("s", fields, topic="t").next_tick(after)


@pytest.mark.parametrize(
    ("zone", "night"),
    [("Europe/Berlin", datetime(2026, 10, 24, 22, tzinfo=UTC)),
     ("America/New_York", datetime(2026, 3, 8, 4, tzinfo=UTC)),
     ("Australia/Lord_Howe", datetime(2026, 4, 4, 12, tzinfo=UTC)),  # back half an hour
     ("Australia/Lord_Howe", datetime(2026, 10, 3, 13, tzinfo=UTC))],
)  # fmt: skip
@pytest.mark.parametrize("spec", ["30 * * * *", "*/20 * * * *", "30 1 * * *", "0 2 * * *"])
def test_the_latest_tick_is_always_one_the_next_ticks_walk_fires(
    zone: str, night: datetime, spec: str
) -> None:
    """`on_missed="latest"` fires `latest_tick`: in Lord Howe it was the second 01:30, a tick
    the beat's walk (`next_tick`) never fires (found by a reviewer)."""
    item = schedule("s", spec, topic="t", timezone=zone)
    fired = [item.next_tick(night - timedelta(days=2))]
    while fired[-1] < night + timedelta(hours=8):
        fired.append(item.next_tick(fired[-1]))
    for minute in range(0, 6 * 60, 7):
        at = night + timedelta(minutes=minute, seconds=13)
        assert item.latest_tick(at) == max(tick for tick in fired if tick <= at), at


def test_in_the_hours_second_pass_the_next_tick_is_tomorrows_and_the_latest_todays() -> None:
    """From the second pass of the repeated hour (02:10 CET, after 02:10 CEST), cronsim's
    next 02:30 was the first pass's, already past: the next tick was before `after`."""
    nightly = schedule("s", "30 2 * * *", topic="t", timezone="Europe/Berlin")
    second_pass = datetime(2026, 10, 25, 1, 10, tzinfo=UTC)  # 02:10 CET
    assert nightly.next_tick(second_pass) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)
    assert nightly.latest_tick(second_pass) == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    new_york = schedule("s", "30 1 * * *", topic="t", timezone="America/New_York")
    second_pass = datetime(2026, 11, 1, 6, 10, tzinfo=UTC)  # 01:10 EST, after 01:10 EDT
    assert new_york.next_tick(second_pass) == datetime(2026, 11, 2, 6, 30, tzinfo=UTC)
    assert new_york.latest_tick(second_pass) == datetime(2026, 11, 1, 5, 30, tzinfo=UTC)


@pytest.mark.parametrize("on_missed", ["skip", "latest"])
def test_a_beat_back_in_the_hours_second_pass_fires_a_missed_daily_tick_at_most_once(
    engine: Engine, on_missed: str
) -> None:
    """A beat down over the 02:30 CEST tick, back at 02:10 CET: the tick was fired again on
    every run (next_tick set back to it each time) until 02:30 CET, 1,201 times a second."""
    nightly = schedule(
        "nightly", "30 2 * * *", topic="t.dst", timezone="Europe/Berlin", on_missed=on_missed
    )
    _put(engine, nightly, datetime(2026, 10, 25, 0, 30, tzinfo=UTC))  # then beat went down
    back = datetime(2026, 10, 25, 1, 10, tzinfo=UTC)
    fired = sum(fire_due(engine, back + timedelta(seconds=n)).fired for n in range(5))
    assert fired == (1 if on_missed == "latest" else 0)
    keys = [key for key, _, _ in _messages(engine, "nightly")]
    assert keys == (["periodic:nightly:2026-10-25T00:30:00+00:00"] if fired else [])
    assert Schedules(engine).get("nightly").next_tick == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)


# ------------------------------------------------------------------ firing


def test_a_due_tick_becomes_one_ready_message_and_the_next_tick_is_set(engine: Engine) -> None:
    item = schedule("every2", "2s", topic="t.periodic", body={"n": 1})
    _put(engine, item, T0)
    assert fire_due(engine, now=T0 - timedelta(milliseconds=1)).fired == 0  # not yet
    assert fire_due(engine, now=T0 + timedelta(milliseconds=400)).fired == 1
    assert fire_due(engine, now=T0 + timedelta(milliseconds=600)).fired == 0  # once
    tick = T0.isoformat()
    assert _messages(engine, "every2") == [
        (f"periodic:every2:{tick}", "ready", {"periodic": "every2", "tick": tick})
    ]
    with engine.connect() as conn:
        fired_id = conn.execute(
            text("SELECT id FROM commit_log WHERE key = :key"), {"key": f"periodic:every2:{tick}"}
        ).scalar_one()
    row = Schedules(engine).get("every2")
    assert row.next_tick == T0 + timedelta(seconds=2)
    assert (row.last_tick, row.last_message_id) == (T0, fired_id)


def test_a_firer_that_ran_late_fires_every_tick_it_passed_each_once(engine: Engine) -> None:
    item = schedule("every1s", "1s", topic="t.periodic")
    _put(engine, item, T0)
    assert fire_due(engine, now=T0 + timedelta(milliseconds=2500)).fired == 3
    assert [key for key, _, _ in _messages(engine, "every1s")] == [
        f"periodic:every1s:{(T0 + timedelta(seconds=n)).isoformat()}" for n in range(3)
    ]
    assert Schedules(engine).get("every1s").next_tick == T0 + timedelta(seconds=3)
    # a minute and more late: only the last minute's ticks are on time, the rest were missed
    result = fire_due(engine, now=T0 + timedelta(seconds=100))
    assert (result.fired, result.skipped) == (61, 1)


@pytest.mark.parametrize(("policy", "fired"), [("skip", 0), ("latest", 1)])
def test_after_downtime_missed_ticks_are_skipped_or_the_latest_runs_once(
    engine: Engine, policy: str, fired: int
) -> None:
    item = schedule("hourly", "0 * * * *", topic="t.periodic", on_missed=policy)
    _put(engine, item, T0)
    now = T0 + timedelta(hours=5, minutes=20)  # five ticks missed, the last 20 minutes ago
    result = fire_due(engine, now=now)
    assert (result.fired, result.skipped) == (fired, 1)  # older ticks were missed
    latest = (T0 + timedelta(hours=5)).isoformat()
    assert [key for key, _, _ in _messages(engine, "hourly")] == (
        [f"periodic:hourly:{latest}"] if fired else []
    )
    assert Schedules(engine).get("hourly").next_tick == T0 + timedelta(hours=6)
    # a tick only a little late is on time under either policy
    assert fire_due(engine, now=T0 + timedelta(hours=6, seconds=30)).fired == 1


def test_four_firers_at_once_fire_each_tick_exactly_once(engine: Engine) -> None:
    """As several beats (or one beat's task on several workers) would: every tick of a 1 s
    schedule over 4 s is reported fired by exactly one of them (the key would hide a second
    message, so the firers' own counts are what is checked)."""
    now = datetime.now(UTC)
    item = schedule("every1", "1s", topic="t.periodic")
    _put(engine, item, item.next_tick(now))
    counts = [0] * 4
    errors: list[BaseException] = []
    stop = threading.Event()

    def fire(index: int) -> None:
        try:
            while not stop.is_set():
                counts[index] += fire_due(engine).fired
        except BaseException as exc:  # asserted below
            errors.append(exc)

    threads = [threading.Thread(target=fire, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    threading.Event().wait(4.2)
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == []
    keys = [key for key, _, _ in _messages(engine, "every1")]
    assert len(keys) == len(set(keys)) == sum(counts)
    assert 3 <= len(keys) <= 5
    ticks = sorted(datetime.fromisoformat(key.split(":", 2)[2]) for key in keys)
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(ticks))


def test_a_paused_schedule_does_not_fire_and_resumes_from_the_next_tick(engine: Engine) -> None:
    item = schedule("paused", "1s", topic="t.periodic")
    _put(engine, item, T0)
    schedules = Schedules(engine)
    assert schedules.pause("paused").paused
    assert fire_due(engine, now=T0 + timedelta(seconds=5)).fired == 0
    resumed = schedules.resume("paused")
    assert not resumed.paused
    assert resumed.next_tick > datetime.now(UTC) - timedelta(seconds=1)  # not caught up
    with pytest.raises(NotFound, match="no periodic schedule is named 'nope'"):
        schedules.pause("nope")


# ------------------------------------------------------------------ declared in code


def test_declared_schedules_are_stored_updated_and_kept_from_run_time_changes(
    engine: Engine,
) -> None:
    periodic.periodic("0 3 * * *", topic="report.nightly", timezone="Europe/Berlin")
    periodic.periodic("every 10m", topic="cache.warm", name="warm")
    schedules = Schedules(engine)
    schedules.put(schedule("from-api", "1h", topic="t.api"))
    assert periodic.store_declared(engine, now=T0) == 2
    rows = {row.name: row for row in schedules.list()}
    assert set(rows) == {"report.nightly", "warm", "from-api"}
    assert rows["report.nightly"].declared_in == "code"
    assert rows["report.nightly"].next_tick == datetime(2026, 11, 26, 2, 0, tzinfo=UTC)
    with pytest.raises(DeclaredInCode, match="declared in code"):
        schedules.put(schedule("warm", "1m", topic="cache.warm"))
    assert schedules.pause("warm").paused  # pausing one is fine

    periodic._declared.clear()  # the next release: one changed, one no longer declared
    periodic.periodic("every 5m", topic="cache.warm", name="warm")
    periodic.store_declared(engine, now=T0 + timedelta(minutes=1))
    rows = {row.name: row for row in schedules.list()}
    # a worker's start removes nothing: another worker may declare it (the sweep removes it)
    assert set(rows) == {"report.nightly", "warm", "from-api"}
    assert rows["warm"].every_ms == 300_000 and rows["warm"].paused  # kept paused
    assert rows["warm"].next_tick == T0 + timedelta(minutes=5)
    assert rows["report.nightly"].next_tick == datetime(2026, 11, 26, 2, 0, tzinfo=UTC)
    schedules.delete("from-api")
    assert [row.name for row in schedules.list()] == ["report.nightly", "warm"]


# Two teams' workers on one database, each with its own handler modules.
TEAM_A = (("0 3 * * *", "report.nightly"), ("every 10m", "cache.warm"))
TEAM_B = (("*/5 * * * *", "billing.sync"),)


def _declare(team: tuple[tuple[str, str], ...]) -> None:
    """This process's declarations become `team`'s, as in a worker importing its modules."""
    periodic._declared.clear()
    for when, topic in team:
        periodic.periodic(when, topic=topic)


def _names(engine: Engine) -> list[str]:
    return [row.name for row in Schedules(engine).list()]


def test_workers_of_two_handler_sets_starting_in_turn_keep_both_sets(engine: Engine) -> None:
    """Team A's worker, team B's, team A's again, B's again: every start stores its own
    schedules and removes none of the other's, which keep their pause, next tick and history."""
    _declare(TEAM_A)
    periodic.store_declared(engine, now=T0)
    assert Schedules(engine).pause("cache.warm").paused
    assert fire_due(engine, now=datetime(2026, 11, 26, 3, 0, 1, tzinfo=UTC)).fired == 1
    nightly = Schedules(engine).get("report.nightly")
    both = ["billing.sync", "cache.warm", "report.nightly"]
    for start, team in enumerate((TEAM_B, TEAM_A, TEAM_B, TEAM_A), start=1):
        _declare(team)
        assert periodic.store_declared(engine, now=T0 + timedelta(minutes=start)) == len(team)
        assert _names(engine) == both, f"after start {start}"
    assert Schedules(engine).get("cache.warm").paused
    kept = Schedules(engine).get("report.nightly")
    assert (kept.next_tick, kept.last_tick, kept.last_message_id, kept.created_at) == (
        nightly.next_tick,
        nightly.last_tick,
        nightly.last_message_id,
        nightly.created_at,
    )


def test_a_set_no_worker_declares_any_more_is_removed_after_the_grace_period(
    engine: Engine,
) -> None:
    """Team B's last worker stops after declaring at T0; team A's worker goes on declaring
    every DECLARE_EVERY. B's schedule stays while its last declaration is at most
    UNDECLARED_GRACE old and goes at A's first round after that; A's own stay."""
    Schedules(engine).put(schedule("from-api", "1h", topic="t.api"))
    _declare(TEAM_B)
    periodic.Declarer(engine, "b@host").run_once(now=T0)
    _declare(TEAM_A)
    worker_a = periodic.Declarer(engine, "a@host")
    at = T0
    while at + periodic.DECLARE_EVERY <= T0 + periodic.UNDECLARED_GRACE:
        assert worker_a.run_once(now=at) == periodic.Declared(2, [])
        at += periodic.DECLARE_EVERY
    assert at == T0 + periodic.UNDECLARED_GRACE  # B declared exactly the grace ago: kept
    assert worker_a.run_once(now=at) == periodic.Declared(2, [])
    assert "billing.sync" in _names(engine)
    at += periodic.DECLARE_EVERY
    assert worker_a.run_once(now=at) == periodic.Declared(2, ["billing.sync"])
    assert _names(engine) == ["cache.warm", "from-api", "report.nightly"]
    row = Schedules(engine).get("cache.warm")
    assert (row.declared_at, row.declared_by) == (at, "a@host")
    # schedules made through the API or the CLI are never swept, however old
    a_day_later = datetime.now(UTC) + timedelta(days=1)
    assert periodic.sweep_undeclared(engine, now=a_day_later) == ["cache.warm", "report.nightly"]
    assert _names(engine) == ["from-api"]


def test_a_worker_sweeps_only_after_two_rounds_in_a_row_reached_the_database(
    engine: Engine, settings: Settings
) -> None:
    """Right after a worker starts, or the database was away, the other workers may not have
    declared again yet: the sweep waits for the worker's next round."""
    _declare(TEAM_B)
    periodic.store_declared(engine, now=T0)
    _declare(TEAM_A)
    worker_a = periodic.Declarer(engine, "a@host")
    later = T0 + timedelta(hours=1)  # B's declaration is long stale
    assert worker_a.run_once(now=later).removed == []  # its start
    away = make_engine(settings, "postgresql://nobody@127.0.0.1:1/none", poolclass=NullPool)
    worker_a.engine, engine_a = away, worker_a.engine
    with pytest.raises(OperationalError):
        worker_a.run_once(now=later + periodic.DECLARE_EVERY)
    worker_a.engine = engine_a
    assert worker_a.run_once(now=later + 2 * periodic.DECLARE_EVERY).removed == []  # back
    assert "billing.sync" in _names(engine)
    assert worker_a.run_once(now=later + 3 * periodic.DECLARE_EVERY).removed == ["billing.sync"]


def test_a_code_declared_schedule_is_deleted_now_once_no_running_worker_declares_it(
    engine: Engine, database_url: str
) -> None:
    """`delaysvc schedules delete NAME` (and the API's DELETE) removes a code-declared schedule
    at once when no worker has declared it for STILL_DECLARED; one that a running worker
    declares is refused, naming the worker: it would be back at the worker's next round."""
    _declare(TEAM_B)
    periodic.store_declared(engine, now=T0)  # a day ago by the database's clock
    env = outside_env() | {
        "DELAYSVC_DATABASE_URL": database_url,
        "DELAYSVC_DELAY_LEVELS": TEST_LEVELS,
    }
    deleted = _delaysvc(env, "schedules", "delete", "billing.sync")
    assert (deleted.returncode, deleted.stdout, deleted.stderr) == (
        0,
        "deleted: billing.sync\n",
        "",
    )
    assert _names(engine) == []

    periodic.store_declared(engine, declared_by="b@host")  # declared now
    refused = _delaysvc(env, "schedules", "delete", "billing.sync")
    assert refused.returncode == 1, refused.stderr
    assert "declared in code (@periodic) by a running worker (b@host, " in refused.stderr
    with pytest.raises(DeclaredInCode, match=r"by a running worker \(b@host, \d+s ago\)"):
        Schedules(engine).delete("billing.sync")
    assert _names(engine) == ["billing.sync"]


def _delaysvc(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "delaysvc", *args], env=env, capture_output=True, text=True
    )


def test_two_declarations_of_one_name_are_refused() -> None:
    periodic.periodic("1m", topic="a")
    with pytest.raises(ConfigError, match="two periodic schedules are named 'a'"):
        periodic.periodic("2m", topic="a")
