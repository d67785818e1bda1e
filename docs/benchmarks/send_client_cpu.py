"""A single send's client side: this process's CPU a call (`time.process_time`) next to the
call's wall time, for the raw one-row insert, the service's `send_one` statement alone (both
psycopg, prepared, autocommit, one held connection) and `Producer.send` (pooled). On a machine
of two cores the client's CPU is CPU the server does not get: what the Python side spends
beyond the raw insert's client is what a send pays twice.

Run from the repository root, with the disk's flush taken out if the machine's varies:
    PGOPTIONS="-c synchronous_commit=off" \
        python docs/benchmarks/send_client_cpu.py [SERVER_URL] [ROUNDS]
(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds); it works in a database of its own.
"""

import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import raw_insert_on, scratch_database, send_one_call, server_and_rounds
from timing import alternate, per_call_us, print_spread

from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds()
N = 3000
BODY = {"order": 42}


def main() -> None:
    with scratch_database(SERVER, "delaysvc_send_client_cpu") as (engine, settings):
        producer = Producer(settings, engine)
        send_one, params = send_one_call(producer.prepare("t", BODY, delay_level=1))
        conn = psycopg.connect(libpq_url(settings.database_url), autocommit=True)
        calls: dict[str, Callable[[], object]] = {
            "raw one-row insert": raw_insert_on(conn),
            "send_one statement alone": lambda: conn.execute(
                send_one, params, prepare=True
            ).fetchone(),
            "Producer.send": lambda: producer.send("t", BODY, delay_level=1),
        }
        measures = {}
        for name, call in calls.items():
            measures[f"{name}: wall"] = partial(per_call_us, call, N)
            measures[f"{name}: client CPU"] = partial(per_call_us, call, N, clock=time.process_time)
        times = alternate(measures, ROUNDS)
        conn.close()
    print(f"{N:,} calls a measure a round, {ROUNDS} rounds; us a call")
    print_spread(times, "call")


if __name__ == "__main__":
    main()
