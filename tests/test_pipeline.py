"""The Spark pipeline with a real SparkSession (local[2]) and the real PostgreSQL: bulk
scheduling with rejects and no duplicates on a re-run; archiving that verifies before it
deletes and finishes a run a crash interrupted, archiving each message exactly once."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from delaysvc.consumption import Consumer, handler
from delaysvc.pipeline import archive, bulk
from delaysvc.producer import Producer
from delaysvc.settings import Settings


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from delaysvc.pipeline.spark import session

    spark = session("local[2]")
    yield spark
    spark.stop()


def _count(engine: Engine, where: str = "true") -> int:
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM commit_log WHERE {where}")).scalar_one()


def test_to_options_follows_the_producers_rules() -> None:
    options = bulk.to_options(
        {"topic": "t", "body": '{"a": 1}', "delay_level": "3", "key": "", "delay": None}, False
    )
    assert options == {"topic": "t", "body": {"a": 1}, "delay_level": 3}
    assert bulk.to_options({"topic": "t", "body": "plain"}, False)["body"] == "plain"
    keyed = bulk.to_options({"topic": "t", "body": "x"}, True)
    assert keyed["key"] == bulk.to_options({"topic": "t", "body": "x"}, True)["key"]
    with pytest.raises(Exception, match="delay_level"):
        bulk.to_options({"topic": "t", "body": "x", "delay_level": "soon"}, False)


def test_bulk_schedule_a_csv_stores_the_good_rows_and_rejects_the_bad(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    rows = [
        {"topic": "bulk.ok", "body": '{"n": 1}', "delay": "5m", "key": "k1"},
        {"topic": "bulk.ok", "body": '{"n": 2}', "delay_level": "2", "key": "k2"},
        {
            "topic": "bulk.ok",
            "body": "plain text",
            "deliver_at": "2027-03-01T00:00:00+00:00",
            "key": "k3",
        },
        {"topic": "bad topic", "body": "{}", "key": "k4"},
        {"topic": "bulk.ok", "body": "{}", "delay": "5 minutes", "key": "k5"},
        {"topic": "bulk.ok", "body": "{}", "deliver_at": "2027-03-01T00:00:00", "key": "k6"},
        {"topic": "bulk.ok", "body": '{"n": 7}', "key": "k7"},
    ]
    path = tmp_path / "jobs.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=["topic", "body", "delay", "delay_level", "deliver_at", "key"]
        )
        writer.writeheader()
        writer.writerows(rows)
    rejects = tmp_path / "rejects.jsonl"
    first = bulk.run(spark, settings, path, "csv", rejects, partitions=3)
    assert (first.read, first.written, first.duplicates, first.rejected) == (7, 4, 0, 3)
    reasons = sorted(json.loads(line)["reason"].split(":")[0] for line in rejects.open())
    assert reasons == ["delay", "deliver_at", "topic"]
    with engine.connect() as conn:
        stored = dict(conn.execute(text("SELECT key, delay_level FROM commit_log")).all())
    assert stored == {"k1": None, "k2": 2, "k3": None, "k7": 0}  # k7: due now

    again = bulk.run(spark, settings, path, "csv", rejects)
    assert (again.written, again.duplicates, again.rejected) == (0, 4, 3)
    assert _count(engine) == 4


def test_bulk_schedule_json_lines_and_parquet(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    lines = tmp_path / "jobs.jsonl"
    lines.write_text(
        '{"topic": "bulk.j", "body": {"deep": [1, 2]}, "delay_level": 1}\n'
        "not json\n"
        '{"topic": "bulk.j", "body": "x", "delay_ms": 1500}\n'
    )
    result = bulk.run(spark, settings, lines, "jsonl", tmp_path / "r1.jsonl", key_from_row=True)
    assert (result.written, result.rejected) == (2, 1)
    rerun = bulk.run(spark, settings, lines, "jsonl", tmp_path / "r1.jsonl", key_from_row=True)
    assert (rerun.written, rerun.duplicates) == (0, 2)  # derived keys: no duplicates

    table = tmp_path / "jobs.parquet"
    spark.createDataFrame(
        [("bulk.p", '{"n": 1}', "1h", None), ("bulk.p", '{"n": 2}', None, "9")],
        "topic string, body string, delay string, delay_level string",
    ).write.parquet(str(table))
    parquet = bulk.run(spark, settings, table, "parquet", tmp_path / "r2.jsonl")
    assert (parquet.written, parquet.rejected) == (2, 0)
    with engine.connect() as conn:
        levels = (
            conn.execute(
                text("SELECT delay_level FROM commit_log WHERE topic = 'bulk.p' ORDER BY id")
            )
            .scalars()
            .all()
        )
    assert sorted(levels, key=str) == [5, None]  # level 9 is clamped to the top level (5)


def _finished_messages(settings: Settings, engine: Engine, count: int) -> list[int]:
    """`count` messages that succeeded, were cancelled or died, finished 40 days ago."""

    @handler("archive.ok")
    def ok(message):  # type: ignore[no-untyped-def]
        return None

    producer = Producer(settings, engine)
    ids = [producer.send("archive.ok", {"n": n}).id for n in range(count)]
    Consumer(settings, engine).run_once("archive.ok", limit=count)
    cancelled = producer.send("archive.other", {}, delay="1h")
    producer.cancel(cancelled.id)
    with engine.begin() as conn:
        conn.execute(text("UPDATE commit_log SET finished_at = finished_at - interval '40 days'"))
    producer.send("archive.ok", {"n": "recent"}, delay="1h")  # unfinished: stays
    return [*ids, cancelled.id]


def _archived_ids(spark: Any, out: Path) -> list[int]:
    return sorted(r["id"] for r in spark.read.parquet(str(out / "run=*")).select("id").collect())


def test_archive_writes_verifies_then_deletes(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    ids = _finished_messages(settings, engine, 30)
    out = tmp_path / "archive"
    result = archive.run(spark, settings, engine, 30 * 86_400_000, out)
    assert (result.written, result.deleted) == (31, 31)
    assert _archived_ids(spark, out) == sorted(ids)
    assert _count(engine) == 1  # only the unfinished message is left
    topics = sorted(p.name for p in Path(result.folder or "").glob("topic=*"))
    assert topics == ["topic=archive.ok", "topic=archive.other"]
    with engine.connect() as conn:
        run = conn.execute(text("SELECT status, rows_written, checksum FROM pipeline_run")).one()
    assert (run.status, run.rows_written, run.checksum) == ("succeeded", 31, f"31:{sum(ids)}")
    nothing = archive.run(spark, settings, engine, 30 * 86_400_000, out)
    assert (nothing.written, nothing.deleted) == (0, 0)


def test_an_archive_run_killed_before_deleting_is_finished_by_the_next_run(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    ids = _finished_messages(settings, engine, 12)
    out = tmp_path / "archive"
    crashed = archive.run(spark, settings, engine, 30 * 86_400_000, out, stop_after="write")
    assert (crashed.written, crashed.deleted) == (13, 0)
    assert _count(engine) == 14  # nothing deleted yet
    resumed = archive.run(spark, settings, engine, 30 * 86_400_000, out)
    assert resumed.deleted == 13
    assert resumed.written == 0  # the verified folder was kept, not written twice
    assert _archived_ids(spark, out) == sorted(ids)  # each message exactly once
    assert _count(engine) == 1


def test_report_counts_archived_and_live_messages_per_topic_level_and_hour(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    from delaysvc.pipeline import report

    @handler("report.fails")
    def fails(message):  # type: ignore[no-untyped-def]
        from delaysvc.errors import DeadLetter

        raise DeadLetter("no")

    ids = _finished_messages(settings, engine, 8)  # 8 succeeded + 1 cancelled, 40 days ago
    out = tmp_path / "archive"
    archive.run(spark, settings, engine, 30 * 86_400_000, out)  # archived and deleted
    producer = Producer(settings, engine)
    for n in range(3):  # live: finished now, still in PostgreSQL
        producer.send("report.fails", {"n": n})
    Consumer(settings, engine).run_once("report.fails")
    result = report.run(spark, settings, engine, out, tmp_path / "report")
    assert result.read == len(ids) + 3
    with engine.connect() as conn:
        rows = {
            (r.topic, r.level): r for r in conn.execute(text("SELECT * FROM report_hourly")).all()
        }
    assert {key: row.messages for key, row in rows.items()} == {
        ("archive.ok", 0): 8,
        ("archive.other", -1): 1,  # cancelled from the timer lane: no level
        ("report.fails", 0): 3,
    }
    assert rows[("report.fails", 0)].dead == 3
    assert rows[("archive.ok", 0)].dead == 0
    assert rows[("archive.ok", 0)].lateness_p99_ms >= 0
    again = report.run(spark, settings, engine, out, tmp_path / "report")
    assert again.rows == result.rows  # re-running replaces the hours, never adds
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM report_hourly")).scalar_one() == 3
