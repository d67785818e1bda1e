"""What one lane row for a run of messages would buy a batch and cost its delivery: a
prototype priced beside the queue as it is, before anything is built (issue 36's batch target;
docs/benchmarks/2026-12-06-batch-ceiling named it the way left).

As it is, a message into a level is two rows: its commit-log row and its level's queue row
(`consume_queue`), each with its primary key's entry. The prototype keeps the commit log as it
is and gives the level one row per run of messages sharing lane, topic, due time and priority:
`lane_run (level, queue_offset, message_ids bigint[], topic, deliver_ts, priority)`, keyed as
`consume_queue` is. Its delivery takes the due runs and the messages in them that are still
waiting (a message cancelled inside a run stays in it, so the move reads each message's status
in the commit log by its primary key: what the queue row spares the move today).

Measured, variants in turn round after round, in one database:

- "batch": `send_batch` of 10,000 (the send suite's items, one level) as it is, and with its
  lane rows replaced by the run's one row (`batching._copy_lanes` swapped for the prototype's:
  the Messages made after the row is written, the same lane counts); us a message, 10 batches a
  round. Beside them the raw COPY the batch target is a share of (`delaysvc.bench.raw`).
- "delivery": 100,000 due messages of one level (10 batches) moved into their topic's queue by
  `store.delivery.move_due` (10,000 a statement, its whole statement: lateness buckets, counts,
  the schedule offset), and by the same statement over `lane_run` (one run a statement);
  us a message.

Run from the repository root:
    python docs/benchmarks/lane_runs.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 5 rounds); it works in a database of its own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import batch_lots, scratch_database, server_and_rounds
from timing import alternate, print_spread

from delaysvc.bench import raw
from delaysvc.db.names import sql
from delaysvc.producer import batching
from delaysvc.producer.sending import Producer
from delaysvc.store import delivery

SERVER, ROUNDS = server_and_rounds(5)
SIZE = 10_000
BATCHES = 10
NAME = "delaysvc_lane_runs"

LANE_RUN = """CREATE TABLE delaysvc.lane_run (
    level smallint, queue_offset bigint, message_ids bigint[] NOT NULL, topic text NOT NULL,
    deliver_ts timestamptz NOT NULL, priority smallint NOT NULL,
    PRIMARY KEY (level, queue_offset))"""

# a run's row: its first message's offset, its messages' ids in order
_INSERT_RUN = """INSERT INTO delaysvc.lane_run
    (level, queue_offset, message_ids, topic, deliver_ts, priority)
VALUES (%s, %s, CAST(%s AS bigint[]), %s, to_timestamp(%s / 1e6 + 946684800), %s)"""

# move_due's statement over the runs: its head, next head and locked rows as
# `delivery._MOVE_DUE_LEVEL` has them, read from `lane_run`; then the due runs taken and their
# waiting messages in order as `moved`; then everything after `moved` as move_due does it
_HEAD = delivery._MOVE_DUE_LEVEL[: delivery._MOVE_DUE_LEVEL.index("), moved AS (")]
assert _HEAD.count("delaysvc.consume_queue") == 2, "the head CTEs read the queue twice"
_MOVE_DUE_RUNS = (
    _HEAD.replace("delaysvc.consume_queue", "delaysvc.lane_run")
    + """), taken AS (
    DELETE FROM delaysvc.lane_run q
    WHERE q.level = :lane AND q.ctid = ANY(ARRAY(SELECT ctid FROM locked))
    RETURNING q.queue_offset, q.message_ids, q.topic, q.deliver_ts, q.priority
), moved AS (
    SELECT t.queue_offset + m.n - 1 AS queue_offset, m.id AS message_id, t.topic,
        t.deliver_ts, t.priority
    FROM taken t CROSS JOIN LATERAL unnest(t.message_ids) WITH ORDINALITY AS m(id, n)
    JOIN delaysvc.commit_log c ON c.id = m.id
    WHERE c.status = 'scheduled'
)"""
    + delivery._MOVED_TO_TOPIC
)


def copy_runs(
    cursor: Any,
    created: Sequence[batching.Item],
    ids: Sequence[int],
    dues: Sequence[int],
    taken: Sequence[int | None],
    lanes: Any,
    meanwhile: Callable[[], Any],
) -> Any:
    """The prototype's `batching._copy_lanes` for a batch into levels: one row a run."""
    runs: dict[tuple[Any, ...], tuple[int, list[int]]] = {}
    for item, message_id, due, offset in zip(created, ids, dues, taken, strict=True):
        run = (item.lane, item.topic, due, item.priority)
        if run not in runs:
            assert offset is not None and item.lane > 0, "the prototype takes levels only"
            runs[run] = (offset, [])
        runs[run][1].append(message_id)
    for (lane, topic, due, priority), (first, members) in runs.items():
        array = "{" + ",".join(map(str, members)) + "}"
        cursor.execute(_INSERT_RUN, (lane, first, array, topic, due, priority))
    return meanwhile()


