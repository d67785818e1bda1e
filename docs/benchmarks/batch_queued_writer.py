"""Prices one lever for issue 36's batch target: psycopg's `QueuedLibpqWriter`, which hands
a COPY's data to a thread that writes it to the server while Python formats the next rows,
against the default writer (`LibpqWriter`, which writes from the formatting thread). The two
in turn, round after round, in one process on one database, each round with a raw COPY of the
same rows' worth for the ratio (as batch_ratio.py).

The product is not changed: the script swaps `delaysvc.store.batches.copying` for a copy of it
that passes `writer=QueuedLibpqWriter(cursor)` during its own rounds.

Run from the repository root:
    python docs/benchmarks/batch_queued_writer.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 6 rounds); it works in a database of its own.
"""

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from psycopg.adapt import PyFormat
from psycopg.copy import QueuedLibpqWriter
from psycopg.types.json import set_json_dumps
from scratch import batch_lots, scratch_database, server_and_rounds

from delaysvc.bench import raw
from delaysvc.config.validation import json_text
from delaysvc.db.names import qualify
from delaysvc.producer.sending import Producer
from delaysvc.store import batches

SERVER, ROUNDS = server_and_rounds(6)
ROWS = 200_000
SIZE = 10_000
NAME = "delaysvc_batch_queued_writer"
DEFAULT = batches.copying


@contextmanager
def queued_copying(cursor: Any, table: str, row: Any) -> Iterator[Any]:
    """`batches.copying` with psycopg's queued writer."""
    columns = ", ".join(name for name, _ in row)
    statement = qualify(f"COPY delaysvc.{table} ({columns}) FROM STDIN (FORMAT BINARY)")
    cursor.adapters.register_dumper(bytes, cursor.adapters.get_dumper(bytes, PyFormat.BINARY))
    set_json_dumps(json_text, cursor)
    with cursor.copy(statement, writer=QueuedLibpqWriter(cursor)) as copy:
        copy.set_types([kind for _, kind in row])
        yield copy


def rate(producer: Producer, lots: list[Any], copying: Any) -> float:
    batches.copying = copying
    try:
        started = time.perf_counter()
        for items in lots:
            producer.send_batch(items)
        return ROWS / (time.perf_counter() - started)
    finally:
        batches.copying = DEFAULT


def main() -> None:
    with scratch_database(SERVER, NAME) as (engine, settings):
        producer = Producer(settings, engine)
        url = SERVER.rsplit("/", 1)[0] + "/" + NAME
        lots = batch_lots(ROWS // SIZE, SIZE)
        producer.send_batch(lots[0])  # warm: connections, plans
        rate(producer, lots[:2], queued_copying)
        for round_ in range(ROUNDS):
            order = [("default", DEFAULT), ("queued", queued_copying)]
            if round_ % 2:
                order.reverse()
            copied = raw.copy_rows(url, ROWS)
            found = {name: rate(producer, lots, way) for name, way in order}
            print(
                f"raw COPY {copied:,.0f} rows/s; send_batch of {SIZE:,}: default "
                f"{found['default']:,.0f} msg/s ({found['default'] / copied:.1%}), queued "
                f"{found['queued']:,.0f} ({found['queued'] / copied:.1%}); queued/default "
                f"{found['queued'] / found['default']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
