"""What a send_batch of 100,000 holds at its peak (tracemalloc), beside the size of its bodies
encoded (one copy of the batch as it is stored): the bodies are encoded as their rows are sent,
so the peak is the Messages returned and the items' checked fields, not the bodies.

    python docs/benchmarks/2026-11-27-send-batch-copy/memory.py \
        postgresql://root@127.0.0.1:5432/batchprof

tests/integration/test_send_batch.py asserts the same at a body of 3,000 bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from delaysvc.bench.suites import reset_tables
from delaysvc.config.settings import Settings
from delaysvc.config.validation import encode_body
from delaysvc.db.engines import make_engine
from delaysvc.producer.sending import Producer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--body-bytes", type=int, default=2000)
    args = parser.parse_args()
    settings = Settings(database_url=args.url)
    producer = Producer(settings, make_engine(settings))
    reset_tables(producer.engine)
    filler = "x" * args.body_bytes  # one string for all items
    items = [
        {"topic": "t.big", "body": {"n": n, "filler": filler}, "delay": "1h"}
        for n in range(args.size)
    ]
    encoded = sum(len(encode_body(item["body"], 1 << 20)[0]) for item in items)
    tracemalloc.start()
    sent = producer.send_batch(items)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(sent) == args.size
    print(
        json.dumps(
            {
                "messages": args.size,
                "bodies_encoded_bytes": encoded,
                "peak_bytes": peak,
                "peak_per_message_bytes": round(peak / args.size),
                "peak_vs_bodies": round(peak / encoded, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
