"""What is left to take from a `send_batch` of 10,000 in Python: the batch as it is, beside
two variants priced in the same run (2026-12-06-batch-ceiling):

- "Messages not made": `Message.sent` replaced by a function giving the id, so the batch makes
  no Message (what making them costs; the API returns them, so this is a price, not a way);
- "checks in the commit log's COPY": each item checked as its commit-log row is written
  (checked lazily, as `_copied` reads it) instead of all before, the ids drawn while the first
  500 are checked, so that PostgreSQL stores rows while Python checks the next items (only a
  batch of one lane, no keys and no caps: the bench's).

The three take turns, round after round; us a message, over 10 batches a round.

Run from the repository root:
    python docs/benchmarks/batch_ceiling.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 7 rounds); it works in a database of its own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import batch_lots, scratch_database, server_and_rounds
from timing import alternate, print_spread

from delaysvc.producer import batching, message
from delaysvc.producer.sending import Producer
from delaysvc.store import batches

SERVER, ROUNDS = server_and_rounds(7)
SIZE = 10_000
BATCHES = 10
CHECKED_FIRST = 500  # items checked while the ids are drawn


class CheckedAsRead(Sequence[batching.Item]):
    """A batch's items, each checked the first time it is read (in order)."""

    def __init__(self, items: Sequence[Any], checker: batching._Checker):
        self.items, self.checker = items, checker
        self.done: list[batching.Item] = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: Any) -> Any:
        done = self.done
        while len(done) <= index:
            done.append(self.checker.item(self.items[len(done)]))
        return done[index]


def checks_in_the_copy(producer: Producer, items: Sequence[dict[str, Any]]) -> None:
    now = datetime.now().astimezone()

    def write(conn: Any) -> Any:
        with conn.transaction(), conn.psycopg_cursor() as cursor:
            checked = CheckedAsRead(items, batching._Checker(producer.settings, now))
            first = checked[0]
            with batches.drawing(cursor, len(items), first.lane, first.delay_ms or 0) as drawn:
                checked[min(CHECKED_FIRST, len(items)) - 1]
            reserved = batches.Reserved(drawn.stored_at, [drawn.offsets or []])
            plan = batching._Plan(list(range(len(items))), {}, {}, {first.lane: len(items)})
            max_bytes = producer.settings.max_body_bytes
            return batching._copied(cursor, checked, plan, drawn.ids, reserved, max_bytes)

    with batching.collector_paused():
        producer._write(None, write)


def per_message(send: Callable[[list[dict[str, Any]]], object], lots: list[Any]) -> float:
    started = time.perf_counter()
    for items in lots:
        send(items)
    return (time.perf_counter() - started) / (len(lots) * SIZE) * 1e6


def messages_unmade(producer: Producer) -> Callable[[list[dict[str, Any]]], object]:
    """`producer.send_batch` with `Message.sent` giving the id alone: no Message made."""
    made = message.Message.sent

    def unmade(cls: Any, item: Any, id: int, *_: Any, **__: Any) -> int:
        return id

    def send(items: list[dict[str, Any]]) -> object:
        message.Message.sent = classmethod(unmade)  # type: ignore[method-assign,assignment]
        try:
            return producer.send_batch(items)
        finally:
            message.Message.sent = made  # type: ignore[method-assign]

    return send


def main() -> None:
    with scratch_database(SERVER, "delaysvc_batch_ceiling") as (engine, settings):
        producer = Producer(settings, engine)
        lots = batch_lots(BATCHES, SIZE)
        without_messages = messages_unmade(producer)

        def streamed(items: list[dict[str, Any]]) -> None:
            checks_in_the_copy(producer, items)

        producer.send_batch(lots[0])  # warm: connections, plans
        streamed(lots[0])
        times = alternate(
            {
                "send_batch as it is": lambda: per_message(producer.send_batch, lots),
                "Messages not made": lambda: per_message(without_messages, lots),
                "checks in the commit log's COPY": lambda: per_message(streamed, lots),
            },
            ROUNDS,
        )
    print(f"send_batch of {SIZE:,}, {BATCHES} a round, {ROUNDS} rounds, us a message")
    print_spread(times, "variant")


if __name__ == "__main__":
    main()
