"""What `delaysvc up`, `worker`, `beat` and `web` run as child processes: each child's command
line (`Command`), for the Celery workers, beat, the web app's gunicorn and the embedded
PostgreSQL's keeper. `delaysvc.runtime.supervisor` starts and keeps them."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path

from delaysvc.config.settings import Settings

STOP_GRACE_SECONDS = 20
"""How long a child has to stop once told (SIGTERM) before it is killed."""
CELERY = [sys.executable, "-m", "celery", "-A", "delaysvc.tasks", "--quiet"]  # no banner
QUIET = ["--without-mingle", "--without-gossip", "-l", "warning"]


class Command(list[str]):
    """A child process's command line, the name its output lines are prefixed with, and how it
    reloads: `reload_signal` for a program that reloads itself on a signal (gunicorn: SIGHUP
    starts new workers under the same master), else None: a new process replaces it, once it
    is ready when it `says_ready` (writes its pid to the file `READY_FILE_ENV` names, as
    delaysvc's Celery worker and beat do: `delaysvc.tasks.app.READY_FILE_ENV`), else at
    once."""

    def __init__(
        self,
        name: str,
        argv: Iterable[str],
        reload_signal: int | None = None,
        says_ready: bool = False,
    ):
        super().__init__(argv)
        self.name = name
        self.reload_signal = reload_signal
        self.says_ready = says_ready


def worker_commands(
    settings: Settings,
    delivery: bool = True,
    consume: bool = True,
    concurrency: int | None = None,
) -> list[Command]:
    from delaysvc.tasks.app import CONSUME_QUEUE, DELIVERY_QUEUE

    commands = []
    if delivery:
        # every lane, and the fold, stats, schedules and history tasks
        threads = settings.levels.max_level + 5
        pool = ["-P", "threads", "-c", str(threads)]
        argv = [*CELERY, "worker", "-Q", DELIVERY_QUEUE, *pool, "-n", "delivery@%h", *QUIET]
        commands.append(Command("delivery", argv, says_ready=True))
    if consume:
        processes = concurrency or os.cpu_count() or 2
        argv = [*CELERY, "worker", "-Q", CONSUME_QUEUE, "-c", str(processes), "-n", "consume@%h"]
        commands.append(Command("consume", [*argv, *QUIET], says_ready=True))
    return commands


def beat_command(settings: Settings) -> Command:
    """Beat keeps its schedule in memory (`tasks.app`: every entry fires every few seconds),
    so it writes no schedule file and takes no `-s`."""
    return Command("beat", [*CELERY, "beat", "-l", "warning"], says_ready=True)


WEB_THREADS = 1
"""Requests a web worker serves at once by default: one (gunicorn's sync workers). With more
(`delaysvc web --threads N`, gunicorn's threaded workers) a worker serves others while one
waits on the database, and their single sends are written together (group commit,
`delaysvc.producer.grouping`): 1.1-1.4x the sync workers' single sends on the 2-core machine of
docs/benchmarks/2026-11-28-http-idle-clients, at two to three times their p99 latency, so it is
not the default."""

CONNECTIONS_PER_THREAD = 2
"""Client connections a threaded web worker holds at most, per thread (gunicorn's
`--worker-connections`). A threaded worker keeps every kept-alive client it accepts, and
gunicorn's own limit (1,000) lets one worker accept them all: 50 of 50 wrk connections on one
of four workers, half the requests a second (docs/benchmarks/2026-11-28-group-commit). Twice
the threads spreads them and leaves a kept-alive slot a thread. A worker that holds its most
accepts no more until one closes: with 1.25x the threads and 40 idle kept-alive clients beside
wrk's 50, every request's p99 was 0.9-1 s; with twice, 112-121 ms
(docs/benchmarks/2026-11-28-http-idle-clients)."""


WEB_SERVERS = ("asgi", "sync")
"""How `delaysvc web` and `delaysvc up` serve: "asgi" (the default), gunicorn's master with
uvicorn's workers running the ASGI app (`delaysvc.web.asgi`), whose single sends are written on
the event loop, grouped: 3.3x the sync workers' single sends at 50 clients, at a third of
their p99 (docs/benchmarks/2026-12-06-http-asgi); "sync", gunicorn's sync (or, with threads,
threaded) workers running the Flask app."""


def web_command(
    host: str,
    port: int,
    workers: int = 2,
    access_log: bool = True,
    log_format: str = "text",
    threads: int = WEB_THREADS,
    server: str = WEB_SERVERS[0],
) -> Command:
    logs = ["--access-logfile", "-"] if access_log else []
    if log_format == "json":  # gunicorn's own lines too (delaysvc.web.gunicorn_logger)
        logs += ["--logger-class", "delaysvc.web.gunicorn_logger.JsonLogger"]
    # its workers die with their master (uvicorn's never look for it), and finish a request
    # within the grace `up` gives the master before it kills it
    hooks = ["-c", "python:delaysvc.runtime.gunicorn_hooks"]
    hooks += ["--graceful-timeout", str(STOP_GRACE_SECONDS - 5)]
    if server == "asgi":
        app = ["-k", "uvicorn_worker.UvicornWorker", "delaysvc.web.asgi:create_asgi_app()"]
        # uvicorn took X-Forwarded-For from any local peer as the client's address (a local
        # proxy passing the client's header on let it name itself anew at each failed login):
        # the app reads it itself, from DELAYSVC_PROXY_HOPS proxies only
        app = ["--forwarded-allow-ips", "", *app]
    else:
        most = threads * CONNECTIONS_PER_THREAD  # client connections a threaded worker holds
        held = ["--worker-connections", str(most)] if threads > 1 else []
        app = ["--threads", str(threads), *held, "delaysvc.web:create_app()"]
    return Command(
        "web",
        reload_signal=signal.SIGHUP,
        argv=[
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
            *hooks,
            *app,
        ],
    )


def keeper_command(var_dir: Path) -> Command:
    """The embedded PostgreSQL's keeper (`delaysvc.runtime.embedded_keeper`)."""
    module = "delaysvc.runtime.embedded_keeper"
    return Command("database", [sys.executable, "-m", module, str(var_dir.resolve())])
