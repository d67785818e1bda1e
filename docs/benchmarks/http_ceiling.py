"""The ceiling of any Flask endpoint on this machine, beside the raw insert the HTTP target is
set against (issue 36: "single send at 50 clients >= 25% of the raw insert").

    python docs/benchmarks/http_ceiling.py postgresql://root@127.0.0.1:5432/SCRATCH [SECONDS]

Three figures, each measured for SECONDS (default 20) in one run: the raw one-row insert at 50
clients (`delaysvc.bench.raw`, as `delaysvc bench http` measures it); then gunicorn -w 4
(sync workers, as `delaysvc web` runs it) serving a bare Flask app whose
`POST /api/v1/messages` parses the JSON body and answers 201 with a small JSON object without
touching any database, and the same app answering with a fixed bytes response and no JSON
parsing; wrk with 50 connections posting `delaysvc bench http`'s single-send body. No
delaysvc code serves these requests: what they reach is the most a Flask view can, here.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from delaysvc.bench import raw
from delaysvc.bench.http import run_wrk
from delaysvc.db.engines import libpq_url
from delaysvc.runtime.supervisor import free_port, wait_until_answering

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


def main(url: str, seconds: float) -> None:
    raw_rate = raw.insert_one_row_per_transaction(libpq_url(url), 50, seconds)
    rates = {}
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "bare_flask.py").write_text(APP)
        port = free_port()
        command = [sys.executable, "-m", "gunicorn", "-b", f"127.0.0.1:{port}", "-w", "4"]
        command += ["--log-level", "warning", "--chdir", folder, "bare_flask:app"]
        web = subprocess.Popen(command)
        try:
            if not wait_until_answering(f"http://127.0.0.1:{port}/healthz"):
                raise RuntimeError("gunicorn did not answer within 60 s")
            views = (("JSON view", "/api/v1/messages"), ("bare view", "/bare/api/v1/messages"))
            for name, path in views:
                result = run_wrk(f"http://127.0.0.1:{port}{path}", "unused", 50, seconds)
                failed = sum(result[k] for k in ("connect", "read", "write", "timeout"))
                rates[name] = (result["requests"] / (result["duration_us"] / 1e6), failed)
        finally:
            web.terminate()
            web.wait(timeout=30)
    print(f"raw one-row insert, 50 clients: {raw_rate:,.0f} tx/s; 25% of it: {raw_rate / 4:,.0f}")
    for name, (rate, failed) in rates.items():
        print(
            f"gunicorn -w 4 + Flask, {name}, 50 connections, no database: {rate:,.0f} req/s "
            f"= {rate / raw_rate:.1%} of the raw insert ({failed} socket errors)"
        )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 20.0)
