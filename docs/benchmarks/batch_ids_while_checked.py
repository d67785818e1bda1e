"""A `send_batch` of 10,000 with its ids drawn while its items are checked (the tree:
`batches.drawing_ids` sends the statement in pipeline mode and reads it after the checks)
against the same statement run after the checks (the way before 6eca5bd, but for the ids and
the offsets having been one statement then: one round trip more here), and against that with
each item's tuple also made through `Item`'s own `__new__` (before 6eca5bd too), in turn in
one process on one database. Each round times 5 batches (each message its own body, as the
send suite's), the caller keeping each batch's Messages until the next one's come back. Then
the checks alone (`batching.prepare` of the same 10,000 items, no database), their tuples made
either way, in turn.

It measures the code of 2026-12-02 (`batches.drawing_ids`, replaced by `batches.drawing` on
2026-12-04, which draws the first item's lane's offsets too): run it from a checkout of 001a98f.

Run from the repository root:
python docs/benchmarks/batch_ids_while_checked.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 10 rounds); it works in a database of its own.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds
from timing import alternate, per_call_us, print_spread

from delaysvc.producer import batching
from delaysvc.producer.sending import Producer
from delaysvc.store import batches

SIZE = 10_000
BATCHES = 5
TREE = (batches.drawing_ids, batching._new_tuple)


@contextmanager
def ids_after(cursor: Any, count: int) -> Iterator[batches.DrawnIds]:
    """The ids drawn once the block (the checks) has ended, the database idle meanwhile."""
    drawn = batches.DrawnIds()
    yield drawn
    with TREE[0](cursor, count) as after:
        pass
    drawn.ids = after.ids


def through_new(cls: Any, values: tuple[Any, ...]) -> Any:
    return cls(*values)


WAYS = {
    "ids while checked (tree)": TREE,
    "ids after the checks": (ids_after, TREE[1]),
    "ids after, items through __new__": (ids_after, through_new),
}


def _round(producer: Producer, way: tuple[Any, Any]) -> float:
    """Median milliseconds of a `send_batch` of 10,000 in one round."""
    batches.drawing_ids, batching._new_tuple = way
    times = []
    kept: list[Any] = []
    for batch in range(BATCHES):
        items = [
            {"topic": "bench.noop", "body": {"order_id": batch * SIZE + n}, "delay": "1h"}
            for n in range(SIZE)
        ]
        started = time.perf_counter()
        kept = producer.send_batch(items)
        times.append(time.perf_counter() - started)
    del kept
    return statistics.median(times) * 1000


def main() -> None:
    server, rounds = server_and_rounds(10)
    with scratch_database(server, "delaysvc_ids_while_checked") as (engine, settings):
        producer = Producer(settings, engine)
        producer.send_batch([{"topic": "bench.noop", "body": 0, "delay": "1h"}])  # warm
        results = alternate(
            {name: partial(_round, producer, way) for name, way in WAYS.items()}, rounds
        )
    print_spread(results, "send_batch of 10,000, ms")
    tree = statistics.median(results["ids while checked (tree)"])
    for name, times in results.items():
        print(f"{name}: {statistics.median(times) / tree:.2f}x the tree's time (medians)")
    items = [{"topic": "bench.noop", "body": {"order_id": n}, "delay": "1h"} for n in range(SIZE)]
    now = datetime.now().astimezone()

    def checks(make: Any) -> float:
        batching._new_tuple = make
        return per_call_us(lambda: batching.prepare(items, settings, now), 20, warm=2) / SIZE

    ways = {"made straight (tree)": TREE[1], "through __new__": through_new}
    checked = alternate({name: partial(checks, make) for name, make in ways.items()}, rounds)
    print_spread(checked, "the checks alone, us an item")


if __name__ == "__main__":
    main()
