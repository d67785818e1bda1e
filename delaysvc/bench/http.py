"""The HTTP API under load: `wrk` (C, Debian's `wrk` package) keeps N connections busy with
`POST /api/v1/messages` against gunicorn on loopback for a while. Reported: requests/s, latency
p50/p90/p99/max, every non-2xx answer and socket error (the goal is zero), and the messages
stored (at least one per acknowledged request: a request cut off at the end may still land).
Beside it, the raw limit at the same concurrency: one-row INSERT per transaction."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from delaysvc import auth
from delaysvc.bench import raw
from delaysvc.bench.progress import step
from delaysvc.bench.suites import Figures
from delaysvc.db.engines import libpq_url
from delaysvc.db.names import sql
from delaysvc.runtime.commands import web_command
from delaysvc.runtime.supervisor import (
    die_with_parent,
    free_port,
    wait_until_answering,
)

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext

TOPIC = "bench.http"
BATCH_TOPIC = "bench.http.batch"
BATCH = 1000
"""Messages per call of `POST /api/v1/messages/batch` (and of the Python batch beside it)."""
WRK_SINGLE = """
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, nil, nil,
    '{"topic": "%(topic)s", "body": {"order_id": ' .. n .. '}, "delay": "1h"}')
end
"""
WRK_BATCH = """
wrk.body = [=[%(body)s]=]
"""
WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(token)s"
%(requests)s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RESULT {"requests": %%d, "duration_us": %%d, "connect": %%d, "read": %%d, "write": %%d, ' ..
    '"status": %%d, "timeout": %%d, "p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "max_us": %%d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
"""


ASGI_WORKERS = 2
"""uvicorn worker processes for `--server asgi`: one event loop a core keeps this 2-core
machine's cores busy (4 measured slower: docs/benchmarks/2026-12-06-http-asgi-floor)."""


def missing() -> str | None:
    """Why the suite cannot run here, or None."""
    return None if shutil.which("wrk") else "wrk is not installed: apt-get install wrk"


def batch_items() -> list[dict[str, Any]]:
    return [{"topic": BATCH_TOPIC, "body": {"order_id": n}, "delay": "1h"} for n in range(BATCH)]


