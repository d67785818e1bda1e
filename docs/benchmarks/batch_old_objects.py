"""A `send_batch` of 10,000 with its objects counted old when it ends (`gc.freeze()` then
`gc.unfreeze()` after the batch: tried, and not taken) against the collector merely held off
and on again (`batching.collector_paused`, the tree), in turn in one process on one database.
Each round times 5 batches (each message its own body, as the send suite's), the items made
then sent, the caller keeping each batch's Messages until the next one's come back, as an
application holding its results does: a batch's time with its items made, and the send's
alone; the time spent in collections is taken from `gc.callbacks`.

Run from the repository root:
python docs/benchmarks/batch_old_objects.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 5 rounds); it works in a database of its own.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds
from timing import alternate, print_spread

from delaysvc.producer import batching
from delaysvc.producer.sending import Producer

SIZE = 10_000
BATCHES = 5
held_off_only = batching.collector_paused  # the tree's, kept before `_round` swaps it


@contextmanager
def counted_old() -> Iterator[None]:
    """`collector_paused`, then every tracked object moved into the oldest generation at once,
    unless the application froze objects of its own."""
    with held_off_only():
        try:
            yield
        finally:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()


class Collections:
    """Seconds spent in the collector (`gc.callbacks`) since `seconds` was last set to 0."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


def _round(
    producer: Producer,
    paused: Callable[[], AbstractContextManager[None]],
    collections: Collections,
    spent: list[float],
    sends: list[float],
) -> float:
    """Median milliseconds of a batch in one round, its items made and sent; the median of
    the sends alone is appended to `sends`, the collector's time per batch to `spent`."""
    batching.collector_paused = paused
    times = []
    sent = []
    collections.seconds = 0.0
    kept: list[Any] = []
    for batch in range(BATCHES):
        made = time.perf_counter()
        items = [
            {"topic": "bench.noop", "body": {"order_id": batch * SIZE + n}, "delay": "1h"}
            for n in range(SIZE)
        ]
        started = time.perf_counter()
        kept = producer.send_batch(items)
        sent.append(time.perf_counter() - started)
        times.append(time.perf_counter() - made)
    del kept
    spent.append(collections.seconds / BATCHES * 1000)
    sends.append(statistics.median(sent) * 1000)
    return statistics.median(times) * 1000


def main() -> None:
    server, rounds = server_and_rounds()
    collections = Collections()
    ways = {"counted old (tried)": counted_old, "held off only (tree)": held_off_only}
    spent: dict[str, list[float]] = {way: [] for way in ways}
    sends: dict[str, list[float]] = {way: [] for way in ways}
    with scratch_database(server, "delaysvc_old_objects") as (engine, settings):
        producer = Producer(settings, engine)
        producer.send_batch([{"topic": "bench.noop", "body": 0, "delay": "1h"}])  # warm
        measures = {
            way: partial(_round, producer, paused, collections, spent[way], sends[way])
            for way, paused in ways.items()
        }
        results = alternate(measures, rounds)
    print_spread(results, "10,000 items made and sent, ms")
    print_spread(sends, "the send_batch alone, ms")
    print_spread(spent, "in collections, ms a batch")
    for what, taken in (("made and sent", results), ("the send alone", sends)):
        tried, tree = (statistics.median(times) for times in taken.values())
        print(f"{what}: tried / tree (medians) {tried / tree:.2f}x the time")


if __name__ == "__main__":
    main()
