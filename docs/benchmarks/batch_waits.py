"""Where a `send_batch` of 10,000 waits for PostgreSQL: the wall time of each wait of the
client's connection (`psycopg.Connection.wait`), by where in the batch it waits, and the share
of the batch's wall time Python's own CPU takes (`time.process_time`).

Run from the repository root:
    python docs/benchmarks/batch_waits.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 3 rounds of 10 batches); it works in a database of its own.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds

from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds(3)
SIZE = 10_000
BATCHES = 10
# the frames a wait is named by, innermost last
PLACES = {
    "drawing": "the ids and offsets drawn while Python checks",
    "_copy_lanes": "the lanes' COPY",
    "_copied": "the commit log's COPY",
    "count_into_lanes": "the lanes' counts",
    "_connection": "commit",
}


def place() -> str:
    """The part of a batch a wait is in, by the innermost of PLACES on the caller's stack
    (walked frame by frame: a traceback's summary would cost the batch more than its waits)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in PLACES:
            return PLACES[frame.f_code.co_name]
        frame = frame.f_back
    return "elsewhere"


def main() -> None:
    waited: Counter[str] = Counter()
    unwrapped = psycopg.Connection.wait

    def wait(self: Any, gen: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return unwrapped(self, gen, *args, **kwargs)
        finally:
            spent = time.perf_counter() - started
            waited[place()] += spent

    with scratch_database(SERVER, "delaysvc_batch_waits") as (engine, settings):
        producer = Producer(settings, engine)
        lots = [
            [
                {"topic": "bench.noop", "body": {"order_id": n, "action": "cancel"}, "delay": "1h"}
                for n in range(start, start + SIZE)
            ]
            for start in range(0, BATCHES * SIZE, SIZE)
        ]
        producer.send_batch(lots[0])  # warm: connections, plans
        psycopg.Connection.wait = wait  # type: ignore[method-assign]
        for round_ in range(1, ROUNDS + 1):
            waited.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            for items in lots:
                producer.send_batch(items)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(
                f"round {round_}: {wall / BATCHES * 1e3:.1f} ms a batch, Python's CPU "
                f"{cpu / wall:.0%} of it; waits, ms a batch:"
            )
            for where, seconds in waited.most_common():
                print(f"  {seconds / BATCHES * 1e3:6.2f}  {where}")
        psycopg.Connection.wait = unwrapped  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
