"""The machine's own services and programs that tests use or stop: CI runs its two passes at
once (`.ci/run`), and they share this machine's RabbitMQ (127.0.0.1:5672). A test that uses or
stops one holds it for its whole run, by a lock file both passes see. And the PgBouncer keeping
prepared statements that `.ci/run` builds (`keeping_pgbouncer`)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from delaysvc.bench.pgbouncer import PREPARED_SINCE, version

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


def keeping_pgbouncer() -> str:
    """The path of a PgBouncer of 1.22 or later, which keeps its clients' prepared statements
    (`DELAYSVC_DATABASE_POOLING=transaction-prepared`): `DELAYSVC_TEST_PGBOUNCER_PREPARED`,
    which `.ci/run` sets to the 1.24.1 it builds from Debian's source. Unset: the test is
    skipped, saying so (Debian 12's own is 1.18); set to an older one: it fails."""
    path = os.environ.get("DELAYSVC_TEST_PGBOUNCER_PREPARED")
    if not path:
        pytest.skip(
            "needs a PgBouncer of 1.22 or later: DELAYSVC_TEST_PGBOUNCER_PREPARED, its path "
            "(.ci/run builds 1.24.1 from Debian's source)"
        )
    assert version(path) >= PREPARED_SINCE, f"{path} is older than {PREPARED_SINCE}"
    return path
