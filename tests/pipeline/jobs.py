"""The pipeline's end-to-end run (docs/pipeline.md, tests/pipeline/): generated jobs
-> `bulk-schedule` -> delivered and run by real workers -> `archive` -> `report`.

A handler module for the workers (`DELAYSVC_HANDLERS=tests.pipeline.jobs`): the topic
`pipeline.e2e` runs a no-op, so each job finishes as succeeded. `generate_jobs` writes the
input file: N keyed jobs at delay levels 1 and 2, as Parquet.

    python -m tests.pipeline.jobs jobs.parquet 1000000
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from delaysvc.worker.consumer import Job, handler

TOPIC = "pipeline.e2e"


@handler(TOPIC)
def done(message: Job) -> None:
    return None


def generate_jobs(spark: Any, path: Path, rows: int, levels: tuple[int, ...] = (1, 2)) -> Path:
    """`rows` jobs (topic, body {"n": i}, delay_level, key e2e-i) as a Parquet folder."""
    from pyspark.sql import functions as F

    which = ((F.col("id") % len(levels)) + 1).cast("int")
    level = F.element_at(F.array(*(F.lit(n) for n in levels)), which)
    frame = spark.range(rows).select(
        F.lit(TOPIC).alias("topic"),
        F.concat(F.lit('{"n": '), F.col("id").cast("string"), F.lit("}")).alias("body"),
        level.cast("int").alias("delay_level"),
        F.concat(F.lit("e2e-"), F.col("id").cast("string")).alias("key"),
    )
    frame.write.mode("overwrite").parquet(str(path))
    return path


if __name__ == "__main__":
    from delaysvc.pipeline.spark import session

    target, count = Path(sys.argv[1]), int(sys.argv[2])
    generate_jobs(session(), target, count)
    print(f"{count} jobs -> {target}")
