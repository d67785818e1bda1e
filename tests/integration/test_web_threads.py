"""`delaysvc web --threads N` (gunicorn's threaded workers): a worker holds at most
`CONNECTIONS_PER_THREAD` client connections a thread, so one worker cannot take every kept-alive
client (docs/benchmarks/2026-11-28-http-idle-clients). A real gunicorn, as `delaysvc web`
starts it."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from delaysvc import auth
from delaysvc.runtime.commands import CONNECTIONS_PER_THREAD, web_command
from delaysvc.runtime.supervisor import (
    die_with_parent,
    free_port,
    wait_until_answering,
)
from tests.conftest import outside_env
from tests.support.web_process import login_form, web_process


def _held(web: subprocess.Popen[bytes], port: int) -> list[int]:
    """Client connections on `port` each of `web`'s workers has accepted."""
    return [
        sum(
            1
            for c in w.net_connections("tcp")
            if c.status == "ESTABLISHED" and c.laddr.port == port
        )
        for w in psutil.Process(web.pid).children()
    ]


def test_a_threaded_worker_accepts_no_more_connections_than_its_cap(database_url: str) -> None:
    threads = 2
    cap = threads * CONNECTIONS_PER_THREAD
    port = free_port()
    command = web_command(
        "127.0.0.1", port, workers=1, access_log=False, threads=threads, server="sync"
    )
    assert command[command.index("--worker-connections") + 1] == str(cap)
    env = outside_env() | {"DELAYSVC_DATABASE_URL": database_url}
    web = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent()
    )
    clients: list[socket.socket] = []
    try:
        assert wait_until_answering(f"http://127.0.0.1:{port}/healthz", process=web)
        time.sleep(0.5)  # the health check's connection closed
        # idle clients, as a proxy's pool keeps them: connected, asking nothing yet
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(cap + 3)]
        time.sleep(0.5)
        assert _held(web, port) == [cap]  # the other 3 wait in the listen queue
    finally:
        for client in clients:
            client.close()
        web.terminate()
        web.wait(timeout=30)


def test_sync_workers_take_no_connection_cap() -> None:
    command = web_command("127.0.0.1", 8080, workers=2, server="sync")
    assert "--worker-connections" not in command
    assert command[command.index("--threads") + 1] == "1"


def test_the_default_server_is_the_asgi_one_and_takes_no_threads() -> None:
    command = web_command("127.0.0.1", 8080, workers=2)
    assert command[command.index("-k") + 1] == "uvicorn_worker.UvicornWorker"
    assert "--threads" not in command
    refused = subprocess.run(
        [sys.executable, "-m", "delaysvc", "web", "--threads", "4"],
        env=outside_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2  # click's usage error, before anything starts
    assert "--threads is for --server sync" in refused.stderr


def test_the_workers_share_one_session_key_where_var_cannot_be_written(
    database_url: str, engine: Any, tmp_path: Path
) -> None:
    """Found by a reviewer: with no DELAYSVC_SECRET_KEY and a `var/` that cannot be written,
    each web worker signed sessions with a key of its own: 7 of 20 dashboard pages bounced to
    the login, logins and actions failed at random ("form expired")."""
    auth.create_user(engine, "ada", "admin-password-1", role="admin")
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    var = str(unwritable / "var")  # under a file: never made
    with tempfile.TemporaryFile() as stderr:
        with web_process(database_url, workers=2, stderr=stderr, DELAYSVC_VAR_DIR=var) as (
            base,
            _,
        ):
            browser, form = login_form(base, "ada", "admin-password-1")
            browser.open(f"{base}/login", urllib.parse.urlencode(form).encode())
            for _ in range(20):  # each served by either worker
                assert browser.open(f"{base}/").geturl() == f"{base}/"  # not sent to /login
        stderr.seek(0)
        said = stderr.read().decode()
    assert "cannot be written" in said and "DELAYSVC_SECRET_KEY" in said
