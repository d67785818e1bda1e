"""The `rolling` suite: a rolling restart under a steady flow costs nothing.

`send_batch` at `--rolling-rate` per second (level 1) for `--rolling-seconds` through the real
path (the `delaysvc up` worker and beat commands, a no-op handler). A quarter of the way in,
the delivery worker is replaced the way a deploy replaces it: a new one started, given
`START_SECONDS` to boot, then SIGTERM to the old one (its lanes hand over to the new worker as
they stop). Past the middle, the consumer worker likewise. At the end, after the backlog has
run: messages lost (sent but not succeeded), re-runs (attempts beyond the first) against the
jobs running when the consumer got its SIGTERM, and the lateness of every message of the window
(deliver_ts -> in the topic queue, and -> handler started), plotted over time with the
restarts marked.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from delaysvc.bench.load import send_at_rate
from delaysvc.bench.peer_handlers import SOAK_TOPIC
from delaysvc.bench.peers import DelaysvcPeer
from delaysvc.bench.progress import step
from delaysvc.bench.suites import BODY, Figures, percentiles
from delaysvc.db.names import sql
from delaysvc.maintenance import heartbeats
from delaysvc.producer.sending import Producer
from delaysvc.runtime.supervisor import die_with_parent

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext

START_SECONDS = 10.0
"""A new worker's time to boot before the old one is stopped (Celery starts in ~3 s here)."""
READY_SECONDS = 60.0
DRAIN_SECONDS = 60.0
TARGET_P99_MS = 100.0


class Deployment:
    """The workers and beat, each started on its own, so one can be replaced."""

    def __init__(self, peer: DelaysvcPeer, processes: int):
        self.peer = peer
        self.env = dict(os.environ, **peer.worker_env())
        delivery, consume, beat = peer.worker_commands(processes)
        self.commands = {"delivery": delivery, "consume": consume, "beat": beat}
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.started = 0

    def start(self, name: str) -> subprocess.Popen[bytes]:
        command = list(self.commands[name])
        if "-n" in command:  # every worker its own node name
            command[command.index("-n") + 1] = f"{name}{self.started}@%h"
        log = (self.peer.folder / f"{name}-{self.started}.out").open("wb")
        self.started += 1
        process = subprocess.Popen(
            command,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # so started from the main thread: see rolling_suite
        )
        self.running[name] = process
        return process

    def replace(self, name: str, in_flight: Any = None) -> dict[str, Any]:
        """Start a new `name`, give it START_SECONDS, SIGTERM the old one (its main process
        alone, as `delaysvc up` does: a warm shutdown) and wait for it to exit."""
        old = self.running[name]
        self.start(name)
        time.sleep(START_SECONDS)
        held = in_flight() if in_flight is not None else None
        stopped_at = time.monotonic()
        old.terminate()
        code = old.wait(timeout=120)
        return {
            "sigterm_at": stopped_at,
            "stop_seconds": round(time.monotonic() - stopped_at, 2),
            "exit": code,
        } | ({"running_at_sigterm": held} if held is not None else {})

    def stop_all(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.terminate()
        for process in self.running.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()


def rolling_suite(ctx: BenchContext) -> Figures:
    rate, seconds = int(ctx.size("rolling_rate")), float(ctx.size("rolling_seconds"))
    step(
        f"rolling: {rate:,} msg/s for {seconds:.0f} s; the delivery worker, then the consumer "
        "worker, replaced under the flow"
    )
    with tempfile.TemporaryDirectory(prefix="delaysvc-bench-rolling-") as folder:
        peer = DelaysvcPeer(ctx, Path(folder))
        peer.prepare()
        deployment = Deployment(peer, int(ctx.size("processes")))
        events: list[tuple[float, str]] = []
        replaced: dict[str, Any] = {}
        try:
            for name in ("delivery", "consume", "beat"):
                deployment.start(name)
            _wait_until_running(ctx.engine)
            first_id = _last_id(ctx.engine)
            began = time.monotonic()

            def restarts() -> None:
                for name, at in (("delivery", 0.25), ("consume", 0.55)):
                    time.sleep(max(0.0, began + seconds * at - time.monotonic()))
                    events.append((time.monotonic() - began, f"new {name} worker"))
                    probe = (lambda: _running(ctx.engine)) if name == "consume" else None
                    done = deployment.replace(name, probe)
                    events.append((done.pop("sigterm_at") - began, f"SIGTERM old {name}"))
                    replaced[name] = done
                    step(f"rolling: {name} worker replaced ({done})")

            # the flow from a thread, the replacements from this one: a worker dies with the
            # thread that started it (`die_with_parent`), and this thread outlives them all
            producer = Producer(ctx.settings, ctx.engine)
            flow: list[int] = []
            sender = threading.Thread(
                target=lambda: flow.append(
                    send_at_rate(
                        producer,
                        rate,
                        seconds,
                        lambda n: [{"topic": SOAK_TOPIC, "body": BODY, "delay_level": 1}] * n,
                    )
                ),
                name="rolling-flow",
                daemon=True,
            )
            sender.start()
            restarts()
            sender.join()
            if not flow:
                raise RuntimeError("the flow's thread failed: its traceback is above")
            (sent,) = flow
            drained = _wait_until_run(ctx.engine, first_id, sent)
            rows = _window(ctx.engine, first_id)
        finally:
            deployment.stop_all()
            peer.cleanup()
    return _figures(rows, sent, rate, seconds, drained, events, replaced)


def _wait_until_running(engine: Engine) -> None:
    """Until beat, every lane and the consumers have reported in."""
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if heartbeats.read_health(engine).status == "ok":
            return
        time.sleep(0.2)
    raise RuntimeError(f"the workers did not report in within {READY_SECONDS:g} s")


def _last_id(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(sql("SELECT coalesce(max(id), 0) FROM delaysvc.message")).scalar_one()
        )


def _running(engine: Engine) -> int:
    with engine.connect() as conn:
        running = sql("SELECT count(*) FROM delaysvc.commit_log WHERE status = 'running'")
        return int(conn.execute(running).scalar_one())


def _wait_until_run(engine: Engine, first_id: int, sent: int) -> bool:
    deadline = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < deadline:
        if _succeeded(engine, first_id) >= sent:
            return True
        time.sleep(0.5)
    return _succeeded(engine, first_id) >= sent


def _succeeded(engine: Engine, first_id: int) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sql(
                    "SELECT count(*) FROM delaysvc.message WHERE id > :id AND status = 'succeeded'"
                ),
                {"id": first_id},
            ).scalar_one()
        )


