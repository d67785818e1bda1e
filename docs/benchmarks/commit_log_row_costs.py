"""What PostgreSQL spends on each part of a batch's rows: 10,000 messages of a `send_batch` (the
send suite's shape: one topic, a body each, a level) COPYed into the commit log and into their
level's partition as migrated, and into copies of each with fewer indexes. The rows are read
back once, as binary COPY data, and sent again as that block, so no Python runs per row: a COPY's
time is the server's (the client only hands it the bytes). Each table is emptied (TRUNCATE)
before its COPY; the ways in turn, round after round.

- commit log, as migrated: its primary key (id) and its partial indexes (a held key, running,
  retrying, finished), whose predicates every row is checked against;
- primary key only: `LIKE delaysvc.commit_log` with its primary key;
- primary key only, status text: the same with `status` a plain text column, not the
  `message_status` domain whose rule every row is checked against;
- no index: the same with no index at all;
- level partition, as migrated: primary key (level, queue_offset);
- level partition, no index.

Run from the repository root:
    python docs/benchmarks/commit_log_row_costs.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 15 rounds).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psycopg
from scratch import batch_lots, copy_data, scratch_database, server_and_rounds
from timing import alternate, print_spread

from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import level_partition
from delaysvc.store.batches import LEVEL_ROW, MESSAGE_ROW

ROWS = 10_000
LEVEL = 17  # "1h" of the default levels: the send suite's
MESSAGE_COLUMNS = ", ".join(name for name, _ in MESSAGE_ROW)
LEVEL_COLUMNS = ", ".join(name for name, _ in LEVEL_ROW)
COPIES = [
    "CREATE TABLE public.cl_key (LIKE delaysvc.commit_log INCLUDING DEFAULTS, PRIMARY KEY (id))",
    "CREATE TABLE public.cl_key_text (LIKE public.cl_key INCLUDING DEFAULTS, PRIMARY KEY (id))",
    "ALTER TABLE public.cl_key_text ALTER COLUMN status TYPE text",
    "CREATE TABLE public.cl_bare (LIKE delaysvc.commit_log INCLUDING DEFAULTS)",
    "CREATE TABLE public.queue_bare (LIKE delaysvc.consume_queue INCLUDING DEFAULTS)",
]


def main() -> None:
    server, rounds = server_and_rounds(15)
    with scratch_database(server, "delaysvc_commit_log_row_costs") as (engine, settings):
        Producer(settings, engine).send_batch(batch_lots(1, ROWS)[0])
        assert settings.database_url is not None
        conn = psycopg.connect(libpq_url(settings.database_url), autocommit=True)
        message_rows = copy_data(conn, "delaysvc.commit_log", MESSAGE_COLUMNS, "id")
        level_rows = copy_data(conn, "delaysvc.consume_queue", LEVEL_COLUMNS, "queue_offset")
        for statement in COPIES:
            conn.execute(statement)
        partition = f"delaysvc.{level_partition(LEVEL)}"
        ways = {
            "commit log, as migrated": ("delaysvc.commit_log", MESSAGE_COLUMNS, message_rows),
            "primary key only": ("public.cl_key", MESSAGE_COLUMNS, message_rows),
            "primary key only, status text": ("public.cl_key_text", MESSAGE_COLUMNS, message_rows),
            "no index": ("public.cl_bare", MESSAGE_COLUMNS, message_rows),
            "level partition, as migrated": (partition, LEVEL_COLUMNS, level_rows),
            "level partition, no index": ("public.queue_bare", LEVEL_COLUMNS, level_rows),
        }

        def copy_ms(table: str, columns: str, data: bytes) -> float:
            conn.execute(f"TRUNCATE {table}")
            with conn.transaction(), conn.cursor() as cursor:
                started = time.perf_counter()
                with cursor.copy(f"COPY {table} ({columns}) FROM STDIN (FORMAT BINARY)") as copy:
                    copy.write(data)
                return (time.perf_counter() - started) * 1e3

        results = alternate({way: partial(copy_ms, *args) for way, args in ways.items()}, rounds)
        conn.close()
    print_spread(results, f"ms a COPY of {ROWS:,} rows")


if __name__ == "__main__":
    main()
