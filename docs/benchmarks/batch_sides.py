"""Which side a `send_batch` of 10,000 waits on: its wall time, the client's CPU (Python) and
the CPU of the PostgreSQL backends serving it, per batch, for two checkouts in turn. A side
whose CPU is well below the wall time waits on the other for that long.

Each run is a process of its own on a scratch database, 30 batches of 10,000 (each message
its own body, as the send suite's; the batches made before the clock starts), CPU read from
/proc (the backends found by the scratch database's name in their process titles).

Run from the repository root:
    python docs/benchmarks/batch_sides.py [SERVER_URL] [ROUNDS] [OTHER_CHECKOUT]
(default the local PostgreSQL, 4 rounds); with OTHER_CHECKOUT (a `git worktree` of another
commit), its runs alternate with the working tree's, each in its own process.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from scratch import server_and_rounds
from timing import checkouts_in_turn

TICK = os.sysconf("SC_CLK_TCK")
BATCHES = 30
SIZE = 10_000


def _cpu_seconds(title: str) -> float:
    """CPU seconds used so far by the processes whose command line holds `title`."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if title not in Path(f"/proc/{pid}/cmdline").read_text():
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def measure(server: str, label: str) -> None:
    """One run, in this process: the code `delaysvc` imports here (PYTHONPATH's checkout)."""
    from scratch import batch_lots, scratch_database

    import delaysvc
    from delaysvc.producer.sending import Producer

    assert delaysvc.__file__ is not None and delaysvc.__file__.startswith(os.environ["PYTHONPATH"])

    name = f"delaysvc_batch_sides_{os.getpid()}"
    with scratch_database(server, name) as (engine, settings):
        producer = Producer(settings, engine)
        lots = batch_lots(BATCHES, SIZE)
        producer.send_batch(lots[0])  # warm: connections, plans
        database, python, started = _cpu_seconds(name), time.process_time(), time.perf_counter()
        for items in lots:
            producer.send_batch(items)
        wall = (time.perf_counter() - started) / BATCHES
        python = (time.process_time() - python) / BATCHES
        database = (_cpu_seconds(name) - database) / BATCHES
    print(
        f"{label:5} {SIZE / wall:9,.0f} msg/s: {wall * 1e3:5.1f} ms a batch, Python's CPU "
        f"{python * 1e3:5.1f} ms ({python / wall:.0%}), its backends' {database * 1e3:5.1f} ms "
        f"({database / wall:.0%})",
        flush=True,
    )


def main() -> None:
    server, rounds = server_and_rounds(4)
    other = sys.argv[3] if len(sys.argv) > 3 else None
    tree = str(Path(__file__).resolve().parents[2])
    sides: list[tuple[str, str, dict[str, str]]] = [("tree", tree, {})]
    if other:
        sides.append(("other", str(Path(other).resolve()), {}))
    checkouts_in_turn(__file__, server, sides, rounds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        measure(sys.argv[2], sys.argv[3])
    else:
        main()
