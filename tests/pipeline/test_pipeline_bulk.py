"""The Spark pipeline's bulk scheduling: bad rows of every kind, every format, parallel partitions
written once, the CLI, and one rule set on two paths (Spark's transform and the producer decide
every cell alike)."""

from __future__ import annotations

import csv
import json
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given
from hypothesis import settings as settings_
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from delaysvc.config.settings import Settings
from delaysvc.errors import DatabaseUnavailable, DelaysvcError, SchemaNotReady, ValidationError
from delaysvc.pipeline import bulk, extract
from delaysvc.pipeline import rejects as pipeline_rejects
from delaysvc.pipeline import store as pipeline_store
from delaysvc.producer.sending import Producer
from tests.support.pipeline import _count

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
    # a time ahead (2026-12-01 was, when this was written: a time past is the store time now)
    ahead = datetime.now(UTC).replace(microsecond=0) + timedelta(days=30)
    spark.createDataFrame(
        [
            ("bulk.p", '{"n": 1}', "1h", None, None),
            ("bulk.p", '{"n": 2}', None, 9, None),
            ("bulk.p", '{"n": 3}', None, None, ahead),
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
    assert stored[2][1] == ahead


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_bulk_schedule_writes_many_rows_in_parallel_partitions_once(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path, fmt: str
) -> None:
    from delaysvc.pipeline.bulk_bench import bench_bulk

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


def test_a_reject_cap_refuses_the_rows_it_covers_not_the_rest_of_their_batch(
    producer: Producer, engine: Engine, settings: Settings
) -> None:
    """A batch holding 20 rows of a topic capped at 10 (reject) and 5 of a topic no cap covers
    was refused whole, the free topic's rows with the capped one's reason (found by a
    reviewer). Only the capped topic's rows are refused now, the rest stored; a task run again
    (the same run's batches) stores nothing twice and refuses the same rows."""
    from delaysvc.producer import caps

    caps.set_cap(engine, "topic", "bulk.capped", 10)
    topics = ["bulk.capped"] * 20 + ["bulk.free"] * 5
    topics[3], topics[21] = topics[21], topics[3]  # the free rows among the capped ones
    rows = [
        (rid, True, bulk.message_line(producer.prepare(topic, {"n": rid}, delay="1h")))
        for rid, topic in enumerate(topics)
    ]
    rows = [(rid, fast, line, None, None, None) for rid, fast, line in rows]
    for _ in range(2):  # the second: the task run again
        report = list(bulk.store_partition(iter(rows), settings, "csv", False, "caps"))
        refused = {rid: reason for tag, rid, _, reason in report if tag == bulk.REJECT}
        assert sorted(refused) == [rid for rid, topic in enumerate(topics) if topic != "bulk.free"]
        assert all(
            reason.startswith("backlog_full: topic bulk.capped holds 0 waiting messages")
            for reason in refused.values()
        )
        assert report[-1] == (bulk.COUNTS, 5, 0, None)
        with engine.connect() as conn:
            stored = conn.execute(text("SELECT topic, count(*) FROM commit_log GROUP BY topic"))
            assert dict(stored.all()) == {"bulk.free": 5}


def test_under_a_full_reject_cap_a_row_whose_key_is_held_is_a_duplicate_not_a_refusal(
    producer: Producer, engine: Engine, settings: Settings
) -> None:
    """Found by a reviewer: a file sent again under a full cap listed rows whose messages
    were scheduled by the first run as refused (`backlog_full`), beside the new rows."""
    from delaysvc.producer import caps

    held = [producer.send("bulk.full", {"n": n}, delay="1h", key=f"k{n}") for n in range(3)]
    caps.set_cap(engine, "topic", "bulk.full", 3)  # full
    rows = [
        bulk.message_line(producer.prepare("bulk.full", {"n": n}, delay="1h", key=f"k{n}"))
        for n in range(5)  # k0-k2 held, k3 and k4 new
    ]
    report = list(
        bulk.store_partition(
            iter([(rid, True, line, None, None, None) for rid, line in enumerate(rows)]),
            settings,
            "csv",
            False,
            "full",
        )
    )
    refused = sorted(rid for tag, rid, _, _ in report if tag == bulk.REJECT)
    assert refused == [3, 4]
    assert report[-1] == (bulk.COUNTS, 0, 3, None)
    assert all(producer.get(m.id).status == "scheduled" for m in held)


def test_json_lines_rejects_are_json_with_each_value_as_the_line_spelled_it(
    tmp_path: Path,
) -> None:
    """A rejected line was parsed and dumped again: `1e400` came out as `Infinity` (no JSON:
    strict readers such as jq refuse the file) and `1e3` as `1000.0` (found by a reviewer).
    A line that is a JSON object keeps its text, its reason added; any other line (not JSON,
    or Python's NaN) is kept whole as a string under `line`."""
    lines = [
        '{"topic": "j.ok", "body": 1e400, "key": "j5"}',
        '{"topic":"j.ok","body":{},"delay_ms":1e3,"reason":"mine"}',
        '{"topic": "j.ok", "body": NaN}',
        "[1, 2]",
        "{}",
    ]
    path = tmp_path / "in.rejects.jsonl"
    pipeline_rejects.write_rejects([("why", line) for line in lines], [], "jsonl", path)
    written = path.read_text().splitlines()
    strict = [json.loads(line, parse_constant=_refused) for line in written]
    assert [value["reason"] for value in strict] == ["why"] * 5
    assert written[0] == '{"topic": "j.ok", "body": 1e400, "key": "j5", "reason": "why"}'
    assert '"delay_ms":1e3' in written[1] and strict[1]["reason"] == "why"
    assert strict[2] == {"line": lines[2], "reason": "why"}
    assert strict[3] == {"line": "[1, 2]", "reason": "why"}
    assert strict[4] == {"reason": "why"}


def _refused(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def test_a_batch_deadlocked_with_another_writer_of_its_keys_is_stored_again(
    producer: Producer, engine: Engine, settings: Settings
) -> None:
    """A batch inserts its keys in (topic, key) order; another transaction held its key `b`
    and then asked for its `a`: PostgreSQL broke the deadlock by rolling the batch back, and
    the whole bulk-schedule failed with a traceback (found by a reviewer: a `send_batch` of the
    same keys in its own order, 3 of 3 runs). The batch is now stored again: here it finds
    both keys held."""
    lines = [
        bulk.message_line(producer.prepare(topic="bulk.dl", body={"k": k}, delay="1h", key=k))
        for k in ("a", "b")
    ]
    rows = [(rid, True, line, None, None, None) for rid, line in enumerate(lines)]
    done: dict[str, Any] = {}

    def store() -> None:
        try:
            done["report"] = list(bulk.store_partition(iter(rows), settings, "csv", False, "dl"))
        except BaseException as exc:  # asserted below
            done["error"] = exc

    with engine.connect() as other:
        other.begin()
        # PostgreSQL rolls back the transaction whose wait it checks first: the batch's
        other.execute(text("SET LOCAL deadlock_timeout = '30s'"))
        producer.send("bulk.dl", "other", delay="1h", key="b", connection=other)
        batch = threading.Thread(target=store)
        batch.start()
        deadline = time.monotonic() + 30
        with engine.connect() as watch:
            while not watch.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                )
            ).scalar_one():
                watch.rollback()
                assert time.monotonic() < deadline, "the batch never waited on key b"
                time.sleep(0.01)
        producer.send("bulk.dl", "other", delay="1h", key="a", connection=other)
        other.commit()
    batch.join(timeout=60)
    assert "error" not in done, done["error"]
    assert done["report"][-1] == (bulk.COUNTS, 0, 2, None)
    with engine.connect() as conn:
        bodies = conn.execute(text("SELECT body FROM commit_log WHERE topic = 'bulk.dl'")).all()
    assert len(bodies) == 2


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
        # refused before Spark starts: its start printed lines before the error
        (
            ["bulk-schedule", "{tmp}/jobs.csv", "--rejects", "/proc/x.csv"],
            "error: rejects: /proc/x.csv cannot be written",
        ),
        (
            ["bulk-schedule", "{tmp}/jobs.csv", "--rejects", "{tmp}"],
            "error: rejects: {tmp} is the input {tmp}/jobs.csv, holds it or is inside it",
        ),
        # Spark logged ~40 lines of Java before the one line (found by a reviewer)
        (
            ["bulk-schedule", "{tmp}/fake.parquet"],
            "error: path: {tmp}/fake.parquet is not a Parquet file (it does not begin and end "
            "with PAR1); give --format csv or jsonl for other files",
        ),
        (
            ["bulk-schedule", "{tmp}/empty", "--format", "parquet"],
            "error: path: {tmp}/empty holds no Parquet files (none but hidden or empty ones)",
        ),
    ],
)
def test_cli_user_errors_are_one_line_and_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    from delaysvc.cli import cli

    (tmp_path / "jobs.txt").write_text("topic,body\n")
    (tmp_path / "jobs.csv").write_text("topic,body\n")
    (tmp_path / "fake.parquet").write_text("topic,body\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "part-0.parquet").write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
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


def test_bulk_schedule_never_deletes_a_rejects_folder_it_did_not_make(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """--rejects naming a folder of the user's (here the one holding the input) is refused
    before anything is stored; an earlier rejects folder is written over, nothing else in it
    touched."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mydata"
    folder.mkdir()
    table = folder / "jobs.parquet"
    pq.write_table(pa.table({"topic": ["bulk.rm", "bad topic"], "body": ["{}", "{}"]}), table)
    (folder / "other-file.txt").write_text("important")
    for rejects in (folder, folder / "other-file.txt", table):
        with pytest.raises(ValidationError, match=r"^rejects: "):
            bulk.run(spark, settings, table, rejects=rejects)
    assert sorted(p.name for p in folder.iterdir()) == ["jobs.parquet", "other-file.txt"]
    assert (folder / "other-file.txt").read_text() == "important"
    assert _count(engine) == 0

    earlier = tmp_path / "earlier.rejects.parquet"
    for _ in range(2):  # the second run writes over the first's rejects folder
        result = bulk.run(spark, settings, table, rejects=earlier)
        assert (result.written + result.duplicates, result.rejected) == (1, 1)
        assert [p.name for p in earlier.iterdir()] == [pipeline_rejects.PARQUET_PART]
        refused = pq.read_table(earlier).to_pylist()
        assert [(r["topic"], r["reason"].split(":")[0]) for r in refused] == [
            ("bad topic", "topic")
        ]


@pytest.mark.parametrize("rejects", ["/proc/jobs.rejects.csv", "{tmp}/a-folder"])
def test_bulk_schedule_refuses_rejects_it_cannot_write_before_storing_anything(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path, rejects: str
) -> None:
    (tmp_path / "a-folder").mkdir()
    path = tmp_path / "jobs.csv"
    path.write_text("topic,body,key\nbulk.rj,{},good-1\nbad topic,{},bad-1\n")
    with pytest.raises(ValidationError, match=r"^rejects: .*(cannot be written|is a folder)"):
        bulk.run(spark, settings, path, rejects=Path(rejects.replace("{tmp}", str(tmp_path))))
    assert _count(engine) == 0


def test_bulk_schedule_json_lines_bodies_are_the_lines_values_as_they_are(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """A JSON string body stays a string, whatever its text spells (as Producer.send)."""
    bodies = ["42", "true", '{"a": 1}', "null", "NaN", "hello", 42, {"a": 1}]
    path = tmp_path / "jobs.jsonl"
    path.write_text(
        "".join(
            json.dumps({"topic": "bulk.s", "key": f"s{n}", "body": b}) + "\n"
            for n, b in enumerate(bodies)
        )
    )
    result = bulk.run(spark, settings, path)
    assert (result.written, result.rejected) == (len(bodies), 0)
    with engine.connect() as conn:
        stored = dict(conn.execute(text("SELECT key, body FROM commit_log")).all())
    assert {k: json.loads(bytes(b)) for k, b in stored.items()} == {
        f"s{n}": b for n, b in enumerate(bodies)
    }


def test_bulk_schedule_csv_bodies_that_are_not_json_are_text(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """NaN, Infinity, -Infinity and 1e400 (Python's parser takes them, JSON has not) are text,
    as `delaysvc send` stores them."""
    bodies = ["NaN", "Infinity", "-Infinity", "1e400", "[1, NaN]", '{"a": -1e999}', "1e300"]
    path = tmp_path / "jobs.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["topic", "body", "key"])
        writer.writerows(["bulk.n", b, f"n{n}"] for n, b in enumerate(bodies))
    result = bulk.run(spark, settings, path)
    assert (result.written, result.rejected) == (len(bodies), 0)
    with engine.connect() as conn:
        stored = dict(conn.execute(text("SELECT key, body FROM commit_log")).all())
    assert {k: bytes(b) for k, b in stored.items()} == {
        **{f"n{n}": json.dumps(b).encode() for n, b in enumerate(bodies[:-1])},
        "n6": b"1e+300",
    }


def test_bulk_schedule_refuses_bytes_that_are_not_utf8_rather_than_store_them_changed(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """Spark reads a byte that is not UTF-8 (a Windows-1252 export's é) as U+FFFD and says
    nothing: `caf\xe9` was stored as `"caf�"`, and keys were changed alike, so two keys
    could become one (found by a reviewer). Such a row is refused, naming its cell."""
    csv_path = tmp_path / "latin1.csv"
    csv_path.write_bytes(
        b"topic,body,key\r\nb.ok,plain,c0\r\nb.ok,caf\xe9,c1\r\nb.ok,x,k\xe9y\r\n"
        b'b.ok,"line1\r\nline2",c3\r\n'
    )
    result = bulk.run(spark, settings, csv_path)
    assert (result.written, result.rejected) == (2, 2)
    with (tmp_path / "latin1.rejects.csv").open(newline="") as f:
        reasons = {row["body"]: row["reason"] for row in csv.DictReader(f)}
    assert reasons["caf\ufffd"].startswith(
        "body: holds U+FFFD, put where the input's bytes are not UTF-8"
    )
    assert reasons["x"].startswith("key: holds U+FFFD")
    jsonl_path = tmp_path / "latin1.jsonl"
    jsonl_path.write_bytes(
        b'{"topic": "b.j", "body": "caf\xe9", "key": "j1"}\n{"topic": "b.j", "body": 1}\n'
    )
    result = bulk.run(spark, settings, jsonl_path)
    assert (result.written, result.rejected) == (1, 1)
    rejected = json.loads((tmp_path / "latin1.rejects.jsonl").read_text())
    assert rejected["reason"].startswith("line: holds U+FFFD")
    with engine.connect() as conn:
        bodies = conn.execute(text("SELECT body FROM commit_log")).scalars().all()
    # and a CR LF inside a quoted cell of a file whose rows end in CR LF (RFC 4180) is kept:
    # Spark made it LF
    assert sorted(bytes(b) for b in bodies) == sorted([b"1", b'"line1\\r\\nline2"', b'"plain"'])


def test_bulk_schedule_refuses_a_csv_row_of_more_cells_than_the_header(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """An unquoted comma in a body makes one cell more: the row is refused, not stored with
    its cells shifted; a row of fewer cells is the row with its last cells empty."""
    path = tmp_path / "ragged.csv"
    path.write_text(
        "topic,body,key\n"
        'bulk.r,{"a":1,"b":2},order-1\n'
        'bulk.r,{"a":1},order-2,extra-cell\n'
        'bulk.r,"{""a"":3}"\n'
        'bulk.r,"{""a"":4}",order-4\n'
    )
    result = bulk.run(spark, settings, path)
    assert (result.written, result.rejected) == (2, 2)
    with (tmp_path / "ragged.rejects.csv").open() as f:
        rejects = list(csv.DictReader(f))
    assert list(rejects[0]) == ["topic", "body", "key", "reason"]
    assert [r["reason"] for r in rejects] == [
        "row: has 4 cells, the header 3 (an unquoted comma in a cell? quote the cell)"
    ] * 2
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT key, body FROM commit_log ORDER BY body")).all()
    assert [(k, bytes(b)) for k, b in stored] == [(None, b'{"a":3}'), ("order-4", b'{"a":4}')]
    empty = tmp_path / "empty.csv"  # no header, no rows
    empty.write_text("")
    assert bulk.run(spark, settings, empty).read == 0


def test_bulk_schedule_refuses_a_parquet_deliver_at_without_a_time_zone(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """A TIMESTAMP_NTZ (pandas' and pyarrow's naive datetime) is refused as the same time
    in a CSV is; a TIMESTAMP (an instant) is that instant on either path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    at = datetime(2027, 3, 1, 12, 0)
    naive = tmp_path / "naive.parquet"
    pq.write_table(
        pa.table(
            {
                "topic": ["bulk.at"],
                "body": ["{}"],
                "key": ["naive-1"],
                "deliver_at": pa.array([at], pa.timestamp("us")),
            }
        ),
        naive,
    )
    result = bulk.run(spark, settings, naive)
    assert (result.written, result.rejected) == (0, 1)
    refused = pq.read_table(tmp_path / "naive.rejects.parquet").to_pylist()
    assert [r["reason"].split(" (")[0] for r in refused] == ["deliver_at: must be timezone-aware"]

    aware = tmp_path / "aware.parquet"
    pq.write_table(
        pa.table(
            {
                "topic": ["bulk.at", "bulk.at"],
                "body": ["{}", "[]"],
                "key": ["fast", None],  # keyless + --key-from-row: the producer's path
                "deliver_at": pa.array([at.replace(tzinfo=UTC)] * 2, pa.timestamp("us", "UTC")),
            }
        ),
        aware,
    )
    result = bulk.run(spark, settings, aware, key_from_row=True)
    assert (result.written, result.rejected) == (2, 0)
    with engine.connect() as conn:
        times = conn.execute(text("SELECT deliver_ts FROM commit_log")).scalars().all()
    assert times == [at.replace(tzinfo=UTC)] * 2


def test_bulk_schedule_takes_any_offset_a_send_takes_and_structs_at_any_depth(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """Found by a reviewer: a `deliver_at` offset beyond PostgreSQL's text input (+16:00, as a
    send takes it) failed the whole COPY, the rows after it unstored; a Parquet body holding
    structs in a list came back with each struct an array (`[{"a": 1}]` as `[[1]]`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jobs = tmp_path / "offsets.csv"
    with jobs.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["topic", "body", "key", "deliver_at"])
        writer.writerow(["bulk.tz", "{}", "plain", "2027-01-01T09:00:00+00:00"])
        writer.writerow(["bulk.tz", "{}", "far-east", "2027-01-01T09:00:00+1600"])
        writer.writerow(["bulk.tz", "{}", "far-west", "2027-01-01T09:00:00-16:30"])
    result = bulk.run(spark, settings, jobs)
    assert (result.written, result.rejected) == (3, 0)
    with engine.connect() as conn:
        due = dict(conn.execute(text("SELECT key, deliver_ts FROM commit_log")).all())
    nine = datetime(2027, 1, 1, 9, tzinfo=UTC)
    assert due == {
        "plain": nine,
        "far-east": nine - timedelta(hours=16),
        "far-west": nine + timedelta(hours=16, minutes=30),
    }

    nested = tmp_path / "nested.parquet"
    pair = pa.struct([("a", pa.int64()), ("b", pa.string())])
    bodies = [[{"a": 1, "b": "x"}], [{"a": 2, "b": "y"}, {"a": 3, "b": None}]]
    table = pa.table(
        {
            "topic": ["bulk.nested"] * 2,
            "body": pa.array(bodies, pa.list_(pair)),
            "key": ["n1", "n2"],
        }
    )
    pq.write_table(table, nested)
    assert bulk.run(spark, settings, nested).written == 2
    producer = Producer(settings, engine)
    stored = [producer.find("bulk.nested", key).body for key in ("n1", "n2")]
    assert stored == bodies


def test_a_key_repeated_in_a_file_stores_its_first_valid_row_as_send_batch_does(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """Found by a reviewer: 2,269 of 5,000 keys, each on two rows, kept the later row's body
    and delay; an earlier row left to the producer's path (a JSON escape in its tags) always
    lost to a later one the JVM took; a row refused does not hold its key."""
    jobs = tmp_path / "repeats.csv"
    with jobs.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["topic", "body", "key", "delay", "tags"])
        for n in range(2000):
            writer.writerow(["bulk.rep", '"first"', f"k{n}", "1h", ""])
            writer.writerow(["bulk.rep", '"second"', f"k{n}", "5s", ""])
        for n in range(50):  # the first row the producer's path's, the second the JVM's
            writer.writerow(["bulk.rep", '"first"', f"slow{n}", "1h", '["\\u0061"]'])
            writer.writerow(["bulk.rep", '"second"', f"slow{n}", "5s", ""])
        writer.writerow(["bulk.rep", '"refused"', "bad", "soon", ""])  # holds nothing
        writer.writerow(["bulk.rep", '"second"', "bad", "5s", ""])
    result = bulk.run(spark, settings, jobs, partitions=3)
    assert (result.written, result.duplicates, result.rejected) == (2051, 2050, 1)
    with engine.connect() as conn:
        stored = dict(
            conn.execute(text("SELECT key, convert_from(body, 'UTF8') FROM commit_log")).all()
        )
    assert stored.pop("bad") == '"second"'
    assert set(stored.values()) == {'"first"'}, sum(v != '"first"' for v in stored.values())

    lines = tmp_path / "repeats.jsonl"  # every line the producer's path's
    with lines.open("w") as f:
        f.write("\n   \n\t\n")  # blank lines are no records (they were rejects: "not JSON")
        for n in range(2000):
            for body in ("first", "second"):
                f.write(json.dumps({"topic": "bulk.rep.j", "body": body, "key": f"j{n}"}) + "\n")
    result = bulk.run(spark, settings, lines, partitions=3)
    assert (result.read, result.written, result.duplicates, result.rejected) == (
        4000,
        2000,
        2000,
        0,
    )
    with engine.connect() as conn:
        distinct = "SELECT DISTINCT convert_from(body, 'UTF8') FROM commit_log WHERE topic = %r"
        bodies = conn.execute(text(distinct % "bulk.rep.j")).scalars().all()
    assert bodies == ['"first"']


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_keyless_rows_are_spread_over_every_partition(spark: Any, tmp_path: Path, fmt: str) -> None:
    """Found by a reviewer: spread by range of (topic, key), rows of one topic and no key
    were one range, and one task stored the whole file (28 s against 20 s on 2 cores)."""
    from pyspark.sql import functions as F

    path = tmp_path / f"keyless.{fmt}"
    with path.open("w", newline="") as f:
        if fmt == "csv":
            f.write("topic,body,key\n" + "".join(f"t,{n},\n" for n in range(3000)))
        else:
            f.write("".join(json.dumps({"topic": "t", "body": n}) + "\n" for n in range(3000)))
    frame = bulk.extract(spark, path, fmt).withColumn(bulk.RID, F.monotonically_increasing_id())
    sizes = bulk._spread(frame, 3, fmt).rdd.glom().map(len).collect()
    assert len(sizes) == 3 and sum(sizes) == 3000 and min(sizes) > 500, sizes


def test_a_parquet_column_of_whole_numbers_is_a_key_on_either_path(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """Found by a reviewer: an int64 key column was stored as text by the JVM, refused ("must
    be a string") on the producer's path (a row with a JSON escape in its tags)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "topic": ["bulk.ids"] * 2,
            "body": ["{}", "{}"],
            "key": pa.array([101, 102], pa.int64()),
            "tags": [None, '["\\u0061"]'],
        }
    )
    pq.write_table(table, tmp_path / "ids.parquet")
    result = bulk.run(spark, settings, tmp_path / "ids.parquet")
    assert (result.written, result.rejected) == (2, 0)
    with engine.connect() as conn:
        keys = conn.execute(text("SELECT key FROM commit_log ORDER BY key")).scalars().all()
    assert keys == ["101", "102"]


def test_a_float_column_of_whole_delays_is_taken_on_either_path(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    """pandas writes an integer column with a missing value as float64: `delay_ms` 60000.0 was
    refused row by row ("must be a whole number, got 60000.0"). A whole float is its number,
    on the JVM's path and on the producer's (a row whose tags hold an escape); 1.5, NaN and
    infinity are still refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    nan, inf = float("nan"), float("inf")
    table = pa.table(
        {
            "topic": ["bulk.f"] * 7,
            "body": [f'{{"n": {n}}}' for n in range(7)],
            "delay_ms": pa.array([60000.0, None, 90000.0, 1.5, None, nan, inf], pa.float64()),
            "delay_level": pa.array([None, 3.0, None, None, 2.5, None, None], pa.float32()),
            "tags": [None, None, '["\\u0061"]', None, None, None, None],
        }
    )
    pq.write_table(table, tmp_path / "floats.parquet")
    result = bulk.run(spark, settings, tmp_path / "floats.parquet")
    assert (result.written, result.rejected) == (3, 4)
    with engine.connect() as conn:
        stored = conn.execute(
            text(
                "SELECT body, delay_level, "
                "round(extract(epoch FROM deliver_ts - stored_at) * 1000 / 1000) AS s "
                "FROM commit_log ORDER BY id"
            )
        ).all()
    by_body = {json.loads(bytes(b))["n"]: (level, int(s)) for b, level, s in stored}
    assert by_body[0][1] == 60 and by_body[2][1] == 90 and by_body[1][0] == 3, by_body
    refused = spark.read.parquet(str(tmp_path / "floats.rejects.parquet")).collect()
    reasons = sorted(r["reason"].split(":")[0] for r in refused)
    assert reasons == ["delay_level", "delay_ms", "delay_ms", "delay_ms"], refused


def test_bulk_schedule_refuses_a_file_that_is_not_parquet_or_a_folder_of_none_in_one_line(
    spark: Any, settings: Settings, tmp_path: Path
) -> None:
    """They gave a page of Java (a CSV named .parquet; an empty folder, taken as Parquet); then
    one line, after Spark's own ~40 lines of Java (the CLI now asks before Spark starts:
    `test_cli_user_errors_are_one_line_and_exit_2`). A folder with one file that is not
    Parquet among Parquet files is refused naming it (Spark failed mid-run)."""
    fake = tmp_path / "jobs.parquet"
    fake.write_text("topic,body\nt,{}\n")
    empty = tmp_path / "nothing"
    (empty / "_hidden").mkdir(parents=True)
    (empty / ".crc").write_text("x")
    mixed = tmp_path / "mixed"
    spark.createDataFrame([("t", "{}")], "topic string, body string").write.parquet(str(mixed))
    (mixed / "stray.parquet").write_text("not parquet")
    cases = (
        (fake, "is not a Parquet file", "PAR1"),
        (empty, "holds no Parquet files", "hidden or empty"),
        (mixed, "holds a file that is not Parquet", "stray.parquet"),
    )
    for path, what, cause in cases:
        with pytest.raises(ValidationError) as refused:
            bulk.run(spark, settings, path)
        assert str(refused.value).startswith(f"path: {path} {what} ("), str(refused.value)
        assert cause in str(refused.value)
        assert "--format csv or jsonl" in str(refused.value)
        assert "\n" not in str(refused.value)


def test_the_parquet_check_reads_a_folder_as_spark_does(
    spark: Any, settings: Settings, tmp_path: Path
) -> None:
    """Found by a reviewer: the first check refused folders Spark reads, an empty file beside
    a good one, an upload under way (`._COPYING_`), a partition folder named `_src=a`."""
    folder = tmp_path / "jobs"
    spark.createDataFrame([("bulk.pq", "{}")], "topic string, body string").write.parquet(
        str(folder)
    )
    (folder / "part-empty.parquet").write_bytes(b"")
    (folder / "part-9.parquet._COPYING_").write_text("half a file")
    assert extract._not_parquet(folder) is None
    result = bulk.run(spark, settings, folder)  # Spark reads it so too
    assert (result.read, result.written) == (1, 1)
    partitioned = tmp_path / "partitioned" / "_src=a"
    partitioned.mkdir(parents=True)
    (folder / "part-empty.parquet").unlink()
    (folder / "part-9.parquet._COPYING_").unlink()
    for part in folder.glob("*.parquet"):
        part.rename(partitioned / part.name)
    assert extract._not_parquet(partitioned.parent) is None
    assert spark.read.parquet(str(partitioned.parent)).columns == ["topic", "body", "_src"]


def test_bulk_schedule_on_a_database_not_migrated_or_missing_is_one_error(
    spark: Any, settings: Settings, pg_server: Any, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.csv"
    path.write_text("topic,body,key\nbulk.um,{},good-1\n")
    name = f"delaysvc_bare_{uuid.uuid4().hex[:8]}"
    with pg_server.janitor(name):
        bare = settings.model_copy(update={"database_url": pg_server.url(name)})
        with pytest.raises(SchemaNotReady, match="not migrated"):
            bulk.run(spark, bare, path)
    missing = settings.model_copy(update={"database_url": pg_server.url(name + "_none")})
    with pytest.raises(DatabaseUnavailable, match=f'database "{name}_none" does not exist'):
        bulk.run(spark, missing, path)


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
        "deliver_ts, round(extract(epoch FROM deliver_ts - stored_at) * 1000) AS wait_ms, "
        "deliver_ts = stored_at AS due_at_store "
        "FROM commit_log"
    )

    def stored() -> list[tuple[str, ...]]:
        """Each row's values; its due time as an instant when it was given one in the
        future, else as the wait from storing (the two inserts run at different times; a time
        already past is the store time)."""
        with engine.begin() as conn:
            rows = [
                (*r[:9], r.deliver_ts if r.key in absolute and not r.due_at_store else r.wait_ms)
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
