"""The `history` suite: does a big finished history slow the service down or bloat it?

On an empty system, then with `--history-finished` finished messages in the history (spread
over `--history-days` days), the same three measures:
- send: `Producer.send`, one transaction per message, one client, for `--history-seconds`;
- move: timed delivery moves (`delivery.run_once`) of `--history-due` due level-1 rows;
- claim: a consumer (`Consumer.run_once`, no-op handler) runs those jobs: jobs/s.
Between them: the sweep's rate (finished rows moved out of commit_log per second, measured on
the jobs just run and on `--history-sweep` more finished rows), the hot tables' sizes in both
phases, and retention: the time to drop the oldest day (`history.drop_older_than`).
Target (the issue): send/move/claim within 1.2x of the empty system, hot tables the same
size, retention in seconds.

The history is written straight by set-based SQL into its day partitions (rows shaped as the
sweep leaves them), as the scale suite writes its backlog.
"""

from __future__ import annotations

import time
from datetime import UTC, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from delaysvc import store
from delaysvc.bench.progress import Progress, step
from delaysvc.bench.scale import fill_lane, send_rate, timed_moves
from delaysvc.bench.suites import Figures, reset_tables
from delaysvc.db.names import sql, table
from delaysvc.maintenance import history
from delaysvc.producer.sending import Producer
from delaysvc.store import history as store_history
from delaysvc.worker.consumer import Consumer, handler

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext

TOPIC = "bench.history"
HOT_TABLES = ("commit_log", "topic_queue", "consume_queue_1", "timer_queue")
FILL_CHUNK = 500_000
TARGET_RATIO = 1.2


def history_suite(ctx: BenchContext) -> Figures:
    finished, days = ctx.size("history_finished"), ctx.size("history_days")
    seconds, due = ctx.seconds("history_seconds"), ctx.size("history_due")
    handler(TOPIC)(lambda message: None)
    reset_tables(ctx.engine)
    _settle(ctx.engine)
    step(f"history: empty: send for {seconds:g}s, move and run {due:,} jobs")
    empty = _measure(ctx, seconds, due)
    step(f"history: writing {finished:,} finished messages over {days} days")
    fill_seconds = _fill_history(ctx.engine, finished, days)
    _settle(ctx.engine)
    step(f"history: {finished:,} finished: send for {seconds:g}s, move and run {due:,} jobs")
    full = _measure(ctx, seconds, due)
    step("history: retention: dropping the oldest day")
    dropped_rows, drop_seconds = _drop_oldest_day(ctx.engine)
    # last: the rows it writes through commit_log would leave it bigger for what follows
    step(f"history: sweeping {ctx.size('history_sweep'):,} finished rows out of commit_log")
    sweep = _sweep_rate(ctx.engine, ctx.size("history_sweep"))
    result: dict[str, Any] = {
        "finished": finished,
        "days": days,
        "fill_rows_per_s": round(finished / fill_seconds),
        "sweep_rows_per_s": sweep,
        "send_per_s_empty": round(empty["send_per_s"]),
        "send_per_s_history": round(full["send_per_s"]),
        "move_ms_empty": empty["move_ms"],
        "move_ms_history": full["move_ms"],
        "claim_per_s_empty": round(empty["claim_per_s"]),
        "claim_per_s_history": round(full["claim_per_s"]),
        "send_slowdown": round(empty["send_per_s"] / full["send_per_s"], 3),
        "move_slowdown": round(full["move_ms"]["mean"] / empty["move_ms"]["mean"], 3),
        "claim_slowdown": round(empty["claim_per_s"] / full["claim_per_s"], 3),
        "hot_bytes_empty": empty["hot_bytes"],
        "hot_bytes_history": full["hot_bytes"],
        "history_bytes": full["history_bytes"],
        "retention_rows": dropped_rows,
        "retention_seconds": round(drop_seconds, 3),
        "target_slowdown": TARGET_RATIO,
    }
    return Figures(results={"history": result})


def _measure(ctx: BenchContext, seconds: float, due: int) -> dict[str, Any]:
    """Send for `seconds`, move `due` due rows, run them; the sweep runs as beat would, so
    commit_log keeps only what is in flight."""
    send_per_s = send_rate(Producer(ctx.settings, ctx.engine), TOPIC, seconds, delay="1h")
    fill_lane(ctx.engine, 1, due, "now() - interval '1 minute'", topic=TOPIC)
    move_ms = timed_moves(ctx.engine, ctx.settings.delivery_batch)
    consumer = Consumer(ctx.settings, ctx.engine)
    began, ran = time.perf_counter(), 0
    while claimed := consumer.run_once(TOPIC, limit=ctx.settings.consume_batch).claimed:
        ran += claimed
    claim_per_s = ran / (time.perf_counter() - began)
    history.move_all(ctx.engine)
    _vacuum(ctx.engine)
    return {
        "send_per_s": send_per_s,
        "move_ms": move_ms,
        "claim_per_s": claim_per_s,
        "hot_bytes": _sizes(ctx.engine),
        "history_bytes": _history_bytes(ctx.engine),
    }


