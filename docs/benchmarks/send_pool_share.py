"""What the pool costs a single send: `Producer.send` as it is (a pooled connection checked out
and returned around its one statement, `db.autocommit_cursor`), the same send's parts on a
connection held open (its checks, the same statement on the same kind of cursor, the returned
Message), and the checkout and return alone. Each round measures the three in turn.

Run from the repository root, with the disk's flush taken out if the machine's varies:
    PGOPTIONS="-c synchronous_commit=off" \
        python docs/benchmarks/send_pool_share.py [SERVER_URL] [ROUNDS]
(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds); it works in a database of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds
from timing import alternate, per_call_us, print_spread

from delaysvc import store
from delaysvc.db import engines as db
from delaysvc.db.engines import libpq_url
from delaysvc.producer.message import Message
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds()
N = 3000
BODY = {"order": 42}


def main() -> None:
    with scratch_database(SERVER, "delaysvc_send_pool_share") as (engine, settings):
        producer = Producer(settings, engine)
        held = psycopg.connect(libpq_url(settings.database_url), autocommit=True)
        cursor = held.cursor()

        def pooled() -> object:
            return producer.send("t", BODY, delay_level=1)

        def on_held_connection() -> object:
            new = producer.prepare("t", BODY, delay_level=1)
            inserted = store.insert_message(cursor, new, caps_held=False)
            assert inserted is not None
            row = inserted[0]
            return Message.sent(new, row.id, row.stored_at, row.deliver_ts)

        def checkout_and_return() -> None:
            with db.autocommit_cursor(engine):
                pass

        variants: dict[str, Callable[[], object]] = {
            "Producer.send (pooled)": pooled,
            "the same on a held connection": on_held_connection,
            "the pool's checkout and return alone": checkout_and_return,
        }
        times = alternate(
            {name: partial(per_call_us, call, N) for name, call in variants.items()}, ROUNDS
        )
        held.close()
    print(f"{N:,} calls a variant a round, {ROUNDS} rounds; us a call")
    print_spread(times, "variant")


if __name__ == "__main__":
    main()
