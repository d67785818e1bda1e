"""The `soak` suite: `--soak-messages` through the whole path at `--soak-rate` per second.

`send_batch` at a steady rate (level 1) -> a real delivery worker, consume worker and beat
(the `delaysvc up` commands, broker Redis db 13 or the filesystem one) -> a no-op handler.
Every `SAMPLE_SECONDS` it samples, from PostgreSQL's statistics (cheap, never a COUNT(*) of a
hot table): messages moved into topic queues (schedule_offset.moved_total), jobs claimed
(deletes from topic_queue), and each hot table's size and dead tuples. Throughput at the end
of the run vs its start (DESIGN.md target: >= 80%) and the table sizes over time (bounded)
are reported and plotted.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from delaysvc.bench.load import send_at_rate
from delaysvc.bench.peer_handlers import SOAK_TOPIC
from delaysvc.bench.peers import DelaysvcPeer, _rss, _start, _stop
from delaysvc.bench.progress import step
from delaysvc.bench.suites import BODY, Figures
from delaysvc.db.names import sql
from delaysvc.producer.sending import Producer

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext

SAMPLE_SECONDS = 2.0
HOT_TABLES = ("commit_log", "topic_queue", "consume_queue_1", "timer_queue")
DRAIN_SECONDS = 60.0
TARGET_RATIO = 0.8
WARM_UP_SECONDS = 60.0
SLOW_PLAN_MS = 5000
LONG_RUNNING_KEPT = 50
LONG_RUNNING_SECONDS = 5  # statements and transactions older than this are sampled
STALL_SECONDS = 10.0  # no claim for this long while sending: the workers' logs are kept
LEVEL_1_SECONDS = 1.0  # messages go in at level 1: the last is claimed about this much later


def soak_suite(ctx: BenchContext) -> Figures:
    messages, rate = ctx.size("soak_messages"), ctx.size("soak_rate")
    seconds = messages / rate
    step(f"soak: {messages:,} messages at {rate:,}/s ({seconds:.0f} s) through the whole path")
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="delaysvc-bench-soak-") as folder:
        peer = DelaysvcPeer(ctx, Path(folder))
        peer.prepare()
        workers = _start(peer, ctx.size("processes"))
        stop = threading.Event()
        sampler = threading.Thread(
            target=_sample_until,
            args=(ctx.engine, workers, samples, stop, max(1.0, min(SAMPLE_SECONDS, seconds / 20))),
            daemon=True,
        )
        drained, sent, sending_ended = False, 0, 0.0  # what the report says if sending failed
        _log_waits_and_slow_statements(ctx.engine)
        try:
            producer = Producer(ctx.settings, ctx.engine)
            _warm_up(ctx.engine, producer)
            base = _claimed(ctx.engine)  # the statistics count since the database was made
            sampler.start()
            sent = send_at_rate(
                producer,
                rate,
                seconds,
                lambda n: [{"topic": SOAK_TOPIC, "body": BODY, "delay_level": 1}] * n,
            )
            sending_ended = time.monotonic()
            deadline = sending_ended + DRAIN_SECONDS
            while time.monotonic() < deadline and _claimed(ctx.engine) - base < sent:
                time.sleep(0.5)
            drained = _claimed(ctx.engine) - base >= sent
            stop.set()
            sampler.join()
        finally:
            stop.set()
            _stop(workers)
            peer.cleanup()
            stalled = _stalls(samples, sending_ended)
            if ctx.out is not None and (not drained or stalled):  # keep what the workers said
                kept = ctx.out / "soak-worker-logs"
                kept.mkdir(parents=True, exist_ok=True)
                for log in Path(folder).glob("*.out"):
                    shutil.copy(log, kept / log.name)
                why = "NOT all ran" if not drained else f"claims stalled ({stalled})"
                step(f"soak: {why}; the workers' logs are in {kept}")
    return Figures(
        results={
            "soak": _summary(samples, sent, rate, drained, sending_ended + LEVEL_1_SECONDS)
            | {"stalls": stalled}
        },
        series={
            "soak_throughput": [(s["t"], s["claimed_per_s"]) for s in samples[1:]],
            **{
                f"soak_bytes:{table}": [(s["t"], s["bytes"][table]) for s in samples]
                for table in HOT_TABLES
            },
            **{
                f"soak_dead:{table}": [(s["t"], s["dead"][table]) for s in samples]
                for table in HOT_TABLES
            },
        },
    )


def _summary(
    samples: list[dict[str, Any]], sent: int, rate: int, drained: bool, flowing_until: float
) -> dict[str, Any]:
    """Throughput of the first and the last tenth of the time jobs flowed steadily: from the
    first claim to the end of sending (plus the delay), not the drain after it."""
    flowing = [s for s in samples[1:] if s["at"] <= flowing_until]
    first = next((i for i, s in enumerate(flowing) if s["claimed_per_s"] > 0), len(flowing))
    # the first window with claims is partial (the flow began inside it): leave it out
    rates = [s["claimed_per_s"] for s in flowing[first + 1 :]]
    # statistics arrive about once a second: average at least 3 samples at each end
    tenth = max(3, len(rates) // 10)
    start, end = rates[:tenth], rates[-tenth:]
    start_rate = sum(start) / len(start) if start else 0.0
    end_rate = sum(end) / len(end) if end else 0.0
    last = samples[-1] if samples else {"bytes": {}, "dead": {}}
    peak = {t: max((s["bytes"][t] for s in samples), default=0) for t in HOT_TABLES}
    return {
        "messages": sent,
        "rate_per_s": rate,
        "drained": drained,
        "claimed_per_s_start": round(start_rate),
        "claimed_per_s_end": round(end_rate),
        "end_vs_start": round(end_rate / start_rate, 3) if start_rate else None,
        "target_ratio": TARGET_RATIO,
        "peak_bytes": peak,
        "final_bytes": last["bytes"],
        "final_dead_tuples": last["dead"],
        "rss_bytes_start": samples[0]["rss"] if samples else 0,
        "rss_bytes_end": last.get("rss", 0),
        # the first samples that saw statements or transactions running long
        "long_running": [
            {"t": s["t"], "sessions": s["long_running"]} for s in samples if "long_running" in s
        ][:LONG_RUNNING_KEPT],
    }


def _stalls(samples: list[dict[str, Any]], sending_ended: float) -> str:
    """The spans of STALL_SECONDS or more, while messages were being sent, in which no job
    was claimed: "from s to s, ..." (empty if none)."""
    spans, since = [], None
    flowing = [s for s in samples[1:] if s["at"] <= sending_ended]
    for sample in flowing:
        if sample["claimed_per_s"] == 0 and since is None:
            since = sample["t"]
        elif since is not None and (sample["claimed_per_s"] > 0 or sample is flowing[-1]):
            if sample["t"] - since >= STALL_SECONDS:
                spans.append(f"{since:.0f}-{sample['t']:.0f} s")
            since = None
    return ", ".join(spans)


def _log_waits_and_slow_statements(engine: Engine) -> None:
    """Have the server log lock waits and statements over a second in the bench database, and
    the plans of those over SLOW_PLAN_MS (auto_explain, where the server has it), so a stall
    can be traced in its log. Needs a superuser; skipped otherwise."""
    with engine.connect() as conn:
        superuser = "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
        if not conn.execute(sql(superuser)).scalar():
            return
        settings = ["log_lock_waits = on", "log_min_duration_statement = 1000"]
        try:
            conn.execute(sql("LOAD 'auto_explain'"))  # a missing library would fail every login
            settings += [
                "session_preload_libraries = 'auto_explain'",
                f"auto_explain.log_min_duration = {SLOW_PLAN_MS}",
            ]
        except DBAPIError:
            conn.rollback()
        database = conn.execute(sql("SELECT current_database()")).scalar_one()
        for setting in settings:
            conn.execute(sql(f'ALTER DATABASE "{database}" SET {setting}'))
        conn.commit()


def _warm_up(engine: Engine, producer: Producer) -> None:
    """One message through the whole path first: the lanes' tasks and the consumer's pool
    are running before the clock starts, as in a service that has been up a while."""
    sent = producer.send(SOAK_TOPIC, BODY, delay_level=1)
    deadline = time.monotonic() + WARM_UP_SECONDS
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            status = conn.execute(
                sql("SELECT status FROM delaysvc.message WHERE id = :id"), {"id": sent.id}
            ).scalar_one()
        if status == "succeeded":
            time.sleep(1.5)  # PostgreSQL publishes the statistics at most once a second
            return
        time.sleep(0.2)
    raise RuntimeError(f"the warm-up message was not run within {WARM_UP_SECONDS:g} s")


def _claimed(engine: Engine) -> int:
    with engine.connect() as conn:
        conn.execute(sql("SELECT pg_stat_clear_snapshot()"))
        return int(
            conn.execute(
                sql(
                    "SELECT n_tup_del FROM pg_stat_user_tables WHERE relid = "
                    "'delaysvc.topic_queue'::regclass"
                )
            ).scalar_one()
        )


# What was running long at a sample: a stalled claim shows here with what it waits for.
_LONG_RUNNING = """
SELECT pid, application_name AS app, state, wait_event_type, wait_event,
    round(extract(epoch FROM now() - query_start)::numeric, 1)::float8 AS statement_s,
    round(extract(epoch FROM now() - xact_start)::numeric, 1)::float8 AS transaction_s,
    age(backend_xmin) AS xmin_age, left(regexp_replace(query, '\\s+', ' ', 'g'), 160) AS query
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle'
    AND (now() - query_start > :seconds * interval '1 second'
         OR now() - xact_start > :seconds * interval '1 second')
