"""The bulk-schedule benchmark: generate a CSV of N keyed jobs, schedule it (every row new),
then schedule it again (every row a duplicate by key). Rates are rows per second of the whole
`bulk.run`, Spark's reading and the rejects file included."""

from __future__ import annotations

import csv
import json
import logging
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
    spark: Any, settings: Settings, rows: int, workdir: Path, partitions: int | None = None
) -> dict[str, Any]:
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
    }
    (workdir / "bench-bulk.json").write_text(json.dumps(result, indent=2) + "\n")
    log.info("bench.bulk", extra=result)
    return result
