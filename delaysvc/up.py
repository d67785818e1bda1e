"""Process supervision for `delaysvc up`, `worker`, `beat` and `web`.

`up` starts the embedded PostgreSQL when no database is configured, migrates, then runs the web
app (gunicorn), a delivery worker (threads), a consumer worker (processes) and beat as child
processes sharing one database URL. Ctrl-C or SIGTERM stops the children (Celery's warm
shutdown finishes or releases running jobs), then the embedded server.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence

import click

from delaysvc.settings import Settings

log = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 20
CELERY = [sys.executable, "-m", "celery", "-A", "tasks"]
QUIET = ["--without-mingle", "--without-gossip", "-l", "warning"]


def worker_commands(
    settings: Settings,
    delivery: bool = True,
    consume: bool = True,
    concurrency: int | None = None,
) -> list[list[str]]:
    from tasks.app import CONSUME_QUEUE, DELIVERY_QUEUE

    commands = []
    if delivery:
        threads = settings.levels.max_level + 3
        commands.append(
            [
                *CELERY,
                "worker",
                "-Q",
                DELIVERY_QUEUE,
                "-P",
                "threads",
                "-c",
                str(threads),
                "-n",
                "delivery@%h",
                *QUIET,
            ]
        )
    if consume:
        processes = concurrency or os.cpu_count() or 2
        commands.append(
            [
                *CELERY,
                "worker",
                "-Q",
                CONSUME_QUEUE,
                "-c",
                str(processes),
                "-n",
                "consume@%h",
                *QUIET,
            ]
        )
    return commands


def beat_command(settings: Settings) -> list[str]:
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    schedule = settings.var_dir.resolve() / "celerybeat-schedule"
    return [*CELERY, "beat", "-s", str(schedule), "-l", "warning"]


def web_command(host: str, port: int, workers: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gunicorn",
        "-b",
        f"{host}:{port}",
        "-w",
        str(workers),
        "--access-logfile",
        "-",
        "--log-level",
        "warning",
        "web:create_app()",
    ]


def run_processes(
    commands: Sequence[Sequence[str]],
    env: dict[str, str] | None = None,
    on_started: Callable[[], None] | None = None,
) -> int:
    """Run the commands until one exits or we are told to stop; then stop them all."""
    children = [
        subprocess.Popen(list(command), env=env, start_new_session=True) for command in commands
    ]
    stopping = {"signal": 0}

    def stop(signum: int, _frame: object) -> None:
        stopping["signal"] = signum

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if on_started is not None:
            on_started()
        while not stopping["signal"]:
            running = zip(children, commands, strict=True)
            exited = [(c, command) for c, command in running if c.poll() is not None]
            if exited:
                child, command = exited[0]
                click.echo(
                    f"exited with {child.returncode}: {' '.join(command[:6])}...; stopping all",
                    err=True,
                )
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        _stop_all(children)
        for s, handler in previous.items():
            signal.signal(s, handler)
    failed = [c.returncode for c in children if c.returncode not in (0, None, -15)]
    return 0 if stopping["signal"] or not failed else 1


def _stop_all(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def wait_until_answering(url: str, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status < 500:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def run_all(settings: Settings, host: str, port: int) -> int:
    from delaysvc.db import database_url, make_engine
    from delaysvc.migrate import upgrade

    url = database_url(settings)
    engine = make_engine(settings, url)
    for change in upgrade(engine, settings.levels):
        click.echo(change.describe())
    engine.dispose()
    env = dict(os.environ, DELAYSVC_DATABASE_URL=url)
    if not settings.broker_url:
        click.echo(f"broker: filesystem under {settings.var_dir.resolve() / 'broker'}")
    if settings.embedded_database:
        click.echo(f"database: embedded PostgreSQL under {settings.var_dir.resolve() / 'pg'}")
    base = f"http://{host}:{port}"
    commands = [web_command(host, port), *worker_commands(settings), beat_command(settings)]

    def announce() -> None:
        if wait_until_answering(base + "/healthz"):
            click.echo(f"delaysvc ready: dashboard at {base}/  (Ctrl-C stops everything)")
        else:
            click.echo(f"the web app did not answer at {base} within 60 s", err=True)

    return run_processes(commands, env=env, on_started=announce)
