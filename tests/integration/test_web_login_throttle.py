"""The dashboard's per-client login limit through a real `delaysvc web` (gunicorn's master,
uvicorn's workers): the client is whom the limit counts, and X-Forwarded-For names it only
from DELAYSVC_PROXY_HOPS proxies."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable
from typing import Any

from delaysvc import auth
from tests.support.passes import first_pass_only
from tests.support.web_process import login_form, web_process

Attempt = Callable[[str], int]


def _serving(database_url: str, hops: int, check: Callable[[Attempt], None]) -> None:
    """Run `check` with a wrong login that sends X-Forwarded-For: its status."""
    key, proxies = "k" * 64, str(hops)
    with web_process(database_url, DELAYSVC_SECRET_KEY=key, DELAYSVC_PROXY_HOPS=proxies) as (
        base,
        _,
    ):
        browser, form = login_form(base, "ada", "wrong-password")

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


@first_pass_only("~25 s, two real web servers started; the same on either database")
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
