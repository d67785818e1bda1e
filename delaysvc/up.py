"""Process supervision for `delaysvc up`, `worker`, `beat` and `web`.

`up` starts the embedded PostgreSQL when no database is configured, migrates, then runs the web
app (gunicorn), a delivery worker (threads), a consumer worker (processes) and beat as child
processes sharing one database URL. Ctrl-C or SIGTERM stops the children (Celery's warm
shutdown finishes or releases running jobs), then the embedded server.

Several children share one terminal as honcho and foreman share it: each line is prefixed by
the name of the process that wrote it (`web`, `delivery`, `consume`, `beat`; `delaysvc` for
the supervisor's own). Celery's banners are off (`-q`) and gunicorn's access log is off in
`up` (the dashboard polls every few seconds), so what is left is what needs reading; the
`ready` line comes last, once every part has reported in.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from typing import IO

import click

from delaysvc.settings import Settings

log = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 20
CELERY = [sys.executable, "-m", "celery", "-A", "tasks", "--quiet"]  # --quiet: no banner
QUIET = ["--without-mingle", "--without-gossip", "-l", "warning"]
SUPERVISOR = "delaysvc"  # the name on the lines `run_processes` writes itself
READY_TIMEOUT_SECONDS = 90.0


class Command(list[str]):
    """A child process's command line, and the name its output lines are prefixed with."""

    def __init__(self, name: str, argv: Iterable[str]):
        super().__init__(argv)
        self.name = name


def worker_commands(
    settings: Settings,
    delivery: bool = True,
    consume: bool = True,
    concurrency: int | None = None,
) -> list[Command]:
    from tasks.app import CONSUME_QUEUE, DELIVERY_QUEUE

    commands = []
    if delivery:
        threads = settings.levels.max_level + 3
        pool = ["-P", "threads", "-c", str(threads)]
        argv = [*CELERY, "worker", "-Q", DELIVERY_QUEUE, *pool, "-n", "delivery@%h", *QUIET]
        commands.append(Command("delivery", argv))
    if consume:
        processes = concurrency or os.cpu_count() or 2
        argv = [*CELERY, "worker", "-Q", CONSUME_QUEUE, "-c", str(processes), "-n", "consume@%h"]
        commands.append(Command("consume", [*argv, *QUIET]))
    return commands


def beat_command(settings: Settings) -> Command:
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    schedule = settings.var_dir.resolve() / "celerybeat-schedule"
    return Command("beat", [*CELERY, "beat", "-s", str(schedule), "-l", "warning"])


def web_command(host: str, port: int, workers: int = 2, access_log: bool = True) -> Command:
    logs = ["--access-logfile", "-"] if access_log else []
    return Command(
        "web",
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-b",
            f"{host}:{port}",
            "-w",
            str(workers),
            *logs,
            "--log-level",
            "warning",
            "web:create_app()",
        ],
    )


class Console:
    """One stream for several processes: each line prefixed by its process's name."""

    def __init__(self, names: Iterable[str]):
        self.width = max(len(name) for name in [SUPERVISOR, *names])
        self._lock = threading.Lock()

    def echo(self, name: str, line: str, err: bool = False) -> None:
        """`line` prefixed by `name`; no name: the line alone, between blank lines."""
        with self._lock:
            click.echo(f"{name:<{self.width}} | {line}" if name else f"\n{line}\n", err=err)

    def relay(self, name: str, stream: IO[bytes]) -> threading.Thread:
        """Copy `stream`'s lines, prefixed, until it ends (the process and its children exit)."""

        def copy() -> None:
            for line in stream:
                self.echo(name, line.decode(errors="replace").rstrip("\r\n"))

        thread = threading.Thread(target=copy, name=f"relay-{name}", daemon=True)
        thread.start()
        return thread


