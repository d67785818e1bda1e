"""A delivery tick costs O(batch), not O(backlog): the buffers one move touches are the same
with a small and a large backlog (measured with EXPLAIN (ANALYZE, BUFFERS), not with a clock,
so the test cannot flake on a busy machine)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import Connection, Engine, text

from delaysvc import store
from delaysvc.bench.scale import fill_lane
from delaysvc.schema import LATENESS_BUCKETS_MS, TIMER_LANE

BATCH = 100


def _fill(engine: Engine, lane: int, count: int) -> None:
    """`count` waiting messages in `lane`, due in an hour, written straight by SQL (fast)."""
    fill_lane(engine, lane, count, "now() + interval '1 hour'", topic="t.cost")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


def _buffers(conn: Connection, lane: int) -> int:
    """Shared buffers (hit + read) one move of BATCH due rows touches; rolled back."""
    statement = store._MOVE_DUE_TIMER if lane == TIMER_LANE else store._MOVE_DUE_LEVEL
    with conn.begin() as transaction:
        params = {
            "lane": lane,
            "delay_ms": 1000,
            "batch": BATCH,
            "now": store.database_now(conn) + timedelta(hours=2),
            "bounds": list(LATENESS_BUCKETS_MS),
        }
        plan = conn.execute(
            text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement), params
        ).scalar_one()
        transaction.rollback()
    top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    assert not _seq_scans(top), f"a move scans a whole table: {_seq_scans(top)}"
    # each direct child is one step of the statement (a CTE), inclusive of what it reads
    return sum(
        int(step["Shared Hit Blocks"]) + int(step["Shared Read Blocks"]) for step in top["Plans"]
    )


def _seq_scans(node: dict) -> list[str]:
    found = [node["Relation Name"]] if node["Node Type"] == "Seq Scan" else []
    big = {"commit_log", "topic_queue", "timer_queue"}
    found = [name for name in found if name in big or name.startswith("consume_queue")]
    for child in node.get("Plans", []):
        found += _seq_scans(child)
    return found


@pytest.mark.parametrize("lane", [1, TIMER_LANE], ids=["level", "timer"])
def test_a_tick_touches_the_same_buffers_at_20k_and_200k_pending(engine: Engine, lane: int) -> None:
    _fill(engine, lane, 20_000)
    with engine.connect() as conn:
        small = _buffers(conn, lane)
    _fill(engine, lane, 180_000)
    with engine.connect() as conn:
        large = _buffers(conn, lane)
    assert small > BATCH  # it did touch the rows it moved
    # O(batch): ten times the backlog, at most one more index level per lookup
    assert large <= small * 1.25, (small, large)
