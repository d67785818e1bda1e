"""`delaysvc bench`: the service measured against the raw PostgreSQL limits of the same
machine in the same run. It works in a database of its own (`delaysvc_bench`, dropped and
created on the configured server, or on the embedded one), never in the service's data."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from delaysvc.bench import report, suites
from delaysvc.bench.progress import step
from delaysvc.db import database_url, make_engine, sqlalchemy_url
from delaysvc.migrate import upgrade
from delaysvc.settings import Settings

BENCH_DATABASE = "delaysvc_bench"
SUITES = ("send", "delivery", "consume")


def bench_database(settings: Settings) -> str:
    """A fresh, migrated `delaysvc_bench` database on the configured server; -> its URL."""
    server = make_url(sqlalchemy_url(database_url(settings)))
    admin = create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {BENCH_DATABASE} WITH (FORCE)"))
        conn.execute(text(f"CREATE DATABASE {BENCH_DATABASE}"))
    admin.dispose()
    url = server.set(database=BENCH_DATABASE).render_as_string(hide_password=False)
    engine = make_engine(settings, url)
    upgrade(engine, settings.levels)
    engine.dispose()
    return url


def run(settings: Settings, chosen: list[str], out: Path, **sizes: int | float) -> Path:
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    step(f"preparing database {BENCH_DATABASE}")
    url = bench_database(settings)
    settings = settings.model_copy(update={"database_url": url})
    engine = make_engine(settings, pool_size=8)
    figures = suites.Figures()
    for name in chosen:
        if name == "send":
            got = suites.send_suite(
                settings, engine, url, float(sizes["seconds"]), [1, 4], int(sizes["batch_rows"])
            )
        elif name == "delivery":
            got = suites.delivery_suite(
                settings,
                engine,
                url,
                int(sizes["backlog"]),
                int(sizes["rate"]),
                float(sizes["flow_seconds"]),
            )
        else:
            got = suites.consume_suite(
                settings,
                engine,
                int(sizes["jobs"]),
                int(sizes["processes"]),
                int(sizes["rate"]),
                float(sizes["flow_seconds"]),
            )
        figures.results.update(got.results)
        figures.series.update(got.series)
        figures.samples.update(got.samples)
        suites.reset_tables(engine)
    report.write(out, figures, report.machine_facts(engine), started)
    engine.dispose()
    return out
