"""The machine's own services and programs that tests use or stop: CI runs its two passes at
once (`.ci/run`), and they share this machine's RabbitMQ (127.0.0.1:5672). A test that uses or
stops one holds it for its whole run, by a lock file both passes see. And the PgBouncer keeping
prepared statements that `.ci/run` builds (`keeping_pgbouncer`).

A test that needs a program pip cannot install (Chromium, Java and the JDBC driver for Spark,
wrk, PgBouncer) meets delaysvc's own `MissingPart` when it is absent, naming what to install: on
a machine with only Python and pip the README's test command skips that test, saying so
(`pytest_runtest_makereport`); where `DELAYSVC_TEST_REQUIRE_PARTS` is set (`.ci/run`, which
installs every part) it fails."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from delaysvc.bench.pgbouncer import PREPARED_SINCE, version
from delaysvc.errors import MissingPart

PARTS_REQUIRED = bool(os.environ.get("DELAYSVC_TEST_REQUIRE_PARTS"))

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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test (or its fixture) that met a `MissingPart` is skipped with its message, or, where
    the parts are required (`PARTS_REQUIRED`), fails with it: one line, no traceback."""
    outcome = yield
    if call.excinfo is None or not call.excinfo.errisinstance(MissingPart):
        return
    report = outcome.get_result()  # type: ignore[attr-defined]
    missing = str(call.excinfo.value)
    if PARTS_REQUIRED:
        report.longrepr = f"{missing} (DELAYSVC_TEST_REQUIRE_PARTS: this machine must have it)"
        return
    report.outcome = "skipped"
    path, line, _ = item.location
    report.longrepr = (path, (line or 0) + 1, f"Skipped: not on this machine: {missing}")
