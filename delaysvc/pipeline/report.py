"""report: per topic, delay level and hour (of finished_at, UTC), from the verified archive
folders plus the finished messages still in PostgreSQL: message count, lateness
(delivered_at - deliver_ts) p50/p95/p99/max, handler duration p50/p95/p99, retried (more than
one attempt) and dead. Written as Parquet and upserted into `report_hourly`.

Percentiles are Spark's `percentile_approx`, which returns an element of the data: the
smallest value v with at least p of the values <= v (nearest rank); with fewer rows than its
accuracy (10,000 per group) it is exact."""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from delaysvc.config.settings import Settings
from delaysvc.db.engines import database_url
from delaysvc.errors import ValidationError
from delaysvc.pipeline import archive, store
from delaysvc.pipeline.spark import JdbcTarget, jdbc_target

log = logging.getLogger(__name__)
COLUMNS = (
    "id",
    "topic",
    "status",
    "delay_level",
    "deliver_ts",
    "delivered_at",
    "finished_at",
    "attempts",
    "duration_ms",
)
NO_LEVEL = -1  # the timer lane (any delay that is not a level's)
ROWS_PER_PARTITION = 100_000


@dataclass
class ReportResult:
    run_id: int
    read: int
    written: int
    seconds: float


# ---------------------------------------------------------------- extract


def extract(spark: Any, engine: Engine, target: JdbcTarget) -> Any:
    """Archived and live finished messages. A message both archived and still live (an
    archive run killed before its deletes) counts once; a dead letter redriven and finished
    again after it was archived is a second lifecycle and counts twice."""
    with engine.connect() as conn:
        low, high = store.finished_id_range(conn)
        folders = store.verified_archive_folders(conn)
    frames = []
    if low is not None and high is not None:
        frames.append(_live(spark, target, low, high))
    if folders:  # the runs' folders, their topics as text (`archive.read_folders`)
        frames.append(archive.read_folders(spark, folders).select(*COLUMNS))
    if not frames:
        return spark.createDataFrame([], _empty_schema())
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionByName(other)
    return frame.dropDuplicates(["id", "finished_at"])


def _live(spark: Any, target: JdbcTarget, low: int, high: int) -> Any:
    span = high - low + 1
    partitions = max(
        min(spark.sparkContext.defaultParallelism, span), math.ceil(span / ROWS_PER_PARTITION)
    )
    frame = spark.read.jdbc(
        target.url,
        store.finished_query(),
        column="id",
        lowerBound=low,
        upperBound=high + 1,
        numPartitions=partitions,
        properties={**target.properties, "fetchsize": "10000"},
    )
    return frame.select(*COLUMNS).withColumn("delay_level", frame["delay_level"].cast("int"))


def _empty_schema() -> str:
    return (
        "id long, topic string, status string, delay_level int, deliver_ts timestamp, "
        "delivered_at timestamp, finished_at timestamp, attempts int, duration_ms int"
    )


# ---------------------------------------------------------------- transform


def transform(frame: Any) -> Any:
    """Pure: finished messages -> one row per (hour, topic, level)."""
    from pyspark.sql import functions as F

    lateness = (F.unix_micros(F.col("delivered_at")) - F.unix_micros(F.col("deliver_ts"))).cast(
        "double"
    ) / 1000.0
    quantiles = F.array(F.lit(0.5), F.lit(0.95), F.lit(0.99))
    grouped = (
        frame.withColumn("hour", F.date_trunc("hour", "finished_at"))
        .withColumn("level", F.coalesce(F.col("delay_level").cast("int"), F.lit(NO_LEVEL)))
        .withColumn("lateness_ms", lateness)
        .withColumn("duration", F.col("duration_ms").cast("double"))
        .groupBy("hour", "topic", "level")
        .agg(
            F.count(F.lit(1)).alias("messages"),
            F.percentile_approx("lateness_ms", quantiles).alias("late"),
            F.max("lateness_ms").alias("lateness_max_ms"),
            F.percentile_approx("duration", quantiles).alias("dur"),
            F.sum((F.col("attempts") > 1).cast("long")).alias("retried"),
            F.sum((F.col("status") == "dead").cast("long")).alias("dead"),
        )
    )
    return grouped.select(
        "hour",
        "topic",
        "level",
        "messages",
        *(F.col("late")[i].alias(f"lateness_p{p}_ms") for i, p in enumerate((50, 95, 99))),
        "lateness_max_ms",
        *(F.col("dur")[i].alias(f"duration_p{p}_ms") for i, p in enumerate((50, 95, 99))),
        "retried",
        "dead",
    ).orderBy("hour", "topic", "level")


# ---------------------------------------------------------------- load


_SPARK_WRITES = re.compile(r"_SUCCESS|part-.*|\..*\.crc")
"""The files a Spark Parquet write leaves in its folder: a folder of these alone is a report
written before, which a report replaces."""


def check_out(out: Path, archive_folders: list[str]) -> None:
    """Refuse an `out` a report may not replace: one holding anything but an earlier
    report's Parquet (the archive's folders, a user's files: replacing deleted them), or one
    inside or around an archive folder."""
    here = out.resolve()
    for folder in archive_folders:
        archived = Path(folder.removeprefix("file:")).resolve()
        if here == archived or here in archived.parents or archived in here.parents:
            raise ValidationError(
                "--out", f"{out} holds or is in the archive's folder {archived}: give another"
            )
    if here.exists() and not here.is_dir():
        raise ValidationError("--out", f"{out} is a file; give a folder for the report")
    if here.is_dir():
        others = sorted(p.name for p in here.iterdir() if not _SPARK_WRITES.fullmatch(p.name))
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise ValidationError(
                "--out",
                f"{out} holds other things than an earlier report ({shown}), which writing "
                "the report there would delete: give a new folder, or an earlier report's",
            )


def load(report: Any, engine: Engine, out: Path, run_id: int) -> int:
    """Parquet under `out` (replaced), then upserted into report_hourly. -> rows."""
    report.write.mode("overwrite").parquet(str(out))
    rows = [row.asDict() for row in report.collect()]  # one per topic, level and hour
    with engine.begin() as conn:
        store.upsert_report(conn, rows, run_id)
    return len(rows)


def run(spark: Any, settings: Settings, engine: Engine, out: Path) -> ReportResult:
    started = time.monotonic()
    with engine.connect() as conn:
        check_out(out, store.verified_archive_folders(conn))
    with engine.begin() as conn:
        run_id = store.start_run(conn, "report", {}, None, None)
    try:
        with jdbc_target(database_url(settings)) as target:
            frame = extract(spark, engine, target).cache()
            read = frame.count()
            written = load(transform(frame), engine, out, run_id)
            frame.unpersist()
    except Exception as exc:
        with engine.begin() as conn:
            store.update_run(conn, run_id, status="failed", error=str(exc)[:2000], finished=True)
        raise
    with engine.begin() as conn:
        store.update_run(
            conn,
            run_id,
            status="succeeded",
            rows_read=read,
            rows_written=written,
            output_path=str(out),
            finished=True,
        )
    log.info("report.done", extra={"run_id": run_id, "read": read, "rows": written})
    return ReportResult(run_id, read, written, time.monotonic() - started)
