"""report: per topic, delay level and hour, from the archive (Parquet) plus the finished
messages still in PostgreSQL: counts, lateness (delivered_at - deliver_ts) p50/p95/p99/max,
handler duration p50/p95/p99, retried (more than one attempt) and dead. Written as Parquet and
upserted into `report_hourly`, which the dashboard can chart."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from delaysvc.pipeline import archive
from delaysvc.pipeline import store as pipeline_store
from delaysvc.settings import Settings

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


@dataclass
class ReportResult:
    read: int
    rows: int
    seconds: float


def extract(spark: Any, settings: Settings, engine: Engine, archive_dir: Path) -> Any:
    """Archived and live finished messages, one row each (a message is in one or the other:
    archive deletes what it wrote)."""
    with engine.connect() as conn:
        now: datetime = pipeline_store.database_now(conn)
        low, high = pipeline_store.archivable_range(conn, now)
    frames = []
    if low is not None and high is not None:
        frames.append(archive.extract(spark, settings, low, high, now).select(*COLUMNS))
    runs = sorted(str(p) for p in archive_dir.glob("run=*") if (p / "_SUCCESS").exists())
    if runs:
        frames.append(spark.read.parquet(*runs).select(*COLUMNS))
    if not frames:
        return None
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionByName(other)
    return frame.dropDuplicates(["id"])


def transform(frame: Any) -> Any:
    """Pure: finished messages -> one row per (hour, topic, level)."""
    from pyspark.sql import functions as F

    lateness = (F.col("delivered_at").cast("double") - F.col("deliver_ts").cast("double")) * 1000
    quantiles = F.array(F.lit(0.5), F.lit(0.95), F.lit(0.99))
    grouped = (
        frame.withColumn("hour", F.date_trunc("hour", "finished_at"))
        .withColumn("level", F.coalesce(F.col("delay_level"), F.lit(-1)).cast("short"))
        .withColumn("lateness_ms", lateness)
        .groupBy("hour", "topic", "level")
        .agg(
            F.count("id").alias("messages"),
            F.percentile_approx("lateness_ms", quantiles).alias("late"),
            F.max("lateness_ms").alias("lateness_max_ms"),
            F.percentile_approx(F.col("duration_ms").cast("double"), quantiles).alias("dur"),
            F.sum(F.when(F.col("attempts") > 1, 1).otherwise(0)).alias("retried"),
            F.sum(F.when(F.col("status") == "dead", 1).otherwise(0)).alias("dead"),
        )
    )
    return grouped.select(
        "hour",
        "topic",
        "level",
        "messages",
        F.col("late")[0].alias("lateness_p50_ms"),
        F.col("late")[1].alias("lateness_p95_ms"),
        F.col("late")[2].alias("lateness_p99_ms"),
        "lateness_max_ms",
        F.col("dur")[0].alias("duration_p50_ms"),
        F.col("dur")[1].alias("duration_p95_ms"),
        F.col("dur")[2].alias("duration_p99_ms"),
        "retried",
        "dead",
    )


def load(report: Any, engine: Engine, out: Path, run_id: int) -> int:
    report.write.mode("overwrite").parquet(str(out))
    rows = [row.asDict() for row in report.collect()]  # one row per topic, level and hour
    with engine.begin() as conn:
        pipeline_store.upsert_report(conn, rows, run_id)
    return len(rows)


def run(
    spark: Any, settings: Settings, engine: Engine, archive_dir: Path, out: Path
) -> ReportResult:
    started = time.monotonic()
    with engine.begin() as conn:
        run_id = pipeline_store.start_run(conn, "report", {"archive": str(archive_dir)}, None, None)
    frame = extract(spark, settings, engine, archive_dir)
    read = frame.count() if frame is not None else 0
    rows = load(transform(frame), engine, out, run_id) if frame is not None else 0
    with engine.begin() as conn:
        pipeline_store.update_run(
            conn,
            run_id,
            status="succeeded",
            rows_read=read,
            rows_written=rows,
            output_path=str(out),
            finished=True,
        )
    return ReportResult(read, rows, time.monotonic() - started)
