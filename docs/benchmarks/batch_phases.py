"""Where a `send_batch` of 10,000 spends its wall time, phase by phase: the checks (Python, with
the database drawing the batch's ids meanwhile since 2026-12-02), the placing, planning and
drawing of offsets (`reserve`: the database alone), each COPY while its rows are written
(Python and the database side by side) and its end (the database catching up), and the rest.
Each phase is timed by wrapping the function that does it; the figures are per message,
summed over ten batches.

Run from the repository root: python docs/benchmarks/batch_phases.py [SERVER_URL]
(default postgresql://root@127.0.0.1:5432/postgres); it works in a database of its own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scratch import scratch_database

from delaysvc.producer import batching
from delaysvc.producer.sending import Producer
from delaysvc.store import batches

SERVER = sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres"
SIZE = 10_000
ROUNDS = 10
spent: dict[str, float] = {}


def _add(phase: str, seconds: float) -> None:
    spent[phase] = spent.get(phase, 0.0) + seconds


def _timed(module: Any, name: str, phase: str) -> None:
    function: Callable[..., Any] = getattr(module, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _add(phase, time.perf_counter() - started)

    setattr(module, name, timed)


def _timed_copies() -> None:
    copying = batches.copying

    @contextmanager
    def timed(cursor: Any, table: str, row: Any) -> Iterator[Any]:
        started = time.perf_counter()
        with copying(cursor, table, row) as copy:
            yield copy
            written = time.perf_counter()
        _add(f"COPY {table}: rows written", written - started)
        _add(f"COPY {table}: its end (the database catching up)", time.perf_counter() - written)

    batches.copying = timed  # type: ignore[assignment]


def main() -> None:
    _timed(batching, "prepare", "checks (the database drawing the ids meanwhile)")
    _timed(batching, "_placed", "levels placed (a query)")
    _timed(batching, "_plan", "plan (keys, lanes)")
    _timed(batches, "reserve", "offsets drawn (reserve: the database alone)")
    _timed(batches, "count_into_lanes", "lanes counted")
    _timed_copies()
    with scratch_database(SERVER, "delaysvc_batch_phases") as (engine, settings):
        producer = Producer(settings, engine)
        items = [
            {"topic": "bench.noop", "body": {"order_id": n, "action": "cancel"}, "delay": "1h"}
            for n in range(SIZE)
        ]
        producer.send_batch(items)  # warm: connections, plans
        spent.clear()
        started = time.perf_counter()
        for _ in range(ROUNDS):
            producer.send_batch(items)
        whole = time.perf_counter() - started
    per_message = 1e6 / (ROUNDS * SIZE)
    for phase, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"{phase:55} {seconds * per_message:6.2f} us  {seconds / whole:6.1%}")
    rest = whole - sum(spent.values())
    other = "the rest (connection, commit, Messages dropped, ...)"
    print(f"{other:55} {rest * per_message:6.2f} us  {rest / whole:6.1%}")
    print(f"{'send_batch of 10,000, whole':55} {whole * per_message:6.2f} us a message")


if __name__ == "__main__":
    main()
