"""The `delaysvc` command. Settings are read here, once, from `DELAYSVC_*`; a user mistake
prints one line and exits non-zero, never a traceback."""

from __future__ import annotations

import itertools
import json
import logging
import sys
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import click
from sqlalchemy import Engine

from delaysvc import store
from delaysvc.errors import DelaysvcError, NotFound, ValidationError
from delaysvc.levels import format_ms
from delaysvc.periodic_schedules import Schedules
from delaysvc.producer import OnDuplicate
from delaysvc.settings import Settings


class Context:
    """Built lazily so `--help` and `levels` need no database."""

    @cached_property
    def settings(self) -> Settings:
        return Settings.from_env()

    @cached_property
    def engine(self) -> Engine:
        from delaysvc.db import make_engine

        return make_engine(self.settings)

    @cached_property
    def producer(self):
        from delaysvc.producer import Producer

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
            from sqlalchemy.exc import OperationalError

            if isinstance(exc, OperationalError):
                reason = " ".join(str(exc.orig).split())
                click.echo(f"error: database unreachable: {reason}", err=True)
                sys.exit(1)
            raise


@click.group(cls=Group)
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO.")
@click.version_option(package_name="delaysvc", prog_name="delaysvc")
def cli(verbose: bool) -> None:
    """delaysvc: durable delayed jobs on PostgreSQL."""
    from delaysvc import logs

    settings = click.get_current_context().ensure_object(Context).settings
    logs.configure(settings, logging.INFO if verbose else logging.WARNING)


def main() -> None:
    cli(prog_name="delaysvc")


# ---------------------------------------------------------------- schema and levels


@cli.command()
@pass_ctx
def migrate(ctx: Context) -> None:
    """Upgrade the schema and create one consume queue per configured level."""
    from delaysvc.db import make_engine
    from delaysvc.migrate import upgrade

    direct = ctx.settings.direct_database_url  # DDL not through a pooler, when there is one
    engine = make_engine(ctx.settings, direct) if direct else ctx.engine
    for change in upgrade(engine, ctx.settings.levels):
        click.echo(change.describe())
    if ctx.settings.caps:  # DELAYSVC_BACKLOG_CAPS, stored for every producer
        from delaysvc.caps import apply_configured

        apply_configured(engine, ctx.settings.caps)
    click.echo(f"migrated; {ctx.settings.levels.max_level} delay levels: {ctx.settings.levels}")


def require_levels(ctx: Context) -> None:
    """A process that delivers, consumes or serves runs only with the database's levels."""
    with ctx.engine.connect() as conn:
        store.check_levels(conn, ctx.settings.levels)


JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead.")


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


@cli.command()
@click.option("--no-db", is_flag=True, help="Only the configured levels, no pending counts.")
@JSON_OPTION
@pass_ctx
def levels(ctx: Context, no_db: bool, as_json: bool) -> None:
    """Table of delay levels: level, delay, pending."""
    configured = ctx.settings.levels
    pending: dict[int, int] = {}
    if not no_db:
        with ctx.engine.connect() as conn:
            pending = {row.lane: row.pending for row in store.lane_stats(conn)}
    if as_json:
        echo_json(
            {
                "levels": [
                    {
                        "level": level,
                        "delay": format_ms(configured.delay_ms(level)),
                        "delay_ms": configured.delay_ms(level),
                        "pending": pending.get(level),
                    }
                    for level in range(1, configured.max_level + 1)
                ],
                "timer_pending": None if no_db else pending.get(0, 0),
            }
        )
        return
    click.echo(f"{'level':>5}  {'delay':>6}  {'pending':>9}")
    for level in range(1, configured.max_level + 1):
        count = pending.get(level)
        shown = "-" if count is None else str(count)
        click.echo(f"{level:>5}  {format_ms(configured.delay_ms(level)):>6}  {shown:>9}")
    if not no_db:
        click.echo(f"{'timer':>5}  {'any':>6}  {pending.get(0, 0):>9}")


