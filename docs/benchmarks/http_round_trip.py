"""What one database round trip does to the CPU cost of the Flask request around it.

    python docs/benchmarks/http_round_trip.py [SERVER_URL]

In one process (Flask's test client, CPU time of the process, 3,000 calls each, after 300 to
warm up), in a scratch database of its own on SERVER_URL's PostgreSQL (default
postgresql://root@127.0.0.1:5432/postgres): delaysvc's `POST /api/v1/messages` with the send
stubbed out (a Message made once is returned), `Producer.send_item` alone, the two taking
turns, the real request; then the stubbed request beside a bare psycopg `SELECT 1` and a
`SELECT pg_sleep(0.0003)`, alone and taking turns, and beside work of the same size without
any waiting (a `json.dumps`) and a `time.sleep(0.0003)`. Each figure is printed twice (two rounds).
It shows what the HTTP target's figures (docs/benchmarks/2026-11-27-http-ceiling) left open:
whether a request's CPU is the sum of its parts.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database
from timing import per_call_us

from delaysvc.auth import create_token
from delaysvc.db.engines import libpq_url
from delaysvc.web import create_app

SERVER = sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres"
BODY = {"order_id": 42, "action": "cancel"}
N = 3000


def cpu_us(call: Callable[[], Any]) -> float:
    """This process's CPU a call, in microseconds."""
    return per_call_us(call, N, warm=300, clock=time.process_time)


def main() -> None:
    with scratch_database(SERVER, "delaysvc_http_round_trip") as (engine, settings):
        app = create_app(settings)
        token = create_token(engine, "round-trip", "send")
        client = app.test_client()
        payload = json.dumps({"topic": "bench.http", "body": BODY, "delay": "1h"}).encode()
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        producer = app.extensions["delaysvc"]["producer"]
        send_item = producer.send_item
        item = json.loads(payload)
        made = send_item(dict(item))

        def request() -> None:
            answer = client.post("/api/v1/messages", data=payload, headers=headers)
            assert answer.status_code == 201, answer.data

        def stubbed() -> None:
            producer.send_item = lambda options: made
            try:
                request()
            finally:
                producer.send_item = send_item

        document = {f"k{n}": list(range(20)) for n in range(40)}

        def encode() -> None:
            json.dumps(document)

        with psycopg.connect(libpq_url(settings.database_url), autocommit=True) as conn:
            figures: dict[str, Callable[[], Any]] = {
                "the request, its send stubbed": stubbed,
                "Producer.send_item alone": lambda: send_item(dict(item)),
                "the two taking turns": lambda: (send_item(dict(item)), stubbed()),
                "the real request": request,
                "psycopg SELECT 1 alone": lambda: conn.execute("SELECT 1"),
                "stubbed request + SELECT 1, taking turns": lambda: (
                    conn.execute("SELECT 1"),
                    stubbed(),
                ),
                "json.dumps of a 40-key dict alone": encode,
                "stubbed request + json.dumps, taking turns": lambda: (encode(), stubbed()),
                "stubbed request + time.sleep(0.0003)": lambda: (time.sleep(0.0003), stubbed()),
                "psycopg SELECT pg_sleep(0.0003) alone": lambda: conn.execute(
                    "SELECT pg_sleep(0.0003)"
                ),
                "stubbed request + SELECT pg_sleep(0.0003)": lambda: (
                    conn.execute("SELECT pg_sleep(0.0003)"),
                    stubbed(),
                ),
            }
            rounds = [{name: cpu_us(call) for name, call in figures.items()} for _ in range(2)]
    print(f"CPU time of the process per call, us ({N:,} calls; two rounds)")
    for name in figures:
        print(f"{name:45s} {rounds[0][name]:7.1f} {rounds[1][name]:7.1f}")


if __name__ == "__main__":
    main()
