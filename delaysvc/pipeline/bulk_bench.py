"""The bulk-schedule benchmark: generate N keyed jobs as CSV or Parquet, measure what
PostgreSQL alone takes of the same rows (the ceiling), schedule the file (every row new), then
schedule it again (every row a duplicate by key). Rates are rows per second of the whole
`bulk.run`, Spark's reading and the rejects file included.

The ceiling is the pipeline's own statements with no Spark: two sessions at once (as
`local[2]` writes), each COPYing half the rows into the staging table and running the
set-based insert into the service's tables, then rolling back, so it leaves no message behind
(only dead rows, which a VACUUM then clears). The pipeline's rate as a share of it says how
much Spark and Python cost on top of the database.

`bench_bulk` is a plain function (`delaysvc pipeline bench` and the `pipeline` suite of
`delaysvc bench` call it): give it a SparkSession, or none and a master (`local[2]`, the
issue's setting). It schedules into the database `settings` names: use a scratch database."""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import platform
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from delaysvc.config.levels import DelayLevels
from delaysvc.config.settings import Settings
from delaysvc.db.engines import database_url, libpq_url
from delaysvc.db.names import qualify
from delaysvc.pipeline import bulk, store
from delaysvc.schema.tables import TIMER_LANE

log = logging.getLogger(__name__)
DELAYS = ("5m", "30m", "1h")  # levels 9, 16 and 17 of the default levels
DELAYS_MS = (300_000, 1_800_000, 3_600_000)
FORMATS = ("csv", "parquet")
TOPIC = "bulk.bench"
PARQUET_ROW_GROUP = 50_000  # row groups are what Spark splits a Parquet file by


def generate(path: Path, rows: int, fmt: str = "csv", run: str = "") -> Path:
    """N keyed jobs: body {"n": N}, key bench-RUN-N, delays 5m / 30m / 1h in turn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table(
            {
                "topic": [TOPIC] * rows,
                "body": [f'{{"n": {n}}}' for n in range(rows)],
                "delay": [DELAYS[n % len(DELAYS)] for n in range(rows)],
                "key": [f"bench-{run}-{n}" for n in range(rows)],
            }
        )
        pq.write_table(table, path, row_group_size=PARQUET_ROW_GROUP)
        return path
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["topic", "body", "delay", "key"])
        for n in range(rows):
            writer.writerow([TOPIC, f'{{"n": {n}}}', DELAYS[n % len(DELAYS)], f"bench-{run}-{n}"])
    return path


def insert_ceiling(settings: Settings, rows: int, sessions: int = 2) -> float:
    """-> rows/s PostgreSQL takes the bench's rows at through the pipeline's own statements
    (COPY into the staging table + the set-based insert), `sessions` at once, rolled back."""
    url = libpq_url(database_url(settings))
    share = rows // sessions
    texts = [copy_text(f"ceiling-{s}", share, settings.levels) for s in range(sessions)]
    ready = threading.Barrier(sessions + 1)
    errors: list[BaseException] = []

    def insert(text: str) -> None:
        try:
            with psycopg.connect(url) as conn, conn.cursor() as cur:
                ready.wait()
                cur.execute(store._STAGE)
                with cur.copy(f"COPY pipeline_bulk_stage ({store.COPY_COLUMNS}) FROM STDIN") as c:
                    c.write(text)
                cur.execute(qualify(store.INSERT_STAGED_NEW))
                ready.wait()
                conn.rollback()
        except BaseException as exc:
            errors.append(exc)
            ready.abort()

    threads = [threading.Thread(target=insert, args=(t,)) for t in texts]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    with contextlib.suppress(threading.BrokenBarrierError):  # a session failed: raised below
        ready.wait()  # every session connected
        started = time.monotonic()
        ready.wait()  # every session inserted
    seconds = time.monotonic() - started
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    with psycopg.connect(url, autocommit=True) as conn:  # the rolled-back rows' dead tuples
        conn.execute(
            qualify("VACUUM delaysvc.commit_log, delaysvc.consume_queue, delaysvc.timer_queue")
        )
    return share * sessions / seconds


def copy_text(prefix: str, rows: int, levels: DelayLevels) -> str:
    """The bench's rows as the fast path writes them (store.COPY_COLUMNS): a delay equal to a
    level's goes to that level's lane, any other to the timer lane, as the producer does."""
    line = "{topic}\t{prefix}-{n}\t\\N\t\\N\t{level}\t{lane}\t{ms}\t\\N\tt\t\\\\x{body}\n"
    lanes = [levels.level_for_delay_ms(ms) for ms in DELAYS_MS]
    return "".join(
        line.format(
            topic=TOPIC,
            prefix=prefix,
            n=n,
            level=lanes[n % 3] or bulk.NULL,
            lane=lanes[n % 3] or TIMER_LANE,
            ms=DELAYS_MS[n % 3],
            body=f'{{"n":{n}}}'.encode().hex(),
        )
        for n in range(rows)
    )


def bench_bulk(
    spark: Any | None,
    settings: Settings,
    rows: int = 200_000,
    workdir: Path = Path("var/bench-pipeline"),
    partitions: int | None = None,
    master: str = "local[2]",
    fmt: str = "csv",
) -> dict[str, Any]:
    """-> the result (also written to WORKDIR/bench-bulk.json): the database's ceiling, rows/s
    of the first run (every row new) and of the re-run (every row a duplicate)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if spark is None:
        from delaysvc.pipeline.spark import session

        spark = session(master)
    run = uuid.uuid4().hex[:8]  # keys of their own: the first run's rows are new
    source = generate(workdir / f"bulk-{rows}.{fmt}", rows, fmt, run)
    ceiling = insert_ceiling(settings, rows)
    first = bulk.run(spark, settings, source, fmt, partitions=partitions)
    if first.written != rows:
        raise RuntimeError(f"the first run wrote {first.written:,} of {rows:,} new rows")
    again = bulk.run(spark, settings, source, fmt, partitions=partitions)
    first_rate = first.read / first.seconds
    result = {
        "rows": rows,
        "format": fmt,
        "partitions": partitions or spark.sparkContext.defaultParallelism,
        "master": spark.sparkContext.master,
        "ceiling_rows_per_s": round(ceiling),
        "first": {"written": first.written, "seconds": round(first.seconds, 2)},
        "first_rows_per_s": round(first_rate),
        "first_of_ceiling": round(first_rate / ceiling, 3),
        "rerun": {"duplicates": again.duplicates, "seconds": round(again.seconds, 2)},
        "rerun_rows_per_s": round(again.read / again.seconds),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform()},
    }
    (workdir / "bench-bulk.json").write_text(json.dumps(result, indent=2) + "\n")
    log.info("bench.bulk", extra=result)
    return result
