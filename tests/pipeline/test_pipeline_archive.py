"""The Spark pipeline's archive and report, with one real SparkSession (local[2]) and the real test
PostgreSQL (read over JDBC): the transforms on tiny in-memory DataFrames; archive with a kill at
every step and a re-run (each message archived exactly once, nothing unarchived deleted); report
numbers against hand-computed percentiles."""

from __future__ import annotations

import json
import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, text

from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.errors import DeadLetter, DelaysvcError, ValidationError
from delaysvc.maintenance import history
from delaysvc.pipeline import archive, bulk, report
from delaysvc.pipeline import store as pipeline_store
from delaysvc.producer.dead_letters import DeadLetters
from delaysvc.producer.sending import Producer
from delaysvc.store import history as store_history
from delaysvc.worker.consumer import Consumer, handler
from tests.conftest import TEST_LEVELS
from tests.integration.test_history import reading_the_history
from tests.support.pipeline import DAY_MS, T0, _count, _md5_hash_sum, _nearest_rank


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
    return sorted(r["id"] for r in archive.read_folders(spark, folders).select("id").collect())


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
        cutoff = pipeline_store.transaction_now(conn) - timedelta(days=1)
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
    assert [re.fullmatch(r"run=1-[0-9a-f]{8}", p.name) is not None for p in out.iterdir()] == [True]
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
    victim = next(out.glob("run=1-*/topic=archive.ok/*/*.parquet"))
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
    assert list(out.glob("run=1-*")) == []

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


def test_the_report_reads_every_runs_folder_and_the_archive_keeps_topics_and_priorities(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """Found by a reviewer: from an archive's second run on, the report failed for good (two
    runs' folders, `run=...`, read in one call: CONFLICTING_DIRECTORY_STRUCTURES); a topic
    that looks like a number came back as one (`007` as 7), in the archive and the report; the
    archive kept no `priority` (nor `queue_offset`)."""
    producer = Producer(settings, engine)
    consumer = Consumer(settings, engine)
    out = tmp_path / "archive"
    for topic in ("007", "10"):  # one run each, every topic of a run a number to Spark
        handler(topic)(lambda message: None)
        producer.send_batch([{"topic": topic, "body": n, "priority": 7} for n in range(3)])
        assert consumer.run_once(topic, limit=3).succeeded == 3
        with engine.begin() as conn:
            conn.execute(text("UPDATE commit_log SET finished_at = now() - interval '40 days'"))
        assert len(archive.run(spark, settings, engine, 30 * DAY_MS, out).runs) == 1

    with engine.connect() as conn:
        folders = pipeline_store.verified_archive_folders(conn)
    assert len(folders) == 2
    archived = archive.read_folders(spark, folders)
    assert dict(archived.dtypes)["topic"] == "string"
    assert sorted((r["topic"], r["priority"]) for r in archived.collect()) == [
        ("007", 7),
        ("007", 7),
        ("007", 7),
        ("10", 7),
        ("10", 7),
        ("10", 7),
    ]
    result = report.run(spark, settings, engine, tmp_path / "report")
    assert (result.read, result.written) == (6, 2)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT topic, messages FROM report_hourly ORDER BY topic"))
        assert [tuple(r) for r in rows] == [("007", 3), ("10", 3)]


def _cancelled_messages(settings: Settings, engine: Engine, topic: str, count: int) -> list[int]:
    """`count` messages of `topic` cancelled 40 days ago."""
    producer = Producer(settings, engine)
    sent = producer.send_batch([{"topic": topic, "body": n, "delay": "1h"} for n in range(count)])
    for message in sent:
        producer.cancel(message.id)
    with engine.begin() as conn:
        conn.execute(text("UPDATE commit_log SET finished_at = finished_at - interval '40 days'"))
    return [m.id for m in sent]


def _runs(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r) for r in conn.execute(text("SELECT id, status FROM pipeline_run ORDER BY id"))
        ]


def test_two_databases_archiving_into_one_out_keep_each_others_runs(
    spark: Any, settings: Settings, engine: Engine, other_database_url: str, tmp_path: Path
) -> None:
    """Run ids restart at 1 in each database (or a re-created one): the second database's
    run 1 replaced the first's folder `run=1`, whose rows were already gone from PostgreSQL,
    and the first database's archive then held the second's messages."""
    out = tmp_path / "archive"
    first = _cancelled_messages(settings, engine, "db.first", 5)
    assert archive.run(spark, settings, engine, 30 * DAY_MS, out).deleted == 5
    other_settings = Settings(database_url=other_database_url, delay_levels=TEST_LEVELS)
    other_engine = make_engine(other_settings)
    try:
        second = _cancelled_messages(other_settings, other_engine, "db.second", 3)
        assert archive.run(spark, other_settings, other_engine, 30 * DAY_MS, out).deleted == 3
        assert _archived_ids(spark, other_engine) == sorted(second)
    finally:
        other_engine.dispose()
    assert _archived_ids(spark, engine) == sorted(first)
    assert len(list(out.iterdir())) == 2


