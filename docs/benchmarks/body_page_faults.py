"""Bodies encoded and kept, as the staged insert keeps a batch's (`batching.encoded`: psycopg2,
Django's cursor and asyncio connections have no COPY here): a checkout's `encoded` of 10,000
items and a whole `send_batch` of 10,000 joined to a psycopg2 connection's transaction, beside
orjson's bytes kept as they come, under glibc's default heap trimming and with it set high
(`MALLOC_TRIM_THRESHOLD_`). Each way runs in a process of its own, in turn, round after round.

On this machine each `orjson.dumps` result kept alive costs a page fault (orjson shrinks its
output buffer to fit; the heap above it is given back to the kernel and taken again for the
next): the fault, not the encoding, is most of its time. A COPY batch keeps no body (each is
written and dropped): `batch_sides.py` counts some 200 faults a batch of 10,000.

Run from the repository root:
    python docs/benchmarks/body_page_faults.py [SERVER_URL] [ROUNDS] [OTHER_CHECKOUT]
(default the local PostgreSQL, 3 rounds); with OTHER_CHECKOUT (a `git worktree` of another
commit) its runs come in turn with the working tree's. `encoded` is timed 5 times a run and
the send 5 times (after one to warm), the least kept.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import timeit
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import server_and_rounds
from timing import checkouts_in_turn

SIZE = 10_000
HIGH_TRIM = {"MALLOC_TRIM_THRESHOLD_": "100000000"}


def _least(call: Callable[[], object]) -> tuple[float, float]:
    """(us an item, page faults an item) of `call`, the least time of 5."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds = min(timeit.repeat(call, number=1, repeat=5))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return seconds / SIZE * 1e6, faults / 5 / SIZE


def measure(server: str, label: str) -> None:
    """One round of one way, in this process: the code `delaysvc` imports here (PYTHONPATH)."""
    import orjson
    import psycopg2
    from scratch import batch_lots, scratch_database

    from delaysvc.db.engines import libpq_url
    from delaysvc.producer import batching
    from delaysvc.producer.sending import Producer

    name = f"delaysvc_body_page_faults_{os.getpid()}"
    with scratch_database(server, name) as (engine, settings):
        lots = batch_lots(6, SIZE)
        items = batching.prepare(lots[0], settings, datetime.now().astimezone())
        bodies = [item.body for item in items]
        encoded = _least(lambda: batching.encoded(items, settings.max_body_bytes))
        kept = _least(lambda: [orjson.dumps(body) for body in bodies])
        producer = Producer(settings, engine)
        sends = []
        with psycopg2.connect(libpq_url(str(settings.database_url))) as joined:
            for lot in lots:  # the first to warm
                started = time.perf_counter()
                producer.send_batch(lot, connection=joined)
                joined.commit()
                sends.append(time.perf_counter() - started)
        del sends[0]
    print(
        f"{label:38} encoded {encoded[0]:4.2f} us ({encoded[1]:.2f} faults), orjson's bytes "
        f"kept {kept[0]:4.2f} us ({kept[1]:.2f}) an item; send_batch by psycopg2 "
        f"{min(sends) * 1e3:5.1f} ms",
        flush=True,
    )


def main() -> None:
    server, rounds = server_and_rounds(3)
    tree = str(Path(__file__).resolve().parents[2])
    ways = [("tree", tree, {}), ("tree, " + "=".join(*HIGH_TRIM.items()), tree, HIGH_TRIM)]
    if len(sys.argv) > 3:
        ways.append(("other", str(Path(sys.argv[3]).resolve()), {}))
    checkouts_in_turn(__file__, server, ways, rounds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        measure(sys.argv[2], sys.argv[3])
    else:
        main()
