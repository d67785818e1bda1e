"""Commands on topics: limits (limit, limits), backlog caps (cap, caps), pause."""

from __future__ import annotations

from typing import Any

import click

from delaysvc import store
from delaysvc.cli.app import JSON_OPTION, Context, cli, echo_json, pass_ctx


@cli.command("limit")
@click.argument("topic")
@click.option("--max-running", type=int, help="At most this many jobs of TOPIC run at once.")
@click.option("--rate", help="At most this many starts: '10/s', '600/m', '100/h'.")
@pass_ctx
def limit(ctx: Context, topic: str, max_running: int | None, rate: str | None) -> None:
    """Limit TOPIC across every consumer; an option left out lifts that limit."""
    from delaysvc.worker.limits import set_limits

    found = set_limits(ctx.engine, topic, max_running=max_running, rate=rate)
    click.echo(f"{found.topic}: {_limits_text(found)}")


@cli.command("limits")
@JSON_OPTION
@pass_ctx
def limits_list(ctx: Context, as_json: bool) -> None:
    """The topics with limits."""
    from delaysvc.worker.limits import all_limits

    found = all_limits(ctx.engine)
    if as_json:
        from delaysvc.serialize import limits_json

        echo_json({"limits": [limits_json(item) for item in found]})
        return
    for item in found:
        click.echo(f"{item.topic:<30} {_limits_text(item)}")


@cli.command("cap")
@click.argument("target")
@click.option("--max-waiting", type=int, help="At most this many messages wait in TARGET.")
@click.option(
    "--policy",
    type=click.Choice(["reject", "deliver-early"]),
    help="When full: refuse the send (reject, the default) or deliver the oldest now.",
)
@pass_ctx
def cap(ctx: Context, target: str, max_waiting: int | None, policy: str | None) -> None:
    """Cap the waiting messages of a level (level:16) or a topic (topic:sms.send) for every
    producer; without --max-waiting, lift it."""
    from delaysvc.producer import caps

    scope, name = caps.parse_target(target)
    found = caps.set_cap(ctx.engine, scope, name, max_waiting, policy)
    click.echo(f"{scope}:{found.target if found else name}: {_cap_text(found)}")


@cli.command("caps")
@JSON_OPTION
@pass_ctx
def caps_list(ctx: Context, as_json: bool) -> None:
    """The levels and topics with backlog caps."""
    from delaysvc.producer.caps import all_caps

    found = all_caps(ctx.engine)
    if as_json:
        from delaysvc.serialize import cap_json

        echo_json({"caps": [cap_json(item) for item in found]})
        return
    for item in found:
        click.echo(f"{item.scope + ':' + item.target:<30} {_cap_text(item)}")


def _cap_text(item: Any) -> str:
    return f"at most {item.limit} waiting, {item.policy}" if item else "no cap"


def _limits_text(item: Any) -> str:
    running = f"at most {item.max_running} running" if item.max_running else "any number running"
    rate = f"at most {item.rate_per_s:g} starts/s" if item.rate_per_s else "no rate limit"
    return f"{running}, {rate}"


@cli.command()
@click.argument("topic")
@click.option("--resume", is_flag=True)
@pass_ctx
def pause(ctx: Context, topic: str, resume: bool) -> None:
    """Pause (or --resume) consumption of TOPIC; delivery into its queue goes on."""
    from delaysvc.config.validation import validate_topic

    with ctx.engine.begin() as conn:
        store.set_topic_paused(conn, validate_topic(topic), not resume)
    click.echo(f"{topic}: {'resumed' if resume else 'paused'}")
