"""The Spark pipeline with one real SparkSession (local[2]) and the real test PostgreSQL (read
over JDBC): the transforms on tiny in-memory DataFrames; archive with a kill at every step and
a re-run (each message archived exactly once, nothing unarchived deleted); report numbers
against hand-computed percentiles; bulk scheduling with bad rows of every kind; the CLI."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given
from hypothesis import settings as settings_
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from delaysvc import history
from delaysvc.consumption import Consumer, handler
from delaysvc.dead_letters import DeadLetters
from delaysvc.errors import DeadLetter, DelaysvcError
from delaysvc.pipeline import archive, bulk, report
from delaysvc.pipeline import store as pipeline_store
from delaysvc.producer import Producer
from delaysvc.settings import Settings
from delaysvc.store import history as store_history
from tests.integration.test_history import reading_the_history

DAY_MS = 86_400_000
T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if os.environ.get("DELAYSVC_TEST_DATABASE_URL"):
        pytest.skip(
            "local Spark runs in CI's first pass (embedded PostgreSQL); the second runs the "
            "pipeline on a Spark cluster and on local[2] through the CLI (test_spark_cluster.py)"
        )
    from delaysvc.pipeline.spark import session

    spark = session("local[2]")
    yield spark
    spark.stop()


def _count(engine: Engine, where: str = "true") -> int:
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM message WHERE {where}")).scalar_one()


def _md5_hash_sum(ids: list[int]) -> int:
    return sum(int(hashlib.md5(str(i).encode()).hexdigest()[:15], 16) for i in ids)


def _nearest_rank(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(p * len(ordered)) - 1]


# ---------------------------------------------------------------- transforms, in memory


def test_archive_checksum_is_count_and_sum_of_md5_id_hashes(spark: Any) -> None:
    one_four = spark.createDataFrame([(1,), (4,)], "id long")
    two_three = spark.createDataFrame([(2,), (3,)], "id long")
    assert archive.checksum(one_four) == (2, _md5_hash_sum([1, 4]))
    assert archive.checksum(two_three) == (2, _md5_hash_sum([2, 3]))
    assert archive.checksum(one_four) != archive.checksum(two_three)  # a sum of ids agrees
    big = [2**40 + n for n in range(3)]
    frame = spark.createDataFrame([(i,) for i in big], "id long")
    assert archive.checksum(frame) == (3, _md5_hash_sum(big))


def test_archive_transform_adds_the_utc_date_it_finished(spark: Any) -> None:
    frame = spark.createDataFrame(
        [
            (1, datetime(2026, 1, 5, 23, 59, tzinfo=UTC)),
            (2, datetime(2026, 1, 6, 0, 1, tzinfo=UTC)),
        ],
        "id long, finished_at timestamp",
    )
    dates = {r["id"]: str(r["date"]) for r in archive.transform(frame).collect()}
    assert dates == {1: "2026-01-05", 2: "2026-01-06"}


def test_report_transform_matches_hand_computed_percentiles(spark: Any) -> None:
    lateness = [5, 1, 3, 100, 7, 2, 9, 4, 6, 8, 11, 12]  # ms, one hour, one topic, level 2
    durations = [40, 10, 30, 20, 50, 60, 70, 80, 90, 1000, 15, 25]
    rows = []
    for n, (late, dur) in enumerate(zip(lateness, durations, strict=True)):
        due = T0 + timedelta(minutes=n)
        status = "dead" if n in (3, 7) else "succeeded"
        attempts = 3 if n in (0, 3, 7) else 1
        rows.append(
            (n, "t.a", status, 2, due, due + timedelta(milliseconds=late), due, attempts, dur)
        )
    # another hour and the timer lane (no level); a cancelled one never delivered
    rows.append(
        (
            50,
            "t.a",
            "succeeded",
            None,
            T0,
            T0 + timedelta(milliseconds=2.5),
            T0 + timedelta(hours=1),
            1,
            7,
        )
    )
    rows.append((51, "t.a", "cancelled", None, T0, None, T0 + timedelta(hours=1), 0, None))
    frame = spark.createDataFrame(rows, report._empty_schema())
    out = {(r["hour"].hour, r["level"]): r.asDict() for r in report.transform(frame).collect()}
    assert set(out) == {(10, 2), (11, -1)}
    main = out[(10, 2)]
    assert (main["messages"], main["retried"], main["dead"]) == (12, 3, 2)
    assert [main["lateness_p50_ms"], main["lateness_p95_ms"], main["lateness_p99_ms"]] == [
        6.0,
        100.0,
        100.0,
    ]
    assert [main["lateness_p50_ms"], main["lateness_p95_ms"]] == [
        _nearest_rank(lateness, 0.5),
        _nearest_rank(lateness, 0.95),
    ]
    assert main["lateness_max_ms"] == 100.0
    assert [main["duration_p50_ms"], main["duration_p95_ms"], main["duration_p99_ms"]] == [
        40.0,
        1000.0,
        1000.0,
    ]
    timer = out[(11, -1)]
    assert (timer["messages"], timer["lateness_p50_ms"], timer["lateness_max_ms"]) == (2, 2.5, 2.5)
    assert (timer["duration_p50_ms"], timer["retried"], timer["dead"]) == (7.0, 0, 0)


def test_to_options_follows_the_producers_rules() -> None:
    options = bulk.to_options(
        {"topic": "t", "body": '{"a": 1}', "delay_level": "3", "key": "", "delay": None}, False
    )
    assert options == {"topic": "t", "body": {"a": 1}, "delay_level": 3}
    assert bulk.to_options({"topic": "t", "body": "plain"}, False)["body"] == "plain"
    parsed = bulk.to_options(
        {"topic": "t", "body": "x", "tags": '["a"]', "properties": '{"p": "1"}'}, False
    )
    assert (parsed["tags"], parsed["properties"]) == (["a"], {"p": "1"})
    keyed = bulk.to_options({"topic": "t", "body": "x"}, True)
    assert keyed["key"] == bulk.to_options({"topic": "t", "body": "x"}, True)["key"]
    assert keyed["key"] != bulk.to_options({"topic": "t", "body": "y"}, True)["key"]
    with pytest.raises(DelaysvcError, match="delay_level"):
        bulk.to_options({"topic": "t", "body": "x", "delay_level": "soon"}, False)


# ---------------------------------------------------------------- archive


def _finished_messages(settings: Settings, engine: Engine, count: int) -> list[int]:
    """`count` succeeded, one cancelled and one dead message, all finished 40 days ago, and
    one unfinished message that must stay."""

    @handler("archive.ok")
    def ok(message: Any) -> None:
        return None

    @handler("archive.dead")
    def dies(message: Any) -> None:
        raise DeadLetter("no")

    producer = Producer(settings, engine)
    ids = [
        m.id
        for m in producer.send_batch(
            [{"topic": "archive.ok", "body": {"n": n}} for n in range(count)]
        )
    ]
    consumer = Consumer(settings, engine)
    assert consumer.run_once("archive.ok", limit=count).succeeded == count
    dead = producer.send("archive.dead", {"n": "dead"})
    consumer.run_once("archive.dead")
    cancelled = producer.send("archive.other", {}, delay="1h")
    producer.cancel(cancelled.id)
    with engine.begin() as conn:
        conn.execute(text("UPDATE commit_log SET finished_at = finished_at - interval '40 days'"))
    producer.send("archive.ok", {"n": "recent"}, delay="1h")  # unfinished: stays
    assert _count(engine, "status = 'dead'") == 1
    return [*ids, dead.id, cancelled.id]


def _within_one_day(engine: Engine) -> int:
    """Move every finished message to 1:00 UTC of the day it finished; -> the `older_than_ms`
    that puts the cutoff at 2:00 that day: the archive takes them as part of a day (the
    cutoff's), whose rows it deletes, not as a whole day, whose partition it drops."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE commit_log SET finished_at = date_trunc('day', finished_at, 'UTC') "
                "+ interval '1 hour' WHERE finished_at IS NOT NULL"
            )
        )
        since = conn.execute(
            text(
                "SELECT now() - (min(finished_at) + interval '1 hour') FROM commit_log "
                "WHERE finished_at IS NOT NULL"
            )
        ).scalar_one()
    return int(since.total_seconds() * 1000)


