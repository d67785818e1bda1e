"""Where the peers' handlers say "job i, due at t, received now": one append-only file per
process in a folder, so any worker of any peer (Celery, Procrastinate, a pika consumer,
delaysvc's own) records the same way, on the same clock (this machine's), at the same cost.
The folder comes from `DELAYSVC_BENCH_RECORD_DIR`, set by the bench for the workers it starts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

RECORD_DIR_ENV = "DELAYSVC_BENCH_RECORD_DIR"
WARM_UP = -1  # the job each peer runs first, to know its workers are up

_files: dict[int, TextIO] = {}


def record(i: int, due: float, folder: str | None = None) -> None:
    """Note that job `i`, due at the epoch second `due`, reached its handler now."""
    received = time.time()
    pid = os.getpid()
    out = _files.get(pid)
    if out is None:
        where = Path(folder or os.environ[RECORD_DIR_ENV])
        out = _files[pid] = (where / f"{pid}.log").open("a", buffering=1)
    out.write(f"{i} {due:.6f} {received:.6f}\n")


@dataclass
class Received:
    lateness_ms: dict[int, float]  # first receipt of each job: received - due
    duplicates: int

    def has(self, i: int) -> bool:
        return i in self.lateness_ms

    @property
    def count(self) -> int:
        return sum(1 for i in self.lateness_ms if i != WARM_UP)


def read(folder: Path) -> Received:
    lateness: dict[int, float] = {}
    duplicates = 0
    for path in folder.glob("*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 3:
                continue  # a line being written
            i, due, received = int(parts[0]), float(parts[1]), float(parts[2])
            if i in lateness:
                duplicates += 1
                continue
            lateness[i] = (received - due) * 1000
    return Received(lateness, duplicates)
