"""What each part of the commit log costs a batch's COPY: the index or column behind the
batch send's database limit (issue 36: "say which index or column costs what").

    python docs/benchmarks/batch_write_costs.py postgresql://root@127.0.0.1:5432/SCRATCH [ROWS]

The database must be migrated (`delaysvc migrate`). In a scratch schema it makes a copy of
`commit_log` (its columns, defaults, checks and indexes) per variant: as it is, without each
index in turn, without any index, and the raw limit's plain table (`delaysvc.bench.raw`), then
COPYs the same ROWS (default 100,000) batch rows into each in binary (the batch's own
`MESSAGE_ROW`, built once beforehand, so Python costs every variant the same), two rounds,
variants alternating, each in a transaction rolled back. Prints rows/s per variant, its share
of the raw table's rate, and what dropping the index saves per row.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import psycopg

from delaysvc.bench import raw
from delaysvc.bench.raw import BODY
from delaysvc.db.engines import libpq_url
from delaysvc.store.batches import LEVEL_ROW, MESSAGE_ROW, wire_time

SCHEMA = "batch_costs"


def variants(conn: psycopg.Connection) -> dict[str, str | None]:
    """variant -> the index it drops (None: all kept; "*": all dropped)."""
    names = [
        row[0]
        for row in conn.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = 'delaysvc' "
            "AND tablename = 'commit_log' ORDER BY indexname"
        )
    ]
    found: dict[str, str | None] = {"commit_log as it is": None}
    found.update({f"without {name}": name for name in names})
    found["without any index"] = "*"
    return found


def make_tables(conn: psycopg.Connection, drops: dict[str, str | None]) -> dict[str, str]:
    """variant -> its table in SCHEMA: commit_log's columns, defaults and constraints, and its
    indexes but the one the variant drops."""
    conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    conn.execute(f"CREATE SCHEMA {SCHEMA}")
    indexes = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'delaysvc' "
        "AND tablename = 'commit_log'"
    ).fetchall()
    tables = {}
    for number, (variant, drop) in enumerate(drops.items()):
        table = f"{SCHEMA}.v{number}"
        conn.execute(
            f"CREATE TABLE {table} (LIKE delaysvc.commit_log INCLUDING ALL EXCLUDING INDEXES)"
        )
        for name, definition in indexes:
            if drop == "*" or name == drop:
                continue
            made = definition.replace("delaysvc.commit_log", table)
            conn.execute(made.replace(f"INDEX {name} ", f"INDEX v{number}_{name} "))
        tables[variant] = table
    conn.execute(raw.RAW_TABLE.format(name=f"{SCHEMA}.raw"))
    conn.execute(f"CREATE TABLE {SCHEMA}.lane (LIKE delaysvc.consume_queue_1 INCLUDING ALL)")
    conn.commit()
    return tables


def rows(count: int) -> list[tuple[object, ...]]:
    now = datetime.now(UTC)
    stored, due = wire_time(now), wire_time(now + timedelta(hours=1))  # as the layouts take times
    return [
        (n, "bench.noop", None, None, BODY, True, None, 1, 0, 1, n, "scheduled", stored, due, None)
        for n in range(1, count + 1)
    ]


def copy_rate(
    conn: psycopg.Connection,
    table: str,
    layout: Sequence[tuple[str, str]],
    data: Sequence[tuple[object, ...]],
) -> float:
    """Rows/s of one binary COPY of `data` into `table`, rolled back."""
    columns = ", ".join(name for name, _ in layout)
    with conn.cursor() as cursor:
        started = time.perf_counter()
        with cursor.copy(f"COPY {table} ({columns}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types([kind for _, kind in layout])
            for row in data:
                copy.write_row(row)
        seconds = time.perf_counter() - started
    conn.rollback()
    return len(data) / seconds


def main(url: str, count: int) -> None:
    with psycopg.connect(libpq_url(url)) as conn:
        drops = variants(conn)
        tables = make_tables(conn, drops)
        data = rows(count)
        raw_rows = [("t", BODY) for _ in range(count)]
        lane_rows = [(1, n, n, "bench.noop", row[13], 0) for n, row in enumerate(data, 1)]
        rates: dict[str, list[float]] = {}
        for round_ in range(2):
            print(f"round {round_ + 1}", file=sys.stderr)
            rates.setdefault("raw two-column table", []).append(
                copy_rate(conn, f"{SCHEMA}.raw", (("topic", "text"), ("body", "bytea")), raw_rows)
            )
            for variant, table in tables.items():
                rates.setdefault(variant, []).append(copy_rate(conn, table, MESSAGE_ROW, data))
            rates.setdefault("a level's queue row (consume_queue_1)", []).append(
                copy_rate(conn, f"{SCHEMA}.lane", LEVEL_ROW, lane_rows)
            )
        conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")
        conn.commit()
    raw = max(rates["raw two-column table"])
    whole = max(rates["commit_log as it is"])
    print(f"{count:,} rows a COPY, best of 2 rounds, rows/s; share of the raw table's rate")
    print(f"{'variant':58s} {'rows/s':>10s} {'share':>6s} {'saves/row':>10s}")
    for variant, measured in rates.items():
        best = max(measured)
        saves = (1 / whole - 1 / best) * 1e6 if variant.startswith("without") else None
        print(
            f"{variant:58s} {best:10,.0f} {best / raw:6.1%} "
            + (f"{saves:8.2f}us" if saves is not None else "")
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 100_000)
