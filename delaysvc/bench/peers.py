"""The `peers` suite: one workload on delaysvc and on what a user would pick instead.

The workload, the same on each peer: N jobs, each due a fixed delay after it is enqueued (one
job per call of the peer's own single-job API, from one client thread, as fast as it goes),
handled by a no-op handler in real worker processes the bench starts (`--peer-workers` of them,
or that concurrency). Every handler records "job i, due at t, received now" the same way
(`record.py`), so lateness = received - due on one clock. Then memory: `--peer-pending` more
jobs at a 1 h delay, and how much the broker / database and the worker processes grew.

Peers (each in a place of its own, removed afterwards):
- Celery `apply_async(countdown=...)`, Redis broker db 14, a `celery worker` (prefork);
- Procrastinate `defer` with `schedule_in`, database `delaysvc_bench_procrastinate` on the
  bench's PostgreSQL, `procrastinate worker` processes;
- RabbitMQ TTL + dead-letter-exchange per-delay queues (queues named `delaysvc_bench.*` on the
  local RabbitMQ), pika consumer processes;
- delaysvc itself: `Producer.send` (one transaction per job), delivered and run by a real
  Celery delivery worker, consume worker and beat (`delaysvc.runtime.supervisor`'s commands) through
  delaysvc's own tasks, broker Redis db 13 (the filesystem broker when Redis is absent).

A peer whose package or service is missing is reported as unavailable, with the reason and
the fix, in the results and on stderr; the other peers still run.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sqlalchemy import Engine, create_engine

from delaysvc.bench import raw, record
from delaysvc.bench.progress import Progress, step
from delaysvc.bench.suites import Figures, percentiles, reset_tables
from delaysvc.db.engines import libpq_url
from delaysvc.db.names import sql
from delaysvc.producer.sending import Producer
from delaysvc.runtime.supervisor import die_with_parent

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext

REDIS_URL = "redis://127.0.0.1:6379"
CELERY_REDIS_DB = 14
DELAYSVC_REDIS_DB = 13
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
PROCRASTINATE_DATABASE = "delaysvc_bench_procrastinate"
PENDING_DELAY = 3600.0
INSTALL = "pip install 'delaysvc[bench]'"
STOP_GRACE_SECONDS = 15
START_TIMEOUT = 90.0
DRAIN_GRACE_SECONDS = 60.0
RAW_SECONDS = 3.0


class Peer:
    """One peer: how to check it is there, start its workers, enqueue a job, read its memory
    and clean up. Subclasses fill these in."""

    name = ""
    label = ""
    not_durable = ""
    setup = ""

    def __init__(self, ctx: BenchContext, folder: Path):
        self.ctx, self.folder = ctx, folder

    def prepare(self) -> str | None:
        """Set up the peer's own place; -> why it cannot run here, or None."""
        return None

    def worker_commands(self, workers: int) -> list[list[str]]:
        raise NotImplementedError

    def worker_env(self) -> dict[str, str]:
        return {}

    def open(self) -> None:
        """Open the client used by `enqueue`."""

    def enqueue(self, i: int, due: float, delay: float) -> None:
        raise NotImplementedError

    bulk = ""
    """How `enqueue_many` puts many jobs in, where the peer has a faster way than one call per
    job (the memory measurement's pending jobs; the lateness workload always uses `enqueue`)."""

    def enqueue_many(self, first: int, count: int, due: float, delay: float) -> None:
        for i in range(first, first + count):
            self.enqueue(i, due, delay)

    def stored_bytes(self) -> dict[str, int]:
        """Size of what the broker / database holds (bytes, by component)."""
        return {}

    def settle(self, workers: list[subprocess.Popen[bytes]]) -> None:
        """Wait until the pending jobs are where they rest (a Celery worker fetching ETAs)."""
        time.sleep(1.0)

    def close(self) -> None:
        """Close the client."""

    def cleanup(self) -> None:
        """Remove everything the peer made."""


# ---------------------------------------------------------------- the peers


def _redis(db: int) -> Any:
    import redis

    return redis.Redis.from_url(f"{REDIS_URL}/{db}", socket_connect_timeout=2)


def _redis_missing() -> str | None:
    try:
        _redis(CELERY_REDIS_DB).ping()
    except Exception as exc:
        return f"Redis at {REDIS_URL} not reachable ({exc.__class__.__name__}: {exc})"
    return None


