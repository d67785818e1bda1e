"""`delaysvc bench`: the service measured against the raw PostgreSQL limits of the same
machine in the same run, and against its peers. It works in a database of its own
(`delaysvc_bench`, dropped and created on the configured server, or on the embedded one),
never in the service's data.

Suites live in one registry, `SUITES`: a name -> `Suite` (the function, taking one
`BenchContext` and returning `suites.Figures`, plus the sizes it reads, each a CLI flag with a
full default and a `--quick` one, and what it needs installed). Adding a suite is adding one
entry; `delaysvc bench` builds its flags from the registry. A suite asked for by name whose
needs are missing stops the run before it starts, with one line naming what to install; in
`all`, such a suite is reported as not run.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url

from delaysvc.bench import report, suites
from delaysvc.bench.progress import step
from delaysvc.config.settings import Settings
from delaysvc.db.engines import database_url, make_engine, sqlalchemy_url
from delaysvc.db.names import sql
from delaysvc.errors import MissingPart
from delaysvc.runtime.commands import WEB_THREADS

BENCH_DATABASE = "delaysvc_bench"


@dataclass(frozen=True)
class Size:
    """One size a suite reads: the CLI flag `--<name with dashes>`, its full default and the
    smaller one `--quick` uses."""

    name: str
    default: int | float
    quick: int | float
    help: str


@dataclass(frozen=True)
class BenchContext:
    """What every suite gets: the settings pointing at the bench database, an engine on it,
    its URL, and the sizes (every registered size, from the flags or the defaults)."""

    settings: Settings
    engine: Engine
    url: str
    sizes: Mapping[str, int | float]
    out: Path | None = None
    """The run's output folder, for what a suite keeps beside the report (worker logs)."""

    def size(self, name: str) -> int:
        return int(self.sizes[name])

    def seconds(self, name: str) -> float:
        return float(self.sizes[name])


def _nothing_missing() -> str | None:
    return None


@dataclass(frozen=True)
class Suite:
    run: Callable[[BenchContext], suites.Figures]
    sizes: tuple[Size, ...] = field(default=())
    summary: str = ""
    missing: Callable[[], str | None] = _nothing_missing
    """Why the suite cannot run here (what to install and how), or None."""


# Sizes shared by several suites are one object, so they are one flag.
SECONDS = Size("seconds", 5.0, 1.0, "Per send measurement, seconds.")
BATCH_ROWS = Size("batch_rows", 200_000, 20_000, "send_batch vs COPY, messages.")
BACKLOG = Size("backlog", 200_000, 20_000, "Due backlog to drain, messages.")
RATE = Size("rate", 5_000, 5_000, "Steady flow, msg/s.")
FLOW_SECONDS = Size("flow_seconds", 30.0, 5.0, "Steady flow duration, seconds.")
JOBS = Size("jobs", 100_000, 10_000, "Ready jobs to consume.")
PROCESSES = Size("processes", 2, 2, "Consumer processes.")


def _send(ctx: BenchContext) -> suites.Figures:
    return suites.send_suite(
        ctx.settings, ctx.engine, ctx.url, ctx.seconds("seconds"), [1, 4], ctx.size("batch_rows")
    )


def _delivery(ctx: BenchContext) -> suites.Figures:
    return suites.delivery_suite(
        ctx.settings,
        ctx.engine,
        ctx.url,
        ctx.size("backlog"),
        ctx.size("rate"),
        ctx.seconds("flow_seconds"),
    )


def _consume(ctx: BenchContext) -> suites.Figures:
    return suites.consume_suite(
        ctx.settings,
        ctx.engine,
        ctx.size("jobs"),
        ctx.size("processes"),
        ctx.size("rate"),
        ctx.seconds("flow_seconds"),
    )


def _suite_in(module: str) -> Callable[[BenchContext], suites.Figures]:
    """`delaysvc.bench.<module>.<module>_suite`, imported when the suite runs (the peers need
    their clients, the pipeline needs pyspark)."""

    def run(ctx: BenchContext) -> suites.Figures:
        found: Callable[[BenchContext], suites.Figures] = getattr(
            importlib.import_module(f"delaysvc.bench.{module}"), f"{module}_suite"
        )
        return found(ctx)

    return run


def _missing_in(module: str) -> Callable[[], str | None]:
    """`delaysvc.bench.<module>.missing`, imported when asked."""

    def missing() -> str | None:
        found: Callable[[], str | None] = importlib.import_module(
            f"delaysvc.bench.{module}"
        ).missing
        return found()

    return missing


