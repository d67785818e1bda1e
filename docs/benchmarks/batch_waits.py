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
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import batch_lots, scratch_database, server_and_rounds

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
    frame: Any = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in PLACES:
            return PLACES[frame.f_code.co_name]
        frame = frame.f_back
    return "elsewhere"


def main() -> None:
    waited: dict[str, float] = {}
    unwrapped = psycopg.Connection.wait

    def wait(self: Any, gen: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return unwrapped(self, gen, *args, **kwargs)
        finally:
            spent = time.perf_counter() - started
            where = place()
            waited[where] = waited.get(where, 0.0) + spent

    with scratch_database(SERVER, "delaysvc_batch_waits") as (engine, settings):
        producer = Producer(settings, engine)
        lots = batch_lots(BATCHES, SIZE)
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
            for where, seconds in sorted(waited.items(), key=lambda wait: -wait[1]):
                print(f"  {seconds / BATCHES * 1e3:6.2f}  {where}")
        psycopg.Connection.wait = unwrapped  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