@cli.command()
@JSON_OPTION
@pass_ctx
def stats(ctx: Context, as_json: bool) -> None:
    """Per lane: pending, next due, lateness, offsets, stuck heads; per topic: ready, running,
    dead (`--json`: the shapes of GET /api/v1/levels and /api/v1/topics)."""
    with ctx.engine.connect() as conn:
        lanes = store.lane_stats(conn)
        topics = store.topic_stats(conn)
        durations = store.recent_durations(conn) if as_json else {}
    if as_json:
        from delaysvc.serialize import lane_json, topic_json

        echo_json(
            {
                "lanes": [lane_json(lane) for lane in lanes],
                "topics": [topic_json(topic, durations.get(topic.topic)) for topic in topics],
            }
        )
        return
    click.echo(
        f"{'lane':>5} {'delay':>6} {'pending':>9} {'offset':>9} {'max':>9} {'moved':>10} "
        f"{'moved/s':>9} {'next due in':>12}  state"
    )
    for lane in lanes:
        name = "timer" if lane.lane == 0 else str(lane.lane)
        due = "-"
        if lane.next_due is not None:
            due = f"{(lane.next_due - lane.now).total_seconds():.3f}s"
        state = f"STUCK at {lane.stuck_offset}: {lane.stuck_error}" if lane.stuck_error else "ok"
        rate = "-" if lane.moved_per_s is None else f"{lane.moved_per_s:,.1f}"
        click.echo(
            f"{name:>5} {format_ms(lane.delay_ms) if lane.lane else 'any':>6} {lane.pending:>9} "
            f"{lane.schedule_offset:>9} {lane.max_offset if lane.lane else '-':>9} "
            f"{lane.moved_total:>10} {rate:>9} {due:>12}  {state}"
        )
    click.echo("")
    click.echo(f"{'topic':<40} {'ready':>8} {'running':>8} {'dead':>8}  handler")
    from delaysvc.consumption import load_handler_modules, registered

    load_handler_modules(ctx.settings.handler_modules)
    for topic in topics:
        bound = (
            "yes"
            if registered(topic.topic)
            else f"task {ctx.settings.task_topics[topic.topic]}"
            if topic.topic in ctx.settings.task_topics
            else "NONE (waiting)"
        )
        paused = " (paused)" if topic.paused else ""
        click.echo(
            f"{topic.topic:<40} {topic.ready:>8} {topic.running:>8} {topic.dead:>8}  "
            f"{bound}{paused}"
        )


@cli.command()
@click.option(
    "--lease-tolerance",
    type=float,
    help="Seconds a running job's lease may have expired unrescued [default: 2 leases].",
)
@click.option(
    "--schedule-tolerance",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds a periodic schedule's next tick may be in the past.",
)
@click.option("--limit", default=100, show_default=True, help="Violations listed at most.")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds per statement.")
@pass_ctx
def check(
    ctx: Context,
    lease_tolerance: float | None,
    schedule_tolerance: float,
    limit: int,
    timeout: float,
) -> None:
    """Check the database's invariants, read only and safe under load: exit 0 with a summary
    line, or 1 with one line per violation (see README, "Checking a live database")."""
    from sqlalchemy.exc import DBAPIError

    from delaysvc.check import run_check

    try:
        result = run_check(
            ctx.engine,
            lease_tolerance_s=(
                2.0 * ctx.settings.lease_seconds if lease_tolerance is None else lease_tolerance
            ),
            schedule_tolerance_s=schedule_tolerance,
            limit=limit,
            timeout_s=timeout,
        )
    except DBAPIError as exc:
        reason = " ".join(str(exc.orig).split())
        click.echo(f"error: delaysvc check could not finish: {reason}", err=True)
        sys.exit(2)
    for line in result.lines():
        click.echo(line)
    sys.exit(result.exit_code)


# ---------------------------------------------------------------- producing


