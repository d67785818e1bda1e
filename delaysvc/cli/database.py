"""Commands on the database and its lanes: migrate, levels, stats, check, skip-head."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from delaysvc import store
from delaysvc.cli.app import JSON_OPTION, Context, Seconds, Whole, cli, echo_json, pass_ctx
from delaysvc.cli.topics import echo_topics
from delaysvc.config.levels import format_ms
from delaysvc.errors import ConfigError, one_line

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from delaysvc.config.settings import Settings

DAY_S = 86_400.0


@cli.command()
@click.option(
    "--dry-run",
    is_flag=True,
    help="Say what would change (each level's change), change nothing.",
)
@pass_ctx
def migrate(ctx: Context, dry_run: bool) -> None:
    """Upgrade the schema and create one consume queue per configured level
    (DELAYSVC_DELAY_LEVELS: a level changed or removed hands its waiting messages to the timer
    lane, due when they were due). With DELAYSVC_DELAY_LEVELS unset, refused where the
    database has levels other than the default ones."""
    from delaysvc.db.engines import make_engine, require_one_database
    from delaysvc.schema.migrate import upgrade

    require_one_database(ctx.settings)
    direct = ctx.settings.direct_database_url  # DDL not through a pooler, when there is one
    engine = make_engine(ctx.settings, direct) if direct else ctx.engine
    if not dry_run and "delay_levels" not in ctx.settings.model_fields_set:
        _refuse_default_levels_over_others(engine, ctx.settings)
    changes = upgrade(engine, ctx.settings.levels, dry_run=dry_run)
    for change in changes:
        click.echo(f"would change {change.describe()}" if dry_run else change.describe())
    if dry_run:
        click.echo(
            f"dry run: nothing changed; {len(changes)} level change(s) for "
            f"DELAYSVC_DELAY_LEVELS={ctx.settings.levels}"
        )
        return
    if ctx.settings.caps:  # DELAYSVC_BACKLOG_CAPS, stored for every producer
        from delaysvc.producer.caps import apply_configured

        apply_configured(engine, ctx.settings.caps)
    from delaysvc.maintenance import caps_index

    caps_index.run_once(engine)  # the index of the capped topics' waiting messages
    click.echo(f"migrated; {ctx.settings.levels.max_level} delay levels: {ctx.settings.levels}")


def _refuse_default_levels_over_others(engine: Engine, settings: Settings) -> None:
    """A migrate from a shell without the service's DELAYSVC_DELAY_LEVELS would apply the
    default levels over the database's own, unasked (and the service's workers would then
    refuse to start, their levels differing): ConfigError, unless the database has no levels
    yet or has these. The defaults are applied when asked for by name."""
    from sqlalchemy.exc import ProgrammingError

    try:
        with engine.connect() as conn:
            stored = store.stored_levels(conn)
    except ProgrammingError:  # not migrated yet: the defaults are its first levels
        return
    if not stored or store.levels_differ(stored, settings.levels) is None:
        return
    theirs = " ".join(format_ms(stored[level]) for level in sorted(stored))
    raise ConfigError(
        f"DELAYSVC_DELAY_LEVELS is not set, and the database's levels ({theirs}) are not the "
        f"default ones: migrating would change them to {settings.levels}. Set "
        f"DELAYSVC_DELAY_LEVELS to the service's levels (DELAYSVC_DELAY_LEVELS='{theirs}'), or "
        "to the default ones to change them (`delaysvc migrate --dry-run` says each change)"
    )


@cli.command()
@click.option("--no-db", is_flag=True, help="Only the configured levels, no pending counts.")
@JSON_OPTION
@pass_ctx
def levels(ctx: Context, no_db: bool, as_json: bool) -> None:
    """Table of delay levels: level, delay, pending. The database's levels (the one truth for
    a level's delay), with a note on stderr where DELAYSVC_DELAY_LEVELS differs from them;
    with --no-db the configured ones."""
    configured = ctx.settings.levels
    delays = {level: configured.delay_ms(level) for level in range(1, configured.max_level + 1)}
    pending: dict[int, int] = {}
    differs: str | None = None
    if not no_db:
        with ctx.engine.connect() as conn:
            pending = {row.lane: row.pending for row in store.lane_stats(conn)}
            delays = dict(sorted(store.stored_levels(conn).items()))
        differs = store.levels_differ(delays, configured)
    if as_json:
        echo_json(
            {
                "levels": [
                    {
                        "level": level,
                        "delay": format_ms(delay_ms),
                        "delay_ms": delay_ms,
                        "pending": pending.get(level),
                    }
                    for level, delay_ms in delays.items()
                ],
                "timer_pending": None if no_db else pending.get(0, 0),
                "differs": differs,
            }
        )
        return
    if differs:
        click.echo(f"note: {differs}", err=True)
    click.echo(f"{'level':>5}  {'delay':>6}  {'pending':>9}")
    for level, delay_ms in delays.items():
        count = pending.get(level)
        shown = "-" if count is None else str(count)
        click.echo(f"{level:>5}  {format_ms(delay_ms):>6}  {shown:>9}")
    if not no_db:
        click.echo(f"{'timer':>5}  {'any':>6}  {pending.get(0, 0):>9}")


@cli.command()
@JSON_OPTION
@pass_ctx
def stats(ctx: Context, as_json: bool) -> None:
    """Per lane: pending, next due, lateness, offsets, stuck heads; per topic: ready, running,
    dead (`--json`: `{"lanes": [...], "topics": [...]}`, each item as GET /api/v1/levels and
    /api/v1/topics give it)."""
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
        f"{'moved/s':>9} {'next due in':>12} {'late':>9}  state"
    )
    for lane in lanes:
        name = "timer" if lane.lane == 0 else str(lane.lane)
        due = late = "-"
        if lane.next_due is not None:
            if lane.next_due <= lane.now:  # the head is due and not moved yet: how long
                due, late = "now", f"{(lane.now - lane.next_due).total_seconds():.3f}s"
            else:
                due = f"{(lane.next_due - lane.now).total_seconds():.3f}s"
        state = f"STUCK at {lane.stuck_offset}: {lane.stuck_error}" if lane.stuck_error else "ok"
        rate = "-" if lane.moved_per_s is None else f"{lane.moved_per_s:,.1f}"
        click.echo(
            f"{name:>5} {format_ms(lane.delay_ms) if lane.lane else 'any':>6} {lane.pending:>9} "
            f"{lane.schedule_offset:>9} {lane.max_offset if lane.lane else '-':>9} "
            f"{lane.moved_total:>10} {rate:>9} {due:>12} {late:>9}  {state}"
        )
    click.echo("")
    echo_topics(topics)


@cli.command()
@click.option(
    "--lease-tolerance",
    type=Seconds(DAY_S),
    help="Seconds a running job's lease may have expired unrescued [default: 2 leases].",
)
@click.option(
    "--schedule-tolerance",
    type=Seconds(DAY_S),
    default=60.0,
    show_default=True,
    help="Seconds a periodic schedule's next tick may be in the past.",
)
@click.option(
    "--limit",
    type=Whole(1, 100_000),
    default=100,
    show_default=True,
    help="Violations listed at most.",
)
@click.option(
    "--timeout",
    type=Seconds(DAY_S),
    default=300.0,
    show_default=True,
    help="Seconds per statement.",
)
@pass_ctx
def check(
    ctx: Context,
    lease_tolerance: float | None,
    schedule_tolerance: float,
    limit: int,
    timeout: float,
) -> None:
    """Check the database's invariants, read only and safe under load: exit 0 with a summary
    line, or 1 with one line per violation (docs/how-to/monitoring.md, "Checking a live
    database")."""
    from sqlalchemy.exc import DBAPIError

    from delaysvc.maintenance.check import run_check

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
        reason = store.not_migrated(exc) or _why_unfinished(exc, timeout)
        click.echo(f"error: delaysvc check could not finish: {reason}", err=True)
        sys.exit(2)
    for line in result.lines():
        click.echo(line)
    sys.exit(result.exit_code)


def _why_unfinished(exc: Exception, timeout_s: float) -> str:
    """Why a check stopped, in our words for its two timeouts, else PostgreSQL's."""
    from delaysvc.maintenance.check import LOCK_TIMEOUT_S

    orig = getattr(exc, "orig", exc)
    code = getattr(orig, "sqlstate", None)
    if code == "55P03":  # lock_not_available: its lock timeout
        return (
            f"another transaction held a table it reads for more than {LOCK_TIMEOUT_S:g} s (a "
            "level change by delaysvc migrate, a history day dropped?); run it again once that "
            "is done"
        )
    if code == "57014" and "statement timeout" in str(orig):  # not a cancel by someone
        return f"a statement ran longer than --timeout ({timeout_s:g} s); give it more"
    return one_line(orig)


@cli.command("skip-head")
@click.argument("lane", type=Whole(0, 1000))
@pass_ctx
def skip_head(ctx: Context, lane: int) -> None:
    """Move the head of a stuck LANE to the dead letters so the lane moves on."""
    with ctx.engine.begin() as conn:
        skipped = store.skip_stuck_head(conn, lane)
    click.echo(f"skipped message {skipped}")
