"""What the commit log's status rule costs a batch: `send_batch` of 10,000 with the rule of the
`message_status` domain (migration 0018) against the same with the rule dropped, in turn in one
scratch database (the rule dropped and added again, NOT VALID, between rounds).

PostgreSQL checks a domain's rule on every value a COPY brings, so a batch's status column is
checked 10,000 times; this prices that check.

Run from the repository root:
    python docs/benchmarks/batch_status_domain.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 8 rounds of 10 batches each way).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import batch_lots, scratch_database, server_and_rounds
from sqlalchemy import Engine, text
from timing import alternate, print_spread

from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import STATUSES

BATCHES = 10
SIZE = 10_000
RULE = "CHECK (VALUE IN (" + ", ".join(f"'{status}'" for status in STATUSES) + ")) NOT VALID"
DOMAIN = "ALTER DOMAIN delaysvc.message_status"


def _ruled(engine: Engine, ruled: bool) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"{DOMAIN} DROP CONSTRAINT IF EXISTS ck_message_status"))
        if ruled:
            conn.execute(text(f"{DOMAIN} ADD CONSTRAINT ck_message_status {RULE}"))
    engine.dispose()  # each server connection's type cache reads the domain afresh


def main() -> None:
    server, rounds = server_and_rounds(8)
    with scratch_database(server, "delaysvc_batch_status_domain") as (engine, settings):
        producer = Producer(settings, engine)

        def batch_ms(ruled: bool) -> float:
            _ruled(engine, ruled)
            lots = batch_lots(BATCHES + 1, SIZE)
            producer.send_batch(lots[0])  # warm: the connection, its plans
            started = time.perf_counter()
            for items in lots[1:]:
                producer.send_batch(items)
            return (time.perf_counter() - started) / BATCHES * 1e3

        results = alternate(
            {"the domain's rule": lambda: batch_ms(True), "no rule": lambda: batch_ms(False)},
            rounds,
        )
        _ruled(engine, True)
    print_spread(results, f"ms a batch of {SIZE:,}")


if __name__ == "__main__":
    main()
