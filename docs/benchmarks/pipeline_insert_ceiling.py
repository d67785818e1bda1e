"""The database's own ceiling for bulk-schedule: how fast PostgreSQL takes N new messages into
the service's tables when nothing else runs, measured with the pipeline's own statements.

    python docs/benchmarks/pipeline_insert_ceiling.py postgresql://root@127.0.0.1:5432/SCRATCH

The database must be migrated (`delaysvc migrate`) and scratch: its messages are deleted.
Prints rows/s of (1) COPY into the staging table alone, (2) the set-based insert
(`pipeline.store._INSERT_STAGED`: commit_log + its indexes + the timer lane) in one session,
(3) the same in two sessions at once (as `local[2]` writes), each with ROWS/2 distinct keys.
"""

from __future__ import annotations

import sys
import threading
import time

import psycopg

from delaysvc.db import libpq_url
from delaysvc.pipeline import store

ROWS = 200_000
DELAYS_MS = (300_000, 1_800_000, 3_600_000)  # the bench's 5m, 30m, 1h: the timer lane


def copy_text(prefix: str, rows: int) -> str:
    line = "bulk.bench\t{prefix}-{n}\t\\N\t\\N\t\\N\t0\t{ms}\t\\N\tt\t\\\\x{body}\n"
    return "".join(
        line.format(prefix=prefix, n=n, ms=DELAYS_MS[n % 3], body=f'{{"n":{n}}}'.encode().hex())
        for n in range(rows)
    )


def clean(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE commit_log, timer_queue, consume_queue, topic_queue CASCADE")
        conn.execute("CHECKPOINT")


def staged_insert(url: str, text: str, insert: bool, out: list[float]) -> None:
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        start = time.monotonic()
        cur.execute(store._STAGE)
        with cur.copy(f"COPY pipeline_bulk_stage ({store.COPY_COLUMNS}) FROM STDIN") as copy:
            copy.write(text)
        if insert:
            cur.execute(store._INSERT_STAGED)
        conn.commit()
        out.append(time.monotonic() - start)


def main(url: str) -> None:
    url = libpq_url(url)
    whole = copy_text("one", ROWS)
    halves = [copy_text(f"two{i}", ROWS // 2) for i in range(2)]
    for label, texts, insert in (
        ("COPY into the staging table only", [whole], False),
        ("COPY + set-based insert, 1 session", [whole], True),
        ("COPY + set-based insert, 2 sessions", halves, True),
    ):
        clean(url)
        times: list[float] = []
        threads = [
            threading.Thread(target=staged_insert, args=(url, t, insert, times)) for t in texts
        ]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.monotonic() - start
        print(f"{label}: {ROWS} rows in {wall:.2f} s = {ROWS / wall:,.0f} rows/s")
    clean(url)


if __name__ == "__main__":
    main(sys.argv[1])
