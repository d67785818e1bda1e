"""The `dead` group: list, redrive and purge dead letters."""

from __future__ import annotations

import sys
from datetime import UTC

import click

from delaysvc.cli.app import JSON_OPTION, MESSAGE_ID, Context, Whole, cli, echo_json, pass_ctx
from delaysvc.errors import ValidationError


@cli.group()
def dead() -> None:
    """List, redrive and purge dead letters (`delaysvc show ID` shows one with its errors)."""


@dead.command("list")
@click.option("--topic", help="Only the dead letters of this topic.")
@click.option(
    "--limit", type=Whole(1, 100_000), default=50, show_default=True, help="List at most this many."
)
@JSON_OPTION
@pass_ctx
def dead_list(ctx: Context, topic: str | None, limit: int, as_json: bool) -> None:
    """The newest dead letters (of --topic), each with its reason and last error."""
    from delaysvc.producer.dead_letters import DeadLetters

    rows = DeadLetters(ctx.engine).list(topic=topic, limit=limit)
    if as_json:
        from delaysvc.serialize import dead_letter_json

        echo_json({"dead": [dead_letter_json(row) for row in rows]})
        return
    if not rows:  # said on stderr: the list itself stays empty for scripts
        click.echo("no dead letters" + (f" of {topic}" if topic else ""), err=True)
    for row in rows:
        died = row.died_at.astimezone(UTC)  # said as UTC: it was the session's zone, unsaid
        click.echo(
            f"{row.message_id:>10} {row.topic:<30} {died:%Y-%m-%d %H:%M:%SZ} "
            f"attempts={row.attempts} {row.reason} | {row.last_error or ''}"
        )


@dead.command("redrive")
@click.argument("message_ids", type=MESSAGE_ID, nargs=-1)
@click.option("--topic", help="All dead letters of a topic ...")
@click.option("--error-contains", help="... whose error contains this text.")
@pass_ctx
def dead_redrive(
    ctx: Context, message_ids: tuple[int, ...], topic: str | None, error_contains: str | None
) -> None:
    """Run dead messages again now, by id or by filter."""
    from delaysvc.producer.dead_letters import DeadLetters

    letters = DeadLetters(ctx.engine)
    _ids_or_filters(message_ids, topic, error_contains)
    if message_ids:
        count = len(letters.redrive_all(message_ids))
    elif topic or error_contains:
        count = letters.redrive_matching(topic=topic, error_contains=error_contains)
    else:
        raise ValidationError("ids", "give message ids, --topic or --error-contains")
    click.echo(f"redriven: {count}")


@dead.command("purge")
@click.argument("message_ids", type=MESSAGE_ID, nargs=-1)
@click.option("--topic", help="All dead letters of a topic ...")
@click.option("--error-contains", help="... whose error contains this text.")
@click.option("--yes", is_flag=True, help="Do not ask first.")
@pass_ctx
def dead_purge(
    ctx: Context,
    message_ids: tuple[int, ...],
    topic: str | None,
    error_contains: str | None,
    yes: bool,
) -> None:
    """Forget dead letters, by id or by filter: they can no longer be redriven (the messages'
    history stays). Asks first, unless --yes; without a terminal to ask on, it needs --yes."""
    from delaysvc.producer.dead_letters import DeadLetters

    letters = DeadLetters(ctx.engine)
    if not (message_ids or topic or error_contains):
        raise ValidationError("ids", "give message ids, --topic or --error-contains")
    _ids_or_filters(message_ids, topic, error_contains)
    if not yes:
        which = (
            f"dead letters {', '.join(map(str, message_ids))}"
            if message_ids
            else "the dead letters"
            + (f" of topic {topic}" if topic else "")
            + (f" whose error contains {error_contains!r}" if error_contains else "")
        )
        if not sys.stdin.isatty():
            raise ValidationError("--yes", f"purging {which} needs it off a terminal")
        click.confirm(f"forget {which}?", abort=True)
    if message_ids:
        count = letters.purge(list(message_ids))
    elif topic or error_contains:
        count = letters.purge_matching(topic=topic, error_contains=error_contains)
    click.echo(f"purged: {count}")


def _ids_or_filters(ids: tuple[int, ...], topic: str | None, error_contains: str | None) -> None:
    """Ids and a filter together would act on the ids alone, the filter ignored: refused."""
    if ids and (topic is not None or error_contains is not None):
        raise ValidationError("ids", "give message ids, or --topic / --error-contains, not both")
