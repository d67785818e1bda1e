"""The dashboard's per-client login limit through a real `delaysvc web` (gunicorn's master,
uvicorn's workers): the client is whom the limit counts, and X-Forwarded-For names it only
from DELAYSVC_PROXY_HOPS proxies."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable
from http.cookiejar import CookieJar
from typing import Any

from delaysvc import auth
from delaysvc.runtime.supervisor import die_with_parent, free_port, wait_until_answering
from tests.conftest import TEST_LEVELS, outside_env

Attempt = Callable[[str], int]


def _serving(database_url: str, hops: int, check: Callable[[Attempt], None]) -> None:
    """Run `check` with a wrong login that sends X-Forwarded-For: its status."""
    port = free_port()
    env = outside_env() | {
        "DELAYSVC_DATABASE_URL": database_url,
        "DELAYSVC_DELAY_LEVELS": TEST_LEVELS,
        "DELAYSVC_SECRET_KEY": "k" * 64,
        "DELAYSVC_PROXY_HOPS": str(hops),
    }
    command = [sys.executable, "-m", "delaysvc", "web", "--port", str(port), "--workers", "1"]
    web = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent(),
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_answering(f"{base}/healthz", process=web)
        browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
        page = browser.open(f"{base}/login").read().decode()
        token = re.search(r'name="csrf_token" value="([^"]+)"', page)
        assert token is not None
        form = {"name": "ada", "password": "wrong-password", "csrf_token": token.group(1)}

        def attempt(forwarded: str) -> int:
            request = urllib.request.Request(
                f"{base}/login",
                urllib.parse.urlencode(form).encode(),
                headers={"X-Forwarded-For": forwarded},
            )
            try:
                response: Any = browser.open(request)
            except urllib.error.HTTPError as error:
                return error.code
            return int(response.status)

        check(attempt)
    finally:
        web.terminate()
        web.wait(timeout=30)


def test_a_client_cannot_name_itself_anew_each_attempt_unless_behind_proxies(
    database_url: str, engine: Any
) -> None:
    """Found by a reviewer: uvicorn took X-Forwarded-For from any local peer as the client's
    address, so a client behind a local proxy that passed its header on (or on the host)
    named itself anew at each attempt: 40 wrong logins, 40 password checks."""
    auth.create_user(engine, "ada", "admin-password-1", role="admin")
    limit = auth.MAX_CLIENT_FAILED_LOGINS

    def not_believed(attempt: Attempt) -> None:
        statuses = Counter(attempt(f"198.51.100.{n}") for n in range(limit + 5))
        assert statuses == {401: limit, 429: 5}

    _serving(database_url, 0, not_believed)

    def believed(attempt: Attempt) -> None:
        with engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM login_client")
        assert Counter(attempt(f"spoofed, 192.0.2.{n}") for n in range(limit + 5)) == {
            401: limit + 5
        }
        # one client, whatever its port (as some proxies forward it)
        ports = Counter(attempt(f"203.0.113.5:{40000 + n}") for n in range(limit + 2))
        assert ports == {401: limit, 429: 2}

    _serving(database_url, 1, believed)
