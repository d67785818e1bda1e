"""Which of CI's two passes runs a test. `.ci/run` runs the suite twice, both at once:

1. the embedded PostgreSQL 18, the filesystem broker, delaysvc's tables in schema `delaysvc`
   (a laptop's way: nothing set);
2. `DELAYSVC_TEST_DATABASE_URL` (CI: the local PostgreSQL 15), the Redis broker
   (`DELAYSVC_TEST_BROKER_URL`), the tables in schema `jobs` (`DELAYSVC_TEST_SCHEMA`).

Every test runs in both unless it takes long and shows the same in either: then it runs in one,
and its marker says how long it takes and why once is enough. The markers keep the two passes
about as long as each other. A test that needs a part only one pass has (Redis, a RabbitMQ)
says so with its own `skipif` instead.
"""

from __future__ import annotations

import os

import pytest

SECOND_PASS = bool(os.environ.get("DELAYSVC_TEST_DATABASE_URL"))


def first_pass_only(why: str) -> pytest.MarkDecorator:
    """Run in the first pass (embedded PostgreSQL 18, filesystem broker) only. `why`: how long
    the test takes and why it shows the same in the second."""
    return pytest.mark.skipif(
        SECOND_PASS,
        reason=f"{why}: runs in CI's first pass (embedded PostgreSQL 18, filesystem broker) only",
    )


def second_pass_only(why: str) -> pytest.MarkDecorator:
    """Run in the second pass (DELAYSVC_TEST_DATABASE_URL, the Redis broker, schema `jobs`) only.
    `why`: how long the test takes and why it shows the same in the first."""
    return pytest.mark.skipif(
        not SECOND_PASS,
        reason=f"{why}: runs in CI's second pass (PostgreSQL 15, Redis broker, schema jobs) only",
    )
