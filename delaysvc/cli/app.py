"""The `delaysvc` command group: the context every command shares (settings, engine, producer,
built lazily so `--help` needs no database), its errors as one line and an exit code, and the
helpers the commands share."""

from __future__ import annotations

import json
import logging
import sys
from functools import cached_property
from typing import Any

import click
from sqlalchemy import Engine

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.errors import DelaysvcError


class Context:
    """Built lazily, so `--help` needs neither settings nor a database: a bad `DELAYSVC_*`
    value is an error of the command that reads the settings, never of `--help`."""

    verbose = False

    @cached_property
    def settings(self) -> Settings:
        from delaysvc.config import logs

        settings = Settings.from_env()
        logs.configure(settings, logging.INFO if self.verbose else logging.WARNING)
        return settings

    @cached_property
    def engine(self) -> Engine:
        from delaysvc.db.engines import make_engine

        return make_engine(self.settings)

    @cached_property
    def producer(self):
        from delaysvc.producer.sending import Producer

        return Producer(self.settings, self.engine)


pass_ctx = click.make_pass_decorator(Context, ensure=True)


class Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DelaysvcError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2 if exc.code in ("config_error", "invalid", "too_large") else 1)
        except Exception as exc:
            from sqlalchemy.exc import DBAPIError, OperationalError

            if isinstance(exc, OperationalError):
                reason = " ".join(str(exc.orig).split())
                click.echo(f"error: database unreachable: {reason}", err=True)
                sys.exit(1)
            missing = store.not_migrated(exc) if isinstance(exc, DBAPIError) else None
            if missing is not None:
                click.echo(f"error: {missing}", err=True)
                sys.exit(1)
            raise


@click.group(cls=Group)
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO.")
@click.version_option(package_name="delaysvc", prog_name="delaysvc")
def cli(verbose: bool) -> None:
    """delaysvc: durable delayed jobs on PostgreSQL."""
    # logging is configured with the settings, when a command first reads them
    click.get_current_context().ensure_object(Context).verbose = verbose


def main() -> None:
    cli(prog_name="delaysvc")


def require_levels(ctx: Context) -> None:
    """A process that delivers, consumes or serves runs only with the database's levels."""
    with ctx.engine.connect() as conn:
        store.check_levels(conn, ctx.settings.levels)


JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))