def _sweep_rate(engine: Engine, rows: int) -> int:
    """Finished rows moved out of commit_log per second by the sweep."""
    with engine.begin() as conn:
        conn.execute(
            sql(
                "INSERT INTO delaysvc.commit_log (topic, body, body_is_json, lane, status, "
                "stored_at, deliver_ts, delivered_at, started_at, finished_at, attempts, "
                "duration_ms) SELECT :topic, :body, true, -1, 'succeeded', now(), now(), now(), "
                "now(), now(), 1, 1 FROM generate_series(1, :rows)"
            ),
            {"topic": TOPIC, "body": b'{"order_id": 42}', "rows": rows},
        )
    progress = Progress("sweep", rows)
    began, moved = time.perf_counter(), 0
    while batch := history.move_once(engine, wait=True).moved:
        moved += batch
        progress.update(moved)
    progress.done()
    return round(moved / (time.perf_counter() - began))


def _fill_history(engine: Engine, finished: int, days: int) -> float:
    """`finished` succeeded messages, evenly over the `days` days before yesterday."""
    with engine.begin() as conn:
        today = store.clock_now(conn).astimezone(UTC).date()
        first = today - timedelta(days=days + 1)
        store_history.make_partitions(conn, [first + timedelta(days=d) for d in range(days)])
    progress = Progress("fill", finished)
    started, done = time.perf_counter(), 0
    per_day = -(-finished // days)
    for day in range(days):
        count = min(per_day, finished - done)
        for chunk in range(0, count, FILL_CHUNK):
            size = min(FILL_CHUNK, count - chunk)
            with engine.begin() as conn:
                conn.execute(
                    sql(
                        f"INSERT INTO delaysvc.message_history ({store_history.COLUMNS}) "
                        "SELECT nextval('delaysvc.commit_log_id_seq'), :topic, 'k' || g, NULL, "
                        ":body, true, NULL, 1, 0, -1, NULL, 'succeeded', t, t, t, t, "
                        "t + interval '1 ms', 1, 1, NULL, NULL, NULL, NULL "
                        "FROM generate_series(1, :size) g, LATERAL (SELECT CAST(:day AS "
                        "timestamptz) + (:chunk + g - 1) * (interval '1 day' / :count) AS t) x"
                    ),
                    {
                        "topic": TOPIC,
                        "body": b'{"order_id": 42}',
                        "size": size,
                        "chunk": chunk,
                        "count": count,
                        "day": (first + timedelta(days=day)).isoformat() + "T00:00:00+00:00",
                    },
                )
            done += size
            progress.update(done)
    progress.done()
    return time.perf_counter() - started


def _drop_oldest_day(engine: Engine) -> tuple[int, float]:
    with engine.connect() as conn:
        oldest = store_history.partitions(conn)[0]
        rows = conn.execute(sql(f"SELECT count(*) FROM delaysvc.{oldest.name}")).scalar_one()
    began = time.perf_counter()
    dropped = history.drop_older_than(engine, oldest.ends)
    assert dropped == [oldest.name], dropped
    return rows, time.perf_counter() - began


def _sizes(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {name: _bytes(conn, name) for name in HOT_TABLES}


def _history_bytes(engine: Engine) -> int:
    with engine.connect() as conn:
        return sum(_bytes(conn, p.name) for p in store_history.partitions(conn))


def _bytes(conn: Connection, name: str) -> int:
    """A table's size with its indexes and TOAST."""
    return int(
        conn.execute(
            sql("SELECT pg_total_relation_size(CAST(:t AS regclass))"), {"t": table(name)}
        ).scalar_one()
    )


def _settle(engine: Engine) -> None:
    """VACUUM ANALYZE, then flush the dirty pages now: a checkpoint writing gigabytes after
    the history's load would compete with the measurement that follows."""
    _vacuum(engine)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        try:
            conn.execute(sql("CHECKPOINT"))
        except DBAPIError as exc:  # needs superuser or pg_checkpoint: measure regardless
            step(f"history: no CHECKPOINT ({exc.orig})")


def _vacuum(engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sql("VACUUM ANALYZE"))
