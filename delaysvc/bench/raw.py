"""The raw PostgreSQL limits of this machine, measured in the same run as the service so each
service figure can be shown as a ratio: one-row INSERT per transaction, COPY, and moving rows
between two plain tables in batches (what a delivery does, without the service)."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

from delaysvc.bench.progress import Progress

RAW_TABLE = """CREATE TABLE {name} (
    id bigserial PRIMARY KEY, topic text NOT NULL, body bytea NOT NULL,
    deliver_ts timestamptz NOT NULL DEFAULT now())"""
BODY = b'{"order_id": 42, "action": "cancel"}'


def _fresh(conn: psycopg.Connection, *names: str) -> None:
    """Plain logged tables shaped like a narrow message row, as the service's are."""
    for name in names:
        conn.execute(f"DROP TABLE IF EXISTS {name}")
        conn.execute(RAW_TABLE.format(name=name))


def insert_one_row_per_transaction(
    url: str, clients: int, seconds: float, processes: bool = False
) -> float:
    """Rows/s with `clients` connections each committing one INSERT at a time (`processes`:
    each a process of its own, else a thread)."""
    with psycopg.connect(url, autocommit=True) as conn:
        _fresh(conn, "bench_raw_insert")
    if processes:
        return per_second_in_processes(_insert_client, url, clients, seconds)
    return per_second(lambda stop: _insert_client(url)(stop), clients, seconds)


def _insert_client(url: str) -> Callable[[float], int]:
    conn = psycopg.connect(url, autocommit=True)

    def run(stop: float) -> int:
        done = 0
        with conn:
            while time.monotonic() < stop:
                conn.execute(
                    "INSERT INTO bench_raw_insert (topic, body) VALUES (%s, %s)", ("t", BODY)
                )
                done += 1
        return done

    return run


def per_second(client: Callable[[float], int], clients: int, seconds: float) -> float:
    """Run `clients` threads of `client(stop_at)` (each returns how much it did by the
    monotonic time `stop_at`) for `seconds`; -> their total per second."""
    stop = time.monotonic() + seconds
    with ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(client, [stop] * clients))
    return done / seconds


Client = Callable[[Any], Callable[[float], int]]
"""A client of `per_second_in_processes`: a module-level function that gets ready (imports,
connects, warms up) with its argument and returns what runs until the monotonic time `stop`,
returning how much it did."""


def per_second_in_processes(client: Client, arg: Any, clients: int, seconds: float) -> float:
    """`per_second` with each client a process of its own (spawned: nothing of this process
    is shared), as an application's clients are. The clock starts once every one is ready;
    every process is ended before this returns, also when one fails."""
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(clients + 1)
    results = context.Queue()
    processes = [
        context.Process(target=_run_client, args=(client, arg, ready, seconds, results))
        for _ in range(clients)
    ]
    for process in processes:
        process.start()
    try:
        ready.wait(timeout=300)
        done = sum(results.get(timeout=seconds + 300) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    return done / seconds


def _run_client(
    client: Client, arg: Any, ready: Any, seconds: float, results: multiprocessing.Queue
) -> None:
    run = client(arg)
    ready.wait(timeout=300)
    results.put(run(time.monotonic() + seconds))


def copy_rows(url: str, rows: int) -> float:
    """Rows/s of one COPY of `rows` rows."""
    with psycopg.connect(url, autocommit=True) as conn:
        _fresh(conn, "bench_raw_copy")
        started = time.perf_counter()
        copy_in = "COPY bench_raw_copy (topic, body) FROM STDIN"
        with conn.transaction(), conn.cursor() as cursor, cursor.copy(copy_in) as copy:
            for _ in range(rows):
                copy.write_row(("t", BODY))
        return rows / (time.perf_counter() - started)


def move_rows(url: str, rows: int, batch: int, progress: Progress) -> float:
    """Rows/s moved from one plain table to another, `batch` rows per transaction, in id order
    with FOR UPDATE SKIP LOCKED: the bare bones of a delivery."""
    with psycopg.connect(url, autocommit=True) as conn:
        _fresh(conn, "bench_raw_src", "bench_raw_dst")
        conn.execute(
            "INSERT INTO bench_raw_src (topic, body) SELECT 't', %s FROM generate_series(1, %s)",
            (BODY, rows),
        )
        conn.execute("VACUUM ANALYZE bench_raw_src")
        moved = 0
        started = time.perf_counter()
        while moved < rows:
            count = conn.execute(
                """WITH m AS (
                       DELETE FROM bench_raw_src WHERE id IN (
                           SELECT id FROM bench_raw_src ORDER BY id LIMIT %s
                           FOR UPDATE SKIP LOCKED)
                       RETURNING *)
                   INSERT INTO bench_raw_dst SELECT * FROM m""",
                (batch,),
            ).rowcount
            if count == 0:
                break
            moved += count
            progress.update(moved)
        return moved / (time.perf_counter() - started)
