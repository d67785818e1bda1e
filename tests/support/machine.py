"""The machine's own services that tests use or stop: CI runs its two passes at once
(`.ci/run`), and they share this machine's RabbitMQ (127.0.0.1:5672). A test that uses or stops
one holds it for its whole run, by a lock file both passes see."""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
"""The machine's RabbitMQ, which CI starts (and requires: DELAYSVC_TEST_REQUIRE_RABBITMQ)."""


@contextmanager
def holding(service: str) -> Iterator[None]:
    """This process alone uses `service` (a name: "rabbitmq") until the block ends; another
    test that holds it, in this pass or the other, waits. Released when the file is closed,
    also when the process dies."""
    path = Path(tempfile.gettempdir()) / f"delaysvc-tests-{service}.lock"
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
