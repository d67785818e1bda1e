"""A batch's ids and offsets drawn (`delaysvc.store.batches.reserve`) the way of 2026-11-28
(one array of every lane's offsets, its rows sorted by lane, read as text) and the way that
replaced it (an array a lane, nothing sorted, read in binary), side by side: the statement
alone for 10,000 messages in one lane and in three, and `send_batch` of 10,000 with each.
Rounds alternate the two, so the disk's flush drifts on both alike.

Runs on the code of 2026-11-28 to d344e2d (`git checkout d344e2d`): `reserve` has drawn the
offsets alone since, the ids being drawn while the items are checked (`drawing_ids`).

Run from the repository root: python docs/benchmarks/batch_reserve.py [SERVER_URL] [ROUNDS]
(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds); it works in a database of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds
from timing import alternate, per_call_us, print_spread

from delaysvc.db.names import driver_sql
from delaysvc.producer.sending import Producer
from delaysvc.store import batches

SERVER, ROUNDS = server_and_rounds()
SIZE = 10_000

_BEFORE = """WITH lanes AS MATERIALIZED (
    SELECT a.pos, a.n, CAST(CASE WHEN a.lane = 0 THEN 'delaysvc.timer_queue_seq'
        ELSE format('delaysvc.consume_queue_%s_seq', a.lane) END AS regclass) AS seq
    FROM unnest(CAST(:lanes AS smallint[]), CAST(:counts AS int[]))
        WITH ORDINALITY AS a(lane, n, pos)
)
SELECT statement_timestamp() AS stored_at,
    ARRAY(SELECT nextval('delaysvc.commit_log_id_seq')
        FROM generate_series(1, CAST(:count AS int))) AS ids,
    ARRAY(SELECT nextval(s.seq) FROM (
        SELECT l.seq FROM lanes l CROSS JOIN generate_series(1, l.n) AS g ORDER BY l.pos, g
    ) s) AS offsets"""


def reserve_before(cursor: Any, count: int, lanes: Sequence[tuple[int, int]]) -> batches.Reserved:
    """The statement of before, its offsets split by lane as `reserve` now gives them."""
    cursor.execute(
        driver_sql(_BEFORE),
        {"count": count, "lanes": [lane for lane, _ in lanes], "counts": [n for _, n in lanes]},
    )
    stored_at, ids, offsets = cursor.fetchone()
    flat = iter(offsets)
    return batches.Reserved(stored_at, ids, [list(islice(flat, n)) for _, n in lanes])


WAYS = {"before": reserve_before, "now": batches.reserve}


def main() -> None:
    with scratch_database(SERVER, "delaysvc_batch_reserve") as (engine, settings):
        producer = Producer(settings, engine)
        one_lane = [(17, SIZE)]  # the level of "1h" in the default levels
        three = [(17, 4_000), (0, 3_000), (1, 3_000)]
        items = [
            {"topic": "bench.noop", "body": {"order_id": n, "action": "cancel"}, "delay": "1h"}
            for n in range(SIZE)
        ]
        raw = engine.raw_connection()
        cursor = raw.driver_connection.cursor()

        def statement(way: Callable[..., Any], lanes: list[tuple[int, int]]) -> Callable[[], Any]:
            def call() -> None:
                way(cursor, SIZE, lanes)
                raw.driver_connection.rollback()

            return call

        def batch(way: Callable[..., Any]) -> Callable[[], Any]:
            def call() -> None:
                batches.reserve = way  # type: ignore[assignment]
                producer.send_batch(items)

            return call

        calls = {}
        for name, way in WAYS.items():
            calls[f"reserve, 1 lane, {name}"] = statement(way, one_lane)
            calls[f"reserve, 3 lanes, {name}"] = statement(way, three)
            calls[f"send_batch of 10,000, {name}"] = batch(way)
        for call in calls.values():
            call()  # warm: plans, connections
        measures = {name: partial(_ms, call) for name, call in calls.items()}
        taken = alternate(measures, ROUNDS)
        raw.close()
    print(f"10,000 messages a call, 5 calls a measure, {ROUNDS} rounds in turn")
    print_spread(taken, "ms a call")


def _ms(call: Callable[[], object]) -> float:
    return per_call_us(call, 5, warm=0) / 1000


if __name__ == "__main__":
    main()
