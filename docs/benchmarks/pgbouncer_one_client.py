"""Where a single send through PgBouncer loses its time at one client: the pooler's own work, or
the machine's scheduling of a third process. `Producer.send` from one client, straight to
PostgreSQL (its statement prepared, as the producer runs direct, and unprepared, as it runs
behind a transaction pooler) and through a transaction-pooling PgBouncer, once scheduled as
the system likes and once with PgBouncer on this process's core (`os.sched_setaffinity`; the
server's processes left free). The variants take turns, round after round.

Run from the repository root:
    python docs/benchmarks/pgbouncer_one_client.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 5 rounds); it works in a database of its own, with the disk's
flush taken out (`synchronous_commit=off` for that database) so that the hop is what varies.
"""

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds
from timing import alternate, per_call_us, print_spread

from delaysvc.bench.pgbouncer import pgbouncer
from delaysvc.db.engines import make_engine
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds()
N = 2000
NAME = "delaysvc_pgbouncer_one_client"
BODY = {"order": 42}


@contextmanager
def on_one_core(*pids: int) -> Iterator[None]:
    """`pids` (0: this process) run on this process's first core while the block runs."""
    cores = {pid: os.sched_getaffinity(pid) for pid in pids}
    first = min(os.sched_getaffinity(0))
    for pid in pids:
        os.sched_setaffinity(pid, {first})
    try:
        yield
    finally:
        for pid, allowed in cores.items():
            os.sched_setaffinity(pid, allowed)


def sends(producer: Producer, pins: tuple[int, ...] = ()) -> float:
    """us a `Producer.send`, `pins` on one core meanwhile."""
    call: Callable[[], object] = lambda: producer.send("t", BODY, delay_level=1)  # noqa: E731
    if not pins:
        return per_call_us(call, N)
    with on_one_core(*pins):
        return per_call_us(call, N)


def main() -> None:
    with scratch_database(SERVER, NAME) as (engine, settings):
        with engine.connect() as conn:
            conn.execute(text(f"ALTER DATABASE {NAME} SET synchronous_commit = off"))
            conn.commit()
        url = settings.database_url
        with pgbouncer(url, pool_size=4) as bouncer:
            ways = {
                "direct": settings,
                "direct, unprepared": settings.model_copy(
                    update={"database_pooling": "transaction"}
                ),
                "PgBouncer": settings.model_copy(
                    update={
                        "database_url": bouncer.url(url),
                        "database_pooling": "transaction",
                        "direct_database_url": url,
                    }
                ),
            }
            producers = {
                way: Producer(chosen, make_engine(chosen, chosen.database_url))
                for way, chosen in ways.items()
            }
            measures = {way: partial(sends, producer) for way, producer in producers.items()}
            measures["PgBouncer on this process's core"] = partial(
                sends, producers["PgBouncer"], (0, bouncer.pid)
            )
            measures["direct, this process on one core"] = partial(sends, producers["direct"], (0,))
            times = alternate(measures, ROUNDS)
            for producer in producers.values():
                producer.engine.dispose()
    print(f"Producer.send from one client, {N:,} a round, {ROUNDS} rounds, us a send")
    print_spread(times, "way")


if __name__ == "__main__":
    main()
