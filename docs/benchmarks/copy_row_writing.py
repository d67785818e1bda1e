"""What psycopg's `Copy.write_row` costs a batch's rows on top of formatting them: 10,000
commit-log rows (`batches.MESSAGE_ROW`, as a batch's are) written by `write_row`, against the
same rows formatted by psycopg's own row formatter (`format_row_binary`, C in its binary build,
which `write_row` calls through two Python methods) into a buffer of ours, `write` every 32 KB.

Only this process's CPU is timed (`time.process_time`), on a binary COPY into a temporary
table of the commit log's row, rolled back; the two ways in turn, round after round. The second
way reaches into psycopg's private `_copy_base`: it is measured here, not used by the service.

Run from the repository root:
    python docs/benchmarks/copy_row_writing.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 15 rounds).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psycopg
from psycopg import Copy
from psycopg._copy_base import format_row_binary
from scratch import server_and_rounds
from timing import alternate, print_spread

from delaysvc.db.engines import libpq_url
from delaysvc.store.batches import MESSAGE_ROW

ROWS = 10_000
BODY = b'{"order_id":42,"action":"cancel"}'
SIGNATURE = b"PGCOPY\n\xff\r\n\0" + bytes(8)  # binary COPY's header: flags 0, no extension
TRAILER = b"\xff\xff"
COLUMNS = {"int8": "bigint", "text": "text", "text[]": "text[]", "bytea": "bytea"}
COLUMNS |= {"bool": "boolean", "jsonb": "jsonb", "int2": "smallint"}


def _rows() -> list[tuple[Any, ...]]:
    return [
        (n, "bench.noop", None, None, BODY, True, None, 17, 0, 17, n, "scheduled", n, n, None)
        for n in range(ROWS)
    ]


def by_write_row(copy: Copy, rows: list[tuple[Any, ...]]) -> None:
    write = copy.write_row
    for row in rows:
        write(row)


def by_formatter(copy: Copy, rows: list[tuple[Any, ...]]) -> None:
    transformer = copy.formatter.transformer
    buffer = bytearray(SIGNATURE)
    for row in rows:
        format_row_binary(row, transformer, buffer)
        if len(buffer) > 32_768:
            copy.write(buffer)
            buffer = bytearray()
    buffer += TRAILER
    copy.write(buffer)


def main() -> None:
    server, rounds = server_and_rounds(15)
    rows = _rows()
    columns = ", ".join(f"{name} {COLUMNS[kind]}" for name, kind in MESSAGE_ROW)
    with psycopg.connect(libpq_url(server)) as conn, conn.cursor() as cursor:
        cursor.execute(f"CREATE TEMP TABLE commit_log_row ({columns})")

        def us_a_row(write: Callable[[Copy, list[tuple[Any, ...]]], None]) -> float:
            with cursor.copy("COPY commit_log_row FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types([kind for _, kind in MESSAGE_ROW])
                started = time.process_time()
                write(copy, rows)
                used = time.process_time() - started
            cursor.execute("SELECT count(*) FROM commit_log_row")
            assert cursor.fetchone() == (ROWS,)
            cursor.execute("TRUNCATE commit_log_row")
            return used / ROWS * 1e6

        results = alternate(
            {
                "Copy.write_row": lambda: us_a_row(by_write_row),
                "format_row_binary": lambda: us_a_row(by_formatter),
            },
            rounds,
        )
    print_spread(results, "us of Python a row")


if __name__ == "__main__":
    main()
