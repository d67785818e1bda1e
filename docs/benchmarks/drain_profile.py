"""Where a drain's time goes: the delivery move of a due level backlog, whole and with parts of
its statement left out, against the raw move (two plain tables) on the same server.

Run from the repository root: python docs/benchmarks/drain_profile.py [SERVER_URL] [ROWS]
(default postgresql://root@127.0.0.1:5432/postgres, 300000); it works in a database of its own.
The raw move and the variants take turns, ROUNDS times, so a machine whose speed drifts
during the run (this one does) skews no variant more than another; each ratio is to the raw
move of its own round, and the median of the rounds is reported.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scratch import scratch_database
from sqlalchemy import Engine, text

from delaysvc import store
from delaysvc.bench import raw
from delaysvc.bench.progress import Progress
from delaysvc.bench.scale import fill_lane
from delaysvc.db.engines import libpq_url
from delaysvc.store import LATENESS_BUCKETS_MS

SERVER = sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres"
ROWS = int(sys.argv[2]) if len(sys.argv) > 2 else 300_000
ROUNDS = 3
DATABASE = "delaysvc_drain_profile"
BATCH = 1000

MOVE = store._MOVE_DUE_LEVEL
# what moves did until 2026-11-24: mark each moved message ready in the commit log
MARKED = """, marked AS (
    UPDATE commit_log c SET status = 'ready', delivered_at = clock_timestamp(),
        lane = -1, queue_offset = NULL
    FROM moved WHERE c.id = moved.message_id
)"""
WITH_MARKING = MOVE.replace("), advanced AS (", ")" + MARKED + ", advanced AS (")
# the move's figures cut to the count and the offset (no topics, lateness, next head)
BARE = MOVE[: MOVE.index("SELECT count(*) AS moved")] + (
    "SELECT count(*) AS moved, max(queue_offset) AS max_offset FROM moved"
)
VARIANTS = {
    "service move, marking commit_log (before)": (WITH_MARKING, "", ""),
    "service move": (MOVE, "", ""),
    "bare figures": (BARE, "", ""),
    "and no topic_queue (topic, seq) index": (
        BARE,
        "DROP INDEX ix_topic_queue_topic_seq",
        "CREATE INDEX ix_topic_queue_topic_seq ON topic_queue (topic, seq)",
    ),
}


def drain(engine: Engine, statement: str, before: str, after: str) -> float:
    if before:
        with engine.begin() as conn:
            conn.execute(text(before))
    fill_lane(engine, 1, ROWS, "now() - interval '1 hour'")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))
    params = {"lane": 1, "delay_ms": 1000, "batch": BATCH, "now": None}
    if "bounds" in statement:
        params["bounds"] = list(LATENESS_BUCKETS_MS)
    moved, started = 0, time.perf_counter()
    with engine.connect() as conn:
        while True:
            with conn.begin():
                store.lock_lane(conn, 1)
                (row,) = store._unprepared(conn, statement, params)
            if not row.moved:
                break
            moved += row.moved
    rate = moved / (time.perf_counter() - started)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE commit_log, topic_queue, consume_queue"))
        if after:
            conn.execute(text(after))
    return rate


def main() -> None:
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with scratch_database(SERVER, DATABASE, delay_levels="1s 2s") as (engine, settings):
        url = libpq_url(settings.database_url)
        for round_ in range(1, ROUNDS + 1):
            raw_rate = raw.move_rows(url, ROWS, BATCH, Progress("raw move", ROWS))
            print(f"round {round_}: raw move {raw_rate:,.0f} rows/s")
            for name, steps in VARIANTS.items():
                rate = drain(engine, *steps)
                ratios[name].append(rate / raw_rate)
                print(f"  {name}: {rate:,.0f} rows/s = {rate / raw_rate:.0%} of raw")
    print(f"median of {ROUNDS} rounds, {ROWS:,} rows each, batches of {BATCH}:")
    for name, values in ratios.items():
        print(f"  {name}: {statistics.median(values):.0%} of the raw move")


if __name__ == "__main__":
    main()
