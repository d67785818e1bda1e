"""A real `delaysvc web` for a test (gunicorn's master and its workers, as users start it), and
a browser's login form on it."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.cookiejar import CookieJar
from typing import IO, Any

from delaysvc.runtime.supervisor import die_with_parent, free_port, wait_until_answering
from tests.conftest import TEST_LEVELS, outside_env


@contextmanager
def web_process(
    database_url: str, *, workers: int = 1, stderr: int | IO[Any] = subprocess.DEVNULL, **env: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """-> (its base URL, the process), answering; stopped after, however the test ends."""
    port = free_port()
    environment = outside_env() | {
        "DELAYSVC_DATABASE_URL": database_url,
        "DELAYSVC_DELAY_LEVELS": TEST_LEVELS,
        **env,
    }
    command = [sys.executable, "-m", "delaysvc", "web", "--port", str(port)]
    web = subprocess.Popen(
        [*command, "--workers", str(workers)], env=environment, stdout=subprocess.DEVNULL,
        stderr=stderr, preexec_fn=die_with_parent(),
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_answering(f"{base}/healthz", process=web), web.stderr
        yield base, web
    finally:
        web.terminate()
        web.wait(timeout=30)


def login_form(base: str, name: str, password: str) -> tuple[Any, dict[str, str]]:
    """-> (a browser keeping its cookies, the login form to post, its CSRF token filled in)."""
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
    page = browser.open(f"{base}/login").read().decode()
    token = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert token is not None
    return browser, {"name": name, "password": password, "csrf_token": token.group(1)}
