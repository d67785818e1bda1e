"""What the index of every waiting message by topic (`ix_commit_log_waiting_topic`, dropped by
migration 0020) cost a `send_batch` of 10,000, side by side: one migrated database, the index
made and dropped again between rounds, so both ways meet the same disk in turn; the commit
log and its lanes emptied before each round. Each round times 5 batches of 10,000 (each message
its own body, as the send suite's) and takes their median.

Run from the repository root:
python docs/benchmarks/capped_index_batch.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 5 rounds); it works in a database of its own.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds

from delaysvc.producer.sending import Producer

SIZE = 10_000
BATCHES = 5
OLD_INDEX = (
    "CREATE INDEX ix_commit_log_waiting_topic ON delaysvc.commit_log (topic, deliver_ts) "
    "WHERE status IN ('scheduled', 'retrying')"
)


def _round(engine: Engine, producer: Producer, with_index: bool) -> float:
    """Median seconds of a batch of 10,000 in one round."""
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE delaysvc.commit_log, delaysvc.consume_queue"))
        conn.execute(text("DROP INDEX IF EXISTS delaysvc.ix_commit_log_waiting_topic"))
        if with_index:
            conn.execute(text(OLD_INDEX))
    times = []
    for batch in range(BATCHES):
        items = [
            {"topic": "bench.noop", "body": {"order_id": batch * SIZE + n}, "delay": "1h"}
            for n in range(SIZE)
        ]
        started = time.perf_counter()
        producer.send_batch(items)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    server, rounds = server_and_rounds()
    taken: dict[str, list[float]] = {"with the index (before 0020)": [], "without (0020)": []}
    with scratch_database(server, "delaysvc_capped_index") as (engine, settings):
        producer = Producer(settings, engine)
        producer.send_batch([{"topic": "bench.noop", "body": 0, "delay": "1h"}])  # warm
        for done in range(rounds):
            for way in taken:
                taken[way].append(_round(engine, producer, way.startswith("with the")))
            print(f"round {done + 1}/{rounds}", file=sys.stderr)
    print(f"send_batch of {SIZE:,}: median of {BATCHES} batches a round, {rounds} rounds in turn")
    print(f"{'':32} {'msg/s each round':>48}")
    for way, seconds in taken.items():
        rates = "  ".join(f"{SIZE / s:>8,.0f}" for s in seconds)
        print(f"{way:32} {rates}")
    before, after = (statistics.median(s) for s in taken.values())
    print(f"without / with, median: {before / after:.2f}x msg/s")


if __name__ == "__main__":
    main()
