"""Whether a single send through a transaction-pooling PgBouncer gains by the simple query
protocol (the statement and its values in one `Query` message, psycopg's `ClientCursor`)
instead of the extended protocol unprepared (Parse, Bind, Describe, Execute, Sync: what
psycopg sends when `database_pooling=transaction` turns preparing off).

    python docs/benchmarks/send_one_simple_query.py [SERVER_URL] [ROUNDS]

(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds; it works in a database of its
own, with `synchronous_commit = off` set on that database so that the disk's flush, which
varies from minute to minute here, is out of every variant, PgBouncer's included.) Needs
`pgbouncer` on the PATH (`delaysvc.bench.pgbouncer` starts one, transaction mode). One
connection a variant, autocommit; `send_one` as a send to level 1 runs it; variants in turn,
round after round; prints each one's median, min and max in us a call.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any

import psycopg
from scratch import scratch_database, send_one_call, server_and_rounds
from timing import alternate, per_call_us, print_spread

from delaysvc.bench.pgbouncer import pgbouncer
from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds()
N = 2000
DATABASE = "delaysvc_send_one_simple_query"
UNPREPARED: dict[str, Any] = {"prepare_threshold": None}  # as `database_pooling=transaction`
SIMPLE_QUERY: dict[str, Any] = {**UNPREPARED, "cursor_factory": psycopg.ClientCursor}


def main() -> None:
    with scratch_database(SERVER, DATABASE) as (engine, settings):
        url = libpq_url(settings.database_url)
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {DATABASE} SET synchronous_commit = off")
        producer = Producer(settings, engine)
        statement, params = send_one_call(producer.prepare("t", {"order": 42}, delay_level=1))
        with pgbouncer(settings.database_url) as bouncer, ExitStack() as connections:
            pooled = bouncer.url(settings.database_url)
            ways = {
                "direct, prepared": (url, {}, True),
                "direct, unprepared": (url, UNPREPARED, None),
                "direct, simple query": (url, SIMPLE_QUERY, None),
                "PgBouncer, unprepared": (pooled, UNPREPARED, None),
                "PgBouncer, simple query": (pooled, SIMPLE_QUERY, None),
            }
            measures: dict[str, Callable[[], float]] = {}
            for name, (target, options, prepare) in ways.items():
                conn = connections.enter_context(
                    psycopg.connect(target, autocommit=True, **options)
                )

                def call(conn: psycopg.Connection = conn, prepare: bool | None = prepare) -> object:
                    return conn.execute(statement, params, prepare=prepare).fetchone()

                measures[name] = partial(per_call_us, call, N)
            print_spread(alternate(measures, ROUNDS), f"{N:,} calls a measure; us a call")


if __name__ == "__main__":
    main()
