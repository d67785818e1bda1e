"""Where a send's time goes: the service's insert statement alone (psycopg, prepared,
autocommit) next to the raw one-row insert, then `Producer.send`; a batch of 1,000 split into
validation, the database write and building the returned Message objects.

Run from the repository root: python docs/benchmarks/send_profile.py [SERVER_URL]
(default postgresql://root@127.0.0.1:5432/postgres); it works in a database of its own.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

import psycopg
from sqlalchemy import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scratch import scratch_database, send_one_call
from timing import per_call_us

from delaysvc.bench.raw import BODY, _fresh
from delaysvc.config.settings import Settings
from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer

SERVER = sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres"
DATABASE = "delaysvc_send_profile"
N = 4000


def main() -> None:
    with scratch_database(SERVER, DATABASE) as (engine, settings):
        profile(engine, settings)


def profile(engine: Engine, settings: Settings) -> None:
    url = settings.database_url
    producer = Producer(settings, engine)
    new = producer.prepare("profile.t", BODY, delay="1h")
    statement, params = send_one_call(new)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        _fresh(conn, "bench_raw_insert")
        raw = per_call_us(
            lambda: conn.execute(
                "INSERT INTO bench_raw_insert (topic, body) VALUES (%s, %s)", ("t", BODY)
            ),
            N,
        )
        ours = per_call_us(lambda: conn.execute(statement, params, prepare=True).fetchone(), N)
    send = per_call_us(lambda: producer.send("profile.t", BODY, delay="1h"), N)
    print(f"raw one-row INSERT, autocommit:          {raw:6.0f} us")
    print(f"the service's insert statement, psycopg: {ours:6.0f} us ({raw / ours:.0%} of raw)")
    print(f"Producer.send:                           {send:6.0f} us ({raw / send:.0%} of raw)")

    items = [{"topic": "profile.t", "body": BODY, "delay": "1h"}] * 1000
    rounds = 50
    batch = per_call_us(lambda: producer.send_batch(items), rounds) / 1000
    now = datetime.now().astimezone()
    prepared = [producer._prepare_item(item, now) for item in items]
    validate = per_call_us(lambda: [producer._prepare_item(i, now) for i in items], rounds) / 1000
    write = per_call_us(
        lambda: producer._write(None, lambda c: producer._store(c, prepared)), rounds
    )
    write /= 1000
    print(
        f"send_batch of 1,000: {batch:.1f} us/message = validation {validate:.1f} + database "
        f"write {write:.1f} + returned Message objects {batch - validate - write:.1f}"
    )


if __name__ == "__main__":
    main()
