"""Single sends on a connection the producer keeps (`delaysvc.db.held`, what `Producer.send`
does) against the same send on a connection taken from the engine's pool for each send and
switched to autocommit and back (`db.autocommit_cursor`, what it did before), beside the raw
one-row insert: 1 client, and 4 client processes (spawned, as the send suite's), in turn.

Run from the repository root: python docs/benchmarks/held_connections.py [SERVER_URL] [ROUNDS]
(default postgresql://root@127.0.0.1:5432/postgres, 3 rounds); it works in a database of its own.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds

from delaysvc.bench import raw
from delaysvc.bench.suites import BODY, NOOP_TOPIC
from delaysvc.config.settings import Settings
from delaysvc.db import engines
from delaysvc.db.engines import libpq_url, make_engine
from delaysvc.producer.message import Message
from delaysvc.producer.sending import Producer
from delaysvc.store import producing

SECONDS = 5


def kept(settings: Settings) -> Callable[[float], int]:
    """A client sending by `Producer.send`: its kept connection."""
    producer = Producer(settings, make_engine(settings))
    return _client(lambda: producer.send(NOOP_TOPIC, BODY, delay="1h"), producer)


def pooled(settings: Settings) -> Callable[[float], int]:
    """A client sending the same way but on a pooled connection for each send."""
    producer = Producer(settings, make_engine(settings))

    def send() -> Message:
        new = producer.prepare(NOOP_TOPIC, BODY, delay="1h")
        with engines.autocommit_cursor(producer.engine) as cursor:
            inserted = producing.insert_message(cursor, new, False)
        assert inserted is not None
        row, _, _ = inserted
        return Message.sent(new, row.id, row.stored_at, row.deliver_ts)

    return _client(send, producer)


def _client(send: Callable[[], object], producer: Producer) -> Callable[[float], int]:
    for _ in range(20):
        send()

    def run(stop: float) -> int:
        done = 0
        while time.monotonic() < stop:
            send()
            done += 1
        producer.engine.dispose()
        return done

    return run


def main() -> None:
    server, rounds = server_and_rounds(3)
    rates: dict[str, list[float]] = {}
    with scratch_database(server, "delaysvc_held_connections") as (_, settings):
        url = libpq_url(settings.database_url)
        for round_ in range(rounds):
            for clients in (1, 4):
                processes = clients > 1
                rates.setdefault(f"raw insert, {clients}", []).append(
                    raw.insert_one_row_per_transaction(url, clients, SECONDS, processes)
                )
                for name, client in (("pooled", pooled), ("kept", kept)):
                    if processes:
                        rate = raw.per_second_in_processes(client, settings, clients, SECONDS)
                    else:
                        rate = raw.per_second(client(settings), 1, SECONDS)
                    rates.setdefault(f"{name}, {clients}", []).append(rate)
            print(f"round {round_ + 1} of {rounds} done", file=sys.stderr)
    print(f"{SECONDS} s a measure, {rounds} rounds in turn; sends (inserts) a second")
    print(f"{'clients: way':24s} {'median':>8s} {'min':>8s} {'max':>8s}  share of raw (median)")
    for clients in (1, 4):
        base = statistics.median(rates[f"raw insert, {clients}"])
        for name in ("raw insert", "pooled", "kept"):
            got = rates[f"{name}, {clients}"]
            print(
                f"{clients}: {name:21s} {statistics.median(got):8,.0f} {min(got):8,.0f} "
                f"{max(got):8,.0f}  {statistics.median(got) / base:.0%}"
            )


if __name__ == "__main__":
    main()