def _archived_ids(spark: Any, engine: Engine) -> list[int]:
    with engine.connect() as conn:
        folders = pipeline_store.verified_archive_folders(conn)
    return sorted(r["id"] for r in spark.read.parquet(*folders).select("id").collect())


def _dead_letters(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM dead_letter")).scalar_one()


def test_archive_writes_verifies_then_deletes(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    ids = _finished_messages(settings, engine, 40)
    out = tmp_path / "archive"
    result = archive.run(spark, settings, engine, 30 * DAY_MS, out)
    assert (result.written, result.deleted, len(result.runs)) == (42, 42, 1)
    assert _archived_ids(spark, engine) == sorted(ids)
    assert _count(engine) == 1  # only the unfinished message is left
    assert _dead_letters(engine) == 0
    folder = Path(result.folders[0])
    topics = sorted(p.name for p in folder.glob("topic=*"))
    assert topics == ["topic=archive.dead", "topic=archive.ok", "topic=archive.other"]
    dead = spark.read.parquet(str(folder)).where("status = 'dead'").collect()
    assert [(r["dead_reason"], json.loads(r["body"])) for r in dead] == [("no", {"n": "dead"})]
    with engine.connect() as conn:
        run = conn.execute(text("SELECT status, rows_written, checksum FROM pipeline_run")).one()
    assert (run.status, run.rows_written) == ("succeeded", 42)
    assert run.checksum == f"42:{_md5_hash_sum(ids)}"
    nothing = archive.run(spark, settings, engine, 30 * DAY_MS, out)
    assert (nothing.written, nothing.deleted, nothing.runs) == (0, 0, [])


def test_archive_checksum_in_postgres_matches_spark_and_python(
    engine: Engine, settings: Settings
) -> None:
    producer = Producer(settings, engine)
    ids = [m.id for m in producer.send_batch([{"topic": "c.x", "body": n} for n in range(5)])]
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE commit_log SET status = 'cancelled', "
                "finished_at = now() - interval '2 days'"
            )
        )
    history.move_all(engine)
    with engine.begin() as conn:
        cutoff = pipeline_store.database_now(conn) - timedelta(days=1)
        assert pipeline_store.range_checksum(conn, ids[1], ids[3], None, cutoff) == (
            3,
            _md5_hash_sum(ids[1:4]),
        )


@pytest.mark.parametrize(
    ("point", "whole_day"),
    [("written", True), ("verified", True), *((point, False) for point in archive.CRASH_POINTS)],
)
def test_an_archive_run_killed_at_any_step_is_finished_exactly_once_by_the_next(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path, point: str, whole_day: bool
) -> None:
    """A whole day is dropped (no "deleting" step); the part of a day is deleted in batches."""
    archive_delete_batch = archive.DELETE_BATCH
    archive.DELETE_BATCH = 7  # several delete batches, so "deleting" stops halfway
    try:
        ids = _finished_messages(settings, engine, 20)
        older_than = 30 * DAY_MS if whole_day else _within_one_day(engine)
        out = tmp_path / "archive"
        with pytest.raises(archive.SimulatedCrash):
            archive.run(spark, settings, engine, older_than, out, crash_at=point)
        left = {"written": 23, "verified": 23, "deleting": 23 - 7}[point]
        assert _count(engine) == left
        resumed = archive.run(spark, settings, engine, older_than, out)
    finally:
        archive.DELETE_BATCH = archive_delete_batch
    assert resumed.written == (22 if point == "written" else 0)  # a verified copy is kept
    assert resumed.deleted == left - 1
    assert _archived_ids(spark, engine) == sorted(ids)  # each message exactly once
    assert _count(engine) == 1
    assert sorted(p.name for p in out.iterdir()) == ["run=1"]
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT id, status FROM pipeline_run ORDER BY id")).all()
    assert [tuple(r) for r in runs] == [(1, "succeeded")]


