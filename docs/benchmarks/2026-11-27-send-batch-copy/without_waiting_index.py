"""Would a slimmer commit log make send_batch faster? send_batch of 10,000, and the batch's
database write alone (`bench.suites._batch_database_write`), on two databases alternately: one
as migrated, one without `ix_commit_log_waiting_topic` (the commit log's dearest index in a
batch's COPY: `index_costs.py`), with a raw COPY of as many rows beside them.

    createdb -h 127.0.0.1 -U root batchslim
    DELAYSVC_DATABASE_URL=postgresql://root@127.0.0.1:5432/batchslim delaysvc migrate
    psql -h 127.0.0.1 -U root -d batchslim -c "DROP INDEX delaysvc.ix_commit_log_waiting_topic"
    python docs/benchmarks/2026-11-27-send-batch-copy/without_waiting_index.py \
        postgresql://root@127.0.0.1:5432/batchprof postgresql://root@127.0.0.1:5432/batchslim

The index is what a topic's backlog cap counts and delivers early by; this measures only what
it costs. Prints the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from delaysvc.bench import raw
from delaysvc.bench.suites import _batch_database_write, reset_tables
from delaysvc.config.settings import Settings
from delaysvc.db.engines import libpq_url, make_engine
from delaysvc.producer.sending import Producer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("as_migrated")
    parser.add_argument("without_index")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--size", type=int, default=10_000)
    args = parser.parse_args()
    sides = {}
    for name, url in (("as_migrated", args.as_migrated), ("without_index", args.without_index)):
        settings = Settings(database_url=url)
        sides[name] = (Producer(settings, make_engine(settings)), url)
    figures: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for name in sides if round_ % 2 == 0 else reversed(sides):
            producer, url = sides[name]
            reset_tables(producer.engine)
            items = [
                {"topic": "bench.noop", "body": {"order_id": n, "action": "cancel"}, "delay": "1h"}
                for n in range(args.size)
            ]
            started = time.perf_counter()
            producer.send_batch(items)
            rate = args.size / (time.perf_counter() - started)
            figures.setdefault(f"{name}_send_batch", []).append(rate)
            written = _batch_database_write(libpq_url(url), producer, args.size)
            figures.setdefault(f"{name}_database_write", []).append(written)
        figures.setdefault("raw_copy", []).append(
            raw.copy_rows(libpq_url(args.as_migrated), args.size)
        )
    print(json.dumps({name: round(statistics.median(v)) for name, v in figures.items()}))


if __name__ == "__main__":
    main()
