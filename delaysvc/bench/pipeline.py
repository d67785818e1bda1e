"""The `pipeline` suite: the Spark bulk-schedule bench (`delaysvc.pipeline.bulk_bench.bench_bulk`)
into the bench database. It needs pyspark and a Java runtime; without them the suite reports
itself as not run, with the reason and the fix, in the results and on stderr."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from delaysvc.bench.progress import step
from delaysvc.bench.suites import Figures

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext

TARGET_ROWS_PER_S = 100_000  # DESIGN.md: bulk scheduling


def missing() -> str | None:
    """Why the suite cannot run here, or None."""
    from delaysvc.pipeline.requirements import missing_java, missing_python_parts

    return missing_python_parts() or missing_java()


def pipeline_suite(ctx: BenchContext) -> Figures:
    reason = missing()
    if reason:
        step(f"pipeline: NOT RUN: {reason}")
        return Figures(results={"pipeline_bulk": {"skipped": reason}})
    from delaysvc.pipeline.bulk_bench import FORMATS, bench_bulk
    from delaysvc.pipeline.spark import session

    rows, partitions = ctx.size("pipeline_rows"), ctx.size("pipeline_partitions")
    results = {}
    spark = session("local[2]")
    try:
        for fmt in FORMATS:
            step(f"pipeline: Spark bulk-schedule of {rows:,} {fmt} rows, {partitions} partitions")
            with tempfile.TemporaryDirectory(prefix="delaysvc-bench-pipeline-") as workdir:
                result = bench_bulk(spark, ctx.settings, rows, Path(workdir), partitions, fmt=fmt)
            results[f"pipeline_bulk_{fmt}"] = {**result, "target_rows_per_s": TARGET_ROWS_PER_S}
    finally:
        spark.stop()
    return Figures(results=results)