def test_archive_refuses_to_delete_when_the_copy_does_not_verify(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    _finished_messages(settings, engine, 5)
    out = tmp_path / "archive"
    with pytest.raises(archive.SimulatedCrash):
        archive.run(spark, settings, engine, 30 * DAY_MS, out, crash_at="verified")
    # the verified folder loses a file before the deletes resume
    victim = next((out / "run=1").glob("topic=archive.ok/*/*.parquet"))
    victim.unlink()
    with pytest.raises(DelaysvcError, match="missing or changed"):
        archive.run(spark, settings, engine, 30 * DAY_MS, out)
    assert _count(engine) == 8  # nothing deleted
    with engine.connect() as conn:
        status = conn.execute(text("SELECT status FROM pipeline_run WHERE id = 1")).scalar_one()
    assert status == "failed"


def test_a_day_that_changed_after_its_copy_was_verified_is_not_dropped_and_the_next_run_takes_it(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """Between the verified copy and the drop, a dead letter of that day is redriven out of
    the history: the drop sees the day is not what was copied, drops nothing and fails the
    run; the next run copies the day as it is now, each message once."""
    ids = _finished_messages(settings, engine, 10)
    dead = ids[-2]
    out = tmp_path / "archive"
    with pytest.raises(archive.SimulatedCrash):
        archive.run(spark, settings, engine, 30 * DAY_MS, out, crash_at="verified")
    assert DeadLetters(engine).redrive(dead).status == "ready"
    with pytest.raises(DelaysvcError, match="changed after its copy was verified"):
        archive.run(spark, settings, engine, 30 * DAY_MS, out)
    assert _count(engine) == 13  # nothing dropped
    assert not (out / "run=1").exists()

    again = archive.run(spark, settings, engine, 30 * DAY_MS, out)

    assert (again.written, again.deleted) == (11, 11)
    assert _archived_ids(spark, engine) == sorted(set(ids) - {dead})
    assert _count(engine) == 2  # the redriven message and the unfinished one
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT id, status FROM pipeline_run ORDER BY id")).all()
    assert [tuple(r) for r in runs] == [(1, "failed"), (2, "succeeded")]


def test_a_drop_waits_for_a_long_reader_of_the_history_or_stops_with_the_copy_verified(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report reading the history holds its days: the drop waits for it past the DDL's own
    2 s lock timeout; after DROP_PATIENCE the command stops saying why, its copy verified,
    and the next run drops the day. (The drop failed at the first lock timeout.)"""
    ids = _finished_messages(settings, engine, 10)
    out = tmp_path / "archive"
    with pytest.raises(archive.SimulatedCrash):
        archive.run(spark, settings, engine, 30 * DAY_MS, out, crash_at="verified")
    monkeypatch.setattr(archive, "DROP_PATIENCE", 3.0)
    with reading_the_history(engine), pytest.raises(DelaysvcError, match="kept it busy for 3 s"):
        archive.run(spark, settings, engine, 30 * DAY_MS, out)
    assert _count(engine) == 13  # nothing dropped

    monkeypatch.setattr(archive, "DROP_PATIENCE", 60.0)
    with reading_the_history(engine, seconds=4):
        result = archive.run(spark, settings, engine, 30 * DAY_MS, out)

    assert (result.runs, result.written, result.deleted) == ([1], 0, 12)
    assert _archived_ids(spark, engine) == sorted(ids)
    assert _count(engine) == 1  # the unfinished message


def test_an_archive_takes_what_finished_before_it_started_and_ends_while_more_finish(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--older-than 0s` on a busy system: each run it makes lets more messages finish (here
    one per run, swept into the history at once). The cutoff is taken once, so the archive
    ends with what had finished when it started; the newer ones wait for the next. (It took
    the cutoff afresh per run, and ran after the finishing messages for as long as they came.)"""
    ids = _finished_messages(settings, engine, 5)
    finish = archive._finish
    runs: list[int] = []

    def finish_and_one_more_finishes(job: Any, span: Any, recorded: str | None) -> None:
        runs.append(span.run_id)
        assert len(runs) <= 3, "the archive keeps chasing messages that finished after it began"
        finish(job, span, recorded)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO commit_log (topic, body, body_is_json, lane, status, "
                    "deliver_ts, finished_at) VALUES ('late', '', false, -1, 'succeeded', now(), "
                    "now())"
                )
            )
        history.move_all(engine)

    monkeypatch.setattr(archive, "_finish", finish_and_one_more_finishes)
    result = archive.run(spark, settings, engine, 0, tmp_path / "archive")

    assert len(runs) == 1  # the day 40 days ago; the late message finished after the cutoff
    assert _archived_ids(spark, engine) == sorted(ids)
    assert result.deleted == len(ids)
    assert _count(engine, "topic = 'late'") == 1  # still here, for the next archive


def test_archive_drops_the_days_it_copied_whole_and_leaves_the_history_small(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    _finished_messages(settings, engine, 10)
    result = archive.run(spark, settings, engine, 30 * DAY_MS, tmp_path / "archive")
    assert (result.written, result.deleted) == (12, 12)
    with engine.connect() as conn:
        days = [day.day for day in store_history.partitions(conn)]
    assert days == []  # the copied day is gone, not emptied


# ---------------------------------------------------------------- report


def test_report_counts_archived_and_live_messages_per_topic_level_and_hour(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    @handler("report.fails")
    def fails(message: Any) -> None:
        raise DeadLetter("no")

    _finished_messages(settings, engine, 8)  # 8 ok + 1 dead + 1 cancelled, 40 days ago
    with engine.begin() as conn:  # known lateness 10, 20, ..., 80 ms and durations 1..8 ms
        conn.execute(
            text(
                "UPDATE commit_log SET delivered_at = deliver_ts + (id * interval '10 ms'), "
                "duration_ms = id, finished_at = date_trunc('hour', finished_at) "
                "WHERE topic = 'archive.ok' AND status = 'succeeded'"
            )
        )
    archive.run(spark, settings, engine, 30 * DAY_MS, tmp_path / "archive")
    producer = Producer(settings, engine)
    producer.send_batch([{"topic": "report.fails", "body": n} for n in range(3)])
    Consumer(settings, engine).run_once("report.fails")
    result = report.run(spark, settings, engine, tmp_path / "report")
    assert (result.read, result.written) == (13, 4)
    with engine.connect() as conn:
        rows = {(r.topic, r.level): r for r in conn.execute(text("SELECT * FROM report_hourly"))}
    assert {key: (r.messages, r.dead, r.retried) for key, r in rows.items()} == {
        ("archive.ok", 0): (8, 0, 0),
        ("archive.dead", 0): (1, 1, 0),
        ("archive.other", -1): (1, 0, 0),  # cancelled from the timer lane: no level
        ("report.fails", 0): (3, 3, 0),
    }
    ok = rows[("archive.ok", 0)]
    assert [ok.lateness_p50_ms, ok.lateness_p95_ms, ok.lateness_max_ms] == [40.0, 80.0, 80.0]
    assert [ok.duration_p50_ms, ok.duration_p99_ms] == [4.0, 8.0]
    assert sorted(r["topic"] for r in spark.read.parquet(str(tmp_path / "report")).collect()) == [
        "archive.dead",
        "archive.ok",
        "archive.other",
        "report.fails",
    ]
    again = report.run(spark, settings, engine, tmp_path / "report")
    assert again.written == 4  # re-running replaces the hours, never adds
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM report_hourly")).scalar_one() == 4
        run_ids = conn.execute(text("SELECT DISTINCT run_id FROM report_hourly")).scalars().all()
    assert run_ids == [again.run_id]


# ---------------------------------------------------------------- bulk-schedule


BAD_ROWS = [
    ({"topic": "bad topic", "body": "{}"}, "topic"),
    ({"topic": "bulk.ok", "body": "{}", "delay": "5 minutes"}, "delay"),
    ({"topic": "bulk.ok", "body": "{}", "deliver_at": "2027-03-01T00:00:00"}, "deliver_at"),
    ({"topic": "bulk.ok", "body": "{}", "deliver_at": "2099-03-01T00:00:00+00:00"}, "deliver_at"),
    ({"topic": "bulk.ok", "body": "{}", "deliver_at": "tomorrow"}, "deliver_at"),
    ({"topic": "bulk.ok", "body": "{}", "delay": "5m", "delay_level": "2"}, "delay"),
    ({"topic": "bulk.ok", "body": "{}", "delay_level": "two"}, "delay_level"),
    ({"topic": "bulk.ok", "body": "{}", "delay_ms": "-5"}, "delay_ms"),
    ({"topic": "", "body": "{}"}, "topic"),
    ({"topic": "bulk.ok", "body": ""}, "body"),
    ({"topic": "bulk.ok", "body": "x" * 5_000_000}, "body"),  # over 4 MiB
    ({"topic": "bulk.ok", "body": "{}", "key": "k" * 1000}, "key"),
    ({"topic": "bulk.ok", "body": "{}", "properties": "{not json"}, "properties"),
    ({"topic": "bulk.ok", "body": "{}", "tags": "[1, 2]"}, "tags"),
    ({"topic": "bulk.ok", "body": "{}", "colour": "red"}, "colour"),
]
COLUMNS = ["topic", "body", "delay", "delay_ms", "delay_level", "deliver_at", "key", "tags"]
COLUMNS += ["properties", "colour"]


def test_bulk_schedule_a_csv_stores_the_good_rows_and_rejects_every_kind_of_bad_row(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    good = [
        {"topic": "bulk.ok", "body": '{"n": 1}', "delay": "5m", "key": "k1"},
        {"topic": "bulk.ok", "body": '{"n": 2}', "delay_level": "2", "key": "k2"},
        {
            "topic": "bulk.ok",
            "body": "plain text",
            "deliver_at": "2027-03-01T00:00:00+00:00",
            "key": "k3",
        },
        {
            "topic": "bulk.ok",
            "body": '{"n": 4}',
            "delay_ms": "2000",
            "key": "k4",
            "tags": '["a", "b"]',
        },
        {"topic": "bulk.ok", "body": '{"n": 5}', "key": "k5", "properties": '{"tenant": "7"}'},
        {"topic": "bulk.ok", "body": '{"n": 6}', "delay": "45m"},  # keyless
    ]
    rows = [*good[:3], *(r for r, _ in BAD_ROWS), *good[3:]]
    path = tmp_path / "jobs.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    first = bulk.run(spark, settings, path, partitions=3)
    assert (first.read, first.written, first.duplicates, first.rejected) == (21, 6, 0, 15)
    assert first.rejects == tmp_path / "jobs.rejects.csv"
    csv.field_size_limit(10_000_000)
    with (tmp_path / "jobs.rejects.csv").open() as f:
        rejects = list(csv.DictReader(f))
    assert list(rejects[0]) == [*COLUMNS, "reason"]
    reasons = sorted((r["reason"].split(":")[0], r["topic"], r["body"][:10]) for r in rejects)
    expected = sorted((field, r["topic"], r["body"][:10]) for r, field in BAD_ROWS)
    assert reasons == expected
    with engine.connect() as conn:
        stored = {
            r.key: (r.delay_level, r.lane, bytes(r.body), r.tags, r.properties)
            for r in conn.execute(text("SELECT * FROM commit_log"))
        }
        waiting = conn.execute(text("SELECT count(*) FROM consume_queue")).scalar_one()
        timers = conn.execute(text("SELECT count(*) FROM timer_queue")).scalar_one()
        skew = conn.execute(
            text(
                "SELECT max(abs(extract(epoch FROM deliver_ts - stored_at) - 2700)) "
                "FROM commit_log WHERE key IS NULL"
            )
        ).scalar_one()
    assert stored == {
        "k1": (None, 0, b'{"n":1}', None, None),
        "k2": (2, 2, b'{"n":2}', None, None),
        "k3": (None, 0, b'"plain text"', None, None),
        "k4": (2, 2, b'{"n":4}', ["a", "b"], None),  # 2000 ms is level 2's delay
        "k5": (0, -1, b'{"n":5}', None, {"tenant": "7"}),  # no delay: due now
        None: (None, 0, b'{"n":6}', None, None),
    }
    assert (waiting, timers) == (2, 3)
    assert float(skew) < 0.001  # deliver_ts = the database's store time + 45m

    again = bulk.run(spark, settings, path)
    assert (again.written, again.duplicates, again.rejected) == (1, 5, 15)  # keyless: again
    assert _count(engine) == 7


def test_bulk_schedule_json_lines_with_keys_from_rows_and_parquet_with_parquet_rejects(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    lines = tmp_path / "jobs.jsonl"
    lines.write_text(
        '{"topic": "bulk.j", "body": {"deep": [1, 2]}, "delay_level": 1}\n'
        "not json\n"
        "[1, 2]\n"
        '{"topic": "bulk.j", "body": "x", "delay_ms": 1500}\n'
        '{"topic": "bulk.j", "body": "x", "delay": "soon"}\n'
    )
    result = bulk.run(spark, settings, lines, key_from_row=True)
    assert (result.written, result.rejected) == (2, 3)
    rejects = [json.loads(line) for line in (tmp_path / "jobs.rejects.jsonl").open()]
    found = [(r.get("line", ""), r.get("delay", ""), r["reason"].split(":")[0]) for r in rejects]
    assert sorted(found) == [
        ("", "soon", "delay"),
        ("[1, 2]", "", "line"),
        ("not json", "", "line"),
    ]
    rerun = bulk.run(spark, settings, lines, key_from_row=True)
    assert (rerun.written, rerun.duplicates) == (0, 2)  # derived keys: no duplicates
    with engine.connect() as conn:
        body = conn.execute(text("SELECT body FROM commit_log WHERE delay_level = 1")).scalar_one()
    assert json.loads(bytes(body)) == {"deep": [1, 2]}

    table = tmp_path / "jobs.parquet"
    spark.createDataFrame(
        [
            ("bulk.p", '{"n": 1}', "1h", None, None),
            ("bulk.p", '{"n": 2}', None, 9, None),
            ("bulk.p", '{"n": 3}', None, None, datetime(2026, 12, 1, tzinfo=UTC)),
            ("bad topic", '{"n": 4}', None, None, None),
        ],
        "topic string, body string, delay string, delay_level int, deliver_at timestamp",
    ).write.parquet(str(table))
    parquet = bulk.run(spark, settings, table)
    assert (parquet.written, parquet.rejected) == (3, 1)
    refused = spark.read.parquet(str(tmp_path / "jobs.rejects.parquet")).collect()
    assert [(r["topic"], r["reason"].split(":")[0]) for r in refused] == [("bad topic", "topic")]
    with engine.connect() as conn:
        stored = conn.execute(
            text(
                "SELECT delay_level, deliver_ts FROM commit_log "
                "WHERE topic = 'bulk.p' ORDER BY body"
            )
        ).all()
    assert stored[1][0] == 5  # level 9 is clamped to the top level (5)
    assert stored[2][1] == datetime(2026, 12, 1, tzinfo=UTC)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_bulk_schedule_writes_many_rows_in_parallel_partitions_once(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path, fmt: str
) -> None:
    from delaysvc.pipeline.bench import bench_bulk

    result = bench_bulk(spark, settings, 30_000, tmp_path, fmt=fmt)
    assert (result["first"]["written"], result["rerun"]["duplicates"]) == (30_000, 30_000)
    # the ceiling's own inserts were rolled back: only the pipeline's rows are there
    assert _count(engine, "topic = 'bulk.bench'") == 30_000
    assert _count(engine, "key LIKE 'ceiling-%'") == 0
    assert result["ceiling_rows_per_s"] > 0
    assert result["first_of_ceiling"] == pytest.approx(
        result["first_rows_per_s"] / result["ceiling_rows_per_s"], abs=0.001
    )
    with engine.connect() as conn:
        lanes = dict(
            conn.execute(text("SELECT lane, count(*) FROM commit_log GROUP BY lane")).all()
        )
    assert lanes == {0: 30_000}  # 5m, 30m, 1h are no test level: the timer lane
    saved = json.loads((tmp_path / "bench-bulk.json").read_text())
    assert (saved["rows"], saved["format"]) == (30_000, fmt)
    # a second bench in the same database measures new rows too (keys of its own)
    again = bench_bulk(spark, settings, 3_000, tmp_path, fmt=fmt)
    assert (again["first"]["written"], again["rerun"]["duplicates"]) == (3_000, 3_000)


def test_a_batch_tried_as_all_new_falls_back_to_skipping_held_keys_in_the_same_transaction(
    producer: Producer, engine: Engine
) -> None:
    """The plain insert a task tries first fails on a held key (or a key twice in the batch);
    the batch is then stored by the skipping insert, from the same staging rows, and the
    caller's transaction goes on."""

    def lines(*keys: str | None) -> str:
        return "".join(
            bulk.message_line(producer.prepare(topic="bulk.k", body={"k": k}, delay="1s", key=k))
            for k in keys
        )

    with engine.begin() as conn:
        assert pipeline_store.insert_copy_text(conn, lines("a", "b"), keys_may_be_held=False) == 2
    with engine.begin() as conn:
        held = lines("b", "c", None, "d", "d")
        assert pipeline_store.insert_copy_text(conn, held, keys_may_be_held=False) == 3
        conn.execute(text("INSERT INTO topic_state (topic) VALUES ('bulk.k')"))  # still usable
    with engine.connect() as conn:
        keys = conn.execute(text("SELECT key FROM commit_log ORDER BY id")).scalars().all()
        lane_rows = conn.execute(text("SELECT count(*) FROM consume_queue")).scalar_one()
        paused = conn.execute(text("SELECT count(*) FROM topic_state")).scalar_one()
    assert sorted(k or "" for k in keys) == ["", "a", "b", "c", "d"]
    assert (lane_rows, paused) == (5, 1)


# ---------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["archive", "--older-than", "30 days"],
            "error: --older-than: '30 days' is not a duration",
        ),
        (
            ["bulk-schedule", "/nonexistent/jobs.csv"],
            "error: path: /nonexistent/jobs.csv does not exist",
        ),
        (
            ["bulk-schedule", "{tmp}/jobs.txt"],
            "error: format: 'txt' is not one of csv, jsonl, parquet",
        ),
        (
            ["bulk-schedule", "{tmp}/jobs.txt", "--format", "xml"],
            "error: format: 'xml' is not one of csv, jsonl, parquet",
        ),
    ],
)
def test_cli_user_errors_are_one_line_and_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    from delaysvc.cli import cli

    (tmp_path / "jobs.txt").write_text("topic,body\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = CliRunner().invoke(cli, ["pipeline", *args])
    assert result.exit_code == 2
    assert len(result.output.splitlines()) == 1, result.output
    assert result.output.startswith(message)


def test_cli_bulk_schedule_ends_with_one_summary_line(
    spark: Any, database_url: str, engine: Engine, tmp_path: Path
) -> None:
    from delaysvc.cli import cli

    path = tmp_path / "jobs.csv"
    path.write_text('topic,body,delay,key\nbulk.cli,"{""a"": 1}",5m,a\nbad topic,{},5m,b\n')
    env = {"DELAYSVC_DATABASE_URL": database_url, "DELAYSVC_DELAY_LEVELS": "1s 2s 3s 5s 8s"}
    result = CliRunner().invoke(cli, ["pipeline", "bulk-schedule", str(path)], env=env)
    assert result.exit_code == 0, result.output
    summary = result.stdout.strip().splitlines()
    assert len(summary) == 1
    assert "spark: master local[2]" in result.stderr  # which master ran it
    assert summary[0].startswith("bulk-schedule: read 2, written 1, rejected 1, ")
    assert summary[0].endswith(f"; duplicates 0; rejects -> {tmp_path / 'jobs.rejects.csv'}")
    assert _count(engine, "topic = 'bulk.cli'") == 1


# ---------------------------------------------------------------- one rule set, two paths

# Every kind of cell the producer's rules tell apart, per column ("" and None are both empty).
CELLS: dict[str, list[Any]] = {
    "topic": ["t.a", "t.slow", "a" * 127, "a" * 128, "bad topic", "-x", "x-", "ä", "t.a\n", ""],
    "body": [
        '{"n": 1}',
        "plain text",
        "[1, 2.50, 1e5, -0.0]",
        '  {"b": null, "a": "é\\u00e9"}  ',
        '"quoted"',
        "true",
        "NaN",
        "1e400",
        '"\\ud800"',
        "x" * 70,  # over the test's 64-byte limit as text...
        '"' + "y" * 40 + '"',  # ...and under it as JSON
        "[" * 5000,  # deeper than JSON can be read
        "a\tb\\c\nd",
        None,
        # bodies the JVM encodes itself, and near misses it must leave to the producer
        '{ "k" : "v w" ,"n": -12, "t": false, "z": null }',
        '[ "x" , 1 , true , null ]',
        ' "spaced string" ',
        "123456789012345678",
        "12345678901234567890",
        "{}",
        "[]",
        "-0",
        "01",
        "[1, -0]",
        '{"a": 1, "a": 2}',
        '{"a": [1]}',
        '{"é": "ü\x7f"}',
        '{"a": "b"}x',
        '{"a": "b\u0000"}',
        '{"x": "' + "y" * 58 + '"}',  # 65 bytes: over the test's limit
        '{"x": "' + "y" * 57 + '"}',  # 64 bytes: at it
    ],
    "delay": [
        "5m",
        "2s",
        "0s",
        "1h30m",
        "500ms",
        "1s1s",
        "3s",
        "401d",
        "5 minutes",
        "5",
        "9" * 20 + "d",
    ],
    "delay_ms": ["2000", "0", "3000", "7", " 7 ", "-5", "1.5", "9" * 20, "٣"],
    "delay_level": ["1", "0", "-3", "5", "99", " 3", "two", "²", "--5", "٣", "9" * 20],
    "deliver_at": [
        "2027-03-01T00:00:00+00:00",
        "2027-03-01 00:00Z",
        "2027-03-01T00:00:00.5+05:30",
        "2027-03-01T00:00:00.1234567-03:00",
        "2026-01-01T00:00:00-03:00",
        "1969-12-31T23:59:59Z",
        "2027-03-01T00:00:00",
        "2027-02-30T00:00:00Z",
        "2027-03-01T24:00:00Z",
        "2027-03-01T00:00:60Z",
        "2027-03-01T00:00:00+24:00",
        "20270301T000000Z",
        "2099-01-01T00:00:00Z",
        "tomorrow",
    ],
    "key": ["k1", "k\\2", "\\N", "NULL", "ключ", "k" * 256, "k" * 257, "a\tb", "k\x7f", " "],
    "tags": [
        '["a", "b"]',
        "[]",
        '["NULL"]',
        '[ "x:1" ,"y.z" ]',
        '["\\u0041"]',
        '["a b"]',
        "[1, 2]",
        '"a"',
        '{"a": "b"}',
        "[" + ",".join(f'"t{n}"' for n in range(17)) + "]",
        "not json",
    ],
    "properties": [
        '{"x": "1"}',
        "{}",
        '{"a": "1", "b": "ü\\u00fc"}',
        '{"x": "1", "x": "2"}',
        '{"": "v"}',
        '{"x": 1}',
        '{"a\\u0000": "v"}',
        '{"n": "' + "v" * 5000 + '"}',
        "[1]",
        "{not json",
    ],
    "colour": ["red"],
}
EQUIVALENCE_COLUMNS = [*bulk.FIELDS, "colour"]


def _one_change_rows() -> list[dict[str, Any]]:
    """A good row, then the good row with each cell above in turn (a wide hand-made table)."""
    base = {"topic": "t.a", "body": '{"n": 1}', "key": "base"}
    rows = [base]
    for column, values in CELLS.items():
        rows.extend({**base, column: value} for value in values)
        rows.append({**base, column: ""})
    return rows


def _decisions(
    spark: Any,
    settings: Settings,
    engine: Engine,
    records: list[dict[str, Any]],
    key_from_row: bool,
) -> tuple[dict[int, tuple[str | None, str | None]], dict[int, tuple[str | None, str | None]], int]:
    """-> ({row: (COPY line, reason)} by the Spark transform, the same by the producer's own
    `to_options` + `Producer.prepare`, how many rows the JVM accepted and encoded itself)."""
    from delaysvc.pipeline import rules

    schema = "_rid long, " + ", ".join(f"`{c}` string" for c in EQUIVALENCE_COLUMNS)
    frame = spark.createDataFrame(
        [(n, *(r.get(c) for c in EQUIVALENCE_COLUMNS)) for n, r in enumerate(records)], schema
    )
    producer = Producer(settings, engine)
    prepared = rules.prepare(frame, settings, key_from_row).collect()
    by_spark = {
        rid: (line, reason)
        for rid, line, reason in bulk.validate(prepared, producer, "csv", key_from_row)
    }
    by_producer: dict[int, tuple[str | None, str | None]] = {}
    now = datetime.now().astimezone()
    for n, record in enumerate(records):
        cells = {c: record.get(c) for c in EQUIVALENCE_COLUMNS}
        try:
            options = bulk.to_options(cells, key_from_row)
            by_producer[n] = (bulk.message_line(producer.prepare(**options, now=now)), None)
        except DelaysvcError as exc:
            by_producer[n] = (None, str(exc))
    return by_spark, by_producer, sum(1 for row in prepared if row["_line"])


def _stored_values(line: str) -> tuple[Any, ...]:
    """A COPY line as the values it stores (times as instants, JSON as values)."""
    fields = [
        None if f == "\\N" else f.replace("\\\\", "\\") for f in line.rstrip("\n").split("\t")
    ]
    topic, key, tags, props, level, lane, delay_ms, at, is_json, body = fields
    return (
        topic,
        key,
        tags,
        json.loads(props) if props is not None else None,
        level,
        lane,
        delay_ms,
        datetime.fromisoformat(at) if at is not None else None,
        is_json,
        body,
    )


def _assert_same(
    records: list[dict[str, Any]],
    by_spark: dict[int, tuple[str | None, str | None]],
    by_producer: dict[int, tuple[str | None, str | None]],
) -> None:
    assert set(by_spark) == set(by_producer) == set(range(len(records)))
    for n, record in enumerate(records):
        (spark_line, spark_reason), (producer_line, producer_reason) = by_spark[n], by_producer[n]
        assert spark_reason == producer_reason, record
        if producer_line is not None:
            assert spark_line is not None, record
            assert _stored_values(spark_line) == _stored_values(producer_line), record


def _equivalence_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"max_body_bytes": 64, "topic_delays": "t.slow=3s"})


def test_the_spark_transform_decides_every_kind_of_cell_as_the_producer_does(
    spark: Any, settings: Settings, engine: Engine
) -> None:
    settings = _equivalence_settings(settings)
    records = _one_change_rows()
    for key_from_row in (False, True):
        by_spark, by_producer, encoded = _decisions(spark, settings, engine, records, key_from_row)
        _assert_same(records, by_spark, by_producer)
        assert encoded > len(records) // 3  # the JVM decided and encoded most good rows
    accepted = sum(1 for line, _ in by_producer.values() if line)
    assert 0 < accepted < len(records)


_cell_strategy = {
    column: st.one_of(st.sampled_from(values), st.just(""), st.none())
    for column, values in CELLS.items()
}
_cell_strategy["key"] = st.one_of(_cell_strategy["key"], st.text(max_size=8))
_cell_strategy["body"] = st.one_of(_cell_strategy["body"], st.text(max_size=12))
_sparse = {
    c: (s if c in ("topic", "body") else st.one_of(st.none(), st.none(), s))
    for c, s in _cell_strategy.items()
}


@settings_(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(records=st.lists(st.fixed_dictionaries(_sparse), min_size=40, max_size=80))
def test_generated_rows_get_the_same_decision_and_values_from_spark_and_the_producer(
    spark: Any, settings: Settings, engine: Engine, records: list[dict[str, Any]]
) -> None:
    by_spark, by_producer, _ = _decisions(
        spark, _equivalence_settings(settings), engine, records, key_from_row=False
    )
    _assert_same(records, by_spark, by_producer)


def test_spark_and_producer_lines_store_the_same_rows(
    spark: Any, settings: Settings, engine: Engine
) -> None:
    """The accepted rows of the wide table stored from the Spark transform's COPY lines and
    by the producer's own insert (`store.insert_messages`) are the same rows."""
    from delaysvc import store as service_store

    settings = _equivalence_settings(settings)
    records = [
        {**r, "key": f"{n}-{r.get('key')}"} if r.get("key") else r
        for n, r in enumerate(_one_change_rows())
    ]
    by_spark, _, _ = _decisions(spark, settings, engine, records, key_from_row=False)
    producer = Producer(settings, engine)
    messages = []
    for record in records:
        try:
            messages.append(producer.prepare(**bulk.to_options(dict(record), False)))
        except DelaysvcError:
            continue
    absolute = {r["key"] for r in records if r.get("deliver_at") and r.get("key")}
    query = text(
        "SELECT topic, key, tags, body, body_is_json, properties, delay_level, lane, status, "
        "deliver_ts, round(extract(epoch FROM deliver_ts - stored_at) * 1000) AS wait_ms "
        "FROM commit_log"
    )

    def stored() -> list[tuple[str, ...]]:
        """Each row's values; its due time as an instant when it was given one, else as
        the wait from storing (the two inserts run at different times)."""
        with engine.begin() as conn:
            rows = [
                (*r[:9], r.deliver_ts if r.key in absolute else r.wait_ms)
                for r in conn.execute(query)
            ]
            conn.execute(
                text("TRUNCATE commit_log, consume_queue, timer_queue, topic_queue CASCADE")
            )
        return sorted(tuple(str(v) for v in r) for r in rows)

    with engine.begin() as conn:
        created = pipeline_store.insert_copy_text(
            conn, "".join(line for line, _ in by_spark.values() if line)
        )
    from_spark = stored()
    with engine.begin() as conn:
        service_store.insert_messages(conn, messages)
    assert created == len(messages) > 20
    assert from_spark == stored()


# ---------------------------------------------------------------- end to end


def test_end_to_end_bulk_schedule_then_delivered_by_real_workers_archived_and_reported(
    spark: Any, database_url: str, engine: Engine, tmp_path: Path
) -> None:
    """The issue's run at a small size, with the CLI commands: generated jobs ->
    `bulk-schedule` -> a real delivery worker, consumer and beat run them ->
    `archive --older-than 0s` -> `report`; the counts match at every step."""
    from delaysvc.cli import cli
    from delaysvc.pipeline import e2e
    from tests.conftest import TEST_LEVELS
    from tests.e2e.conftest import Service, wait_for

    rows = 3_000
    jobs = e2e.generate_jobs(spark, tmp_path / "jobs.parquet", rows)
    env = {"DELAYSVC_DATABASE_URL": database_url, "DELAYSVC_DELAY_LEVELS": TEST_LEVELS}

    def pipeline(*args: str) -> str:
        result = CliRunner().invoke(cli, ["pipeline", *args], env=env)
        assert result.exit_code == 0, result.output
        return result.stdout.strip().splitlines()[-1]

    assert pipeline("bulk-schedule", str(jobs)).startswith(
        f"bulk-schedule: read {rows}, written {rows}, rejected 0, "
    )
    assert pipeline("bulk-schedule", str(jobs)).endswith(
        "; duplicates 3000; rejects -> " + str(tmp_path / "jobs.rejects.parquet")
    )
    assert _count(engine, f"topic = '{e2e.TOPIC}' AND status = 'scheduled'") == rows

    service = Service(database_url, tmp_path / "var", engine, handlers="delaysvc.pipeline.e2e")
    service.start()
    try:
        wait_for(
            lambda: service.count_status("succeeded", e2e.TOPIC) == rows,
            120,
            f"{rows} jobs run",
            every=0.5,
        )
    finally:
        service.stop()
    with engine.connect() as conn:
        early = conn.execute(
            text("SELECT count(*) FROM message WHERE delivered_at < deliver_ts")
        ).scalar_one()
    assert early == 0  # none delivered before its time

    archived = pipeline("archive", "--older-than", "0s", "--out", str(tmp_path / "archive"))
    assert archived.startswith(f"archive: read {rows}, written {rows}, rejected 0, ")
    assert f"; deleted {rows} -> " in archived
    assert _count(engine) == 0
    archive_rows = spark.read.parquet(str(tmp_path / "archive"))
    assert archive_rows.where(f"topic = '{e2e.TOPIC}' AND status = 'succeeded'").count() == rows

    reported = pipeline("report", "--out", str(tmp_path / "report"))
    assert reported.startswith("report: read 3000, ")
    history = pipeline_store.recent_report_rows(engine, 24, topic=e2e.TOPIC)
    assert sum(r["messages"] for r in history) == rows
    assert {r["level"] for r in history} == {1, 2}
    assert all(r["dead_rate"] == 0 and r["lateness_p50_ms"] is not None for r in history)


class ExecutorLost(Exception):
    """The rows stop coming: the task's executor died mid-partition."""


def test_a_task_run_again_stores_none_of_the_batches_its_first_attempt_committed(
    settings: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keyless rows (no key rule to dedupe them): a first attempt commits two batches and
    dies in its third; the second attempt gets the same rows and stores only the rest."""
    monkeypatch.setattr(bulk, "BATCH", 10)
    producer = Producer(settings, engine)
    rows = [
        (rid, True, bulk.message_line(producer.prepare("bulk.retry", {"n": rid}, delay="1h")))
        for rid in range(100, 145)
    ]
    rows = [(rid, fast, line, None, None, None) for rid, fast, line in rows]

    def dying(after: int) -> Iterator[Any]:
        yield from rows[:after]
        raise ExecutorLost

    with pytest.raises(ExecutorLost):
        list(bulk.store_partition(dying(25), settings, "csv", False, "run-1"))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM commit_log")).scalar_one() == 20
    again = list(bulk.store_partition(iter(rows), settings, "csv", False, "run-1"))
    assert again[-1] == (bulk.COUNTS, 45, 0, None)  # what the run created, over both attempts
    with engine.connect() as conn:
        bodies = conn.execute(text("SELECT body FROM commit_log ORDER BY id")).scalars().all()
    assert sorted(json.loads(bytes(b))["n"] for b in bodies) == list(range(100, 145))
    # a batch of the same first row but other rows is refused, not stored in part again
    with pytest.raises(DelaysvcError, match="could store some rows twice"):
        list(bulk.store_partition(iter(rows[:5]), settings, "csv", False, "run-1"))
    with engine.begin() as conn:
        pipeline_store.forget_bulk_run(conn, "run-1")
        assert conn.execute(text("SELECT count(*) FROM bulk_batch")).scalar_one() == 0
