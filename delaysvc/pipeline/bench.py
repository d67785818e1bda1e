"""The bulk-schedule benchmark: generate a CSV of N keyed jobs, schedule it (every row new),
then schedule it again (every row a duplicate by key). Rates are rows per second of the whole
`bulk.run`, Spark's reading and the rejects file included.

`bench_bulk` is a plain function (`delaysvc pipeline bench` calls it; a bench suite registry
can too): give it a SparkSession, or none and a master (`local[2]`, the issue's setting).
It schedules into the database `settings` names: use a scratch database."""

from __future__ import annotations

import csv
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

from delaysvc.pipeline import bulk
from delaysvc.settings import Settings

log = logging.getLogger(__name__)
DELAYS = ("5m", "30m", "1h")


def generate_csv(path: Path, rows: int, topic: str = "bulk.bench") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["topic", "body", "delay", "key"])
        for n in range(rows):
            writer.writerow([topic, f'{{"n": {n}}}', DELAYS[n % len(DELAYS)], f"bench-{n}"])
    return path


def bench_bulk(
    spark: Any | None,
    settings: Settings,
    rows: int = 200_000,
    workdir: Path = Path("var/bench-pipeline"),
    partitions: int | None = None,
    master: str = "local[2]",
) -> dict[str, Any]:
    """-> the result (also written to WORKDIR/bench-bulk.json): rows/s of the first run
    (every row new) and of the re-run (every row a duplicate)."""
    if spark is None:
        from delaysvc.pipeline.spark import session

        spark = session(master)
    source = generate_csv(workdir / f"bulk-{rows}.csv", rows)
    first = bulk.run(spark, settings, source, "csv", partitions=partitions)
    again = bulk.run(spark, settings, source, "csv", partitions=partitions)
    result = {
        "rows": rows,
        "partitions": partitions or spark.sparkContext.defaultParallelism,
        "master": spark.sparkContext.master,
        "first": {"written": first.written, "seconds": round(first.seconds, 2)},
        "first_rows_per_s": round(first.read / first.seconds),
        "rerun": {"duplicates": again.duplicates, "seconds": round(again.seconds, 2)},
        "rerun_rows_per_s": round(again.read / again.seconds),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform()},
    }
    (workdir / "bench-bulk.json").write_text(json.dumps(result, indent=2) + "\n")
    log.info("bench.bulk", extra=result)
    return result
