"""The service's own figures, each measured beside the raw limit it is compared with.

- send: `Producer.send` one message per transaction at several concurrencies (raw: one-row
  INSERT per transaction at the same concurrency); `send_batch` of 1,000 and of 10,000 (raw:
  COPY), and batches of 10,000 through the batch's database statements alone (no Python of
  ours).
- delivery: drain a due backlog through `delivery.run_once` (raw: moving rows between two plain
  tables in batches of the same size); a steady flow at a fixed rate for a while, delivered by
  `LaneRunner`s (what the Celery delivery task runs), reporting lateness = delivered_at (when
  it entered the topic queue: `store.DELIVERED_AT`) -
  deliver_ts (both on the database clock).
- consume: a ready backlog of a no-op handler's jobs run by consumer processes calling
  `Consumer.run_once` (what each Celery consume task runs): jobs/s through claim -> run ->
  finish; in the steady flow, deliver_ts -> handler started.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import psycopg
from sqlalchemy import Engine

from delaysvc import store
from delaysvc.bench import raw
from delaysvc.bench.load import send_at_rate
from delaysvc.bench.progress import Progress, step
from delaysvc.config.settings import Settings
from delaysvc.config.validation import encode_body
from delaysvc.db.engines import libpq_url, make_engine
from delaysvc.db.names import sql
from delaysvc.maintenance.delivery import LaneRunner, run_once
from delaysvc.producer import batching
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import TIMER_LANE
from delaysvc.store import batches as store_batches

NOOP_TOPIC = "bench.noop"
FLOW_TOPIC = "bench.flow"
BODY = {"order_id": 42, "action": "cancel"}
BATCH = 10_000  # the batch send's target is set for it: >= 30% of a raw COPY's rate


@dataclass
class Figures:
    """What one suite measured: named results, time series for plots, raw samples."""

    results: dict[str, Any] = field(default_factory=dict)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else []

    def q(p: int) -> float:
        return round(cuts[p - 1] if cuts else ordered[0], 2)

    return {"p50": q(50), "p95": q(95), "p99": q(99), "max": round(ordered[-1], 2)}


def reset_tables(engine: Engine) -> None:
    """Empty the service's tables between suites (the schema and levels stay)."""
    with engine.begin() as conn:
        conn.execute(
            sql(
                "TRUNCATE delaysvc.commit_log, delaysvc.message_history, "
                "delaysvc.consume_queue, delaysvc.timer_queue, "
                "delaysvc.topic_queue, delaysvc.dead_letter, "
                "delaysvc.topic_state, delaysvc.lane_count"
            )
        )
        conn.execute(
            sql(
                "UPDATE delaysvc.schedule_offset SET moved_total = 0, early_total = 0, "
                "stuck_offset = NULL,"
                " stuck_error = NULL, stuck_since = NULL"
            )
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sql("VACUUM ANALYZE"))


def _send_backlog(
    producer: Producer, count: int, label: str, topic: str = NOOP_TOPIC, **options: Any
) -> None:
    progress = Progress(label, count)
    for start in range(0, count, 5000):
        size = min(5000, count - start)
        producer.send_batch([{"topic": topic, "body": BODY, **options}] * size)
        progress.update(start + size)
    progress.done()


# ---------------------------------------------------------------- send


SIDE_BY_SIDE = 3
"""Rounds of each send ratio: the raw limit and the service measured in turn, each round's
ratio from two measurements taken seconds apart, and the median of the rounds reported. The
disk's flush time of the 2-core machine these targets were set on varies several-fold from
minute to minute (the single send's ratio read 16% in one run there and 65% in another, each
from one raw measurement and one of the service's, minutes apart)."""