class CeleryPeer(Peer):
    name = "celery"
    label = "Celery 5 apply_async(countdown) + Redis"
    not_durable = (
        "countdown tasks leave Redis at once and wait in the worker's RAM until due (ETA "
        "tasks ignore the prefetch limit); an ETA beyond visibility_timeout (1 h) is delivered "
        "again (duplicates); this machine's Redis keeps nothing on disk (no AOF/RDB), so a "
        "Redis restart loses every job not yet fetched"
    )
    setup = (
        "task_acks_late, task_reject_on_worker_lost, worker_prefetch_multiplier=1, "
        "visibility_timeout 3600 s, prefork worker; Redis db 14"
    )

    def prepare(self) -> str | None:
        missing = _redis_missing()
        if missing:
            return f"{missing}; start redis-server on 127.0.0.1:6379"
        _redis(CELERY_REDIS_DB).flushdb()
        return None

    def worker_env(self) -> dict[str, str]:
        from delaysvc.bench.peer_celery import BROKER_ENV

        return {BROKER_ENV: f"{REDIS_URL}/{CELERY_REDIS_DB}"}

    def worker_commands(self, workers: int) -> list[list[str]]:
        from delaysvc.bench.peer_celery import QUEUE

        return [
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "delaysvc.bench.peer_celery",
                "worker",
                "-Q",
                QUEUE,
                "-c",
                str(workers),
                "--without-mingle",
                "--without-gossip",
                "-l",
                "warning",
            ]
        ]

    def open(self) -> None:
        from delaysvc.bench.peer_celery import TASK, make_app

        self.app = make_app(f"{REDIS_URL}/{CELERY_REDIS_DB}")
        self.task = self.app.tasks[TASK]

    def enqueue(self, i: int, due: float, delay: float) -> None:
        self.task.apply_async((i, due), countdown=delay)

    def stored_bytes(self) -> dict[str, int]:
        info = _redis(CELERY_REDIS_DB).info("memory")
        return {"Redis used_memory": int(info["used_memory"])}

    def settle(self, workers: list[subprocess.Popen[bytes]]) -> None:
        from delaysvc.bench.peer_celery import QUEUE

        client = _redis(CELERY_REDIS_DB)
        # the worker fetches every ETA task into its memory: give it time at 1M pending
        deadline = time.monotonic() + max(60.0, client.llen(QUEUE) / 2000)
        while time.monotonic() < deadline and client.llen(QUEUE) > 0:
            time.sleep(0.25)
        time.sleep(1.0)

    def close(self) -> None:
        self.app.close()

    def cleanup(self) -> None:
        _redis(CELERY_REDIS_DB).flushdb()


class ProcrastinatePeer(Peer):
    name = "procrastinate"
    label = "Procrastinate 3 defer(schedule_in) on PostgreSQL"
    not_durable = (
        "durable (jobs are rows, committed by defer); a scheduled job is found by the "
        "worker's fetch polling (5 s default), not by NOTIFY"
    )
    setup = (
        "defaults (listen_notify on, fetch_job_polling_interval 5 s, concurrency 1 per "
        "worker process); database of its own on the same PostgreSQL"
    )

    def prepare(self) -> str | None:
        if importlib.util.find_spec("procrastinate") is None:
            return f"procrastinate is not installed ({INSTALL})"
        from delaysvc.bench import bench_database

        url = bench_database(self.ctx.settings, PROCRASTINATE_DATABASE, migrate=False)
        self.dsn = libpq_url(url)
        from delaysvc.bench.peer_procrastinate import make_app

        app = make_app(self.dsn)
        with app.open():
            app.schema_manager.apply_schema()
        self.engine = create_engine(url)
        return None

    def worker_env(self) -> dict[str, str]:
        from delaysvc.bench.peer_procrastinate import DSN_ENV

        return {DSN_ENV: self.dsn}

    def worker_commands(self, workers: int) -> list[list[str]]:
        command = [
            sys.executable,
            "-m",
            "procrastinate",
            "--app=delaysvc.bench.peer_procrastinate.app",
            "--log-level=warning",
            "worker",
            "--concurrency=1",
        ]
        return [command] * workers

    def open(self) -> None:
        from delaysvc.bench.peer_procrastinate import TASK, make_app

        self.app = make_app(self.dsn)
        self.app.open()
        self.task = self.app.tasks[TASK]

    def enqueue(self, i: int, due: float, delay: float) -> None:
        self.task.configure(schedule_in={"milliseconds": round(delay * 1000)}).defer(i=i, due=due)

    bulk = "batch_defer of 1,000"

    def enqueue_many(self, first: int, count: int, due: float, delay: float) -> None:
        self.task.configure(schedule_in={"milliseconds": round(delay * 1000)}).batch_defer(
            *({"i": i, "due": due} for i in range(first, first + count))  # type: ignore[arg-type]
        )

    def stored_bytes(self) -> dict[str, int]:
        return {"PostgreSQL tables": _tables_bytes(self.engine)}

    def close(self) -> None:
        self.app.close()

    def cleanup(self) -> None:
        from delaysvc.bench import drop_database

        self.engine.dispose()
        drop_database(self.ctx.settings, PROCRASTINATE_DATABASE)


