"""The database's own ceiling for bulk-schedule: how fast PostgreSQL takes N new messages into
the service's tables when nothing else runs, measured with the pipeline's own statements.

    python docs/benchmarks/pipeline_insert_ceiling.py postgresql://root@127.0.0.1:5432/SCRATCH

The database must be migrated (`delaysvc migrate`). Prints rows/s of (1) COPY into the staging
table alone, (2) the set-based insert (`pipeline.store.INSERT_STAGED_NEW`: commit_log + its
indexes + the level lanes) in one session, (3) the same in two sessions at once (as
`local[2]` writes). (2) and (3) are `delaysvc.pipeline.bench.insert_ceiling`, which
`delaysvc pipeline bench` runs before every bench (rolled back: nothing stays behind).
"""

from __future__ import annotations

import sys
import time

import psycopg
from delaysvc.pipeline.bench import copy_text, insert_ceiling

from delaysvc.config.settings import Settings
from delaysvc.db.engines import libpq_url
from delaysvc.pipeline import store

ROWS = 200_000


def copy_only(settings: Settings, rows: int) -> float:
    """-> rows/s of COPY into the staging table alone, rolled back."""
    text = copy_text("copy", rows, settings.levels)
    url = libpq_url(settings.database_url)
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.execute(store._STAGE)
        start = time.monotonic()
        with cur.copy(f"COPY pipeline_bulk_stage ({store.COPY_COLUMNS}) FROM STDIN") as copy:
            copy.write(text)
        seconds = time.monotonic() - start
        conn.rollback()
    return rows / seconds


def main(url: str) -> None:
    settings = Settings.from_env(database_url=url)
    print(f"COPY into the staging table only: {copy_only(settings, ROWS):,.0f} rows/s")
    for sessions in (1, 2):
        rate = insert_ceiling(settings, ROWS, sessions)
        print(f"COPY + set-based insert, {sessions} session(s): {rate:,.0f} rows/s")


if __name__ == "__main__":
    main(sys.argv[1])
