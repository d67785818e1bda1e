"""A delivery tick costs O(batch), not O(backlog), and a claim O(batch), not O(history): the
buffers one move or claim touches are the same with a small and a large table (measured with
EXPLAIN (ANALYZE, BUFFERS), not with a clock, so the test cannot flake on a busy machine),
whichever plan PostgreSQL picks for the prepared statement."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from delaysvc import store
from delaysvc.bench.scale import fill_lane
from delaysvc.db.names import qualify
from delaysvc.schema.tables import LATENESS_BUCKETS_MS, TIMER_LANE
from delaysvc.store import delivery as store_delivery
from tests.support.passes import first_pass_only

BATCH = 100


def _fill(engine: Engine, lane: int, count: int) -> None:
    """`count` waiting messages in `lane`, due in an hour, written straight by SQL (fast)."""
    fill_lane(engine, lane, count, "now() + interval '1 hour'", topic="t.cost")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


def _prepared_plan(
    conn: Connection, statement: str, args: dict[str, tuple[str, str]], plan_cache_mode: str
) -> dict:
    """The plan, with shared buffers, of `statement` run as a prepared statement (as psycopg
    runs one it has seen five times) with PostgreSQL's generic or custom plan forced; rolled
    back. `args`: parameter name -> (SQL type, SQL expression for its value)."""
    statement = qualify(statement)  # the process's schema, as the service's own statements
    for number, name in enumerate(args, start=1):
        statement = re.sub(rf"(?<!:):{name}\b", f"${number}", statement)
    types = ", ".join(kind for kind, _ in args.values())
    values = ", ".join(value for _, value in args.values())
    with conn.begin() as transaction:
        conn.exec_driver_sql(f"SET LOCAL plan_cache_mode = {plan_cache_mode}")
        conn.exec_driver_sql(f"PREPARE measured ({types}) AS {statement}")
        plan = conn.exec_driver_sql(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE measured({values})"
        ).scalar_one()
        transaction.rollback()
    conn.exec_driver_sql("DEALLOCATE measured")
    return (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]


def _buffers(conn: Connection, lane: int, plan_cache_mode: str) -> int:
    """Shared buffers (hit + read) one move of BATCH due rows touches; rolled back."""
    statement = (
        store_delivery._MOVE_DUE_TIMER if lane == TIMER_LANE else store_delivery._MOVE_DUE_LEVEL
    )
    bounds = "{" + ",".join(str(b) for b in LATENESS_BUCKETS_MS) + "}"
    args = {
        "lane": ("int", str(lane)),
        "delay_ms": ("bigint", "1000"),
        "batch": ("int", str(BATCH)),
        "now": ("timestamptz", "now() + interval '2 hours'"),
        "bounds": ("float8[]", f"'{bounds}'"),
    }
    top = _prepared_plan(conn, statement, args, plan_cache_mode)
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


PLANS = ["force_generic_plan", "force_custom_plan"]


@pytest.mark.parametrize("plan_cache_mode", PLANS)
@pytest.mark.parametrize("lane", [1, TIMER_LANE], ids=["level", "timer"])
def test_a_tick_touches_the_same_buffers_at_20k_and_200k_pending(
    engine: Engine, lane: int, plan_cache_mode: str
) -> None:
    """Whichever plan PostgreSQL picks for the prepared move (a session switches to the generic
    one when it looks no costlier), a tick is O(batch)."""
    _fill(engine, lane, 20_000)
    with engine.connect() as conn:
        small = _buffers(conn, lane, plan_cache_mode)
    _fill(engine, lane, 180_000)
    with engine.connect() as conn:
        large = _buffers(conn, lane, plan_cache_mode)
    assert small > BATCH  # it did touch the rows it moved
    # O(batch): ten times the backlog, at most one more index level per lookup
    assert large <= small * 1.25, (small, large)


def _fill_history(engine: Engine, finished: int, ready: int) -> None:
    """`finished` succeeded messages still in commit_log (the most it holds: the history sweep
    fell behind) and `ready` jobs waiting in the topic queue, written straight by SQL."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO commit_log (topic, body, body_is_json, lane, status, stored_at, "
                "deliver_ts, delivered_at, finished_at, attempts) "
                "SELECT 't.cost', :body, true, -1, 'succeeded', now(), now(), now(), now(), 1 "
                "FROM generate_series(1, :n)"
            ),
            {"n": finished, "body": b'{"order_id": 42}'},
        )
        conn.execute(
            text(
                "WITH m AS (INSERT INTO commit_log (topic, body, body_is_json, lane, status, "
                "stored_at, deliver_ts, delivered_at) "
                "SELECT 't.cost', :body, true, -1, 'ready', now(), now(), now() "
                "FROM generate_series(1, :n) RETURNING id, topic, deliver_ts) "
                "INSERT INTO topic_queue (message_id, topic, deliver_ts) "
                "SELECT id, topic, deliver_ts FROM m ORDER BY id"
            ),
            {"n": ready, "body": b'{"order_id": 42}'},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


def _claim_buffers(conn: Connection, plan_cache_mode: str) -> int:
    """Shared buffers one claim of BATCH jobs touches; rolled back."""
    args = {
        "topic": ("text", "'t.cost'"),
        "lease_seconds": ("int", "60"),
        "start_first": ("int", "100"),
    }
    top = _prepared_plan(conn, store.claim_statement(BATCH), args, plan_cache_mode)
    assert top["Actual Rows"] == BATCH
    assert "commit_log" not in _seq_scans(top), "a claim scans the whole commit log"
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


@pytest.mark.parametrize("plan_cache_mode", PLANS)
def test_a_claim_touches_the_same_buffers_with_20k_and_200k_finished_messages(
    engine: Engine, plan_cache_mode: str
) -> None:
    """Whichever plan PostgreSQL picks for the prepared claim (a session switches to the
    generic one when it looks no costlier), its cost does not grow with the history."""
    _fill_history(engine, 20_000, 50 * BATCH)
    with engine.connect() as conn:
        small = _claim_buffers(conn, plan_cache_mode)
    _fill_history(engine, 180_000, 0)
    with engine.connect() as conn:
        large = _claim_buffers(conn, plan_cache_mode)
    assert small > BATCH
    assert large <= small * 1.25, (small, large)


def _fill_ready_with_priorities(engine: Engine, ready: int) -> None:
    """`ready` jobs of 't.cost' in the topic queue, priorities -2..2 in turn."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "WITH m AS (INSERT INTO commit_log (topic, body, body_is_json, lane, status, "
                "stored_at, deliver_ts, delivered_at, priority) "
                "SELECT 't.cost', :body, true, -1, 'ready', now(), now(), now(), (g % 5) - 2 "
                "FROM generate_series(1, :n) g RETURNING id, topic, deliver_ts, priority) "
                "INSERT INTO topic_queue (message_id, topic, deliver_ts, priority) "
                "SELECT id, topic, deliver_ts, priority FROM m ORDER BY id"
            ),
            {"n": ready, "body": b'{"order_id": 42}'},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


def _index_names(node: dict) -> set[str]:
    found = {node["Index Name"]} if "Index Name" in node else set()
    for child in node.get("Plans", []):
        found |= _index_names(child)
    return found


@first_pass_only("fills a million rows (~1 min), the same plan on either server")
@pytest.mark.parametrize("plan_cache_mode", PLANS)
def test_a_claim_by_priority_stays_an_index_scan_at_a_million_ready_jobs(
    engine: Engine, plan_cache_mode: str
) -> None:
    """The claim takes the highest priority first through the topic queue's
    (topic, priority DESC, seq) index: at 1M ready jobs it touches about what it touches at
    20k, and never sorts or scans the queue."""
    _fill_ready_with_priorities(engine, 20_000)
    with engine.connect() as conn:
        small = _claim_buffers(conn, plan_cache_mode)
    _fill_ready_with_priorities(engine, 980_000)
    args = {
        "topic": ("text", "'t.cost'"),
        "lease_seconds": ("int", "60"),
        "start_first": ("int", "100"),
    }
    with engine.connect() as conn:
        large = _claim_buffers(conn, plan_cache_mode)
    with engine.connect() as conn:
        top = _prepared_plan(conn, store.claim_statement(BATCH), args, plan_cache_mode)
    assert "ix_topic_queue_topic_priority_seq" in _index_names(top)
    assert not _seq_scans(top)
    assert large <= small * 1.25, (small, large)
    with engine.begin() as conn:
        claimed = store.claim_ready(conn, "t.cost", BATCH, 60)
    assert {row.priority for row in claimed} == {2}


def _plan_after_growth(
    engine: Engine, run: Callable[[Connection], Any], grow: Callable[[], None]
) -> tuple[str, Any]:
    """(the plan PostgreSQL used, what `run` returned) for `run` on a connection that ran it
    twelve times while the queues were empty, after `grow` filled them with no ANALYZE since:
    what a worker's pooled connection sees when a backlog arrives. The plan comes from
    auto_explain, sent to this client as notices; the last run has a 5 s statement timeout (a
    plan kept from the empty queue took minutes)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))
    with engine.connect() as conn:
        notices: list[str] = []
        driver = conn.connection.driver_connection
        driver.add_notice_handler(lambda notice: notices.append(notice.message_primary or ""))
        for setting in (
            "LOAD 'auto_explain'",
            "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_level = 'notice'",
        ):
            conn.exec_driver_sql(setting)
        conn.commit()
        for _ in range(12):
            with conn.begin():
                run(conn)
        grow()
        notices.clear()
        with conn.begin():
            conn.execute(text("SET LOCAL statement_timeout = '5s'"))
            result = run(conn)
    return "\n".join(notices), result


