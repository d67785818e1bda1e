"""The Spark pipeline end to end: bulk-schedule, then delivered by real workers, archived and
reported; a task run again stores nothing twice."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, text

from delaysvc.config.settings import Settings
from delaysvc.errors import DelaysvcError
from delaysvc.pipeline import bulk
from delaysvc.pipeline import store as pipeline_store
from delaysvc.producer.sending import Producer
from tests.support.pipeline import _count


def test_end_to_end_bulk_schedule_then_delivered_by_real_workers_archived_and_reported(
    spark: Any, database_url: str, engine: Engine, tmp_path: Path
) -> None:
    """The issue's run at a small size, with the CLI commands: generated jobs ->
    `bulk-schedule` -> a real delivery worker, consumer and beat run them ->
    `archive --older-than 0s` -> `report`; the counts match at every step."""
    from delaysvc.cli import cli
    from tests.conftest import TEST_LEVELS
    from tests.e2e.conftest import Service, wait_for
    from tests.pipeline import jobs as e2e

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

    service = Service(database_url, tmp_path / "var", engine, handlers="tests.pipeline.jobs")
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
