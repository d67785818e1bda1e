"""delaysvc's HTTP single send under gunicorn (as `delaysvc web` runs it), under gunicorn's
gevent workers (`pip install gevent`: a worker serves many requests at once, switching to
another while one waits on the database) and under Granian (a WSGI server written in Rust:
`pip install granian`), taking turns, beside the raw insert.

    python docs/benchmarks/http_servers.py postgresql://root@127.0.0.1:5432/SCRATCH [SECONDS]

The raw one-row insert at 50 clients, then twice each in turn: gunicorn -w 4 (sync workers),
gunicorn -w 2 and -w 4 with gevent workers, and Granian with 4 workers of 1 and of 2 threads
(those of them installed), serving `delaysvc.web:create_app()`; wrk
with 50 connections posting `delaysvc bench http`'s single-send body for SECONDS (default 15).
Each line gives requests/s, its share of the raw insert and the servers' CPU a request (the
workers' CPU, read from /proc before and after; issue 36's HTTP target is 25%).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import http_ceiling
from scratch import send_token

from delaysvc.bench import raw
from delaysvc.db.engines import libpq_url
from delaysvc.runtime.commands import web_command
from delaysvc.runtime.supervisor import free_port


def granian(port: int, threads: int, *target: str) -> list[str]:
    """Granian serving `target` (default delaysvc's app factory; or e.g. `--working-dir DIR
    module:app`) with 4 workers of `threads` blocking threads each on `port`."""
    return [
        sys.executable, "-m", "granian", "--interface", "wsgi",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "4",
        "--blocking-threads", str(threads), "--runtime-threads", "1",
        "--no-access-log", "--log-level", "warning",
        *(target or ("--factory", "delaysvc.web:create_app")),
    ]  # fmt: skip


def main(url: str) -> None:
    raw_rate = raw.insert_one_row_per_transaction(libpq_url(url), 50, http_ceiling.SECONDS)
    token = send_token(url, "http-servers")
    env = dict(os.environ, DELAYSVC_DATABASE_URL=url)
    port = free_port()
    gunicorn = list(web_command("127.0.0.1", port, 4, access_log=False))
    servers = {"gunicorn -w 4": gunicorn}
    if importlib.util.find_spec("gevent"):
        for workers in (2, 4):
            command = [*gunicorn, "-k", "gevent", "--worker-connections", "100"]
            command[command.index("-w") + 1] = str(workers)
            servers[f"gunicorn -w {workers} -k gevent"] = command
    if importlib.util.find_spec("granian"):
        servers["granian, 4 workers x 1 thread"] = granian(port, 1)
        servers["granian, 4 workers x 2 threads"] = granian(port, 2)
    print(f"raw one-row insert, 50 clients: {raw_rate:,.0f} tx/s; 25% of it: {raw_rate / 4:,.0f}")
    for turn in (1, 2):
        for name, command in servers.items():
            rates = http_ceiling.served(command, env, port, {name: "/api/v1/messages"}, token)
            rate, failed, cpu_us = rates[name]
            print(
                f"turn {turn}, {name}: {rate:,.0f} req/s = {rate / raw_rate:.1%} of the raw "
                f"insert, {cpu_us:,.0f} us of the workers' CPU a request ({failed} socket errors)",
                flush=True,
            )


if __name__ == "__main__":
    http_ceiling.SECONDS = float(sys.argv[2]) if len(sys.argv) > 2 else 15.0
    main(sys.argv[1])