def _parse_body(text: str) -> Any:
    """BODY is JSON when it parses as JSON, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@cli.command()
@click.argument("topic")
@click.argument("body")
@click.option("--delay", help="Duration such as 30m, 1h30m, 250ms.")
@click.option("--level", "delay_level", type=int, help="Delay level (1..max; <=0 = now).")
@click.option("--at", "deliver_at", help="ISO 8601 time with a timezone.")
@click.option("--key", help="Unique among unfinished messages of the topic.")
@click.option("--tag", "tags", multiple=True, help="Repeatable.")
@click.option("--property", "properties", multiple=True, help="NAME=VALUE, repeatable.")
@click.option("--priority", type=int, default=0, show_default=True, help="Higher runs first.")
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
    at = None
    if deliver_at is not None:
        try:
            at = datetime.fromisoformat(deliver_at)
        except ValueError:
            raise ValidationError("--at", f"{deliver_at!r} is not an ISO 8601 time") from None
    props = {}
    for item in properties:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValidationError("--property", f"{item!r} is not NAME=VALUE")
        props[name] = value
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
    verb = "sent" if message.created else "exists (same topic and key)"
    if message.replaced_id is not None:
        verb = f"sent, replacing {message.replaced_id}"
    click.echo(
        f"{verb}: id={message.id} status={message.status} level={message.delay_level} "
        f"deliver_at={message.deliver_at.isoformat()}"
    )


@cli.command()
@click.argument("message_id", type=int, required=False)
@click.option("--topic")
@click.option("--key")
@pass_ctx
def cancel(ctx: Context, message_id: int | None, topic: str | None, key: str | None) -> None:
    """Cancel a message by ID, or by --topic and --key, while it is not yet running."""
    message = ctx.producer.cancel(message_id, topic=topic, key=key)
    click.echo(f"cancelled: id={message.id}")


@cli.command()
@click.argument("message_id", type=int)
@pass_ctx
def show(ctx: Context, message_id: int) -> None:
    """Print a message as JSON."""
    from delaysvc.serialize import message_json

    click.echo(json.dumps(message_json(ctx.producer.get(message_id), body=True), indent=2))


# ---------------------------------------------------------------- dead letters


@cli.group()
def dead() -> None:
    """List, inspect, redrive and purge dead letters."""


@dead.command("list")
@click.option("--topic")
@click.option("--limit", default=50, show_default=True)
@JSON_OPTION
@pass_ctx
def dead_list(ctx: Context, topic: str | None, limit: int, as_json: bool) -> None:
    from delaysvc.dead_letters import DeadLetters

    rows = DeadLetters(ctx.engine).list(topic=topic, limit=limit)
    if as_json:
        from delaysvc.serialize import dead_letter_json

        echo_json({"dead": [dead_letter_json(row) for row in rows]})
        return
    for row in rows:
        click.echo(
            f"{row.message_id:>10} {row.topic:<30} {row.died_at:%Y-%m-%d %H:%M:%S} "
            f"attempts={row.attempts} {row.reason} | {row.last_error or ''}"
        )


@dead.command("redrive")
@click.argument("message_ids", type=int, nargs=-1)
@click.option("--topic", help="All dead letters of a topic ...")
@click.option("--error-contains", help="... whose error contains this text.")
@pass_ctx
def dead_redrive(
    ctx: Context, message_ids: tuple[int, ...], topic: str | None, error_contains: str | None
) -> None:
    """Run dead messages again now, by id or by filter."""
    from delaysvc.dead_letters import DeadLetters

    letters = DeadLetters(ctx.engine)
    if message_ids:
        count = len([letters.redrive(i) for i in message_ids])
    elif topic or error_contains:
        count = letters.redrive_matching(topic=topic, error_contains=error_contains)
    else:
        raise ValidationError("ids", "give message ids, --topic or --error-contains")
    click.echo(f"redriven: {count}")


@dead.command("purge")
@click.argument("message_ids", type=int, nargs=-1)
@click.option("--topic")
@click.option("--error-contains")
@click.option("--yes", is_flag=True, help="Do not ask first.")
@pass_ctx
def dead_purge(
    ctx: Context,
    message_ids: tuple[int, ...],
    topic: str | None,
    error_contains: str | None,
    yes: bool,
) -> None:
    """Forget dead letters, by id or by filter (the messages' history stays). Asks first,
    unless --yes; without a terminal to ask on, it needs --yes."""
    from delaysvc.dead_letters import DeadLetters

    letters = DeadLetters(ctx.engine)
    if not (message_ids or topic or error_contains):
        raise ValidationError("ids", "give message ids, --topic or --error-contains")
    if not yes:
        which = (
            f"dead letters {', '.join(map(str, message_ids))}"
            if message_ids
            else "the dead letters"
            + (f" of topic {topic}" if topic else "")
            + (f" whose error contains {error_contains!r}" if error_contains else "")
        )
        if not sys.stdin.isatty():
            raise ValidationError("yes", f"purging {which} needs --yes off a terminal")
        click.confirm(f"forget {which}?", abort=True)
    if message_ids:
        count = letters.purge(list(message_ids))
    elif topic or error_contains:
        count = letters.purge_matching(topic=topic, error_contains=error_contains)
    click.echo(f"purged: {count}")


# ---------------------------------------------------------------- topic limits


@cli.command("limit")
@click.argument("topic")
@click.option("--max-running", type=int, help="At most this many jobs of TOPIC run at once.")
@click.option("--rate", help="At most this many starts: '10/s', '600/m', '100/h'.")
@pass_ctx
def limit(ctx: Context, topic: str, max_running: int | None, rate: str | None) -> None:
    """Limit TOPIC across every consumer; an option left out lifts that limit."""
    from delaysvc.limits import set_limits

    found = set_limits(ctx.engine, topic, max_running=max_running, rate=rate)
    click.echo(f"{found.topic}: {_limits_text(found)}")


@cli.command("limits")
@JSON_OPTION
@pass_ctx
def limits_list(ctx: Context, as_json: bool) -> None:
    """The topics with limits."""
    from delaysvc.limits import all_limits

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
    from delaysvc import caps

    scope, name = caps.parse_target(target)
    found = caps.set_cap(ctx.engine, scope, name, max_waiting, policy)
    click.echo(f"{scope}:{found.target if found else name}: {_cap_text(found)}")


@cli.command("caps")
@JSON_OPTION
@pass_ctx
def caps_list(ctx: Context, as_json: bool) -> None:
    """The levels and topics with backlog caps."""
    from delaysvc.caps import all_caps

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


# ---------------------------------------------------------------- periodic schedules


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
    rows = _schedules(ctx).list()
    if as_json:
        from delaysvc.serialize import schedule_json

        echo_json({"schedules": [schedule_json(row) for row in rows]})
        return
    for row in rows:
        click.echo(_schedule_line(row))


@schedules.command("add")
@click.argument("name")
@click.argument("when")
@click.option("--topic", required=True)
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
    from delaysvc.periodic_schedules import schedule

    item = schedule(
        name, when, topic=topic, body=_parse_body(body), timezone=timezone, on_missed=on_missed
    )
    row, created = _schedules(ctx).put(item)
    click.echo(("added: " if created else "replaced: ") + _schedule_line(row))


@schedules.command("pause")
@click.argument("name")
@pass_ctx
def schedules_pause(ctx: Context, name: str) -> None:
    click.echo("paused: " + _schedule_line(_schedules(ctx).pause(name)))


@schedules.command("resume")
@click.argument("name")
@pass_ctx
def schedules_resume(ctx: Context, name: str) -> None:
    click.echo("resumed: " + _schedule_line(_schedules(ctx).resume(name)))


@schedules.command("delete")
@click.argument("name")
@pass_ctx
def schedules_delete(ctx: Context, name: str) -> None:
    """Delete schedule NAME now. One declared in code only once no running worker declares it
    (none has for 2 minutes); left alone, it goes 10 minutes after the last one did."""
    _schedules(ctx).delete(name)
    click.echo(f"deleted: {name}")


@cli.command("skip-head")
@click.argument("lane", type=int)
@pass_ctx
def skip_head(ctx: Context, lane: int) -> None:
    """Move the head of a stuck LANE to the dead letters so the lane moves on."""
    with ctx.engine.begin() as conn:
        skipped = store.skip_stuck_head(conn, lane)
    click.echo(f"skipped message {skipped}")


@cli.command()
@click.argument("topic")
@click.option("--resume", is_flag=True)
@pass_ctx
def pause(ctx: Context, topic: str, resume: bool) -> None:
    """Pause (or --resume) consumption of TOPIC; delivery into its queue goes on."""
    from delaysvc.validation import validate_topic

    with ctx.engine.begin() as conn:
        store.set_paused(conn, validate_topic(topic), not resume)
    click.echo(f"{topic}: {'resumed' if resume else 'paused'}")


# ---------------------------------------------------------------- access


@cli.command("create-token")
@click.argument("name")
@click.option("--scope", type=click.Choice(["send", "admin"]), default="send", show_default=True)
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
    from delaysvc.auth import revoke_token

    if not revoke_token(ctx.engine, name):
        raise NotFound(f"no live token named {name!r}")
    click.echo(f"revoked: {name}")


@cli.command("create-user")
@click.argument("name")
@click.option("--role", type=click.Choice(["admin", "viewer"]), default="admin", show_default=True)
@click.password_option(envvar="DELAYSVC_NEW_USER_PASSWORD")
@pass_ctx
def create_user(ctx: Context, name: str, role: str, password: str) -> None:
    """Create (or reset) a dashboard user."""
    from delaysvc.auth import create_user as make

    make(ctx.engine, name, password, role)
    click.echo(f"user {name!r} ready with role {role}")


# ---------------------------------------------------------------- running


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True)
@pass_ctx
def up(ctx: Context, host: str, port: int) -> None:
    """All in one: (embedded) PostgreSQL, migrations, web app, workers and beat."""
    from delaysvc import extras
    from delaysvc.up import run_all

    embedded = ("embedded",) if ctx.settings.embedded_database else ()
    extras.require("delaysvc up", "worker", "server", *embedded)

    sys.exit(run_all(ctx.settings, host, port))


@cli.command()
@click.option("--delivery/--no-delivery", default=True, help="Serve the delivery queue.")
@click.option("--consume/--no-consume", default=True, help="Serve the consume queue.")
@click.option("--concurrency", "-c", type=int, help="Consumer processes (default: cores).")
@pass_ctx
def worker(ctx: Context, delivery: bool, consume: bool, concurrency: int | None) -> None:
    """Run Celery workers (delivery: threads, one per lane; consume: processes); prints a
    line containing `ready` once its lanes and consumers run."""
    from delaysvc import extras
    from delaysvc.up import run_worker, worker_commands

    extras.require("delaysvc worker", "worker")
    if delivery:
        from delaysvc.db import require_session
        from delaysvc.tasks.app import DELIVERY_NEEDS

        require_session(ctx.settings, DELIVERY_NEEDS)
    require_levels(ctx)
    commands = worker_commands(ctx.settings, delivery, consume, concurrency)
    if not commands:
        raise click.UsageError("nothing to run: give --delivery, --consume or both")
    sys.exit(run_worker(ctx.settings, commands))


@cli.command()
@pass_ctx
def beat(ctx: Context) -> None:
    """Run Celery beat (fires every lane's delivery task, the consume sweep, lease rescue)."""
    from delaysvc import extras
    from delaysvc.up import beat_command, run_processes

    extras.require("delaysvc beat", "worker")
    require_levels(ctx)
    sys.exit(run_processes([beat_command(ctx.settings)]))


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True)
@click.option("--workers", default=2, show_default=True)
@pass_ctx
def web(ctx: Context, host: str, port: int, workers: int) -> None:
    """Serve the HTTP API and dashboard with gunicorn."""
    from delaysvc import extras
    from delaysvc.up import run_processes, web_command

    extras.require("delaysvc web", "server")
    require_levels(ctx)
    sys.exit(run_processes([web_command(host, port, workers, log_format=ctx.settings.log_format)]))


# ---------------------------------------------------------------- benchmarks


def _bench_options(command: Any) -> Any:
    """One flag per size in the suite registry (`delaysvc.bench.SUITES`), so a new suite's
    sizes become flags by being registered."""
    from delaysvc.bench import all_sizes

    for size in reversed(all_sizes().values()):
        flag = "--" + size.name.replace("_", "-")
        kind = int if isinstance(size.default, int) else float
        command = click.option(
            flag,
            size.name,
            type=kind,
            default=None,
            help=f"{size.help} [default: {size.default:g}; --quick: {size.quick:g}]",
        )(command)
    return command


@cli.command()
@click.argument("suites", nargs=-1)
@click.option("--out", type=click.Path(path_type=Path), help="Folder for results.json/.md/png.")
@click.option("--quick", is_flag=True, help="Small sizes: every suite in minutes.")
@_bench_options
@pass_ctx
def bench(
    ctx: Context, suites: tuple[str, ...], out: Path | None, quick: bool, **sizes: float | None
) -> None:
    """Measure the service against this machine's raw PostgreSQL limits and its peers, in
    databases of its own; write results.json, results.md and plots. SUITES: any of the
    registered suites (send, delivery, consume, peers, pipeline, ...) or `all` (the default)."""
    from delaysvc import extras
    from delaysvc.bench import SUITES, chosen_suites, failed_suites, require_parts, run

    try:
        chosen = chosen_suites(list(suites))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="SUITES") from None
    if suites and "all" not in suites:  # asked for by name: `all` reports them as not run
        extras.require("delaysvc bench", "bench")
        require_parts(chosen)
    label = "all" if len(chosen) == len(SUITES) else "-".join(chosen)
    folder = out or Path("docs/benchmarks") / (
        datetime.now().strftime("%Y-%m-%d-") + label + ("-quick" if quick else "")
    )
    written = run(ctx.settings, chosen, folder, quick=quick, **sizes)
    click.echo((written / "results.md").read_text())
    click.echo(f"written to {written}/")
    failed = failed_suites(written)
    if failed:
        click.echo(f"error: suite(s) failed: {', '.join(failed)} (see the report)", err=True)
        sys.exit(1)