class RabbitPeer(Peer):
    name = "rabbitmq"
    label = "RabbitMQ TTL + dead-letter queues (pika)"
    not_durable = (
        "dead-lettering from classic queues is at-most-once (a message expiring as the node "
        "fails can be lost; at-least-once dead-lettering needs quorum queues); one node; a "
        "queue per distinct delay (no arbitrary delays), TTL only expires the queue's head"
    )
    setup = (
        "classic durable queues, persistent messages, publisher confirms (each publish "
        "waits for its confirm), consumers ack after handling, prefetch 100"
    )

    def prepare(self) -> str | None:
        if importlib.util.find_spec("pika") is None:
            return f"pika is not installed ({INSTALL})"
        from delaysvc.bench.peer_rabbitmq import delete_everything

        try:
            delete_everything(AMQP_URL, {round(self.ctx.seconds("peer_delay") * 1000)})
        except Exception as exc:
            where = urlsplit(AMQP_URL)
            return (
                f"RabbitMQ at {where.hostname}:{where.port} not reachable "
                f"({exc.__class__.__name__}: {exc}); start it with rabbitmq-server -detached"
            )
        self.delays: set[int] = set()
        return None

    def worker_commands(self, workers: int) -> list[list[str]]:
        command = [sys.executable, "-m", "delaysvc.bench.peer_rabbitmq", AMQP_URL]
        return [[*command, str(self.folder)]] * workers

    def open(self) -> None:
        from delaysvc.bench.peer_rabbitmq import Publisher

        self.publisher = Publisher(AMQP_URL)

    def enqueue(self, i: int, due: float, delay: float) -> None:
        self.publisher.publish(i, due, round(delay * 1000))

    bulk = "1,000 persistent publishes without confirms, then a wait until the queue holds them"

    def enqueue_many(self, first: int, count: int, due: float, delay: float) -> None:
        self.publisher.publish_many(range(first, first + count), due, round(delay * 1000))

    def stored_bytes(self) -> dict[str, int]:
        import psutil

        beam = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "beam.smp"]
        return {"RabbitMQ (beam.smp) RSS": sum(p.memory_info().rss for p in beam)}

    def close(self) -> None:
        self.delays = self.publisher.delays
        self.publisher.close()

    def cleanup(self) -> None:
        from delaysvc.bench.peer_rabbitmq import delete_everything

        delete_everything(AMQP_URL, self.delays)