def test_a_folder_in_a_runs_place_that_the_run_did_not_write_is_refused_and_kept(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """Only a folder holding its own run's marker (a write a crash cut short) is replaced."""
    _finished_messages(settings, engine, 5)
    out = tmp_path / "archive"
    with pytest.raises(archive.SimulatedCrash):
        archive.run(spark, settings, engine, 30 * DAY_MS, out, crash_at="written")
    (folder,) = out.iterdir()
    (folder / archive.MARKER).write_text("another run's token")
    (folder / "keep.txt").write_text("not ours")
    with pytest.raises(ValidationError, match="was not written by this run; left as it is"):
        archive.run(spark, settings, engine, 30 * DAY_MS, out)
    assert (folder / "keep.txt").read_text() == "not ours"
    assert (folder / archive.MARKER).read_text() == "another run's token"
    assert _count(engine) == 8  # nothing deleted
    assert _runs(engine) == [(1, "failed")]

    again = archive.run(spark, settings, engine, 30 * DAY_MS, out)

    assert (again.runs, again.written, again.deleted) == ([2], 7, 7)
    assert (folder / "keep.txt").read_text() == "not ours"
    assert _runs(engine) == [(1, "failed"), (2, "succeeded")]


def test_a_run_killed_while_deleting_is_finished_from_its_recorded_folder_from_another_directory(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default --out is relative (var/archive): the run records its folder's absolute
    path, and the next run, started elsewhere, finishes the deletes from it. (The relative path
    was recorded, so the report from elsewhere found nothing; the next run looked in its own
    --out and failed on every run, the deletes never finished.)"""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    archive_delete_batch = archive.DELETE_BATCH
    archive.DELETE_BATCH = 7
    try:
        ids = _finished_messages(settings, engine, 20)
        older_than = _within_one_day(engine)
        monkeypatch.chdir(first)
        with pytest.raises(archive.SimulatedCrash):
            archive.run(
                spark, settings, engine, older_than, Path("var/archive"), crash_at="deleting"
            )
        with engine.connect() as conn:
            (recorded,) = conn.execute(text("SELECT output_path FROM pipeline_run")).scalars()
        assert Path(recorded).parent == first / "var" / "archive"
        monkeypatch.chdir(second)
        resumed = archive.run(spark, settings, engine, older_than, Path("var/archive"))
    finally:
        archive.DELETE_BATCH = archive_delete_batch
    assert (resumed.runs, resumed.folders, resumed.deleted) == ([1], [recorded], 23 - 7 - 1)
    assert _archived_ids(spark, engine) == sorted(ids)
    assert _count(engine) == 1
    assert _runs(engine) == [(1, "succeeded")]
    assert list((second / "var" / "archive").iterdir()) == []  # made, nothing written there


def test_a_verified_folder_gone_missing_fails_its_run_and_the_next_run_archives_its_rows(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """(It failed with Spark's PATH_NOT_FOUND on every run, the run stayed running, and the
    report listed the missing folder.)"""
    ids = _finished_messages(settings, engine, 10)
    out = tmp_path / "archive"
    with pytest.raises(archive.SimulatedCrash):
        archive.run(spark, settings, engine, 30 * DAY_MS, out, crash_at="verified")
    (folder,) = out.iterdir()
    shutil.rmtree(folder)
    with pytest.raises(DelaysvcError, match="missing or changed"):
        archive.run(spark, settings, engine, 30 * DAY_MS, out)
    assert _count(engine) == 13  # nothing dropped
    assert _runs(engine) == [(1, "failed")]
    with engine.connect() as conn:
        assert pipeline_store.verified_archive_folders(conn) == []

    again = archive.run(spark, settings, engine, 30 * DAY_MS, out)

    assert (again.runs, again.written, again.deleted) == ([2], 12, 12)
    assert _archived_ids(spark, engine) == sorted(ids)
    assert _count(engine) == 1
    assert _runs(engine) == [(1, "failed"), (2, "succeeded")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--out", "/proc/delaysvc-archive"],
            "error: --out: cannot write into /proc/delaysvc-archive",
        ),
        (["--older-than", "3651d"], "error: --older-than: '3651d' is more than 3650d"),
        (["--older-than", "3000000d"], "error: --older-than: '3000000d' is more than 3650d"),
        (["--older-than", "10000000000000d"], "error: --older-than: '10000000000000d' is more"),
    ],
)
def test_archive_refuses_an_out_it_cannot_write_or_a_too_long_older_than_in_one_line(
    database_url: str, tmp_path: Path, args: list[str], message: str
) -> None:
    """Before Spark starts (its error was pages of Java; the overflow a Python traceback).
    /proc: root may write anywhere else."""
    from delaysvc.cli import cli

    args = ["--out", str(tmp_path / "archive"), *args]  # the last --out is taken
    env = {"DELAYSVC_DATABASE_URL": database_url, "DELAYSVC_DELAY_LEVELS": TEST_LEVELS}
    result = CliRunner().invoke(cli, ["pipeline", "archive", *args], env=env)
    assert result.exit_code == 2, result.output
    assert len(result.output.splitlines()) == 1, result.output
    assert result.output.startswith(message)
