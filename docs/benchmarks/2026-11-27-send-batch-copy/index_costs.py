"""What each part of the schema costs a batch's COPY: 10,000 commit-log rows COPYed (binary, as
`send_batch` sends them) into copies of `commit_log` with more and more of its indexes, into a
level's queue and the timer lane shaped as delaysvc's, the ids and offsets drawn, and a raw COPY
of as many rows into one plain table, alternately, each in a transaction of its own.

    python docs/benchmarks/2026-11-27-send-batch-copy/index_costs.py \
        postgresql://root@127.0.0.1:5432/batchprof --rounds 15

The copies live in a schema of their own (`batch_costs`, dropped at the end) beside a migrated
delaysvc schema (`delaysvc`), whose tables give them their columns. Prints each part's median
milliseconds per 10,000 rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from delaysvc.bench.raw import copy_rows  # noqa: E402
from delaysvc.store.batches import LEVEL_ROW, MESSAGE_ROW, TIMER_ROW, wire_time  # noqa: E402

BODY = b'{"order_id":42,"action":"cancel"}'
INDEXES = {
    "primary key (id)": "ALTER TABLE {t} ADD PRIMARY KEY (id)",
    "ix_commit_log_waiting_topic (topic, deliver_ts)": (
        "CREATE INDEX ON {t} (topic, deliver_ts) WHERE status IN ('scheduled', 'retrying')"
    ),
    "the other four (partial: keys, running, retrying, finished)": (
        "CREATE UNIQUE INDEX ON {t} (topic, key) WHERE key IS NOT NULL AND finished_at IS NULL;"
        "CREATE INDEX ON {t} (lease_until) WHERE status = 'running';"
        "CREATE INDEX ON {t} (topic) WHERE status = 'retrying';"
        "CREATE INDEX ON {t} (finished_at) WHERE finished_at IS NOT NULL"
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", type=int, default=10_000)
    args = parser.parse_args()
    rows = args.rows
    with psycopg.connect(args.url) as conn:
        tables = _make_tables(conn)
        times: dict[str, list[float]] = {}
        next_id = 1
        for _ in range(args.rounds):
            times.setdefault("raw COPY, one plain table", []).append(
                rows / copy_rows(args.url, rows)
            )
            for name, table in tables.items():
                ids = range(next_id, next_id + rows)
                next_id += rows
                times.setdefault(name, []).append(_copy(conn, table, ids))
            started = time.perf_counter()
            conn.execute(
                "SELECT ARRAY(SELECT nextval('batch_costs.ids') FROM generate_series(1, %s)), "
                "ARRAY(SELECT nextval('batch_costs.offsets') FROM generate_series(1, %s))",
                (rows, rows),
            ).fetchone()
            conn.commit()
            times.setdefault("ids and offsets drawn (reserve)", []).append(
                time.perf_counter() - started
            )
        conn.execute("DROP SCHEMA batch_costs CASCADE")
        conn.commit()
    print(
        json.dumps(
            {name: round(statistics.median(t) * 1000, 1) for name, t in times.items()}, indent=1
        )
    )


def _make_tables(conn: psycopg.Connection) -> dict[str, tuple[str, tuple]]:
    conn.execute("DROP SCHEMA IF EXISTS batch_costs CASCADE")
    conn.execute("CREATE SCHEMA batch_costs")
    conn.execute("CREATE SEQUENCE batch_costs.ids")
    conn.execute("CREATE SEQUENCE batch_costs.offsets")
    tables: dict[str, tuple[str, tuple]] = {}
    indexes: list[str] = []
    for n, (label, ddl) in enumerate([("no index", ""), *INDEXES.items()]):
        if ddl:
            indexes.append(label)
        table = f"batch_costs.commit_log_{n}"
        conn.execute(
            f"CREATE TABLE {table} (LIKE delaysvc.commit_log INCLUDING DEFAULTS "
            "INCLUDING CONSTRAINTS) WITH (fillfactor = 100)"
        )
        for made in [INDEXES[i] for i in indexes]:
            for statement in made.split(";"):
                conn.execute(statement.format(t=table))
        name = "commit_log, " + (" + ".join(indexes) if indexes else "no index")
        tables[name] = (table, MESSAGE_ROW)
    conn.execute(
        "CREATE TABLE batch_costs.level (LIKE delaysvc.consume_queue INCLUDING DEFAULTS, "
        "PRIMARY KEY (level, queue_offset))"
    )
    tables["a level's queue (primary key (level, queue_offset))"] = ("batch_costs.level", LEVEL_ROW)
    conn.execute(
        "CREATE TABLE batch_costs.timer (LIKE delaysvc.timer_queue INCLUDING DEFAULTS "
        "INCLUDING INDEXES)"
    )
    tables["the timer lane (primary key (deliver_ts, queue_offset))"] = (
        "batch_costs.timer",
        TIMER_ROW,
    )
    conn.commit()
    return tables


def _copy(conn: psycopg.Connection, target: tuple[str, tuple], ids: range) -> float:
    """Seconds to COPY rows with these ids (and offsets) into the table, and commit."""
    table, layout = target
    at = datetime.now(UTC)
    now, due = wire_time(at), wire_time(at + timedelta(hours=1))  # as the layouts take times
    columns = ", ".join(name for name, _ in layout)
    started = time.perf_counter()
    statement = f"COPY {table} ({columns}) FROM STDIN (FORMAT BINARY)"
    with conn.cursor() as cursor, cursor.copy(statement) as copy:
        copy.set_types([kind for _, kind in layout])
        for n in ids:
            if layout is MESSAGE_ROW:
                row: tuple = (n, "bench.noop", None, None, BODY, True, None, 17, 0, 17, n,
                              "scheduled", now, due, None)  # fmt: skip
            elif layout is LEVEL_ROW:
                row = (17, n, n, "bench.noop", due, 0)
            else:
                row = (due, n, n, "bench.noop", 0)
            copy.write_row(row)
    conn.commit()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
