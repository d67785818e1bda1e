"""The `scale` suite: does a big backlog slow the service down?

The same two measures, on an empty system and then with `--scale-pending` messages waiting:
- send: `Producer.send`, one transaction per message, one client, for `--scale-seconds`, into
  a level that holds part of the backlog;
- tick: timed delivery moves (`delivery.run_once`, batches of the configured size) of a due
  level-1 prefix of `--scale-due` messages, the same in both phases.
Target (DESIGN.md): both within 1.2x of the empty system.

The backlog is written straight by set-based SQL (a send per row would take hours at 10M),
rows shaped as the producer writes them, spread evenly over the levels whose delay outlasts
the run (10 minutes and more) and the timer lane (due in a day), so none falls due meanwhile.
While it is written, a real delivery worker, consume worker and beat (the `delaysvc up`
commands) run beside it; their RSS is sampled on the empty system and with the backlog.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from delaysvc.bench.peers import _rss, _start, _stop
from delaysvc.bench.progress import Progress, step
from delaysvc.bench.suites import BODY, Figures, reset_tables
from delaysvc.db.names import sql
from delaysvc.maintenance.delivery import run_once
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import TIMER_LANE

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext

SCALE_TOPIC = "bench.scale"
LONG_LEVEL_MS = 600_000  # levels at least this long hold the backlog: none falls due in a run
FILL_CHUNK = 500_000
TARGET_RATIO = 1.2


def scale_suite(ctx: BenchContext) -> Figures:
    pending, seconds, due = (
        ctx.size("pending"),
        ctx.seconds("scale_seconds"),
        ctx.size("scale_due"),
    )
    levels = [
        n
        for n in range(1, ctx.settings.levels.max_level + 1)
        if ctx.settings.levels.delay_ms(n) >= LONG_LEVEL_MS
    ]
    send_level = levels[0] if levels else None
    # beat fires each lane's task every lane budget: let two rounds pass before sampling RSS
    settle = 2 * ctx.settings.lane_budget_seconds + 2
    step(f"scale: empty system: send for {seconds:g}s, move {due:,} due rows")
    empty = _measure(ctx, seconds, due, send_level)
    reset_tables(ctx.engine)
    with tempfile.TemporaryDirectory(prefix="delaysvc-bench-scale-") as folder:
        workers = _start_service(ctx, Path(folder))
        try:
            time.sleep(settle)
            rss_empty = _each_rss(workers)
            step(f"scale: writing {pending:,} pending over levels {levels} and the timer lane")
            fill_seconds = _fill_backlog(ctx.engine, pending, levels, ctx.settings)
            time.sleep(settle)
            rss_backlog = _each_rss(workers)
        finally:
            _stop(workers)
    step(f"scale: {pending:,} pending: send for {seconds:g}s, move {due:,} due rows")
    backlog = _measure(ctx, seconds, due, send_level)
    with ctx.engine.connect() as conn:
        table_bytes = conn.execute(
            sql(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "WHERE c.relkind IN ('r', 'p') AND c.relnamespace = "
                "(SELECT relnamespace FROM pg_class WHERE oid = 'delaysvc.commit_log'::regclass)"
            )
        ).scalar_one()
    result: dict[str, Any] = {
        "pending": pending,
        "fill_rows_per_s": round(pending / fill_seconds),
        "table_bytes_with_backlog": int(table_bytes),
        "send_per_s_empty": round(empty["send_per_s"]),
        "send_per_s_backlog": round(backlog["send_per_s"]),
        "send_slowdown": round(empty["send_per_s"] / backlog["send_per_s"], 3),
        "move_ms_empty": empty["move_ms"],
        "move_ms_backlog": backlog["move_ms"],
        "move_slowdown": round(backlog["move_ms"]["mean"] / empty["move_ms"]["mean"], 3),
        "batch": ctx.settings.delivery_batch,
        "rss_bytes": {
            name: {"empty": rss_empty.get(name, 0), "backlog": rss_backlog.get(name, 0)}
            for name in rss_empty
        },
        "target_slowdown": TARGET_RATIO,
    }
    return Figures(results={"scale": result})


def _measure(ctx: BenchContext, seconds: float, due: int, send_level: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {"delay_level": send_level} if send_level else {"delay": "1h"}
    send_per_s = send_rate(Producer(ctx.settings, ctx.engine), SCALE_TOPIC, seconds, **options)
    fill_lane(ctx.engine, 1, due, "now() - interval '1 minute'")
    return {
        "send_per_s": send_per_s,
        "move_ms": timed_moves(ctx.engine, ctx.settings.delivery_batch),
    }


def send_rate(producer: Producer, topic: str, seconds: float, **options: Any) -> float:
    """Single sends per second, one transaction each, one client, for `seconds`."""
    sent, stop = 0, time.monotonic() + seconds
    started = time.perf_counter()
    while time.monotonic() < stop:
        producer.send(topic, BODY, **options)
        sent += 1
    return sent / (time.perf_counter() - started)


def timed_moves(engine: Engine, batch: int) -> dict[str, Any]:
    """Move level 1's due rows, `batch` per move, until none is left: how long each took."""
    times: list[float] = []
    with engine.connect() as conn:
        while True:
            began = time.perf_counter()
            moved = run_once(conn, 1, batch).moved
            if not moved:
                break
            times.append((time.perf_counter() - began) * 1000)
    ordered = sorted(times) or [0.0]
    return {
        "moves": len(times),
        "mean": round(sum(ordered) / len(ordered), 2),
        "p50": round(ordered[len(ordered) // 2], 2),
        "max": round(ordered[-1], 2),
    }


def fill_lane(
    engine: Engine, lane: int, count: int, deliver_ts: str, topic: str = SCALE_TOPIC
) -> None:
    """`count` messages in `lane`, as the producer would store them, in one statement;
    `deliver_ts` is an SQL expression for the first one's due time."""
    sequence = (
        f"delaysvc.consume_queue_{lane}_seq" if lane != TIMER_LANE else "delaysvc.timer_queue_seq"
    )
    target = (
        ", q AS (INSERT INTO delaysvc.consume_queue (level, queue_offset, message_id, topic, "
        "deliver_ts) "
        f"SELECT {lane}, queue_offset, id, topic, deliver_ts FROM m) "
        if lane != TIMER_LANE
        else ", q AS (INSERT INTO delaysvc.timer_queue "
        "(deliver_ts, queue_offset, message_id, topic) "
        "SELECT deliver_ts, queue_offset, id, topic FROM m) "
    ) + f"INSERT INTO delaysvc.lane_count (lane, delta) SELECT {lane}, count(*) FROM m"
    with engine.begin() as conn:
        conn.execute(
            sql(
                "WITH m AS (INSERT INTO delaysvc.commit_log (topic, body, body_is_json, "
                "delay_level, lane,"
                " queue_offset, status, stored_at, deliver_ts) "
                f"SELECT :topic, :body, true, {lane or 'NULL'}, {lane}, "
                f"nextval('{sequence}'), 'scheduled', now(), "
                f"{deliver_ts} + g * interval '1 microsecond' "
                "FROM generate_series(1, :count) g RETURNING id, topic, queue_offset, deliver_ts) "
                + target
            ),
            {"count": count, "topic": topic, "body": b'{"order_id": 42}'},
        )


def _fill_backlog(engine: Engine, pending: int, levels: list[int], settings: Any) -> float:
    lanes = [*levels, TIMER_LANE]
    share, extra = divmod(pending, len(lanes))
    per_lane = [share + (1 if i < extra else 0) for i in range(len(lanes))]
    progress = Progress("fill", pending)
    started, done = time.perf_counter(), 0
    for lane, count in zip(lanes, per_lane, strict=True):
        delay = (
            f"now() + interval '{settings.levels.delay_ms(lane)} milliseconds'"
            if lane != TIMER_LANE
            else "now() + interval '1 day'"
        )
        for chunk in range(0, count, FILL_CHUNK):
            size = min(FILL_CHUNK, count - chunk)
            fill_lane(engine, lane, size, delay)
            done += size
            progress.update(done)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sql("VACUUM ANALYZE"))
        # flush the load's dirty pages now, or the checkpoint writing gigabytes competes with
        # the measurement that follows (a service with a backlog is not mid-bulk-load)
        try:
            conn.execute(sql("CHECKPOINT"))
        except DBAPIError as exc:  # needs superuser or pg_checkpoint: measure regardless
            step(f"scale: no CHECKPOINT after the load ({exc.orig})")
    progress.done()
    return time.perf_counter() - started


def _start_service(ctx: BenchContext, folder: Path) -> list[Any]:
    """The delivery worker, consume worker and beat of `delaysvc up`, on the bench database
    (broker: Redis db 13 when there, else the filesystem broker)."""
    from delaysvc.bench.peers import DelaysvcPeer

    peer = DelaysvcPeer(ctx, folder)
    peer.prepare()
    return _start(peer, 1)


def _each_rss(workers: list[Any]) -> dict[str, int]:
    names = ["delivery worker", "consume worker", "beat"]
    return {name: _rss([w]) for name, w in zip(names, workers, strict=False)}
