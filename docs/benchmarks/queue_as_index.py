"""The server's side of a batch of 10,000 level messages stored two ways: as migrated (each
message a commit-log row and a row in its level's FIFO queue, two COPYs), and with the queue
as an index of the commit log instead (RocketMQ's consume queue is an index into its commit
log): one COPY into a copy of the commit log that has every index of the migrated one and a
partial btree on (lane, queue_offset) for the waiting rows of the levels, from which a delivery
would read its level in offset order.

The rows are a real `send_batch`'s, read back once as binary COPY data and sent again as that
block, so no Python runs per row: a COPY's time is the server's. Each table is emptied
(TRUNCATE) before its COPY; the ways in turn, round after round, each in a transaction of its
own (committed: the commit's flush is in the figure).

Run from the repository root:
    python docs/benchmarks/queue_as_index.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 15 rounds).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psycopg
from commit_log_row_costs import LEVEL, LEVEL_COLUMNS, MESSAGE_COLUMNS, ROWS  # the same rows
from scratch import batch_lots, copy_data, scratch_database, server_and_rounds
from timing import alternate, print_spread

from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import level_partition

QUEUE_AS_INDEX = [
    "CREATE TABLE public.cl_indexed (LIKE delaysvc.commit_log INCLUDING ALL)",
    "CREATE INDEX ON public.cl_indexed (lane, queue_offset) "
    "WHERE lane > 0 AND status = 'scheduled'",
]


def main() -> None:
    server, rounds = server_and_rounds(15)
    with scratch_database(server, "delaysvc_queue_as_index") as (engine, settings):
        Producer(settings, engine).send_batch(batch_lots(1, ROWS)[0])
        assert settings.database_url is not None
        conn = psycopg.connect(libpq_url(settings.database_url), autocommit=True)
        message_rows = copy_data(conn, "delaysvc.commit_log", MESSAGE_COLUMNS, "id")
        level_rows = copy_data(conn, "delaysvc.consume_queue", LEVEL_COLUMNS, "queue_offset")
        for statement in QUEUE_AS_INDEX:
            conn.execute(statement)
        partition = f"delaysvc.{level_partition(LEVEL)}"

        def as_migrated() -> float:
            conn.execute(f"TRUNCATE delaysvc.commit_log, {partition}")
            started = time.perf_counter()
            with conn.transaction(), conn.cursor() as cursor:
                _copy(cursor, "delaysvc.commit_log", MESSAGE_COLUMNS, message_rows)
                _copy(cursor, partition, LEVEL_COLUMNS, level_rows)
            return (time.perf_counter() - started) * 1e3

        def queue_as_index() -> float:
            conn.execute("TRUNCATE public.cl_indexed")
            started = time.perf_counter()
            with conn.transaction(), conn.cursor() as cursor:
                _copy(cursor, "public.cl_indexed", MESSAGE_COLUMNS, message_rows)
            return (time.perf_counter() - started) * 1e3

        results = alternate(
            {
                "commit log + level queue (as migrated)": as_migrated,
                "commit log, the queue an index of it": queue_as_index,
            },
            rounds,
        )
        conn.close()
    print_spread(results, f"ms to store {ROWS:,} level messages")


def _copy(cursor: psycopg.Cursor[Any], table: str, columns: str, data: bytes) -> None:
    with cursor.copy(f"COPY {table} ({columns}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.write(data)


if __name__ == "__main__":
    main()
