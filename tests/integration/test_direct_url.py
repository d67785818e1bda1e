"""`DELAYSVC_DIRECT_DATABASE_URL` is the same database as `DELAYSVC_DATABASE_URL`, reached
without the pooler: a direct URL that reaches another database (another name, another server)
is refused, naming both settings, by what would act on it (`delaysvc migrate`, which would
migrate it instead; a delivery worker, which would take its lanes' locks there and deliver
nothing of the producers'), before they act."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.conftest import Server, outside_env

_counter = itertools.count()


@pytest.fixture
def other_url(pg_server: Server, template_db: str) -> Iterator[str]:
    """A second migrated database on the same server."""
    name = f"delaysvc_other{os.getpid()}_{next(_counter)}"
    with pg_server.janitor(name, template_dbname=template_db):
        yield pg_server.url(name)


def _run(*args: str, database_url: str, direct_url: str) -> subprocess.CompletedProcess[str]:
    env = outside_env() | {
        "DELAYSVC_DATABASE_URL": database_url,
        "DELAYSVC_DIRECT_DATABASE_URL": direct_url,
        "DELAYSVC_DELAY_LEVELS": "1s 2s 3s 5s 8s",
    }
    return subprocess.run(
        [sys.executable, "-m", "delaysvc", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("args", [("migrate",), ("worker", "--no-consume")], ids=str)
def test_a_direct_url_of_another_database_is_refused(
    database_url: str, other_url: str, args: tuple[str, ...]
) -> None:
    done = _run(*args, database_url=database_url, direct_url=other_url)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: DELAYSVC_DIRECT_DATABASE_URL reaches another database"), line
    assert f"({_name(other_url)!r}" in line and f"({_name(database_url)!r}" in line


def _name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def test_a_direct_url_of_the_same_database_written_otherwise_is_taken(database_url: str) -> None:
    same = database_url.replace("127.0.0.1", "localhost")
    if same == database_url:  # the embedded server's socket URL: the same, with its options
        same = database_url + ("&" if "?" in database_url else "?") + "application_name=direct"
    done = _run("migrate", database_url=database_url, direct_url=same)
    assert done.returncode == 0, done.stderr
    assert "migrated; 5 delay levels" in done.stdout
