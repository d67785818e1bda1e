"""Buffers one delivery move of 100 due rows touches at 10k, 100k and 1M pending, for a level lane
and the timer lane (the same measure as tests/integration/test_tick_cost.py, at a larger scale).

Run from the repository root: python docs/benchmarks/tick_cost_1m.py [SERVER_URL]
(default postgresql://root@127.0.0.1:5432/postgres); it works in a database of its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scratch import scratch_database

from tests.integration.test_tick_cost import _buffers, _fill

SERVER = sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres"
DATABASE = "delaysvc_tick_cost"


def main() -> None:
    with scratch_database(SERVER, DATABASE, delay_levels="1s 2s") as (engine, _):
        for lane in (1, 0):
            filled = 0
            for pending in (10_000, 100_000, 1_000_000):
                _fill(engine, lane, pending - filled)
                filled = pending
                with engine.connect() as conn:
                    touched = _buffers(conn, lane)
                name = "timer" if lane == 0 else f"level {lane}"
                print(f"{name}: {pending:>9,} pending -> a move of 100 touches {touched} buffers")


if __name__ == "__main__":
    main()