"""


def long_running(conn: Connection, seconds: float = LONG_RUNNING_SECONDS) -> list[dict[str, Any]]:
    """The sessions of this database whose statement or transaction has run over `seconds`."""
    return [dict(row._mapping) for row in conn.execute(sql(_LONG_RUNNING), {"seconds": seconds})]


def _sample_until(
    engine: Engine,
    workers: list[Any],
    samples: list[dict[str, Any]],
    stop: threading.Event,
    every: float,
) -> None:
    started = time.monotonic()
    while not stop.is_set():
        with engine.connect() as conn:
            conn.execute(sql("SELECT pg_stat_clear_snapshot()"))
            stats = {
                row.relname: row
                for row in conn.execute(
                    sql(
                        "SELECT relname, n_tup_del, n_dead_tup, "
                        "pg_total_relation_size(relid) AS bytes FROM pg_stat_user_tables "
                        "WHERE relid IN (SELECT oid FROM pg_class WHERE relnamespace = (SELECT "
                        "relnamespace FROM pg_class WHERE oid = 'delaysvc.commit_log'::regclass)) "
                        "AND relname = ANY(:names)"
                    ),
                    {"names": list(HOT_TABLES)},
                )
            }
            running_long = long_running(conn)
        now = time.monotonic() - started
        claimed = int(stats["topic_queue"].n_tup_del) if "topic_queue" in stats else 0
        sample = {
            "at": time.monotonic(),
            "t": round(now, 2),
            "claimed": claimed,
            "bytes": {t: int(stats[t].bytes) if t in stats else 0 for t in HOT_TABLES},
            "dead": {t: int(stats[t].n_dead_tup) if t in stats else 0 for t in HOT_TABLES},
            "rss": _rss(workers),
        }
        if running_long:
            sample["long_running"] = running_long
        if samples:
            previous = samples[-1]
            sample["claimed_per_s"] = (claimed - previous["claimed"]) / (now - previous["t"])
        samples.append(sample)
        stop.wait(every)