def _window(engine: Engine, first_id: int) -> list[Any]:
    """Every message of the window: its due time, how late it entered its topic queue and its
    handler started (ms), its attempts and status."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sql(
                    "SELECT extract(epoch FROM deliver_ts) AS due, "
                    "extract(epoch FROM delivered_at - deliver_ts) * 1000 AS late_ms, "
                    "extract(epoch FROM started_at - deliver_ts) * 1000 AS start_ms, "
                    "attempts, status FROM delaysvc.message WHERE id > :id ORDER BY deliver_ts"
                ),
                {"id": first_id},
            )
        )


def _figures(
    rows: list[Any],
    sent: int,
    rate: int,
    seconds: float,
    drained: bool,
    events: list[tuple[float, str]],
    replaced: dict[str, Any],
) -> Figures:
    """The report; the series are by due time, in seconds since the flow began (the first
    message was due one level-1 delay, 1 s, after it), like the events."""
    late = [float(row.late_ms) for row in rows if row.late_ms is not None]
    start = [float(row.start_ms) for row in rows if row.start_ms is not None]
    succeeded = sum(1 for row in rows if row.status == "succeeded")
    reruns = sum(max(0, int(row.attempts) - 1) for row in rows)
    began = float(rows[0].due) - 1.0 if rows else 0.0
    per_second: dict[int, list[float]] = {}
    for row in rows:
        if row.late_ms is not None:
            per_second.setdefault(int(float(row.due) - began), []).append(float(row.late_ms))
    return Figures(
        results={
            "rolling_restart": {
                "rate_per_s": rate,
                "seconds": seconds,
                "sent": sent,
                "succeeded": succeeded,
                "lost": sent - succeeded,
                "drained": drained,
                "reruns": reruns,
                "running_at_consumer_sigterm": replaced.get("consume", {}).get(
                    "running_at_sigterm"
                ),
                "replaced": replaced,
                "events": [[round(t, 2), what] for t, what in events],
                "lateness_ms": percentiles(late),
                "deliver_to_start_ms": percentiles(start),
                "target_p99_ms": TARGET_P99_MS,
            }
        },
        series={
            "rolling_lateness_max": [(t, max(v)) for t, v in sorted(per_second.items())],
            "rolling_lateness_p99": [
                (t, sorted(v)[int(0.99 * (len(v) - 1))]) for t, v in sorted(per_second.items())
            ],
        },
        samples={"rolling_lateness_ms": late},
    )