SUITES: dict[str, Suite] = {
    "send": Suite(_send, (SECONDS, BATCH_ROWS), "send single and batch vs raw INSERT and COPY"),
    "delivery": Suite(
        _delivery, (BACKLOG, RATE, FLOW_SECONDS), "drain vs raw move; lateness of a steady flow"
    ),
    "consume": Suite(
        _consume, (JOBS, PROCESSES, RATE, FLOW_SECONDS), "no-op jobs/s; deliver -> start"
    ),
    "peers": Suite(
        _suite_in("peers"),
        (
            Size("peer_jobs", 20_000, 2_000, "Jobs per peer in the lateness workload."),
            Size("peer_delay", 5.0, 2.0, "Their fixed delay, seconds."),
            Size("peer_pending", 20_000, 5_000, "Pending jobs for the memory measurement."),
            Size("peer_workers", 2, 2, "Worker processes (or concurrency) per peer."),
        ),
        "Celery countdown, Procrastinate, RabbitMQ TTL+DLX and delaysvc on one workload",
    ),
    "pgbouncer": Suite(
        _suite_in("pgbouncer"),
        (SECONDS,),
        "single send and batch straight to PostgreSQL vs through PgBouncer (transaction mode)",
        _missing_in("pgbouncer"),
    ),
    "scale": Suite(
        _suite_in("scale"),
        (
            Size("pending", 2_000_000, 200_000, "Pending messages for scale (full: 10M)."),
            Size("scale_seconds", 10.0, 3.0, "Send measurement per phase, seconds."),
            Size("scale_due", 50_000, 20_000, "Due rows moved per phase (timed moves)."),
        ),
        "send rate and tick cost with a big backlog vs empty; worker/beat RSS",
    ),
    "soak": Suite(
        _suite_in("soak"),
        (
            Size("soak_messages", 600_000, 30_000, "Messages through the whole path (full: 10M)."),
            Size("soak_rate", 3_000, 3_000, "Their steady send rate, msg/s."),
            PROCESSES,
        ),
        "throughput at the end vs the start; table sizes and dead tuples over time",
    ),
    "rolling": Suite(
        _suite_in("rolling"),
        (
            Size("rolling_rate", 1_000, 1_000, "Steady send rate through the restarts, msg/s."),
            Size("rolling_seconds", 90.0, 60.0, "Length of the flow, seconds."),
            PROCESSES,
        ),
        "rolling restart of the delivery, then the consumer worker under a steady flow: lost, "
        "re-runs, lateness",
    ),
    "chaos": Suite(
        _suite_in("chaos"),
        (
            Size("chaos_seconds", 1800.0, 90.0, "Length of the chaos run, seconds."),
            Size("chaos_clients", 4, 4, "Client processes sending, cancelling, redriving."),
            Size("chaos_rate", 30.0, 30.0, "Operations a second per client."),
            Size("chaos_faults", 120, 6, "Faults injected (each kind at least once)."),
            Size("chaos_seed", 1, 1, "Seed of the workload and the fault schedule."),
            Size("chaos_pg_restart", 1, 1, "1: PostgreSQL restarts are among the faults."),
            Size("chaos_drain", 1800.0, 300.0, "At most this long to finish every message, s."),
            Size("chaos_concurrency", 4, 4, "Each of the two consumer workers' processes."),
        ),
        "history-checked run: clients and seeded faults (kill -9, PostgreSQL restart, deploy, "
        "level change), every property checked from the history",
    ),
    "hosts": Suite(
        _suite_in("hosts"),
        (Size("hosts_jobs", 100_000, 20_000, "Ready no-op jobs per host count."), PROCESSES),
        "jobs/s and jobs per database CPU second with 1, 2 and 3 worker hosts on one database",
    ),
    "history": Suite(
        _suite_in("history"),
        (
            Size("history_finished", 10_000_000, 300_000, "Finished messages in the history."),
            Size("history_days", 10, 3, "Days (partitions) they are spread over."),
            Size("history_seconds", 10.0, 3.0, "Send measurement per phase, seconds."),
            Size("history_due", 50_000, 10_000, "Due jobs moved and run per phase."),
            Size("history_sweep", 1_000_000, 100_000, "Finished rows swept out of commit_log."),
        ),
        "send, move and claim with a big finished history vs none; sweep rate; retention time",
    ),
    "http": Suite(
        _suite_in("http"),
        (
            Size("http_clients", 50, 10, "Concurrent HTTP connections (wrk)."),
            Size("http_seconds", 300.0, 10.0, "Load duration, seconds."),
            Size("http_workers", 4, 4, "Sync gunicorn worker processes (--server sync)."),
            Size("http_threads", WEB_THREADS, WEB_THREADS, "Threads of each sync gunicorn worker."),
        ),
        "POST /api/v1/messages under wrk: requests/s, latency percentiles, errors",
        _missing_in("http"),
    ),
    "dashboard": Suite(
        _suite_in("dashboard"),
        (Size("dashboard_rows", 10_000_000, 200_000, "Messages in the tables (half pending)."),),
        "every dashboard page and JSON endpoint timed with many rows in the tables",
    ),
    "pipeline": Suite(
        _suite_in("pipeline"),
        (
            Size(
                "pipeline_rows",
                5_000_000,
                20_000,
                "Rows for the Spark bulk-schedule bench: a bulk load of millions, where the "
                "JVM's ~5 s start is amortized (docs/pipeline.md plots the rate by size).",
            ),
            Size("pipeline_partitions", 2, 2, "Spark partitions."),
        ),
        "Spark bulk-schedule rows/s (needs pyspark and Java)",
        _missing_in("pipeline"),
    ),
}


