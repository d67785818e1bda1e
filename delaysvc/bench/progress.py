"""Progress of long benchmark steps on stderr: one line, rewritten at most 4 times a second."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int | None = None, unit: str = "rows"):
        self.label, self.total, self.unit = label, total, unit
        self.started = self.shown = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.shown < 0.25 and (self.total is None or done < self.total):
            return
        self.shown = now
        elapsed = now - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total:,}" if self.total else ""
        sys.stderr.write(
            f"\r  {self.label}: {done:,}{of} {self.unit}  {rate:,.0f}/s  {elapsed:.1f}s   "
        )
        sys.stderr.flush()

    def done(self, note: str = "") -> None:
        sys.stderr.write(
            f"\r  {self.label}: done in {time.monotonic() - self.started:.1f}s {note}\n"
        )
        sys.stderr.flush()


def step(message: str) -> None:
    sys.stderr.write(f"bench: {message}\n")
    sys.stderr.flush()
