"""`DELAYSVC_DIRECT_DATABASE_URL` is the same database as `DELAYSVC_DATABASE_URL`, reached
without the pooler: a direct URL that reaches another database (another name, another server)
is refused, naming both settings, by what would act on it (`delaysvc migrate`, which would
migrate it instead; a delivery worker, which would take its lanes' locks there and deliver
nothing of the producers'), before they act."""

from __future__ import annotations

import subprocess
from urllib.parse import urlsplit

import pytest

from tests.support.commands import run_delaysvc


def _run(*args: str, database_url: str, direct_url: str) -> subprocess.CompletedProcess[str]:
    return run_delaysvc(
        *args,
        DELAYSVC_DATABASE_URL=database_url,
        DELAYSVC_DIRECT_DATABASE_URL=direct_url,
        DELAYSVC_DELAY_LEVELS="1s 2s 3s 5s 8s",
    )


@pytest.mark.parametrize("args", [("migrate",), ("worker", "--no-consume")], ids=str)
def test_a_direct_url_of_another_database_is_refused(
    database_url: str, other_database_url: str, args: tuple[str, ...]
) -> None:
    done = _run(*args, database_url=database_url, direct_url=other_database_url)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: DELAYSVC_DIRECT_DATABASE_URL reaches another database"), line
    assert f"({_name(other_database_url)!r}" in line and f"({_name(database_url)!r}" in line


def _name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def test_a_direct_url_of_the_same_database_written_otherwise_is_taken(database_url: str) -> None:
    same = database_url.replace("127.0.0.1", "localhost")
    if same == database_url:  # the embedded server's socket URL: the same, with its options
        same = database_url + ("&" if "?" in database_url else "?") + "application_name=direct"
    done = _run("migrate", database_url=database_url, direct_url=same)
    assert done.returncode == 0, done.stderr
    assert "migrated; 5 delay levels" in done.stdout
