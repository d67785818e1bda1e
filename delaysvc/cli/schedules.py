"""The `schedules` group: periodic schedules made at run time, and those declared in code."""

from __future__ import annotations

from typing import Any

import click

from delaysvc.cli.app import JSON_OPTION, Context, cli, echo_json, pass_ctx
from delaysvc.cli.messages import _parse_body
from delaysvc.maintenance.periodic import Schedules


@cli.group()
def schedules() -> None:
    """List, add, pause, resume and delete periodic schedules."""


def _schedules(ctx: Context) -> Schedules:

    return Schedules(ctx.engine)


def _schedule_line(row: Any) -> str:
    from delaysvc.serialize import schedule_json

    data = schedule_json(row)
    state = "paused" if row.paused else f"next {data['next_tick']}"
    return (
        f"{row.name:<24} {data['schedule']:<16} {row.timezone:<14} {row.topic:<24} {state} "
        f"last {data['last_tick'] or '-'} ({row.declared_in})"
    )


@schedules.command("list")
@JSON_OPTION
@pass_ctx
def schedules_list(ctx: Context, as_json: bool) -> None:
    """Every periodic schedule: its timing, topic, next tick, and who declared it."""
    rows = _schedules(ctx).list()
    if as_json:
        from delaysvc.serialize import schedule_json

        echo_json({"schedules": [schedule_json(row) for row in rows]})
        return
    if not rows:  # said on stderr: the list itself stays empty for scripts
        click.echo("no periodic schedules", err=True)
    for row in rows:
        click.echo(_schedule_line(row))


@schedules.command("add")
@click.argument("name")
@click.argument("when")
@click.option("--topic", required=True, help="The topic each tick sends to.")
@click.option("--body", default="null", show_default=True, help="JSON, or plain text.")
@click.option("--timezone", default="UTC", show_default=True, help="IANA name.")
@click.option(
    "--on-missed",
    type=click.Choice(["skip", "latest"]),
    default="skip",
    show_default=True,
    help="After downtime: skip missed ticks, or run the latest once.",
)
@pass_ctx
def schedules_add(
    ctx: Context, name: str, when: str, topic: str, body: str, timezone: str, on_missed: str
) -> None:
    """Add (or replace) schedule NAME: WHEN is a cron expression ('*/5 * * * *') or an
    interval ('30s', 'every 1h')."""
    from delaysvc.maintenance.periodic import schedule

    item = schedule(
        name, when, topic=topic, body=_parse_body(body), timezone=timezone, on_missed=on_missed
    )
    row, created = _schedules(ctx).put(item)
    click.echo(("added: " if created else "replaced: ") + _schedule_line(row))


@schedules.command("pause")
@click.argument("name")
@pass_ctx
def schedules_pause(ctx: Context, name: str) -> None:
    """Stop schedule NAME firing until it is resumed (ticks while paused never fire)."""
    click.echo("paused: " + _schedule_line(_schedules(ctx).pause(name)))


@schedules.command("resume")
@click.argument("name")
@pass_ctx
def schedules_resume(ctx: Context, name: str) -> None:
    """Fire schedule NAME again, from its next tick on."""
    click.echo("resumed: " + _schedule_line(_schedules(ctx).resume(name)))


@schedules.command("delete")
@click.argument("name")
@pass_ctx
def schedules_delete(ctx: Context, name: str) -> None:
    """Delete schedule NAME now. One declared in code only once no running worker declares it
    (none has for 2 minutes); left alone, it goes 10 minutes after the last one did."""
    _schedules(ctx).delete(name)
    click.echo(f"deleted: {name}")