@cli.command()
@click.option("--rate", default=200, show_default=True, help="Messages per second.")
@click.option("--seconds", default=60.0, show_default=True)
@click.option("--topic", default="load.demo", show_default=True)
@click.option("--levels", default="1,2,3", show_default=True, help="Delay levels to spread over.")
@pass_ctx
def load(ctx: Context, rate: int, seconds: float, topic: str, levels: str) -> None:
    """Send a steady stream into the service's own database (watch the dashboard meanwhile).
    Messages for TOPIC need a handler, or they wait in its queue."""
    from delaysvc.bench.load import send_at_rate

    try:
        chosen = [int(level) for level in levels.split(",")]
    except ValueError:
        raise ValidationError("--levels", f"{levels!r} is not comma-separated numbers") from None
    producer = ctx.producer
    producer.prepare(topic, {})  # a bad topic fails here, before anything is sent

    numbers = itertools.count()

    def batch(n: int) -> list[dict[str, Any]]:
        return [
            {"topic": topic, "body": {"n": i}, "delay_level": chosen[i % len(chosen)]}
            for i in itertools.islice(numbers, n)
        ]

    sent = send_at_rate(producer, rate, seconds, batch)
    click.echo(f"sent {sent} messages to {topic} at {rate}/s over levels {chosen}")


def _add_pipeline() -> None:
    from delaysvc.pipeline.cli import pipeline

    cli.add_command(pipeline)


_add_pipeline()

if __name__ == "__main__":  # pragma: no cover
    main()
