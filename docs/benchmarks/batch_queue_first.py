"""A `send_batch` of 10,000 with its level queue's rows COPYed before the commit log's, beside
the batch as it was at fa49ab2 (2026-12-07-lazy-batch-result).

The idea: PostgreSQL keeps up with the queue's narrow rows as Python writes them, and falls
behind on the commit log's; with the commit log last, the Messages could be made while it
catches up, where Python waited. Four variants take turns, round after round, us a message
over 10 batches a round:

- "as it is": `send_batch` of the checkout (at fa49ab2 it made every Message before its last
  COPY ended; from 53cd230 on it makes none until they are read);
- "as it is, Messages not made": the same with `Message.sent` giving the id only;
- "queue first, Messages in catch-up": the queue's COPY, then the commit log's, the Messages
  made before its end;
- "queue first, Messages not made".

The queue-first variants store the bench's shape only (one level, no keys, no caps).

Run from the repository root:
    python docs/benchmarks/batch_queue_first.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 7 rounds); it works in a database of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_ceiling import BATCHES, SIZE, messages_unmade, per_message
from scratch import batch_lots, scratch_database, server_and_rounds
from timing import alternate, print_spread

from delaysvc.config.validation import encode_body
from delaysvc.producer import batching, message
from delaysvc.producer.placement import elapsed_after
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import level_partition
from delaysvc.store import batches

SERVER, ROUNDS = server_and_rounds(7)


def copied_queue_first(make_messages: bool) -> Callable[..., Any]:
    """`batching._copied` for one level and no keys, the queue's rows COPYed first."""

    def copied(
        cursor: Any,
        items: Sequence[batching.Item],
        plan: Any,
        drawn: list[int],
        reserved: batches.Reserved,
        max_body_bytes: int,
    ) -> Any:
        ids = drawn[: len(plan.creating)]
        stored_at, (offsets,) = reserved
        stored = batches.wire_time(stored_at)
        due_after: dict[int, tuple[datetime, int]] = {}
        dues, wire_dues = [], []
        for item in items:
            delay = item.delay_ms or 0
            if delay not in due_after:
                after = elapsed_after(stored_at, delay)
                due_after[delay] = after, batches.wire_time(after)
            due, wire_due = due_after[delay]
            dues.append(due)
            wire_dues.append(wire_due)
        (lane,) = plan.lanes
        with batches.copying(cursor, level_partition(lane), batches.LEVEL_ROW) as copy:
            for item, message_id, wire_due, offset in zip(
                items, ids, wire_dues, offsets, strict=True
            ):
                copy.write_row((item.lane, offset, message_id, item.topic, wire_due, item.priority))
        with batches.copying(cursor, "commit_log", batches.MESSAGE_ROW) as copy:
            for item, message_id, wire_due, offset in zip(
                items, ids, wire_dues, offsets, strict=True
            ):
                topic, body, lane, level, _, _, key, tags, properties, priority = item
                data, is_json = encode_body(body, max_body_bytes)
                row = (message_id, topic, key, tags, data, is_json, properties, level, priority)
                copy.write_row((*row, lane, offset, "scheduled", stored, wire_due, None))
            made: list[Any] = ids
            if make_messages:  # while the server catches up on the commit log's rows
                sent = message.Message.sent
                made = [
                    sent(item, id, stored_at, due)
                    for item, id, due in zip(items, ids, dues, strict=True)
                ]
        batches.count_into_lanes(cursor, plan.lanes)
        return made

    return copied


def main() -> None:
    with scratch_database(SERVER, "delaysvc_batch_queue_first") as (engine, settings):
        producer = Producer(settings, engine)
        lots = batch_lots(BATCHES, SIZE)
        original = batching._copied

        def queue_first(make_messages: bool) -> Callable[[list[dict[str, Any]]], object]:
            def send(items: list[dict[str, Any]]) -> object:
                batching._copied = copied_queue_first(make_messages)
                try:
                    return producer.send_batch(items)
                finally:
                    batching._copied = original

            return send

        ways = {
            "as it is": producer.send_batch,
            "as it is, Messages not made": messages_unmade(producer),
            "queue first, Messages in catch-up": queue_first(True),
            "queue first, Messages not made": queue_first(False),
        }
        for send in ways.values():
            send(lots[0])  # warm: connections, plans
        times = alternate(
            {name: (lambda send=send: per_message(send, lots)) for name, send in ways.items()},
            ROUNDS,
        )
    print(f"send_batch of {SIZE:,}, {BATCHES} a round, {ROUNDS} rounds, us a message")
    print_spread(times, "variant")


if __name__ == "__main__":
    main()
