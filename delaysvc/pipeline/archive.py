"""archive: finished messages older than a retention period -> Parquet (partitioned by topic
and date) -> verified against PostgreSQL -> deleted from PostgreSQL in bounded batches.

Extract reads the id range in parallel partitions inside Spark tasks (each task queries its
own id slice through the service's store; this works over TCP and over the embedded server's
Unix socket alike). Each run has its own folder `run=<id>` and a `pipeline_run` row; only a
verified run deletes, and only rows still finished and older than the run's cutoff. A run
killed at any point is finished by the next one: its folder is written again from scratch if
it does not verify, then its rows are deleted, so every message is archived exactly once and
nothing unarchived is deleted.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from delaysvc.db import make_engine
from delaysvc.pipeline import store
from delaysvc.settings import Settings

log = logging.getLogger(__name__)
ROWS_PER_PARTITION = 50_000
DELETE_BATCH = 10_000


@dataclass
class ArchiveResult:
    run_id: int | None
    read: int = 0
    written: int = 0
    deleted: int = 0
    seconds: float = 0.0
    folder: str | None = None


# ---------------------------------------------------------------- extract


def _schema() -> Any:
    from pyspark.sql import types as T

    return T.StructType(
        [
            T.StructField("id", T.LongType(), False),
            T.StructField("topic", T.StringType(), False),
            T.StructField("key", T.StringType(), True),
            T.StructField("status", T.StringType(), False),
            T.StructField("delay_level", T.IntegerType(), True),
            T.StructField("stored_at", T.TimestampType(), False),
            T.StructField("deliver_ts", T.TimestampType(), False),
            T.StructField("delivered_at", T.TimestampType(), True),
            T.StructField("started_at", T.TimestampType(), True),
            T.StructField("finished_at", T.TimestampType(), False),
            T.StructField("attempts", T.IntegerType(), False),
            T.StructField("duration_ms", T.IntegerType(), True),
            T.StructField("last_error", T.StringType(), True),
            T.StructField("body", T.BinaryType(), False),
            T.StructField("body_is_json", T.BooleanType(), False),
        ]
    )


def extract(spark: Any, settings: Settings, low: int, high: int, cutoff: datetime) -> Any:
    """The archivable rows in [low, high] as a DataFrame, read in parallel id slices."""
    step = ROWS_PER_PARTITION
    slices = [(a, min(a + step - 1, high)) for a in range(low, high + 1, step)]

    def read_slices(parts: Any) -> Any:
        engine = make_engine(settings)
        try:
            for a, b in parts:
                with engine.connect() as conn:
                    for row in store.range_rows(conn, a, b, cutoff):
                        yield tuple(row)
        finally:
            engine.dispose()

    rdd = spark.sparkContext.parallelize(slices, max(1, len(slices))).mapPartitions(read_slices)
    return spark.createDataFrame(rdd, _schema())


# ---------------------------------------------------------------- transform


def transform(frame: Any) -> Any:
    """Partition columns: the date each message finished."""
    from pyspark.sql import functions as F

    return frame.withColumn("date", F.to_date("finished_at"))


def checksum(frame: Any) -> tuple[int, int]:
    from pyspark.sql import functions as F

    row = frame.agg(F.count("id").alias("n"), F.sum("id").alias("s")).collect()[0]
    return int(row["n"]), int(row["s"] or 0)


# ---------------------------------------------------------------- load


def load(frame: Any, folder: Path) -> None:
    frame.write.mode("overwrite").partitionBy("topic", "date").parquet(str(folder))


def run(
    spark: Any,
    settings: Settings,
    engine: Engine,
    older_than_ms: int,
    out: Path,
    stop_after: str | None = None,
) -> ArchiveResult:
    """Archive, verify and delete; first finish any run a crash left behind. `stop_after`
    ("write") stops a run between writing and deleting, as a crash would (tests)."""
    started = time.monotonic()
    total = ArchiveResult(None)
    with engine.begin() as conn:
        leftovers = store.unfinished_runs(conn, "archive")
    for left in leftovers:
        cutoff = datetime.fromisoformat(left.params["cutoff"])
        span = (left.id, left.range_from_id, left.range_to_id, cutoff)
        _finish(spark, settings, engine, span, left.checksum, out, total, stop_after)
    with engine.begin() as conn:
        cutoff = store.database_now(conn) - timedelta(milliseconds=older_than_ms)
        low, high = store.archivable_range(conn, cutoff)
        if low is not None and high is not None:
            run_id = store.start_run(conn, "archive", {"cutoff": cutoff.isoformat()}, low, high)
    if low is not None and high is not None:
        _finish(spark, settings, engine, (run_id, low, high, cutoff), None, out, total, stop_after)
    total.seconds = time.monotonic() - started
    return total


def _finish(
    spark: Any,
    settings: Settings,
    engine: Engine,
    span: tuple[int, int, int, datetime],
    recorded: str | None,
    out: Path,
    total: ArchiveResult,
    stop_after: str | None,
) -> None:
    """Write (unless a verified copy was recorded), verify, record, then delete.

    The checksum is recorded before the first delete, so a run without one still has all
    its rows in PostgreSQL and is simply written again; a run with one is finished from its
    verified folder."""
    run_id, low, high, cutoff = span
    folder = out / f"run={run_id}"
    total.run_id, total.folder = run_id, str(folder)
    if recorded is None or _folder_checksum(spark, folder) != recorded:
        with engine.connect() as conn:
            count, id_sum = store.range_checksum(conn, low, high, cutoff)
        shutil.rmtree(folder, ignore_errors=True)
        load(transform(extract(spark, settings, low, high, cutoff)), folder)
        total.read += count
        recorded = f"{count}:{id_sum}"
        if _folder_checksum(spark, folder) != recorded:
            with engine.begin() as conn:
                store.update_run(
                    conn,
                    run_id,
                    status="failed",
                    finished=True,
                    error="the archive does not match PostgreSQL",
                )
            raise RuntimeError(f"archive run {run_id} does not match PostgreSQL; kept all rows")
        with engine.begin() as conn:
            store.update_run(
                conn,
                run_id,
                rows_read=count,
                rows_written=count,
                checksum=recorded,
                output_path=str(folder),
            )
        total.written += count
    if stop_after == "write":
        return
    for a in range(low, high + 1, DELETE_BATCH):
        with engine.begin() as conn:
            b = min(a + DELETE_BATCH - 1, high)
            total.deleted += store.delete_archived(conn, a, b, cutoff)
    with engine.begin() as conn:
        store.update_run(conn, run_id, status="succeeded", finished=True)
    log.info("archive.done", extra={"run_id": run_id, "checksum": recorded})


def _folder_checksum(spark: Any, folder: Path) -> str | None:
    """ "rows:sum of ids" of a completely written run folder, else None."""
    if not (folder / "_SUCCESS").exists():
        return None
    count, id_sum = checksum(spark.read.parquet(str(folder)))
    return f"{count}:{id_sum}"
