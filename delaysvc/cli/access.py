"""Commands on access: API tokens (create-token, revoke-token, tokens) and dashboard users
(create-user, delete-user, users)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import click

from delaysvc.cli.app import JSON_OPTION, Context, cli, echo_json, pass_ctx
from delaysvc.config import extras
from delaysvc.config.levels import format_ms, parse_duration_ms
from delaysvc.errors import NotFound

SERVER = "server"  # tokens and users are the API's and the dashboard's: hashed as the web checks


@cli.command("create-token")
@click.argument("name")
@click.option(
    "--scope",
    type=click.Choice(["send", "admin"]),
    default="send",
    show_default=True,
    help="send: send, read and cancel messages; admin: every route.",
)
@click.option(
    "--topic",
    "topics",
    multiple=True,
    metavar="TOPIC",
    help="Limit the token to this topic (repeat for more); without it, every topic.",
)
@click.option(
    "--expires-in",
    metavar="DURATION",
    help="The token stops working this long from now (`90d`, `12h`; at most 3660d); "
    "without it, only when revoked.",
)
@pass_ctx
def create_token(
    ctx: Context, name: str, scope: str, topics: tuple[str, ...], expires_in: str | None
) -> None:
    """Create an API token; it is printed once, alone on the last line."""
    extras.require("delaysvc create-token", SERVER)
    from delaysvc.auth import create_token as make

    life_ms = None if expires_in is None else parse_duration_ms(expires_in, field="expires_in")
    token = make(ctx.engine, name, scope, topics or None, life_ms)
    only = f" for topics {', '.join(sorted(set(topics)))}" if topics else ""
    until = f", expiring in {format_ms(life_ms)}" if life_ms is not None else ""
    click.echo(f"token {name!r} created with scope {scope}{only}{until}; it is shown only now:")
    click.echo(token)


@cli.command("revoke-token")
@click.argument("name")
@pass_ctx
def revoke_token(ctx: Context, name: str) -> None:
    """Revoke the API tokens named NAME."""
    extras.require("delaysvc revoke-token", SERVER)
    from delaysvc.auth import revoke_token

    if not revoke_token(ctx.engine, name):
        raise NotFound(f"no live token named {name!r}")
    click.echo(f"revoked: {name}")


@cli.command("create-user")
@click.argument("name")
@click.option(
    "--role",
    type=click.Choice(["admin", "viewer"]),
    default=None,
    help="admin: sees and acts; viewer: only sees. A new user: admin when not given; an "
    "existing one keeps its role when not given.",
)
@click.password_option(
    envvar="DELAYSVC_NEW_USER_PASSWORD",
    help="Asked for (twice) when not given, or read from DELAYSVC_NEW_USER_PASSWORD.",
)
@pass_ctx
def create_user(ctx: Context, name: str, role: str | None, password: str) -> None:
    """Create (or reset) a dashboard user."""
    extras.require("delaysvc create-user", SERVER)
    from delaysvc.auth import create_user as make

    kept = make(ctx.engine, name, password, role, new_role="admin")
    click.echo(f"user {name!r} ready with role {kept}")


@cli.command("tokens")
@JSON_OPTION
@pass_ctx
def tokens(ctx: Context, as_json: bool) -> None:
    """List the API tokens (never their secrets): name, scope, topics, created, revoked or
    expiry."""
    extras.require("delaysvc tokens", SERVER)
    from delaysvc.auth import list_tokens

    def line(row: dict[str, Any]) -> str:
        topics = ",".join(row["topics"]) if row["topics"] else "(every topic)"
        if row["revoked_at"]:
            ended = f" / revoked {row['revoked_at']}"
        elif row["expires_at"]:
            ended = f" / {'expired' if row['expired'] else 'expires'} {row['expires_at']}"
        else:
            ended = ""
        return f"{row['name']:<24} {row['scope']:<6} {topics:<30} {row['created_at']}{ended}"

    header = f"{'name':<24} {'scope':<6} {'topics':<30} created / revoked or expiry"
    _listed("tokens", list_tokens(ctx.engine), as_json, header, line)


@cli.command("users")
@JSON_OPTION
@pass_ctx
def users(ctx: Context, as_json: bool) -> None:
    """List the dashboard users (never their passwords): name, role, created, locked until."""
    extras.require("delaysvc users", SERVER)
    from delaysvc.auth import list_users

    def line(row: dict[str, Any]) -> str:
        locked = f" (locked until {row['locked_until']})" if row["locked_until"] else ""
        return f"{row['name']:<24} {row['role']:<6} {row['created_at']}{locked}"

    _listed("users", list_users(ctx.engine), as_json, f"{'name':<24} {'role':<6} created", line)


def _listed(
    what: str, found: list[Any], as_json: bool, header: str, line: Callable[[dict[str, Any]], str]
) -> None:
    """`found` rows as JSON (`{what: [...]}`, times in ISO 8601) or a table of `line`s."""
    from delaysvc.serialize import iso

    rows = [
        {
            name: iso(value) if isinstance(value, datetime) else value
            for name, value in row._asdict().items()
        }
        for row in found
    ]
    if as_json:
        echo_json({what: rows})
        return
    click.echo(header)
    for row in rows:
        click.echo(line(row))


@cli.command("delete-user")
@click.argument("name")
@pass_ctx
def delete_user(ctx: Context, name: str) -> None:
    """Remove a dashboard user; its sessions end at their next request."""
    extras.require("delaysvc delete-user", SERVER)
    from delaysvc.auth import delete_user as remove

    if not remove(ctx.engine, name):
        raise NotFound(f"no dashboard user named {name!r}")
    click.echo(f"deleted: {name}")
