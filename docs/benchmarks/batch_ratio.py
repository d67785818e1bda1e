"""`send_batch` of 10,000 as a share of a raw COPY (issue 36's batch target: 30%), the two in
turn, round after round, in one process on one database: the raw limit `delaysvc bench send`
measures (`delaysvc.bench.raw.copy_rows`), then the same rows' worth of batches of the send
suite's shape (made before the clock starts).

Run from the repository root:
    python docs/benchmarks/batch_ratio.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 6 rounds); it works in a database of its own.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import batch_lots, scratch_database, server_and_rounds

from delaysvc.bench import raw
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds(6)
ROWS = 200_000
SIZE = 10_000
NAME = "delaysvc_batch_ratio"


def main() -> None:
    with scratch_database(SERVER, NAME) as (engine, settings):
        producer = Producer(settings, engine)
        url = SERVER.rsplit("/", 1)[0] + "/" + NAME
        lots = batch_lots(ROWS // SIZE, SIZE)
        producer.send_batch(lots[0])  # warm: connections, plans
        for _ in range(ROUNDS):
            copied = raw.copy_rows(url, ROWS)
            started = time.perf_counter()
            for items in lots:
                producer.send_batch(items)
            sent = ROWS / (time.perf_counter() - started)
            print(
                f"raw COPY {copied:,.0f} rows/s, send_batch of {SIZE:,} {sent:,.0f} msg/s: "
                f"{sent / copied:.1%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
