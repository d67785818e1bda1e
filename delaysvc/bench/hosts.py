"""The `hosts` suite: consumer throughput with 1, 2 and 3 worker hosts on one database.

A host is what one machine of a deployment runs: its own delivery worker, consumer worker
(`--processes` processes) and beat, in a folder of its own, all on the bench's database and
broker (Redis when it answers, else each host's own filesystem broker). For each count of
hosts, `--hosts-jobs` no-op jobs wait ready in a paused topic while the hosts start and report
in; the topic is resumed and the jobs run: jobs/s from the first start to the last finish,
and the CPU seconds PostgreSQL's processes spent from the resume to the end, so the figure is
also jobs per database CPU second (what one database core sustains). Every job must run once.

Here the hosts share the database's two cores, so the figure shows where the ceiling is on
this machine, not how far separate machines would go: on separate machines, throughput grows
with hosts until the database's cores are busy (`jobs_per_db_cpu_s` x its cores).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from delaysvc import store
from delaysvc.bench.peer_handlers import SOAK_TOPIC
from delaysvc.bench.peers import DelaysvcPeer
from delaysvc.bench.progress import Progress, step
from delaysvc.bench.rolling import Deployment, _succeeded, _wait_until_running
from delaysvc.bench.suites import Figures, _send_backlog
from delaysvc.db.names import sql
from delaysvc.producer.sending import Producer

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from delaysvc.bench import BenchContext

HOST_COUNTS = (1, 2, 3)
DRAIN_SECONDS = 600.0
SETTLE_SECONDS = 5.0


def hosts_suite(ctx: BenchContext) -> Figures:
    jobs, processes = ctx.size("hosts_jobs"), ctx.size("processes")
    figures = Figures()
    for hosts in HOST_COUNTS:
        step(f"hosts: {jobs:,} ready jobs, {hosts} host(s) of {processes} consumer processes")
        figures.results[f"hosts_{hosts}"] = _run(ctx, hosts, jobs, processes)
    one = figures.results["hosts_1"]["jobs_per_s"]
    for hosts in HOST_COUNTS:
        result = figures.results[f"hosts_{hosts}"]
        result["vs_one_host"] = round(result["jobs_per_s"] / one, 2) if one else None
    figures.series["hosts_jobs_per_s"] = [
        (float(h), float(figures.results[f"hosts_{h}"]["jobs_per_s"])) for h in HOST_COUNTS
    ]
    return figures


def _run(ctx: BenchContext, hosts: int, jobs: int, processes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="delaysvc-bench-hosts-") as folder:
        peers = [DelaysvcPeer(ctx, Path(folder) / f"host{n}") for n in range(hosts)]
        for peer in peers:
            peer.folder.mkdir(parents=True)
            peer.prepare()  # the tables emptied, the broker flushed: before anything starts
        with ctx.engine.begin() as conn:
            store.set_topic_paused(conn, SOAK_TOPIC, True)
        _send_backlog(Producer(ctx.settings, ctx.engine), jobs, "fill", topic=SOAK_TOPIC)
        deployments = [Deployment(peer, processes) for peer in peers]
        try:
            for deployment in deployments:
                for name in ("delivery", "consume", "beat"):
                    deployment.start(name)
            _wait_until_running(ctx.engine)  # a part of each kind reported in, on some host:
            time.sleep(SETTLE_SECONDS)  # the others' pools start too (Celery: ~3 s here)
            cpu_before = _postgres_cpu()
            with ctx.engine.begin() as conn:
                store.set_topic_paused(conn, SOAK_TOPIC, False)
            done = _wait_until_done(ctx.engine, jobs)
            db_cpu = _cpu_since(cpu_before)
            ran_twice = _ran_twice(ctx.engine)  # before the cleanup empties the tables
            elapsed = _first_start_to_last_finish(ctx.engine)
        finally:
            for deployment in deployments:
                deployment.stop_all()
            for peer in peers:
                peer.cleanup()
    return {
        "hosts": hosts,
        "processes_per_host": processes,
        "jobs": jobs,
        "succeeded": done,
        "jobs_per_s": round(done / elapsed) if elapsed else 0,
        "seconds": round(elapsed, 2),
        "db_cpu_s": round(db_cpu, 2),
        "jobs_per_db_cpu_s": round(done / db_cpu) if db_cpu else None,
        "ran_twice": ran_twice,
    }


def _wait_until_done(engine: Engine, jobs: int) -> int:
    progress = Progress("run", jobs, "jobs")
    deadline = time.monotonic() + DRAIN_SECONDS
    done = 0
    while time.monotonic() < deadline:
        done = _succeeded(engine, 0)
        progress.update(done)
        if done >= jobs:
            break
        time.sleep(0.1)
    progress.done()
    return done


def _ran_twice(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sql("SELECT count(*) FROM delaysvc.message WHERE attempts > 1")
            ).scalar_one()
        )


def _first_start_to_last_finish(engine: Engine) -> float:
    """Seconds from the first job's start to the last one's end (the database's clock): the
    rate once the consumers run, without the wake-up after the resume."""
    with engine.connect() as conn:
        return float(
            conn.execute(
                sql(
                    "SELECT extract(epoch FROM max(finished_at) - min(started_at)) "
                    "FROM delaysvc.message"
                )
            ).scalar_one()
            or 0.0
        )


def _postgres_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each PostgreSQL server process on this machine."""
    found = {}
    for process in psutil.process_iter(["name", "cpu_times"]):
        if process.info["name"] in ("postgres", "postmaster") and process.info["cpu_times"]:
            times = process.info["cpu_times"]
            found[process.pid] = times.user + times.system
    return found


def _cpu_since(before: dict[int, float]) -> float:
    """CPU seconds PostgreSQL's processes spent since `before`: of each one running now, what
    it added (all of it, for one started since). A backend that ended in between is not
    counted: the workers' pooled connections live through the run."""
    return sum(max(0.0, now - before.get(pid, 0.0)) for pid, now in _postgres_cpu().items())
