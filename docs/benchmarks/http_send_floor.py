"""The floor under the HTTP single send: the service's send behind the thinnest web layers
Python has, beside the raw insert the HTTP target is set against (issue 36: "single send at
50 clients >= 25% of the raw insert").

    python docs/benchmarks/http_send_floor.py [SERVER_URL] [ROUNDS] [SECONDS]

(default postgresql://root@127.0.0.1:5432/postgres, 2 rounds of 15 s; it works in a database
of its own.) Each round, in turn: the raw one-row insert at 50 clients (`delaysvc.bench.raw`,
as `delaysvc bench http` measures it), then wrk with 50 connections posting `delaysvc bench
http`'s single-send body to

- delaysvc's own app (`delaysvc web`'s command, gunicorn -w 4: token check, validation,
  `Producer.send_item`, the answer);
- a bare Flask app under gunicorn -w 4 whose view is `Producer.send_item(request.get_json())`
  and a small JSON answer (no token, no checks of ours);
- a WSGI callable with no framework at all doing the same, under gunicorn -w 4;
- delaysvc's app and the WSGI callable under Granian (its HTTP in Rust), 4 workers, when
  granian is installed (`pip install granian`).

Each line gives requests/s, their share of the raw insert, the web workers' CPU a request and
the messages stored meanwhile. The last two are the most any Python web tier calling the
producer could reach on this machine: the target is beyond the web framework if even they fall
short of it (2026-11-29; `http_asgi_floor.py` puts it on an event loop).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import http_ceiling
from http_servers import granian
from scratch import scratch_database, send_token
from sqlalchemy import Engine, text

from delaysvc.bench import raw
from delaysvc.db.engines import libpq_url
from delaysvc.runtime.commands import web_command
from delaysvc.runtime.supervisor import free_port

APPS = textwrap.dedent(
    """
    import json

    from flask import Flask, request

    from delaysvc.config.settings import Settings
    from delaysvc.db.engines import make_engine
    from delaysvc.producer.sending import Producer

    settings = Settings.from_env()
    producer = Producer(settings, make_engine(settings))

    flask_app = Flask(__name__)

    @flask_app.get("/healthz")
    def healthz():
        return "ok"

    @flask_app.post("/api/v1/messages")
    def send():
        message = producer.send_item(request.get_json())
        return {"id": message.id, "topic": message.topic, "created": message.created}, 201

    def wsgi_app(environ, start_response):
        if environ["PATH_INFO"] == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok"]
        size = int(environ.get("CONTENT_LENGTH") or 0)
        message = producer.send_item(json.loads(environ["wsgi.input"].read(size)))
        answer = {"id": message.id, "topic": message.topic, "created": message.created}
        body = json.dumps(answer).encode()
        start_response(
            "201 Created",
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
        )
        return [body]
    """
)


def servers(folder: str, port: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (the command serving it on `port`, its environment's own variables); the
    apps from APPS, written into `folder`."""
    gunicorn = [sys.executable, "-m", "gunicorn", "-b", f"127.0.0.1:{port}", "-w", "4"]
    gunicorn += ["--log-level", "warning", "--chdir", folder]
    found = {
        "delaysvc's app, gunicorn -w 4": list(web_command("127.0.0.1", port, 4, access_log=False)),
        "bare Flask + send_item, gunicorn -w 4": [*gunicorn, "floor_apps:flask_app"],
        "WSGI + send_item, gunicorn -w 4": [*gunicorn, "floor_apps:wsgi_app"],
    }
    if importlib.util.find_spec("granian"):
        found["delaysvc's app, granian 4 workers"] = granian(port, 1)
        found["WSGI + send_item, granian 4 workers"] = granian(
            port, 1, "--working-dir", folder, "floor_apps:wsgi_app"
        )
    return {name: (command, {}) for name, command in found.items()}


Servers = Callable[[str, int], dict[str, tuple[list[str], dict[str, str]]]]


def in_rounds(server: str, rounds: int, name: str, apps: str, servers: Servers) -> None:
    """`rounds` rounds on a scratch database `name`: the raw insert at 50 clients, then each
    of `servers` under wrk (`apps` written into their folder as `floor_apps.py`); a line each
    with requests/s, their share of the raw insert, the workers' CPU a request and the
    messages stored meanwhile (a request cut off at the run's end may be stored unanswered)."""
    with (
        scratch_database(server, name) as (engine, settings),
        tempfile.TemporaryDirectory() as folder,
    ):
        url = settings.database_url
        Path(folder, "floor_apps.py").write_text(apps)
        token = send_token(url, name)
        env = dict(os.environ, DELAYSVC_DATABASE_URL=url)
        port = free_port()
        for turn in range(1, rounds + 1):
            raw_rate = raw.insert_one_row_per_transaction(libpq_url(url), 50, http_ceiling.SECONDS)
            print(f"round {turn}: raw one-row insert, 50 clients: {raw_rate:,.0f} tx/s", flush=True)
            for served, (command, own) in servers(folder, port).items():
                before = stored(engine)
                rate, failed, cpu_us = http_ceiling.served(
                    command, {**env, **own}, port, {served: "/api/v1/messages"}, token
                )[served]
                print(
                    f"round {turn}: {served}: {rate:,.0f} req/s = {rate / raw_rate:.1%} of the "
                    f"raw insert, {cpu_us:,.0f} us of the workers' CPU a request, "
                    f"{stored(engine) - before:,} messages stored ({failed} failed requests)",
                    flush=True,
                )


def stored(engine: Engine) -> int:
    """Messages in the database: each answered request must have stored one."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM delaysvc.commit_log")).scalar_one())


if __name__ == "__main__":
    http_ceiling.SECONDS = float(sys.argv[3]) if len(sys.argv) > 3 else 15.0
    in_rounds(
        sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres",
        int(sys.argv[2]) if len(sys.argv) > 2 else 2,
        "delaysvc_http_send_floor",
        APPS,
        servers,
    )
