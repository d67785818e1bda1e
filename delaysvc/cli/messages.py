"""Commands on messages: send, cancel, show."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click

from delaysvc.cli.app import MESSAGE_ID, Context, Whole, cli, pass_ctx
from delaysvc.config.validation import not_json
from delaysvc.errors import ValidationError
from delaysvc.producer.sending import OnDuplicate
from delaysvc.schema.tables import TIMER_LANE, lane_name

SEND_OPTIONS = {
    "topic": "TOPIC",
    "body": "BODY",
    "delay": "--delay",
    "delay_level": "--level",
    "deliver_at": "--at",
    "key": "--key",
    "tags": "--tag",
    "properties": "--property",
}
"""The producer's fields a `send` argument or option gives, by its name on the command line."""


def _parse_body(text: str) -> Any:
    """BODY is JSON when it parses as JSON, else the text itself (`NaN` and `Infinity`, which
    Python's parser takes and JSON has not, are text)."""
    try:
        return json.loads(text, parse_constant=not_json)
    except ValueError:
        return text


@cli.command()
@click.argument("topic")
@click.argument("body")
@click.option("--delay", help="Duration such as 30m, 1h30m, 250ms.")
@click.option("--level", "delay_level", type=Whole(), help="Delay level (1..max; <=0 = now).")
@click.option("--at", "deliver_at", help="ISO 8601 time with a timezone.")
@click.option("--key", help="Unique among unfinished messages of the topic.")
@click.option("--tag", "tags", multiple=True, help="Repeatable.")
@click.option("--property", "properties", multiple=True, help="NAME=VALUE, repeatable.")
@click.option(
    "--priority", type=Whole(-1000, 1000), default=0, show_default=True, help="Higher runs first."
)
@click.option(
    "--on-duplicate",
    type=click.Choice(["keep", "replace", "debounce"]),
    default="keep",
    show_default=True,
    help="When an unfinished message holds the key: keep it, replace it, or replace it "
    "without making it due earlier.",
)
@pass_ctx
def send(
    ctx: Context,
    topic: str,
    body: str,
    delay: str | None,
    delay_level: int | None,
    deliver_at: str | None,
    key: str | None,
    tags: tuple[str, ...],
    properties: tuple[str, ...],
    priority: int,
    on_duplicate: OnDuplicate,
) -> None:
    """Schedule BODY (JSON, or plain text) for TOPIC."""
    given = [
        option
        for option, value in (("--delay", delay), ("--level", delay_level), ("--at", deliver_at))
        if value is not None
    ]
    if len(given) > 1:
        raise ValidationError(
            given[1], f"give at most one of --delay, --level, --at (got {', '.join(given)})"
        )
    at = None
    if deliver_at is not None:
        try:
            at = datetime.fromisoformat(deliver_at)
        except ValueError:
            raise ValidationError("--at", f"{deliver_at!r} is not an ISO 8601 time") from None
        if at.utcoffset() is None:
            raise ValidationError(
                "--at", f"{deliver_at!r} has no UTC offset: add one, such as Z or +02:00"
            )
    props = {}
    for item in properties:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValidationError("--property", f"{item!r} is not NAME=VALUE")
        props[name] = value
    try:
        message = ctx.producer.send(
            topic,
            _parse_body(body),
            delay=delay,
            delay_level=delay_level,
            deliver_at=at,
            key=key,
            tags=list(tags) or None,
            properties=props or None,
            priority=priority,
            on_duplicate=on_duplicate,
        )
    except ValidationError as exc:  # named as typed: `--level`, not `delay_level`
        option = SEND_OPTIONS.get(exc.field.partition("[")[0])
        if option is None:
            raise
        raise type(exc)(option, exc.detail) from None
    verb = "sent" if message.created else "exists (same topic and key)"
    if message.replaced_id is not None:
        verb = f"sent, replacing {message.replaced_id}"
    # due at once ("none"): in its topic's queue; else waiting (a retry too) in a level or the
    # timer lane
    waiting = message.status in ("scheduled", "retrying")
    lane = lane_name(message.delay_level or TIMER_LANE) if waiting else "none"
    click.echo(
        f"{verb}: id={message.id} status={message.status} lane={lane} "
        f"deliver_at={message.deliver_at.isoformat()}"
    )


@cli.command()
@click.argument("message_id", type=MESSAGE_ID, required=False)
@click.option("--topic", help="With --key: the unfinished message holding KEY in TOPIC.")
@click.option("--key", help="With --topic.")
@pass_ctx
def cancel(ctx: Context, message_id: int | None, topic: str | None, key: str | None) -> None:
    """Cancel a message by ID, or by --topic and --key, while it is not yet running."""
    message = ctx.producer.cancel(message_id, topic=topic, key=key)
    click.echo(f"cancelled: id={message.id}")


@cli.command()
@click.argument("message_id", type=MESSAGE_ID)
@pass_ctx
def show(ctx: Context, message_id: int) -> None:
    """Print a message as JSON."""
    from delaysvc.serialize import message_json

    click.echo(json.dumps(message_json(ctx.producer.get(message_id), body=True), indent=2))
