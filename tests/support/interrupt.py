"""SIGTERM ends a test run as Ctrl-C does. Python's default for SIGTERM is to die on the spot:
no fixture torn down, no atexit handler run, so an embedded PostgreSQL the run attached to (its
own under `.pytest-pg/`, or the one of a `delaysvc up` a test started) stays up after it. CI
stops a pass with SIGTERM (`.ci/run`), as does `kill` or a job runner's timeout. A pytest
plugin: tests/conftest.py imports its hook."""

from __future__ import annotations

import os
import signal
from types import FrameType

import pytest


def pytest_configure(config: pytest.Config) -> None:
    main = os.getpid()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != main:  # a child forked by a test: it dies as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
