"""Commands on access: API tokens (create-token, revoke-token) and dashboard users (create-user)."""

from __future__ import annotations

import click

from delaysvc.cli.app import Context, cli, pass_ctx
from delaysvc.config import extras
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
@pass_ctx
def create_token(ctx: Context, name: str, scope: str, topics: tuple[str, ...]) -> None:
    """Create an API token; it is printed once, alone on the last line."""
    extras.require("delaysvc create-token", SERVER)
    from delaysvc.auth import create_token as make

    token = make(ctx.engine, name, scope, topics or None)
    only = f" for topics {', '.join(sorted(set(topics)))}" if topics else ""
    click.echo(f"token {name!r} created with scope {scope}{only}; it is shown only now:")
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