def run_wrk(
    url: str, token: str, clients: int, seconds: float, batch: bool = False
) -> dict[str, Any]:
    """wrk against `url`: single sends (…/api/v1/messages), each body its own, or batches of
    BATCH (…/messages/batch), each the same 1,000 messages; -> its RESULT line as a dict."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError(missing())
    if batch:
        requests = WRK_BATCH % {"body": json.dumps({"messages": batch_items()})}
    else:
        requests = WRK_SINGLE % {"topic": TOPIC}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % {"token": token, "requests": requests})
    try:
        out = subprocess.run(
            [
                wrk,
                f"-t{min(2, clients)}",
                f"-c{clients}",
                f"-d{int(seconds)}s",
                "--timeout=10s",
                "-s",
                script.name,
                url,
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=seconds + 120,
        ).stdout
    finally:
        os.unlink(script.name)
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))


def http_suite(ctx: BenchContext) -> Figures:
    reason = missing()
    if reason:
        step(f"http: NOT RUN: {reason}")
        return Figures(results={"http": {"skipped": reason}})
    clients, seconds = ctx.size("http_clients"), ctx.seconds("http_seconds")
    workers, threads = ctx.size("http_workers"), ctx.size("http_threads")
    figures = Figures()
    step(f"raw: one-row INSERT per transaction, {clients} clients")
    raw_rate = raw.insert_one_row_per_transaction(libpq_url(ctx.url), clients, min(seconds, 10))
    token = auth.create_token(ctx.engine, "bench-http", scope="send")
    env = dict(os.environ, DELAYSVC_DATABASE_URL=ctx.url, PYTHONPATH=str(Path.cwd()))
    env["DELAYSVC_DELAY_LEVELS"] = ctx.settings.delay_levels
    batch_seconds = min(seconds, 10)
    # `delaysvc web`'s two servers, each with the same clients: gunicorn's sync workers
    # (`--server sync`; figure `http`, named when they were the default), then the default,
    # uvicorn's workers (`http_asgi`: single sends on the event loop), which also serves the
    # batches
    servers = {"http": ("sync", workers), "http_asgi": ("asgi", ASGI_WORKERS)}
    with tempfile.TemporaryDirectory(prefix="delaysvc-bench-http-") as scratch:
        if ctx.out is not None:
            ctx.out.mkdir(parents=True, exist_ok=True)
        for figure, (server, processes) in servers.items():
            port = free_port()
            command = web_command("127.0.0.1", port, processes, threads=threads, server=server)
            command[command.index("--access-logfile") + 1] = "/dev/null"
            log_path = (ctx.out or Path(scratch)) / f"{figure}-gunicorn.log"
            before = _stored(ctx, TOPIC)
            with _gunicorn(command, env, port, log_path):
                served = f"gunicorn -w {processes} " + (
                    f"--threads {threads}" if server == "sync" else "-k UvicornWorker"
                )
                step(f"wrk: {clients} connections for {seconds:g} s against {served}")
                url = f"http://127.0.0.1:{port}/api/v1/messages"
                result = run_wrk(url, token, clients, seconds)
                if server == "asgi":
                    step(f"wrk: batches of {BATCH:,}, 1 connection for {batch_seconds:g} s")
                    batched = run_wrk(url + "/batch", token, 1, batch_seconds, batch=True)
            stored = _stored(ctx, TOPIC) - before
            figures.results[figure] = {
                "server": served,
                **_single_sends(result, clients, seconds, raw_rate, stored),
            }
    step(f"send_batch of {BATCH:,} in this process, 1 client for {batch_seconds:g} s")
    python_rate = _python_batches(ctx, batch_seconds)
    http_rate = batched["requests"] * BATCH / (batched["duration_us"] / 1e6)
    batch_errors = sum(batched[k] for k in ("connect", "read", "write", "status", "timeout"))
    figures.results["http_batch"] = {
        "batch": BATCH,
        "http_msgs_per_s": round(http_rate),
        "msgs_per_s": round(http_rate),
        "python_batch_msgs_per_s": round(python_rate),
        "ratio": round(http_rate / python_rate, 3),
        "target_ratio": 0.5,
        "errors": batch_errors,
        "p99_ms": batched["p99_us"] / 1000,
    }
    return figures


def _single_sends(
    result: dict[str, Any], clients: int, seconds: float, raw_rate: float, stored: int
) -> dict[str, Any]:
    """The figures of a wrk run of single sends, beside the raw insert's rate and the messages
    `stored` meanwhile."""
    rate = result["requests"] / (result["duration_us"] / 1e6)
    acknowledged = result["requests"] - result["status"]
    return {
        "clients": clients,
        "seconds": seconds,
        "requests": result["requests"],
        "requests_per_s": round(rate, 1),
        "raw_insert_per_s": round(raw_rate, 1),
        "ratio_to_raw": round(rate / raw_rate, 3) if raw_rate else None,
        "target_ratio": 0.25,
        "latency_ms": {
            "p50": result["p50_us"] / 1000,
            "p90": result["p90_us"] / 1000,
            "p99": result["p99_us"] / 1000,
            "max": result["max_us"] / 1000,
        },
        "errors": {k: result[k] for k in ("connect", "read", "write", "status", "timeout")},
        "acknowledged": acknowledged,
        "stored": stored,
        "lost": max(0, acknowledged - stored),
        "python": sys.version.split()[0],
    }


def _stored(ctx: BenchContext, topic: str) -> int:
    with ctx.engine.connect() as conn:
        found = conn.execute(
            sql("SELECT count(*) FROM delaysvc.message WHERE topic = :t"), {"t": topic}
        ).scalar_one()
    return int(found)


@contextmanager
def _gunicorn(command: list[str], env: dict[str, str], port: int, log_path: Path) -> Iterator[None]:
    """gunicorn started with `command`, answering on `port`, until the block ends; its own
    lines go to `log_path` (a pipe nobody read would stop it once full). One that exits or
    does not answer within 60 s stops the suite with its last lines."""
    with log_path.open("wb") as log:
        web = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            preexec_fn=die_with_parent(),  # a killed bench leaves no server on its port
        )
    try:
        if not wait_until_answering(f"http://127.0.0.1:{port}/healthz", process=web):
            said = "\n".join(log_path.read_text(errors="replace").strip().splitlines()[-20:])
            state = "did not answer within 60 s" if web.poll() is None else "exited"
            raise RuntimeError(f"gunicorn {state}; its last lines ({log_path}):\n{said}")
        yield
    finally:
        web.terminate()
        web.wait(timeout=30)


def _python_batches(ctx: BenchContext, seconds: float) -> float:
    """Messages/s of `send_batch` calls of BATCH, the items the HTTP calls send."""
    from delaysvc.producer.sending import Producer

    producer, items = Producer(ctx.settings, ctx.engine), batch_items()
    producer.send_batch(items)
    sent, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        sent += len(producer.send_batch(items))
    return sent / (time.monotonic() - started)