class DelaysvcPeer(Peer):
    name = "delaysvc"
    label = "delaysvc (Celery delivery + consume workers, beat)"
    not_durable = "durable: a send commits its row; a move is one transaction"
    setup = (
        "Producer.send (one transaction per job; delays equal to a level use its FIFO lane), "
        "the `delaysvc up` worker and beat commands, broker Redis db 13"
    )

    def prepare(self) -> str | None:
        self.broker = None if _redis_missing() else f"{REDIS_URL}/{DELAYSVC_REDIS_DB}"
        if self.broker:
            _redis(DELAYSVC_REDIS_DB).flushdb()
        else:
            self.setup = self.setup.replace("broker Redis db 13", "filesystem broker")
        self.var = self.folder / "var"
        reset_tables(self.ctx.engine)
        return None

    def worker_env(self) -> dict[str, str]:
        env = {
            "DELAYSVC_DATABASE_URL": self.ctx.url,
            "DELAYSVC_DELAY_LEVELS": self.ctx.settings.delay_levels,
            "DELAYSVC_HANDLERS": "delaysvc.bench.peer_handlers",
            "DELAYSVC_VAR_DIR": str(self.var),
        }
        if self.broker:
            env["DELAYSVC_BROKER_URL"] = self.broker
        return env

    def worker_commands(self, workers: int) -> list[list[str]]:
        from delaysvc.runtime.commands import beat_command, worker_commands

        settings = self.ctx.settings.model_copy(
            update={"broker_url": self.broker, "var_dir": self.var}
        )
        return [*worker_commands(settings, concurrency=workers), beat_command(settings)]

    def open(self) -> None:
        self.producer = Producer(self.ctx.settings, self.ctx.engine)

    def enqueue(self, i: int, due: float, delay: float) -> None:
        from delaysvc.bench.peer_handlers import TOPIC

        self.producer.send(TOPIC, {"i": i, "due": due}, delay_ms=round(delay * 1000))

    bulk = "send_batch of 1,000"

    def enqueue_many(self, first: int, count: int, due: float, delay: float) -> None:
        from delaysvc.bench.peer_handlers import TOPIC

        self.producer.send_batch(
            [
                {"topic": TOPIC, "body": {"i": i, "due": due}, "delay_ms": round(delay * 1000)}
                for i in range(first, first + count)
            ]
        )

    def stored_bytes(self) -> dict[str, int]:
        return {"PostgreSQL tables": _tables_bytes(self.ctx.engine)}

    def cleanup(self) -> None:
        reset_tables(self.ctx.engine)
        if self.broker:
            _redis(DELAYSVC_REDIS_DB).flushdb()


PEERS: dict[str, type[Peer]] = {
    peer.name: peer for peer in (DelaysvcPeer, CeleryPeer, ProcrastinatePeer, RabbitPeer)
}


