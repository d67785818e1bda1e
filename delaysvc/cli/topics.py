"""The groups of commands on topics, one grammar each, `<noun> <verb>` as `dead` and
`schedules`: `topics list|pause|resume`, `limits list|set`, `caps list|set`.

The spellings from before the groups (`pause TOPIC [--resume]`, `limit TOPIC`, `cap TARGET`, and
`limits` / `caps` alone, which still list) keep working, hidden from `--help`."""

from __future__ import annotations

from typing import Any

import click

from delaysvc import store
from delaysvc.cli.app import JSON_OPTION, Context, cli, echo_json, pass_ctx

# -- topics ---------------------------------------------------------------------------------


@cli.group()
def topics() -> None:
    """List topics; pause and resume their consumption."""


@topics.command("list")
@JSON_OPTION
@pass_ctx
def topics_list(ctx: Context, as_json: bool) -> None:
    """Every topic with messages ready, running, retrying, dead or run before, a pause or
    limits, and whether a live worker has its handler (`--json`: the shape of GET
    /api/v1/topics); a topic whose messages all wait in their lanes shows once one is due."""
    with ctx.engine.connect() as conn:
        rows = store.topic_stats(conn)
        durations = store.recent_durations(conn) if as_json else {}
    if as_json:
        from delaysvc.serialize import topic_json

        echo_json({"topics": [topic_json(row, durations.get(row.topic)) for row in rows]})
        return
    echo_topics(rows)


def echo_topics(rows: list[Any]) -> None:
    """The topic table of `topics list` and `stats`."""
    click.echo(f"{'topic':<40} {'ready':>8} {'running':>8} {'dead':>8}  handler")
    for row in rows:
        # as the workers report it (their `handler <topic>` heartbeats), not this process
        handler = "yes" if row.handled else "NONE: no live worker has one (waiting)"
        paused = " (paused)" if row.paused else ""
        click.echo(
            f"{row.topic:<40} {row.ready:>8} {row.running:>8} {row.dead:>8}  {handler}{paused}"
        )


def _set_paused(ctx: Context, topic: str, paused: bool) -> None:
    from delaysvc.config.validation import validate_topic

    with ctx.engine.begin() as conn:
        store.set_topic_paused(conn, validate_topic(topic), paused)
    click.echo(f"{topic}: {'paused' if paused else 'resumed'}")


@topics.command("pause")
@click.argument("topic")
@pass_ctx
def topics_pause(ctx: Context, topic: str) -> None:
    """Stop consumers from taking TOPIC's jobs; delivery into its queue goes on, so nothing
    is lost or late."""
    _set_paused(ctx, topic, True)


@topics.command("resume")
@click.argument("topic")
@pass_ctx
def topics_resume(ctx: Context, topic: str) -> None:
    """Let consumers take TOPIC's jobs again."""
    _set_paused(ctx, topic, False)


# -- limits ---------------------------------------------------------------------------------


@cli.group("limits", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, hidden=True)  # `limits --json`, from before
@click.pass_context
def limits(click_ctx: click.Context, as_json: bool) -> None:
    """Topic limits across every consumer: jobs running at once, starts per second."""
    if click_ctx.invoked_subcommand is None:
        click_ctx.invoke(limits_list, as_json=as_json)


@limits.command("list")
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
    if not found:  # said on stderr: the list itself stays empty for scripts
        click.echo("no topic has limits", err=True)
    for item in found:
        click.echo(f"{item.topic:<30} {_limits_text(item)}")


LIMIT_OPTIONS = (
    click.argument("topic"),
    click.option("--max-running", type=int, help="At most this many jobs of TOPIC run at once."),
    click.option("--rate", help="At most this many starts: '10/s', '600/m', '100/h'."),
)


def _with(options: tuple[Any, ...]) -> Any:
    def apply(func: Any) -> Any:
        for option in reversed(options):
            func = option(func)
        return func

    return apply


@limits.command("set")
@_with(LIMIT_OPTIONS)
@pass_ctx
def limits_set(ctx: Context, topic: str, max_running: int | None, rate: str | None) -> None:
    """Limit TOPIC across every consumer; an option left out lifts that limit."""
    from delaysvc.worker.limits import set_limits

    found = set_limits(ctx.engine, topic, max_running=max_running, rate=rate)
    click.echo(f"{found.topic}: {_limits_text(found)}")


def _limits_text(item: Any) -> str:
    running = f"at most {item.max_running} running" if item.max_running else "any number running"
    rate = f"at most {item.rate_per_s:g} starts/s" if item.rate_per_s else "no rate limit"
    return f"{running}, {rate}"


# -- caps -----------------------------------------------------------------------------------


@cli.group("caps", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, hidden=True)  # `caps --json`, from before
@click.pass_context
def caps(click_ctx: click.Context, as_json: bool) -> None:
    """Backlog caps of levels and topics: at most so many messages waiting."""
    if click_ctx.invoked_subcommand is None:
        click_ctx.invoke(caps_list, as_json=as_json)


@caps.command("list")
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
    if not found:  # said on stderr: the list itself stays empty for scripts
        click.echo("no level or topic has a backlog cap", err=True)
    for item in found:
        click.echo(f"{item.scope + ':' + item.target:<30} {_cap_text(item)}")


CAP_OPTIONS = (
    click.argument("target"),
    click.option("--max-waiting", type=int, help="At most this many messages wait in TARGET."),
    click.option(
        "--policy",
        type=click.Choice(["reject", "deliver-early"]),
        help="When full: refuse the send (reject, the default) or deliver the oldest now.",
    ),
)


@caps.command("set")
@_with(CAP_OPTIONS)
@pass_ctx
def caps_set(ctx: Context, target: str, max_waiting: int | None, policy: str | None) -> None:
    """Cap the waiting messages of a level (level:16) or a topic (topic:sms.send) for every
    producer; without --max-waiting, lift it."""
    from delaysvc.producer import caps as producer_caps

    scope, name = producer_caps.parse_target(target)
    found = producer_caps.set_cap(ctx.engine, scope, name, max_waiting, policy)
    click.echo(f"{scope}:{found.target if found else name}: {_cap_text(found)}")
    if scope == "topic":  # the index its counts read, made now rather than by a worker's round
        from delaysvc.maintenance import caps_index

        caps_index.run_once(ctx.engine)


def _cap_text(item: Any) -> str:
    return f"at most {item.limit} waiting, {item.policy}" if item else "no cap"


# -- the spellings from before the groups, hidden ---------------------------------------------


@cli.command("limit", hidden=True)
@_with(LIMIT_OPTIONS)
@click.pass_context
def limit_before(click_ctx: click.Context, **options: Any) -> None:
    """`limits set`, as it was spelled before."""
    click_ctx.invoke(limits_set, **options)


@cli.command("cap", hidden=True)
@_with(CAP_OPTIONS)
@click.pass_context
def cap_before(click_ctx: click.Context, **options: Any) -> None:
    """`caps set`, as it was spelled before."""
    click_ctx.invoke(caps_set, **options)


@cli.command("pause", hidden=True)
@click.argument("topic")
@click.option("--resume", is_flag=True, help="`topics resume` instead.")
@pass_ctx
def pause_before(ctx: Context, topic: str, resume: bool) -> None:
    """`topics pause` (`topics resume` with --resume), as it was spelled before."""
    _set_paused(ctx, topic, not resume)