QUEUES = re.compile(r"Seq Scan on (commit_log|topic_queue|timer_queue|consume_queue_\d+)\b")


@pytest.mark.parametrize("lane", [1, TIMER_LANE], ids=["level", "timer"])
def test_a_move_is_planned_for_the_backlog_it_finds_not_for_the_empty_lane_it_began_with(
    engine: Engine, lane: int
) -> None:
    plan, _ = _plan_after_growth(
        engine,
        lambda conn: store.move_due(conn, lane, 1000, BATCH),
        lambda: fill_lane(engine, lane, 50_000, "now() - interval '1 hour'", topic="t.cost"),
    )
    assert "Index Scan" in plan, plan
    assert not QUEUES.findall(plan), plan


def test_a_claim_is_planned_for_the_backlog_it_finds_not_for_the_empty_queue_it_began_with(
    engine: Engine,
) -> None:
    """The consumers' stall: a plan kept from the empty queue re-ran the claim's locking
    subquery for every queued row and a claim ran past the 5 s timeout."""
    plan, claimed = _plan_after_growth(
        engine,
        lambda conn: store.claim_ready(conn, "t.cost", BATCH, 60),
        lambda: _fill_history(engine, 0, 20_000),
    )
    assert "Index Scan" in plan, plan
    assert not QUEUES.findall(plan), plan
    assert len(claimed) == BATCH
    assert [row.seq for row in claimed] == sorted(row.seq for row in claimed)