def all_sizes() -> dict[str, Size]:
    """Every registered size once, in registry order."""
    found: dict[str, Size] = {}
    for suite in SUITES.values():
        for size in suite.sizes:
            found.setdefault(size.name, size)
    return found


def resolve_sizes(given: Mapping[str, int | float | None], quick: bool) -> dict[str, int | float]:
    """The given sizes, the others from the defaults (`quick` ones with `--quick`)."""
    resolved: dict[str, int | float] = {}
    for name, size in all_sizes().items():
        value = given.get(name)
        resolved[name] = value if value is not None else (size.quick if quick else size.default)
    unknown = set(given) - set(resolved)
    if unknown:
        raise ValueError(f"unknown bench sizes: {', '.join(sorted(unknown))}")
    return resolved


def chosen_suites(names: list[str]) -> list[str]:
    """`all` (or nothing) is every registered suite; otherwise the names, checked."""
    if not names or "all" in names:
        return list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)} or all")
    return names


def require_parts(names: list[str]) -> None:
    """Raise MissingPart naming the first of the suites `names` that cannot run here."""
    for name in names:
        reason = SUITES[name].missing()
        if reason:
            raise MissingPart(f"bench {name}: {reason}")


def bench_database(settings: Settings, name: str = BENCH_DATABASE, migrate: bool = True) -> str:
    """A fresh database `name` on the configured server (migrated for delaysvc unless told
    otherwise); -> its URL."""
    server = make_url(sqlalchemy_url(database_url(settings, embedded=True)))
    admin = create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        conn.execute(sql(f"CREATE DATABASE {name}"))
    admin.dispose()
    url = server.set(database=name).render_as_string(hide_password=False)
    if migrate:
        from delaysvc.schema.migrate import upgrade  # Alembic: only when a database is made

        engine = make_engine(settings, url)
        upgrade(engine, settings.levels)
        engine.dispose()
    return url


def drop_database(settings: Settings, name: str) -> None:
    server = make_url(sqlalchemy_url(database_url(settings, embedded=True)))
    admin = create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    admin.dispose()


def failed_suites(out: Path) -> dict[str, str]:
    """Suites of the run in `out` that raised instead of measuring: name -> error."""
    import json

    results = json.loads((out / "results.json").read_text())["results"]
    return {name: r["failed"] for name, r in results.items() if "failed" in r}


def run(
    settings: Settings,
    chosen: list[str],
    out: Path,
    quick: bool = False,
    **sizes: Any,
) -> Path:
    """Run the chosen suites (registry names, or `all`) into `out`: results.json, results.md
    and plots. Sizes not given take their defaults (the quick ones with `quick`)."""
    names = chosen_suites(chosen)
    resolved = resolve_sizes(sizes, quick)
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    step(f"preparing database {BENCH_DATABASE}")
    url = bench_database(settings)
    settings = settings.model_copy(update={"database_url": url})
    engine = make_engine(settings, pool_size=8)
    figures = suites.Figures()
    timings: dict[str, float] = {}
    try:
        for name in names:
            step(f"suite {name}")
            began = datetime.now(UTC)
            try:
                got = SUITES[name].run(BenchContext(settings, engine, url, resolved, out))
            except Exception as exc:
                # the other suites' figures still count; this one says why it has none
                traceback.print_exc()
                step(f"suite {name} FAILED: {exc.__class__.__name__}: {exc}")
                got = suites.Figures(results={name: {"failed": f"{type(exc).__name__}: {exc}"}})
            timings[name] = round((datetime.now(UTC) - began).total_seconds(), 1)
            figures.results.update(got.results)
            figures.series.update(got.series)
            figures.samples.update(got.samples)
            suites.reset_tables(engine)
        used = {size.name: resolved[size.name] for n in names for size in SUITES[n].sizes}
        report.write(
            out, figures, report.machine_facts(engine), started, used, timings, quick=quick
        )
    finally:
        engine.dispose()
    return out
