"""Four sending clients as threads of one Python process (how `delaysvc bench send` runs its
4-client figure) and as four processes (how a web app's workers send), each beside the raw
one-row insert from 4 threads, taking turns for three rounds, 5 s each.

Run from the repository root: python docs/benchmarks/send_clients.py [SERVER_URL]
(default postgresql://root@127.0.0.1:5432/postgres); it works in a database of its own.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from multiprocessing.queues import Queue
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scratch import scratch_database

from delaysvc.bench import raw
from delaysvc.bench.suites import BODY, NOOP_TOPIC, _send_single
from delaysvc.config.settings import Settings
from delaysvc.db.engines import libpq_url, make_engine
from delaysvc.producer.sending import Producer

SERVER = sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres"
DATABASE = "delaysvc_send_clients"
CLIENTS, SECONDS, ROUNDS = 4, 5.0, 3


def one_process(settings: Settings, start: float, done: Queue) -> None:  # type: ignore[type-arg]
    producer = Producer(settings, make_engine(settings))
    producer.send(NOOP_TOPIC, BODY, delay="1h")  # connected before the clock starts
    time.sleep(max(0.0, start - time.monotonic()))
    sent, stop = 0, start + SECONDS
    while time.monotonic() < stop:
        producer.send(NOOP_TOPIC, BODY, delay="1h")
        sent += 1
    done.put(sent)


def in_processes(settings: Settings) -> float:
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    start = time.monotonic() + 2.0
    workers = [
        context.Process(target=one_process, args=(settings, start, done)) for _ in range(CLIENTS)
    ]
    for worker in workers:
        worker.start()
    sent = sum(done.get() for _ in workers)
    for worker in workers:
        worker.join()
    return sent / SECONDS


def main() -> None:
    with scratch_database(SERVER, DATABASE) as (engine, settings):
        producer = Producer(settings, engine)
        print("round | raw insert, 4 threads | send, 4 threads | send, 4 processes")
        for round_ in range(1, ROUNDS + 1):
            limit = raw.insert_one_row_per_transaction(
                libpq_url(settings.database_url), CLIENTS, SECONDS
            )
            threads = _send_single(producer, CLIENTS, SECONDS)
            engine.dispose()  # no pooled connection shared with the forked processes
            processes = in_processes(settings)
            print(
                f"{round_} | {limit:,.0f} tx/s | {threads:,.0f} msg/s ({threads / limit:.0%}) | "
                f"{processes:,.0f} msg/s ({processes / limit:.0%})"
            )


if __name__ == "__main__":
    main()
