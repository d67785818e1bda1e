"""Where a `send_batch` of 10,000 spends its time, phase by phase: for each, its wall time, the
CPU Python used in it and the CPU of the PostgreSQL backend serving the batch. A phase whose
Python CPU is well below its wall time waits on the server; one whose backend CPU is, waits on
Python. The product's code is not changed: its steps are wrapped where `batching` calls them
(`batches.drawing`, `batching.prepare`, `batches.copying`, the Messages made while the last
COPY is stored, `batches.count_into_lanes`), and Python's garbage collections are timed by
`gc.callbacks`.

30 batches of the send suite's shape (one topic, a body each, "1h", a level; made before the
clock starts) on a scratch database; each figure is the median over the batches.

Run from the repository root:
    python docs/benchmarks/batch_phases.py [SERVER_URL] [BATCHES]
(default the local PostgreSQL, 30 batches).
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import batch_lots, scratch_database, server_and_rounds

from delaysvc.producer import batching
from delaysvc.producer.sending import Producer
from delaysvc.store import batches

SIZE = 10_000
Mark = tuple[str, float, float, float | None, float]
"""(the phase that ends here, wall, Python's CPU, the backend's CPU (None: not known yet), garbage
collection so far), in seconds."""
Spent = tuple[float, float, float | None, float]  # a phase's: (wall, Python, backend, GC)


class Timeline:
    """The marks of one batch, and the CPU clock of the backend serving it (read from the
    kernel's scheduler statistics, in ns: a server on this machine)."""

    def __init__(self) -> None:
        self.marks: list[Mark] = []
        self.backend: Path | None = None
        self.collecting = 0.0  # seconds of garbage collection so far
        self._collection_started = 0.0

    def mark(self, phase: str) -> None:
        backend = int(self.backend.read_text().split()[0]) / 1e9 if self.backend else None
        self.marks.append(
            (phase, time.perf_counter(), time.process_time(), backend, self.collecting)
        )

    def on_collection(self, step: str, _info: dict[str, int]) -> None:
        if step == "start":
            self._collection_started = time.perf_counter()
        else:
            self.collecting += time.perf_counter() - self._collection_started


TIMELINE = Timeline()


def wrap() -> None:
    """Mark the batch's steps as `batching` calls them."""
    drawing, prepare, copying = batches.drawing, batching.prepare, batches.copying
    copy_lanes, count_into_lanes = batching._copy_lanes, batches.count_into_lanes

    @contextmanager
    def drawing_marked(cursor: Any, *args: Any) -> Iterator[Any]:
        TIMELINE.backend = Path(f"/proc/{cursor.connection.info.backend_pid}/schedstat")
        TIMELINE.mark("until the draw is sent (the backend's CPU read from here on)")
        with drawing(cursor, *args) as drawn:
            yield drawn
        TIMELINE.mark("ids and offsets drawn (after the checks)")

    def prepare_marked(*args: Any) -> Any:
        items = prepare(*args)
        checked = "items checked (the draw meanwhile)" if TIMELINE.backend else "first item checked"
        TIMELINE.mark(checked)
        return items

    @contextmanager
    def copying_marked(cursor: Any, table: str, row: Any) -> Iterator[Any]:
        name = "a level's queue" if table.startswith("consume_queue") else table
        TIMELINE.mark(f"until the COPY into {name} starts")
        with copying(cursor, table, row) as copy:
            TIMELINE.mark(f"{name}: COPY started")
            yield copy
            TIMELINE.mark(f"{name}: rows written")
        TIMELINE.mark(f"{name}: COPY ended (the server done)")

    def copy_lanes_marked(*args: Any) -> Any:
        *rest, meanwhile = args

        def made() -> Any:
            TIMELINE.mark("lane rows written")
            messages = meanwhile()
            TIMELINE.mark("Messages made (the lane's rows stored meanwhile)")
            return messages

        return copy_lanes(*rest, made)  # type: ignore[call-arg]

    def count_marked(*args: Any) -> None:
        count_into_lanes(*args)
        TIMELINE.mark("lanes counted")

    batches.drawing = drawing_marked  # type: ignore[assignment]
    batching.prepare = prepare_marked  # type: ignore[assignment]
    batches.copying = copying_marked
    batching._copy_lanes = copy_lanes_marked  # type: ignore[assignment]
    batches.count_into_lanes = count_marked  # type: ignore[assignment]


def main() -> None:
    server, count = server_and_rounds(30)
    wrap()
    gc.callbacks.append(TIMELINE.on_collection)
    phases: dict[str, list[Spent]] = {}
    with scratch_database(server, "delaysvc_batch_phases") as (engine, settings):
        producer = Producer(settings, engine)
        lots = batch_lots(count + 1, SIZE)
        for number, items in enumerate(lots):
            TIMELINE.marks.clear()
            TIMELINE.backend, TIMELINE.collecting = None, 0.0
            TIMELINE.mark("start")
            sent = producer.send_batch(items)
            TIMELINE.mark("committed, returned")
            del sent  # the caller's: freed outside the batch's time
            if number == 0:
                continue  # warm: connections, plans
            for before, (phase, wall, python, backend, collecting) in itertools.pairwise(
                TIMELINE.marks
            ):
                served = None if backend is None or before[3] is None else backend - before[3]
                spent = (wall - before[1], python - before[2], served, collecting - before[4])
                phases.setdefault(phase, []).append(spent)
    _print(phases, count)


def _print(phases: dict[str, list[Spent]], count: int) -> None:
    width = max(map(len, phases))
    print(f"send_batch of {SIZE:,}: each phase's median over {count} batches, in ms")
    print(f"{'phase (ends with)':{width}} {'wall':>6} {'Python':>7} {'backend':>8} {'of it GC':>9}")
    totals = [0.0] * 4
    for phase, spans in phases.items():
        medians = [_median_ms([span[i] for span in spans]) for i in range(4)]
        totals = [total + median for total, median in zip(totals, medians, strict=True)]
        print(f"{phase:{width}} " + _columns(medians))
    print(f"{'sum of the medians':{width}} " + _columns(totals))


def _median_ms(seconds: list[float | None]) -> float:
    known = [value for value in seconds if value is not None]
    return statistics.median(known) * 1e3 if known else 0.0


def _columns(values: list[float]) -> str:
    wall, python, backend, collecting = values
    return f"{wall:6.2f} {python:7.2f} {backend:8.2f} {collecting:9.2f}"


if __name__ == "__main__":
    main()
