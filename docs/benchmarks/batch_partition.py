"""A level's queue rows COPYed into the partitioned `consume_queue` (PostgreSQL routes each row
to its level's partition) against the same rows COPYed straight into the level's partition,
which a batch whose messages all go to one level does (`batching._copy_lanes`).

Binary COPY of ROWS rows of `LEVEL_ROW` (built once beforehand, so Python costs both ways the
same), the two ways alternating round after round, each in a transaction rolled back, on a
scratch database migrated as the service's.

Run from the repository root:
    python docs/benchmarks/batch_partition.py [SERVER_URL] [ROUNDS] [ROWS]
(default the local PostgreSQL, 15 rounds, 10,000 rows: a batch's).
"""

from __future__ import annotations

import itertools
import statistics
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import psycopg
from batch_write_costs import copy_rate
from scratch import scratch_database

from delaysvc.db.engines import libpq_url
from delaysvc.store.batches import LEVEL_ROW, wire_time

SERVER = sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres"
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 15
ROWS = int(sys.argv[3]) if len(sys.argv) > 3 else 10_000
LEVEL = 17  # the default levels' 1h, the send suite's batches'
WAYS = {
    "routed (consume_queue)": "consume_queue",
    "straight (its partition)": f"consume_queue_{LEVEL}",
}


def main() -> None:
    due = wire_time(datetime.now(UTC) + timedelta(hours=1))
    # each COPY its own offsets, as a lane's sequence gives them: a key rolled back before
    # leaves a dead index entry its repeat would be checked against
    drawn = itertools.count(1)

    def rows() -> list[tuple[object, ...]]:
        return [(LEVEL, next(drawn), n, "bench.noop", due, 0) for n in range(ROWS)]

    with scratch_database(SERVER, "delaysvc_batch_partition") as (engine, _):
        url = libpq_url(engine.url.render_as_string(hide_password=False))
        with psycopg.connect(url) as conn:
            for table in WAYS.values():  # warm: plans, the partition's relcache entry
                copy_rate(conn, f"delaysvc.{table}", LEVEL_ROW, rows())
            times: dict[str, list[float]] = {way: [] for way in WAYS}
            for round_ in range(ROUNDS):
                ways = list(WAYS.items())
                for way, table in ways if round_ % 2 == 0 else reversed(ways):
                    times[way].append(
                        ROWS / copy_rate(conn, f"delaysvc.{table}", LEVEL_ROW, rows())
                    )
    print(f"{ROWS:,} rows of level {LEVEL} a COPY, {ROUNDS} rounds alternating; us a row")
    print(f"{'way':28s} {'median':>7s} {'min':>7s} {'max':>7s}")
    for way, seconds in times.items():
        per_row = [s / ROWS * 1e6 for s in seconds]
        median = statistics.median(per_row)
        print(f"{way:28s} {median:7.3f} {min(per_row):7.3f} {max(per_row):7.3f}")
    routed, straight = (statistics.median(times[way]) for way in WAYS)
    print(f"straight / routed, medians: {straight / routed:.2f}x the time")


if __name__ == "__main__":
    main()
