"""Commands that run the service: up, worker, beat, web."""

from __future__ import annotations

import sys

import click

from delaysvc.cli.app import Context, Whole, cli, pass_ctx, require_levels
from delaysvc.runtime.commands import WEB_SERVERS, WEB_THREADS
from delaysvc.runtime.supervisor import require_free_port

HOST = click.option(
    "--host", default="127.0.0.1", show_default=True, help="The web app's address (0.0.0.0: all)."
)
PORT = click.option(
    "--port", type=Whole(1, 65535), default=8080, show_default=True, help="The web app's port."
)


@cli.command()
@HOST
@PORT
@pass_ctx
def up(ctx: Context, host: str, port: int) -> None:
    """All in one: (embedded) PostgreSQL, migrations, web app, workers and beat."""
    from delaysvc.config import extras
    from delaysvc.runtime.supervisor import run_all

    embedded = ("embedded",) if ctx.settings.embedded_database else ()
    extras.require("delaysvc up", "worker", "server", *embedded)
    require_workers_can_start(ctx, handlers=True)
    sys.exit(run_all(ctx.settings, host, port))


def require_workers_can_start(ctx: Context, handlers: bool) -> None:
    """Refuse before anything starts what would stop every Celery process as it starts: a
    broker URL kombu has no transport for, and (`handlers`) a handler module not found."""
    from delaysvc.tasks.app import broker_options
    from delaysvc.worker.handlers import require_handler_modules

    broker_options(ctx.settings)
    if handlers:
        require_handler_modules(ctx.settings.handler_modules)


@cli.command()
@click.option("--delivery/--no-delivery", default=True, help="Serve the delivery queue.")
@click.option("--consume/--no-consume", default=True, help="Serve the consume queue.")
@click.option(
    "--concurrency", "-c", type=Whole(1, 1024), help="Consumer processes (default: cores)."
)
@pass_ctx
def worker(ctx: Context, delivery: bool, consume: bool, concurrency: int | None) -> None:
    """Run Celery workers (delivery: threads, one per lane; consume: processes); prints a
    line containing `ready` once its lanes and consumers run."""
    from delaysvc.config import extras
    from delaysvc.runtime.commands import worker_commands
    from delaysvc.runtime.supervisor import run_worker

    extras.require("delaysvc worker", "worker")
    require_workers_can_start(ctx, handlers=True)
    if delivery:
        from delaysvc.db.engines import require_one_database, require_session
        from delaysvc.tasks.app import DELIVERY_NEEDS

        require_session(ctx.settings, DELIVERY_NEEDS)
        require_one_database(ctx.settings)
    require_levels(ctx)
    commands = worker_commands(ctx.settings, delivery, consume, concurrency)
    if not commands:
        raise click.UsageError("nothing to run: give --delivery, --consume or both")
    sys.exit(run_worker(ctx.settings, commands))


@cli.command()
@pass_ctx
def beat(ctx: Context) -> None:
    """Run Celery beat (fires every lane's delivery task, the consume sweep, lease rescue)."""
    from delaysvc.config import extras
    from delaysvc.runtime.commands import beat_command
    from delaysvc.runtime.supervisor import run_processes

    extras.require("delaysvc beat", "worker")
    require_workers_can_start(ctx, handlers=False)
    require_levels(ctx)
    sys.exit(run_processes([beat_command(ctx.settings)]))


@cli.command()
@HOST
@PORT
@click.option(
    "--workers",
    type=Whole(1, 1024),
    default=2,
    show_default=True,
    help="gunicorn worker processes.",
)
@click.option(
    "--threads",
    type=Whole(1, 1024),
    default=None,
    help=f"With --server sync: requests each worker serves at once [default: {WEB_THREADS}] "
    "(more than 1: gunicorn's threaded workers, each holding at most 2N client connections, "
    "whose single sends are written together).",
)
@click.option(
    "--server",
    type=click.Choice(WEB_SERVERS),
    default=WEB_SERVERS[0],
    show_default=True,
    help="asgi: uvicorn's workers (under gunicorn's master) run the app as an ASGI app, single "
    "sends written on the event loop, grouped. sync: gunicorn's sync workers run the Flask app, "
    "one request at a time each (or --threads N).",
)
@pass_ctx
def web(ctx: Context, host: str, port: int, workers: int, threads: int | None, server: str) -> None:
    """Serve the HTTP API and dashboard with gunicorn."""
    from delaysvc.config import extras
    from delaysvc.runtime.commands import web_command
    from delaysvc.runtime.supervisor import run_processes

    if threads is not None and server != "sync":
        raise click.UsageError(
            "--threads is for --server sync (gunicorn's threaded workers); the ASGI server "
            "serves many requests a worker without threads"
        )
    extras.require("delaysvc web", "server")
    require_levels(ctx)
    require_free_port(host, port)
    _one_session_key_for_every_worker(ctx)
    command = web_command(
        host,
        port,
        workers,
        log_format=ctx.settings.log_format,
        threads=threads or WEB_THREADS,
        server=server,
    )
    sys.exit(run_processes([command]))


def _one_session_key_for_every_worker(ctx: Context) -> None:
    """The web workers sign the dashboard's sessions with one key: DELAYSVC_SECRET_KEY, else
    `var/secret_key` (made by the first of them). Where that cannot be written, each worker
    made a key of its own, and a session signed by one was no session to the next: pages
    bounced to the login at random. A key made here for this server's workers instead (they
    inherit it), said on stderr: sessions end when it stops."""
    import os
    import secrets

    from delaysvc.web.ui import session_secret

    if session_secret(ctx.settings) is None:
        os.environ["DELAYSVC_SECRET_KEY"] = secrets.token_hex(32)
        click.echo(
            f"delaysvc web: {ctx.settings.var_dir / 'secret_key'} cannot be written: the "
            "dashboard's sessions are signed with a key made for this run, and end when it "
            "stops; set DELAYSVC_SECRET_KEY (or a writable DELAYSVC_VAR_DIR) to keep them",
            err=True,
        )