def per_message(call: Callable[[], object], messages: int) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) / messages * 1e6


def main() -> None:
    with scratch_database(SERVER, NAME) as (engine, settings):
        with engine.begin() as conn:
            conn.exec_driver_sql(LANE_RUN)
        producer = Producer(settings, engine)
        url = SERVER.rsplit("/", 1)[0] + "/" + NAME
        lots = batch_lots(BATCHES, SIZE)
        level = producer.send_batch(lots[0][:1])[0].delay_level
        assert level is not None  # "1h" is a level
        delay_ms = settings.levels.delay_ms(level)
        as_it_is = batching._copy_lanes

        def send_all(runs: bool) -> None:
            batching._copy_lanes = copy_runs if runs else as_it_is
            try:
                for items in lots:
                    producer.send_batch(items)
            finally:
                batching._copy_lanes = as_it_is

        def deliver_all(statement: str) -> int:
            """Move every due message of the level, a statement of up to 10,000 (a run)."""
            batch = 1 if statement is _MOVE_DUE_RUNS else SIZE
            moved, total = None, 0
            while moved != 0:
                with engine.begin() as conn:
                    delivery.lock_lane(conn, level)
                    later = conn.execute(sql("SELECT now() + interval '2 hours'")).scalar_one()
                    params = {"lane": level, "delay_ms": delay_ms, "batch": batch, "now": later,
                              "bounds": list(delivery.LATENESS_BUCKETS_MS)}  # fmt: skip
                    moved = conn.execute(sql(statement), params).one().moved
                    total += moved
            return total

        def emptied() -> None:
            """Each delivery round starts from empty queues (the batch rounds leave theirs)."""
            with engine.begin() as conn:
                conn.exec_driver_sql(
                    "TRUNCATE delaysvc.topic_queue, delaysvc.consume_queue, delaysvc.lane_run"
                )

        def delivered(statement: str, runs: bool) -> Callable[[], float]:
            def measure() -> float:
                emptied()
                send_all(runs)
                started = time.perf_counter()
                moved = deliver_all(statement)
                assert moved == BATCHES * SIZE, moved
                return (time.perf_counter() - started) / moved * 1e6

            return measure

        for warm in (delivered(delivery._MOVE_DUE_LEVEL, False), delivered(_MOVE_DUE_RUNS, True)):
            warm()
        times = alternate(
            {
                "raw COPY (us a row)": lambda: 1e6 / raw.copy_rows(url, BATCHES * SIZE),
                "batch, queue rows (as it is)": lambda: per_message(
                    lambda: send_all(False), BATCHES * SIZE
                ),
                "batch, one row a run": lambda: per_message(lambda: send_all(True), BATCHES * SIZE),
                "delivery, queue rows (as it is)": delivered(delivery._MOVE_DUE_LEVEL, False),
                "delivery, one row a run": delivered(_MOVE_DUE_RUNS, True),
            },
            ROUNDS,
        )
    print(f"{BATCHES} batches of {SIZE:,} a round, {ROUNDS} rounds; us a message")
    print_spread(times, "variant")


if __name__ == "__main__":
    main()
