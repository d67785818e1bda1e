"""The ceiling of any Flask endpoint on this machine, beside the raw insert the HTTP target is
set against (issue 36: "single send at 50 clients >= 25% of the raw insert").

    python docs/benchmarks/http_ceiling.py postgresql://root@127.0.0.1:5432/SCRATCH [SECONDS]

Four figures, each measured for SECONDS (default 20) in one run: the raw one-row insert at 50
clients (`delaysvc.bench.raw`, as `delaysvc bench http` measures it); then gunicorn -w 4
(sync workers, as `delaysvc web` runs it) serving a bare Flask app whose
`POST /api/v1/messages` parses the JSON body and answers 201 with a small JSON object without
touching any database, the same app answering with a fixed bytes response and no JSON
parsing, and delaysvc's own app (`delaysvc web`'s command, the database migrated, a send
token); wrk with 50 connections posting `delaysvc bench http`'s single-send body. The bare
app's figure is the most a Flask view can reach here; each line also gives the CPU the
gunicorn workers spent a request.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psutil
from scratch import send_token

from delaysvc.bench import raw
from delaysvc.bench.http import run_wrk
from delaysvc.db.engines import libpq_url
from delaysvc.runtime.commands import web_command
from delaysvc.runtime.supervisor import free_port, wait_until_answering

SECONDS = 20.0

APP = textwrap.dedent(
    """
    from flask import Flask, request

    app = Flask(__name__)

    @app.get("/healthz")
    def healthz():
        return "ok"

    @app.post("/api/v1/messages")
    def send():
        item = request.get_json()
        return {"id": 1, "topic": item["topic"], "status": "scheduled"}, 201

    @app.post("/bare/api/v1/messages")
    def bare():
        return b"{}", 201, {"Content-Type": "application/json"}
    """
)


def served(
    command: list[str], env: dict[str, str], port: int, views: dict[str, str], token: str
) -> dict[str, tuple[float, int, float]]:
    """Start gunicorn with `command`; wrk on each view for SECONDS. -> view -> (requests/s,
    failed requests (socket errors and answers other than 2xx), the gunicorn workers' CPU a
    request in us)."""
    web = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    try:
        if not wait_until_answering(f"http://127.0.0.1:{port}/healthz"):
            raise RuntimeError("gunicorn did not answer within 60 s")
        workers = psutil.Process(web.pid).children()
        rates = {}
        for name, path in views.items():
            before = sum(sum(w.cpu_times()[:2]) for w in workers)
            result = run_wrk(f"http://127.0.0.1:{port}{path}", token, 50, SECONDS)
            used = sum(sum(w.cpu_times()[:2]) for w in workers) - before
            failed = sum(result[k] for k in ("connect", "read", "write", "timeout", "status"))
            rates[name] = (result["requests"] / (result["duration_us"] / 1e6), failed,
                           used / result["requests"] * 1e6)  # fmt: skip
        return rates
    finally:
        web.terminate()
        web.wait(timeout=30)


def main(url: str) -> None:
    raw_rate = raw.insert_one_row_per_transaction(libpq_url(url), 50, SECONDS)
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "bare_flask.py").write_text(APP)
        command = [sys.executable, "-m", "gunicorn", "-b", f"127.0.0.1:{port}", "-w", "4"]
        command += ["--log-level", "warning", "--chdir", folder, "bare_flask:app"]
        views = {"a JSON view": "/api/v1/messages", "a bare view": "/bare/api/v1/messages"}
        rates = served(command, dict(os.environ), port, views, "unused")
    token = send_token(url, "http-ceiling")
    command = list(web_command("127.0.0.1", port, 4, access_log=False))
    env = dict(os.environ, DELAYSVC_DATABASE_URL=url)
    rates |= served(command, env, port, {"delaysvc's send": "/api/v1/messages"}, token)
    print(f"raw one-row insert, 50 clients: {raw_rate:,.0f} tx/s; 25% of it: {raw_rate / 4:,.0f}")
    for name, (rate, failed, cpu_us) in rates.items():
        print(
            f"gunicorn -w 4, {name}: {rate:,.0f} req/s = {rate / raw_rate:.1%} of the raw insert, "
            f"{cpu_us:,.0f} us of the workers' CPU a request ({failed} socket errors)"
        )


if __name__ == "__main__":
    SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    main(sys.argv[1])