def _tables_bytes(engine: Engine) -> int:
    """Every table of the database, in any schema but the system's (delaysvc's are in its own
    schema, Procrastinate's in public), with its indexes and TOAST."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sql(
                    "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
                    "AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
                    "AND n.nspname NOT LIKE 'pg_toast%'"
                )
            ).scalar_one()
        )


# ---------------------------------------------------------------- the workload


def peers_suite(ctx: BenchContext, only: list[str] | None = None) -> Figures:
    figures = Figures()
    if importlib.util.find_spec("psutil") is None:
        reason = f"psutil is not installed ({INSTALL})"
        step(f"peers: NOT RUN: {reason}")
        for name in only or list(PEERS):
            figures.results[f"peer_{name}"] = {"label": PEERS[name].label, "unavailable": reason}
        return figures
    step(f"peers: raw limit: one-row INSERT per transaction, 1 client, {RAW_SECONDS:g}s")
    raw_rate = raw.insert_one_row_per_transaction(libpq_url(ctx.url), 1, RAW_SECONDS)
    figures.results["peer_raw"] = {
        "label": "raw PostgreSQL: one-row INSERT per transaction, 1 client (the enqueue limit)",
        "raw_insert_per_s": round(raw_rate),
    }
    for name in only or list(PEERS):
        with tempfile.TemporaryDirectory(prefix=f"delaysvc-bench-{name}-") as folder:
            peer = PEERS[name](ctx, Path(folder))
            result, lateness = measure(
                peer,
                ctx.size("peer_jobs"),
                ctx.seconds("peer_delay"),
                ctx.size("peer_pending"),
                ctx.size("peer_workers"),
            )
        figures.results[f"peer_{name}"] = result
        if lateness:
            figures.samples[f"peer_lateness_ms:{peer.label}"] = lateness
    return figures


def measure(
    peer: Peer, jobs: int, delay: float, pending: int, workers: int
) -> tuple[dict[str, Any], list[float]]:
    """The workload on one peer; -> its result and its lateness samples (ms)."""
    base: dict[str, Any] = {"label": peer.label, "peer": peer.name}
    step(f"peers: {peer.label}: {jobs:,} jobs at {delay:g} s, {workers} workers")
    try:
        reason = peer.prepare()
    except Exception as exc:
        reason = f"setting up failed: {exc.__class__.__name__}: {exc}"
    if reason:
        step(f"peers: {peer.label}: UNAVAILABLE: {reason}")
        return {**base, "unavailable": reason}, []
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes = _start(peer, workers)
        peer.open()
        # a first job through the same delay path: the workers are up and warm, as in service
        peer.enqueue(record.WARM_UP, time.time() + delay, delay)
        warm = lambda: record.read(peer.folder).has(record.WARM_UP)  # noqa: E731
        if not _wait(warm, START_TIMEOUT + delay, processes):
            reason = f"its workers did not run a first job within {START_TIMEOUT + delay:g} s"
            step(f"peers: {peer.label}: UNAVAILABLE: {reason}\n{_logs(peer.folder)}")
            return {**base, "unavailable": reason, "log": _logs(peer.folder)}, []
        enqueue_per_s = _enqueue(peer, jobs, delay, "enqueue")
        _wait(
            lambda: record.read(peer.folder).count >= jobs,
            delay + DRAIN_GRACE_SECONDS,
            processes,
        )
        got = record.read(peer.folder)
        lateness = [got.lateness_ms[i] for i in range(jobs) if got.has(i)]
        memory = _memory_at_pending(peer, pending, processes)
        result = {
            **base,
            "sent": jobs,
            "delay_s": delay,
            "workers": workers,
            "received": len(lateness),
            "duplicates": got.duplicates,
            "enqueue_per_s": round(enqueue_per_s),
            "lateness_ms": percentiles(lateness),
            "memory": memory,
            "not_durable": peer.not_durable,
            "setup": peer.setup,
        }
        if len(lateness) < jobs:
            result["log"] = _logs(peer.folder)
        return result, lateness
    finally:
        _stop(processes)
        for action in (peer.close, peer.cleanup):
            try:
                action()
            except Exception as exc:
                step(f"peers: {peer.label}: {action.__name__} failed: {exc}")


def _enqueue(peer: Peer, count: int, delay: float, label: str, chunk: int = 1) -> float:
    """Jobs/s putting `count` jobs in: one `enqueue` (the peer's single-job API) each when
    `chunk` is 1, else `enqueue_many` (the peer's bulk way) per `chunk` jobs."""
    progress = Progress(f"{peer.name} {label}", count, "jobs")
    started = time.perf_counter()
    for first in range(0, count, chunk):
        size = min(chunk, count - first)
        if chunk == 1:
            peer.enqueue(first, time.time() + delay, delay)
        else:
            peer.enqueue_many(first, size, time.time() + delay, delay)
        progress.update(first + size)
    elapsed = time.perf_counter() - started
    progress.done()
    return count / elapsed


def _memory_at_pending(
    peer: Peer, pending: int, processes: list[subprocess.Popen[bytes]]
) -> dict[str, Any]:
    """Growth of the broker / database and of the worker processes while `pending` jobs wait
    (due in an hour, beyond the run)."""
    stored_before, rss_before = peer.stored_bytes(), _rss(processes)
    rate = _enqueue(peer, pending, PENDING_DELAY, f"{pending:,} pending", chunk=1000)
    peer.settle(processes)
    stored_after, rss_after = peer.stored_bytes(), _rss(processes)
    grown = {f"{k} growth": stored_after[k] - stored_before[k] for k in stored_after}
    grown["worker RSS growth"] = rss_after - rss_before
    return {
        "pending": pending,
        "enqueued_by": peer.bulk or "one call per job",
        "enqueue_per_s": round(rate),
        "bytes": grown,
        "worker_rss_bytes": rss_after,
    }


# ---------------------------------------------------------------- processes


def _start(peer: Peer, workers: int) -> list[subprocess.Popen[bytes]]:
    env = dict(os.environ, **peer.worker_env(), **{record.RECORD_DIR_ENV: str(peer.folder)})
    started = []
    for n, command in enumerate(peer.worker_commands(workers)):
        log = (peer.folder / f"{peer.name}-{n}.out").open("wb")
        started.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # a killed bench leaves no peer running
            )
        )
    return started


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _rss(processes: list[subprocess.Popen[bytes]]) -> int:
    import psutil

    total = 0
    for process in processes:
        try:
            parent = psutil.Process(process.pid)
            for p in [parent, *parent.children(recursive=True)]:
                total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def _wait(
    condition: Callable[[], bool], timeout: float, processes: list[subprocess.Popen[bytes]]
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if any(p.poll() is not None for p in processes):
            return condition()
        time.sleep(0.25)
    return condition()


def _logs(folder: Path, lines: int = 15) -> str:
    tails = []
    for path in sorted(folder.glob("*.out")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        if tail:
            tails.append(f"{path.name}: " + " / ".join(tail))
    return "\n".join(tails)
