"""The `delaysvc` command group: the context every command shares (settings, engine, producer,
built lazily so `--help` needs no database), its errors as one line and an exit code, and the
helpers the commands share."""

from __future__ import annotations

import json
import logging
import math
import sys
from functools import cached_property
from typing import Any

import click
from sqlalchemy import Engine

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.config.validation import ascii_digits
from delaysvc.errors import DelaysvcError, one_line


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
                reason = one_line(exc)
                click.echo(f"error: database: {reason}", err=True)  # unreachable, or refused
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
    """A process that delivers, consumes or serves runs only with the database's levels; a
    database not answering yet is waited for (`DELAYSVC_START_WAIT_SECONDS`)."""
    from delaysvc.db.engines import wait_for_database
    from delaysvc.schema import migrate

    wait_for_database(ctx.engine, ctx.settings.start_wait_seconds, _say)
    with ctx.engine.connect() as conn:
        migrate.check_schema(conn, ctx.settings.levels)


def _say(line: str) -> None:
    click.echo(line, err=True)


class Whole(click.IntRange):
    """A whole number in the digits 0-9, within the range: click's `int` also reads other
    scripts' digits (`١٢` as 12), a number nobody typed."""

    def __init__(self, low: int | None = None, high: int | None = None) -> None:
        super().__init__(min=low, max=high)

    def _describe_range(self) -> str:
        """No range where there is none (click's would be `x<=None`)."""
        if self.min is None and self.max is None:
            return "any whole number"
        return super()._describe_range()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not ascii_digits(value.strip().removeprefix("-")):
            self.fail(f"{value!r} is not a whole number (digits 0-9)", param, ctx)
        return super().convert(value, param, ctx)


class Seconds(click.FloatRange):
    """A finite number of seconds, more than 0 and at most `high` (`nan`, `inf` refused)."""

    def __init__(self, high: float) -> None:
        super().__init__(min=0, max=high, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return super().convert(seconds, param, ctx)


MESSAGE_ID = Whole(1, 2**63 - 1)
"""A message id: a positive bigint."""

JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))