def _in_turn(measures: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each of `measures` once a round, in the order given, `rounds` times. -> name -> its
    figures, a round each."""
    taken: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            taken[name].append(measure())
    return taken


def _ratio_of(figures: list[float], limits: list[float]) -> dict[str, Any]:
    """The median figure and the median of the rounds' ratios (each round's figure over that
    round's limit), with every round's ratio."""
    ratios = [figure / limit for figure, limit in zip(figures, limits, strict=True)]
    return {
        "msgs_per_s": round(statistics.median(figures)),
        "ratio": round(statistics.median(ratios), 3),
        "round_ratios": [round(ratio, 3) for ratio in ratios],
    }


def send_suite(
    settings: Settings,
    engine: Engine,
    url: str,
    seconds: float,
    concurrencies: list[int],
    batch_rows: int,
    rounds: int = SIDE_BY_SIDE,
) -> Figures:
    figures = Figures()
    producer = Producer(settings, engine)
    for clients in concurrencies:
        taken = _in_turn(
            {
                "raw": partial(_raw_inserts, url, clients, seconds),
                "send": partial(_single_sends, producer, clients, seconds),
            },
            rounds,
        )
        figures.results[f"send_single_c{clients}"] = {
            **_ratio_of(taken["send"], taken["raw"]),
            "raw_insert_per_s": round(statistics.median(taken["raw"])),
            "target_ratio": 0.6 if clients == 1 else 0.5,
            "clients": _clients(clients),
        }
    # a level and the timer lane side by side, alternating (the disk's flush time drifts)
    top = settings.levels.max_level  # the longest level, and a delay beside it no level has
    ways = {
        "level": {"delay_level": top},
        "timer": {"delay_ms": settings.levels.delay_ms(top) + 420_000},
    }
    sends = {lane: partial(_lane_sends, producer, seconds, lane, way) for lane, way in ways.items()}
    lanes = _in_turn(sends, 2)
    level, timer = (statistics.median(lanes[lane]) for lane in ("level", "timer"))
    figures.results["send_single_level_vs_timer"] = {
        "level_msgs_per_s": round(level),
        "timer_msgs_per_s": round(timer),
        "ratio": round(level / timer, 3),
        "target_ratio": 0.9,
    }
    taken = _in_turn(
        {
            "raw": partial(_raw_copies, url, batch_rows),
            "1000": partial(_timed_batches, producer, batch_rows, 1000),
            str(BATCH): partial(_timed_batches, producer, batch_rows, BATCH),
            "write": partial(_timed_database_write, producer, url, batch_rows),
        },
        rounds,
    )
    raw_copies = round(statistics.median(taken["raw"]))
    for size in (1000, BATCH):
        figures.results[f"send_batch_{size}"] = {
            **_ratio_of(taken[str(size)], taken["raw"]),
            "raw_copy_per_s": raw_copies,
            "target_ratio": 0.3,
        }
    figures.results["send_batch_database_write"] = {
        **_ratio_of(taken["write"], taken["raw"]),
        "raw_copy_per_s": raw_copies,
    }
    return figures


def _clients(count: int) -> str:
    # more than one client: processes, as an application's are (threads of one process would
    # measure its GIL); the raw insert the same way
    return f"{count} processes" if count > 1 else f"{count} client"


def _raw_inserts(url: str, clients: int, seconds: float) -> float:
    step(f"send: raw one-row INSERT per transaction, {_clients(clients)}, {seconds:g}s")
    return raw.insert_one_row_per_transaction(libpq_url(url), clients, seconds, clients > 1)


def _single_sends(producer: Producer, clients: int, seconds: float) -> float:
    step(f"send: Producer.send, {_clients(clients)}, {seconds:g}s")
    reset_tables(producer.engine)
    if clients > 1:
        return raw.per_second_in_processes(_send_client, producer.settings, clients, seconds)
    return _send_single(producer, clients, seconds)


def _lane_sends(producer: Producer, seconds: float, lane: str, where: dict[str, Any]) -> float:
    """Single sends a second to one lane (`where`: send's timing options), 1 client."""
    step(f"send: Producer.send to the {lane} lane, 1 client, {seconds:g}s")
    reset_tables(producer.engine)
    return _send_single(producer, 1, seconds, **where)


def _raw_copies(url: str, rows: int) -> float:
    step(f"send: raw COPY of {rows:,} rows")
    return raw.copy_rows(libpq_url(url), rows)


def _timed_batches(producer: Producer, rows: int, size: int) -> float:
    reset_tables(producer.engine)
    step(f"send: send_batch of {size:,}, {rows:,} messages")
    return _send_batches(producer, rows, size)


def _timed_database_write(producer: Producer, url: str, rows: int) -> float:
    reset_tables(producer.engine)
    step(f"send: the batch's database write alone, {rows:,} messages")
    return _batch_database_write(libpq_url(url), producer, rows)


def _send_batches(producer: Producer, rows: int, size: int) -> float:
    """Messages/s of `send_batch` calls of `size` (each message its own body, as an
    application's are), `rows` messages in all; the items are made before the clock starts."""
    batches = [
        [
            {"topic": NOOP_TOPIC, "body": {**BODY, "order_id": n}, "delay": "1h"}
            for n in range(start, min(start + size, rows))
        ]
        for start in range(0, rows, size)
    ]
    progress = Progress(f"send_batch of {size:,}", rows)
    done = 0
    started = time.perf_counter()
    for items in batches:
        producer.send_batch(items)
        done += len(items)
        progress.update(done)
    rate = rows / (time.perf_counter() - started)
    progress.done()
    return rate


def _batch_database_write(url: str, producer: Producer, rows: int) -> float:
    """Messages/s PostgreSQL stores through a batch send's own statements (the ids, offsets and
    store time drawn, the binary COPY into the commit log and into the lane, the lane's count),
    `BATCH` per transaction, fed one message validated and encoded once: what `send_batch`
    would reach with no Python cost of its own but psycopg's `write_row` (which the raw COPY's
    figure holds too)."""
    item = batching.prepare(
        [{"topic": NOOP_TOPIC, "body": BODY, "delay": "1h"}],
        producer.settings,
        datetime.now().astimezone(),
    )[0]
    body, is_json = encode_body(item.body, producer.settings.max_body_bytes)
    progress = Progress("batch database write", rows)
    with psycopg.connect(url) as conn, conn.cursor() as cursor:
        started = time.perf_counter()
        for done in range(0, rows, BATCH):
            count = min(BATCH, rows - done)
            with store_batches.drawing(cursor, count, item.lane, item.delay_ms or 0) as drawn:
                pass  # send_batch checks its items here
            ids, stored_at, offsets = drawn.ids, drawn.stored_at, drawn.offsets
            assert offsets is not None  # a lane of its own: a level's or the timer's
            stored = store_batches.wire_time(stored_at)
            due = store_batches.wire_time(stored_at + timedelta(milliseconds=item.delay_ms or 0))
            store_batches.copy_rows(
                cursor,
                "commit_log",
                store_batches.MESSAGE_ROW,
                (
                    (
                        message_id,
                        item.topic,
                        None,
                        None,
                        body,
                        is_json,
                        None,
                        item.delay_level,
                        0,
                        item.lane,
                        offset,
                        "scheduled",
                        stored,
                        due,
                        None,
                    )
                    for message_id, offset in zip(ids, offsets, strict=True)
                ),
            )
            if item.lane > 0:  # a level (the default levels have 1h), else the timer lane
                store_batches.copy_rows(
                    cursor,
                    "consume_queue",
                    store_batches.LEVEL_ROW,
                    (
                        (item.lane, offset, message_id, item.topic, due, 0)
                        for message_id, offset in zip(ids, offsets, strict=True)
                    ),
                )
            else:
                store_batches.copy_rows(
                    cursor,
                    "timer_queue",
                    store_batches.TIMER_ROW,
                    (
                        (due, offset, message_id, item.topic, 0)
                        for message_id, offset in zip(ids, offsets, strict=True)
                    ),
                )
            store_batches.count_into_lanes(cursor, {item.lane: count})
            conn.commit()
            progress.update(done + count)
        seconds = time.perf_counter() - started
    progress.done()
    return rows / seconds


def _send_client(settings: Settings) -> Callable[[float], int]:
    """One client process of `send_suite` (`raw.per_second_in_processes`): its own engine
    and producer, warmed up."""
    producer = Producer(settings, make_engine(settings))
    for _ in range(20):
        producer.send(NOOP_TOPIC, BODY, delay="1h")

    def run(stop: float) -> int:
        done = 0
        while time.monotonic() < stop:
            producer.send(NOOP_TOPIC, BODY, delay="1h")
            done += 1
        producer.engine.dispose()
        return done

    return run


def _send_single(producer: Producer, clients: int, seconds: float, **where: Any) -> float:
    """Single sends per second; `where` the lane (default: delay 1h, a level by default)."""
    where = where or {"delay": "1h"}

    def client(stop: float) -> int:
        done = 0
        while time.monotonic() < stop:
            producer.send(NOOP_TOPIC, BODY, **where)
            done += 1
        return done

    return raw.per_second(client, clients, seconds)


# ---------------------------------------------------------------- delivery


def delivery_suite(
    settings: Settings, engine: Engine, url: str, backlog: int, rate: int, seconds: float
) -> Figures:
    figures = Figures()
    batch = settings.delivery_batch
    step(f"delivery: raw move of {backlog:,} rows in batches of {batch}")
    raw_rate = raw.move_rows(libpq_url(url), backlog, batch, Progress("raw move", backlog))
    reset_tables(engine)
    step(f"delivery: drain a due backlog of {backlog:,} (level 1)")
    _send_backlog(Producer(settings, engine), backlog, "fill level 1", delay_level=1)
    time.sleep(settings.levels.delay_ms(1) / 1000 + 0.1)  # all due
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sql("VACUUM ANALYZE"))
    moved, started = 0, time.perf_counter()
    progress = Progress("drain", backlog)
    with engine.connect() as conn:
        while moved < backlog:
            result = run_once(conn, 1, batch)
            if not result.moved:
                break
            moved += result.moved
            progress.update(moved)
    drain_rate = moved / (time.perf_counter() - started)
    progress.done()
    figures.results["delivery_drain"] = {
        "messages": moved,
        "msgs_per_s": round(drain_rate),
        "raw_move_per_s": round(raw_rate),
        "ratio": round(drain_rate / raw_rate, 3),
        "target_ratio": 0.7,
        "batch": batch,
    }
    reset_tables(engine)
    flow = steady_flow(settings, engine, rate, seconds, consumers=0)
    figures.results["delivery_flow"] = flow.results["flow"]
    figures.series.update(flow.series)
    figures.samples.update(flow.samples)
    return figures


def steady_flow(
    settings: Settings, engine: Engine, rate: int, seconds: float, consumers: int
) -> Figures:
    """Send `rate` msg/s for `seconds` (half at level 1, half through the timer lane with a
    1.5 s delay), deliver with one LaneRunner per lane; with `consumers`, run them too."""
    step(f"flow: {rate:,} msg/s for {seconds:g}s, {consumers} consumer processes")
    figures = Figures()
    producer = Producer(settings, engine)
    stop = threading.Event()
    runners = [
        LaneRunner(engine, lane, settings.delivery_batch, settings.idle_poll_ms / 1000, stop=stop)
        for lane in (1, TIMER_LANE)
    ]
    threads = [threading.Thread(target=_run_lane, args=(r, stop)) for r in runners]
    workers = _start_consumers(settings, consumers, stop_after=None)
    for thread in threads:
        thread.start()
    sent = _produce_at_rate(producer, rate, seconds, figures, engine)
    # let the last messages fall due and be delivered
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _count(engine, f"{store.DELIVERED_AT} IS NULL") > 0:
        time.sleep(0.2)
    if consumers:
        while time.monotonic() < deadline + 20 and _count(engine, "started_at IS NULL") > 0:
            time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join()
    _stop_consumers(workers)
    lateness = _lateness(engine, store.DELIVERED_AT)  # a moved row is as it was
    figures.samples["lateness_ms"] = lateness
    figures.results["flow"] = {
        "rate_per_s": rate,
        "seconds": seconds,
        "sent": sent,
        "delivered": len(lateness),
        "lateness_ms": percentiles(lateness),
        "target_p99_ms": 100 if rate >= 5000 else 20,
    }
    if consumers:
        started = _lateness(engine, "started_at")
        figures.samples["start_latency_ms"] = started
        figures.results["flow"]["started"] = len(started)
        figures.results["flow"]["deliver_to_start_ms"] = percentiles(started)
        figures.results["flow"]["target_start_p99_ms"] = 250 if rate >= 5000 else 50
    return figures


def _run_lane(runner: LaneRunner, stop: threading.Event) -> None:
    while not stop.is_set():
        runner.run(5.0)


def _produce_at_rate(
    producer: Producer, rate: int, seconds: float, figures: Figures, engine: Engine
) -> int:
    """Half at level 1, half through the timer lane (1.5 s); the backlog sampled twice a
    second for the plot."""
    backlog: list[tuple[float, float]] = []

    def batch(n: int) -> list[dict[str, Any]]:
        half = n // 2
        return [{"topic": FLOW_TOPIC, "body": BODY, "delay_level": 1}] * (n - half) + [
            {"topic": FLOW_TOPIC, "body": BODY, "delay_ms": 1500}
        ] * half

    def sample(elapsed: float) -> None:
        if not backlog or elapsed - backlog[-1][0] >= 0.5:
            backlog.append((elapsed, float(_pending(engine))))

    sent = send_at_rate(producer, rate, seconds, batch, sample)
    figures.series["backlog"] = backlog
    return sent


def _pending(engine: Engine) -> int:
    """Exact (the bench's queues are small): `lane_stats`' timer-lane figure is the planner's
    estimate, which lags after the bench empties the tables between suites."""
    with engine.connect() as conn:
        return conn.execute(
            sql(
                "SELECT (SELECT count(*) FROM delaysvc.consume_queue) + (SELECT count(*) FROM "
                "delaysvc.timer_queue)"
            )
        ).scalar_one()


def _count(engine: Engine, condition: str) -> int:
    with engine.connect() as conn:
        return conn.execute(
            sql(
                f"SELECT count(*) FROM delaysvc.message c WHERE {condition} AND status <> "
                "'cancelled'"
            )
        ).scalar_one()


def _lateness(engine: Engine, column: str) -> list[float]:
    """`column` (an expression over message c) - deliver_ts, ms, where it is set."""
    with engine.connect() as conn:
        rows = conn.execute(
            sql(
                f"SELECT date_part('epoch', {column} - deliver_ts) * 1000 FROM "
                "delaysvc.message c "
                f"WHERE {column} IS NOT NULL"
            )
        )
        return [float(value) for (value,) in rows]


# ---------------------------------------------------------------- consume


def consume_suite(
    settings: Settings, engine: Engine, jobs: int, processes: int, rate: int, seconds: float
) -> Figures:
    figures = Figures()
    step(f"consume: {jobs:,} ready no-op jobs, {processes} consumer processes")
    _send_backlog(Producer(settings, engine), jobs, "fill topic queue")
    started = time.perf_counter()
    workers = _start_consumers(settings, processes, stop_after=jobs)
    progress = Progress("consume", jobs, "jobs")
    done = 0
    while done < jobs and any(w.is_alive() for w in workers):
        time.sleep(0.25)
        done = _count(engine, "status = 'succeeded'")
        progress.update(done)
    elapsed = time.perf_counter() - started
    _stop_consumers(workers)
    progress.done()
    done = _count(engine, "status = 'succeeded'")
    figures.results["consume_drain"] = {
        "jobs": done,
        "processes": processes,
        "batch": settings.consume_batch,
        "jobs_per_s": round(done / elapsed),
        "target_jobs_per_s": 5000,
    }
    reset_tables(engine)
    flow = steady_flow(settings, engine, rate, seconds, consumers=processes)
    figures.results["consume_flow"] = flow.results["flow"]
    figures.samples["start_latency_ms"] = flow.samples.get("start_latency_ms", [])
    return figures


def _consumer_process(settings: Settings, stop_after: int | None, stop: Any) -> None:
    """One consumer: claim -> run -> finish in batches until the queue is drained (or told
    to stop); polls every 5 ms when idle (Celery wakes consumers instead)."""
    from delaysvc.worker.consumer import Consumer, handler

    @handler(NOOP_TOPIC)
    @handler(FLOW_TOPIC)
    def noop(message: Any) -> None:
        return None

    engine = make_engine(settings)
    consumer = Consumer(settings, engine)
    while not stop.is_set():
        claimed = consumer.run_once(NOOP_TOPIC).claimed + consumer.run_once(FLOW_TOPIC).claimed
        if not claimed:
            if stop_after is not None:
                return
            time.sleep(0.005)


def _start_consumers(settings: Settings, count: int, stop_after: int | None) -> list[Any]:
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    workers = [
        context.Process(target=_consumer_process, args=(settings, stop_after, stop))
        for _ in range(count)
    ]
    for worker in workers:
        worker.stop_event = stop  # type: ignore[attr-defined]
        worker.start()
    return workers


def _stop_consumers(workers: list[Any]) -> None:
    for worker in workers:
        worker.stop_event.set()
    for worker in workers:
        worker.join(timeout=30)
