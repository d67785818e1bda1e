"""The Procrastinate peer: `defer` with `schedule_in` on PostgreSQL, in a database of its own
(DSN from `DELAYSVC_BENCH_PROCRASTINATE_DSN`, set by the bench for the workers it starts).
Worker: `procrastinate --app=delaysvc.bench.peer_procrastinate.app worker` with its defaults
(LISTEN/NOTIFY on, 5 s fetch polling)."""

from __future__ import annotations

import os

from procrastinate import App, PsycopgConnector

from delaysvc.bench.record import record

DSN_ENV = "DELAYSVC_BENCH_PROCRASTINATE_DSN"
TASK = "delaysvc_bench_peer_noop"


def received(i: int, due: float) -> None:
    record(i, due)


def make_app(dsn: str) -> App:
    app = App(connector=PsycopgConnector(conninfo=dsn))
    app.task(name=TASK)(received)
    return app


app = make_app(os.environ.get(DSN_ENV, ""))
