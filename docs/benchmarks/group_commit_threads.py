"""Single sends from threads of one process, with group commit and without, side by side.

`Producer.send` from 1, 4 and 16 threads at once (each thread sending in a loop for a fixed
time), by a producer with `group_writers=1` and `=2` (a send that comes while that many are
being written waits, and those that waited are written in one statement:
`delaysvc.producer.grouping`) and by one without (each send written alone at once, the
default). Messages a second, alternating variants
round after round; with each figure the mean size of the groups written (messages over
distinct store times: a group's messages share one).

Run from the repository root:
    python docs/benchmarks/group_commit_threads.py [SERVER_URL] [ROUNDS]
(default postgresql://root@127.0.0.1:5432/postgres, 3 rounds); it works in a database of its own.
"""

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds
from sqlalchemy import text
from timing import alternate, print_spread

from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds(3)
SECONDS = 4.0
THREADS = (1, 4, 16)
group_sizes: dict[str, list[float]] = {}


def rate(producer: Producer, threads: int, name: str) -> Callable[[], float]:
    def measure() -> float:
        sent: list[int] = []
        stop = time.monotonic() + SECONDS

        def loop() -> None:
            count = 0
            while time.monotonic() < stop:
                producer.send("bench.group", {"order_id": 42}, delay_level=1)
                count += 1
            sent.append(count)

        with producer.engine.begin() as conn:
            conn.execute(text("TRUNCATE delaysvc.commit_log, delaysvc.consume_queue CASCADE"))
        workers = [threading.Thread(target=loop) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        with producer.engine.connect() as conn:
            stamps = conn.execute(
                text("SELECT count(DISTINCT stored_at) FROM delaysvc.commit_log")
            ).scalar_one()
        group_sizes.setdefault(name, []).append(sum(sent) / stamps)
        return sum(sent) / SECONDS

    return measure


def main() -> None:
    with scratch_database(SERVER, "delaysvc_group_commit") as (engine, settings):
        variants = [
            (f"group_writers={writers}", Producer(settings, engine, group_writers=writers))
            for writers in (1, 2)
        ]
        variants.append(("each alone", Producer(settings, engine)))
        measures = {}
        for threads in THREADS:
            for name, producer in variants:
                label = f"{threads:>2} threads, {name}"
                measures[label] = rate(producer, threads, label)
        rates = alternate(measures, ROUNDS)
    print(f"{SECONDS:g} s a measure, {ROUNDS} rounds; messages a second")
    print_spread(rates, "variant")
    print("\nmessages a group (mean over the run), each round")
    for label, sizes in group_sizes.items():
        print(f"{label:<31} " + " ".join(f"{size:6.2f}" for size in sizes))


if __name__ == "__main__":
    main()