def run_processes(
    commands: Sequence[Command],
    env: dict[str, str] | None = None,
    on_started: Callable[[], None] | None = None,
    console: Console | None = None,
) -> int:
    """Run the commands until one exits or we are told to stop; then stop them all. Several
    commands share the terminal through `console` (one is made if none is given); one alone
    writes to it directly."""
    if len(commands) > 1 and console is None:
        console = Console(command.name for command in commands)
    children: list[subprocess.Popen[bytes]] = []
    relays: list[threading.Thread] = []
    for command in commands:
        if console is None:
            children.append(subprocess.Popen(list(command), env=env, start_new_session=True))
            continue
        child = subprocess.Popen(
            list(command),
            env=dict(env or os.environ, PYTHONUNBUFFERED="1"),  # lines as they are written
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert child.stdout is not None
        relays.append(console.relay(command.name, child.stdout))
        children.append(child)
    stopping = {"signal": 0}

    def stop(signum: int, _frame: object) -> None:
        stopping["signal"] = signum

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if on_started is not None:  # beside the loop, which must see a child exit at once
            threading.Thread(target=on_started, name="on-started", daemon=True).start()
        while not stopping["signal"]:
            running = zip(children, commands, strict=True)
            exited = [(c, command) for c, command in running if c.poll() is not None]
            if exited:
                child, command = exited[0]
                why = f"{command.name} exited with {child.returncode}; stopping all"
                if console is None:
                    click.echo(why, err=True)
                else:
                    console.echo(SUPERVISOR, why, err=True)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        if console is not None and stopping["signal"]:
            console.echo(SUPERVISOR, "stopping all")
        _stop_all(children)
        for relay in relays:
            relay.join(timeout=2)  # the children's last lines
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


def not_yet_reported(healthz: str, started: float, timeout: float) -> list[str]:
    """Wait until every component `healthz` names (beat, the consumers) has written a
    heartbeat since `started` (a `time.monotonic()`); -> those that had not by `timeout`
    (none: all run). Beat's heartbeat is its stats sample, run by a delivery worker."""
    deadline = started + timeout
    late: list[str] = ["web"]
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(healthz, timeout=2) as response:
                ages = json.loads(response.read())["seconds_since"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
            continue
        since = time.monotonic() - started
        late = [name for name, age in ages.items() if age is None or age > since]
        if not late:
            return []
        time.sleep(0.5)
    return late


def run_all(settings: Settings, host: str, port: int) -> int:
    from delaysvc.db import database_url, make_engine
    from delaysvc.migrate import upgrade

    commands = [
        web_command(host, port, access_log=False),
        *worker_commands(settings),
        beat_command(settings),
    ]
    console = Console(command.name for command in commands)
    url = database_url(settings)
    engine = make_engine(settings, url)
    for change in upgrade(engine, settings.levels):
        console.echo(SUPERVISOR, change.describe())
    engine.dispose()
    env = dict(os.environ, DELAYSVC_DATABASE_URL=url)
    base = f"http://{host}:{port}"
    if settings.embedded_database:
        where = settings.var_dir.resolve() / "pg"
        console.echo(SUPERVISOR, f"database: embedded PostgreSQL under {where}")
    if not settings.broker_url:
        console.echo(
            SUPERVISOR, f"broker: filesystem under {settings.var_dir.resolve() / 'broker'}"
        )
    console.echo(SUPERVISOR, f"starting {', '.join(command.name for command in commands)}")
    started = time.monotonic()

    def announce() -> None:
        late = not_yet_reported(base + "/healthz", started, READY_TIMEOUT_SECONDS)
        if late:
            console.echo(
                SUPERVISOR,
                f"not ready after {READY_TIMEOUT_SECONDS:g} s: no word from {', '.join(late)} "
                "(see its lines above)",
                err=True,
            )
        else:  # unprefixed, between blank lines: the line to look for
            console.echo("", f"delaysvc ready: dashboard at {base}/  (Ctrl-C stops everything)")

    return run_processes(commands, env=env, on_started=announce, console=console)
