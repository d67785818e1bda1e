"""What a level queue's index costs a batch's COPY of its rows: 10,000 rows of `LEVEL_ROW` (as
a batch's, binary) COPYed into a table shaped like a level's partition with its primary key
(level, queue_offset) as the service has it, with a primary key on queue_offset alone (the
level is the partition's own), with a BRIN index on queue_offset, and with no index. Each table
is a plain one on a scratch connection; the ways in turn, round after round, each COPY in a
transaction committed, offsets rising from round to round as a level's do.

A level's delivery reads its queue from its schedule offset on, in offset order, a batch at a
time (`FOR UPDATE SKIP LOCKED`): only a btree gives that order without reading the backlog.

Run from the repository root:
    python docs/benchmarks/queue_index_costs.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 15 rounds).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psycopg
from scratch import server_and_rounds
from timing import alternate, print_spread

from delaysvc.db.engines import libpq_url
from delaysvc.store.batches import LEVEL_ROW

ROWS = 10_000
LEVEL = 17  # the default levels' 1h, the send suite's batches'
COLUMNS = (
    "level smallint, queue_offset bigint, message_id bigint, topic text, "
    "deliver_ts timestamptz, priority smallint"
)
WAYS = {
    "primary key (level, queue_offset)": f"CREATE TABLE {{t}} ({COLUMNS}, "
    "PRIMARY KEY (level, queue_offset))",
    "primary key (queue_offset)": f"CREATE TABLE {{t}} ({COLUMNS}, PRIMARY KEY (queue_offset))",
    "BRIN (queue_offset)": f"CREATE TABLE {{t}} ({COLUMNS}); "
    "CREATE INDEX ON {t} USING brin (queue_offset)",
    "no index": f"CREATE TABLE {{t}} ({COLUMNS})",
}


def main() -> None:
    server, rounds = server_and_rounds(15)
    with psycopg.connect(libpq_url(server), autocommit=True) as conn:
        tables = {way: f"queue_index_costs_{n}" for n, way in enumerate(WAYS)}
        for way, table in tables.items():
            conn.execute(f"DROP TABLE IF EXISTS {table}")
            conn.execute(WAYS[way].format(t=table))
        next_offset = {way: 0 for way in WAYS}

        def copy_ms(way: str) -> float:
            start = next_offset[way]
            next_offset[way] += ROWS
            rows = [
                (LEVEL, offset, offset, "bench.noop", 789_000_000_000_000 + offset, 0)
                for offset in range(start, start + ROWS)
            ]
            statement = f"COPY {tables[way]} FROM STDIN (FORMAT BINARY)"
            started = time.perf_counter()
            with conn.transaction(), conn.cursor() as cursor, cursor.copy(statement) as copy:
                copy.set_types([kind for _, kind in LEVEL_ROW])
                for row in rows:
                    copy.write_row(row)
            return (time.perf_counter() - started) * 1e3

        try:
            results = alternate({way: partial(copy_ms, way) for way in WAYS}, rounds)
        finally:
            for table in tables.values():
                conn.execute(f"DROP TABLE IF EXISTS {table}")
    print_spread(results, f"ms a COPY of {ROWS:,} rows")


if __name__ == "__main__":
    main()
