"""`delaysvc pipeline archive | report | bulk-schedule | bench`: each ends with one summary
line (rows read, written, rejected, seconds). Also runs as a script under spark-submit:
`spark-submit --master local[2] --jars /usr/share/java/postgresql.jar
delaysvc/pipeline/cli.py archive --older-than 30d`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from delaysvc.config.settings import Settings
from delaysvc.errors import DelaysvcError, ValidationError

log = logging.getLogger(__name__)


class Group(click.Group):
    """Errors a user can cause end the command with one line, as in `delaysvc`'s group (this
    one also runs on its own under spark-submit)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DelaysvcError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2 if exc.code in ("config_error", "invalid", "too_large") else 1)


class Services:
    """Settings and engine, read at the edge; built on first use."""

    def __init__(self, master: str | None, jars: str | None):
        self.master, self.jars = master, jars
        self._configured: Settings | None = None
        self._settings: Settings | None = None
        self._engine: Any = None

    @property
    def configured(self) -> Settings:
        """The settings as configured (no database started yet)."""
        if self._configured is None:
            self._configured = Settings.from_env()
            if not logging.getLogger().handlers:  # on its own, under spark-submit
                from delaysvc.config import logs

                logs.configure(self._configured)
        return self._configured

    def require(self, jdbc: bool) -> None:
        """Before any work: what the job needs is installed (else one line naming it)."""
        from delaysvc.pipeline.requirements import require

        jdbc_jar = self.configured.jdbc_jar if jdbc else None
        require(jdbc_jar=jdbc_jar, more_jars=(self.jars or "").split(","))

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            from delaysvc.db.engines import database_url

            settings = self.configured
            # the embedded server is started here, once: Spark's tasks get its URL and
            # connect to it, instead of each attaching to the server as a process of its own
            self._settings = settings.model_copy(update={"database_url": database_url(settings)})
        return self._settings

    @property
    def engine(self) -> Any:
        if self._engine is None:
            from delaysvc.db.engines import make_engine

            self._engine = make_engine(self.settings)
        return self._engine

    def spark(self) -> Any:
        from delaysvc.pipeline.spark import session

        spark = session(self.master, self.jars, self.configured.jdbc_jar)
        # on stderr, where Spark's progress goes: which master ran the job (spark-submit's?)
        click.echo(f"spark: master {spark.sparkContext.master}", err=True)
        return spark


@click.group(cls=Group)
@click.option("--master", help="Spark master URL (default local[*], or spark-submit's).")
@click.option("--jars", help="More jars for Spark, comma-separated (the JDBC driver elsewhere).")
@click.pass_context
def pipeline(ctx: click.Context, master: str | None, jars: str | None) -> None:
    """Data pipeline jobs on Spark (PySpark)."""
    logging.getLogger("delaysvc.pipeline").setLevel(logging.INFO)  # progress lines
    ctx.obj = Services(master, jars)  # settings and logging when a job first needs them


def _summary(job: str, read: int, written: int, rejected: int, seconds: float, more: str) -> None:
    click.echo(f"{job}: read {read}, written {written}, rejected {rejected}, {seconds:.1f}s{more}")


@pipeline.command()
@click.option("--older-than", default="30d", show_default=True, help="Retention, e.g. 30d.")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("var/archive"),
    show_default=True,
    help="Folder of the Parquet archive.",
)
@click.pass_obj
def archive(services: Services, older_than: str, out: Path) -> None:
    """Finished messages older than --older-than -> Parquet, verified, then dropped (whole
    days of history) or deleted (the part of the day the cutoff falls in)."""
    from delaysvc.pipeline import archive as job

    retention_ms = job.older_than_ms(older_than)
    out = job.check_out(out)  # before Spark starts: its errors are pages of Java
    services.require(jdbc=True)
    from delaysvc.db.engines import require_session

    require_session(services.configured, job.ARCHIVE)  # before Spark starts: it has a session

    result = job.run(services.spark(), services.settings, services.engine, retention_ms, out)
    runs = ", ".join(result.folders) or "nothing to archive"
    _summary(
        "archive",
        result.written,
        result.written,
        0,
        result.seconds,
        f"; deleted {result.deleted} -> {runs}",
    )


@pipeline.command()
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("var/report"),
    show_default=True,
    help="Folder of the report's Parquet.",
)
@click.pass_obj
def report(services: Services, out: Path) -> None:
    """Per topic, level and hour from the archive and the live tables -> Parquet and the
    report_hourly table."""
    services.require(jdbc=True)
    from delaysvc.pipeline import report as job

    result = job.run(services.spark(), services.settings, services.engine, out)
    _summary("report", result.read, result.written, 0, result.seconds, f" -> {out}")


@pipeline.command("bulk-schedule")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", help="csv, jsonl or parquet (default: from the name).")
@click.option("--rejects", type=click.Path(path_type=Path), help="Default: NAME.rejects.EXT")
@click.option("--key-from-row", is_flag=True, help="Keyless rows get a key from their content.")
@click.option("--partitions", type=click.IntRange(min=1), help="Spark partitions to write with.")
@click.pass_obj
def bulk_schedule(
    services: Services,
    path: Path,
    fmt: str | None,
    rejects: Path | None,
    key_from_row: bool,
    partitions: int | None,
) -> None:
    """Schedule every valid row of a CSV, JSON Lines or Parquet file."""
    from delaysvc.pipeline import bulk
    from delaysvc.pipeline.extract import check_parquet
    from delaysvc.pipeline.rejects import check_rejects

    if not path.exists():
        raise ValidationError("path", f"{path} does not exist")
    fmt = bulk.detect_format(path, fmt)
    if fmt == "parquet":
        check_parquet(path)
    check_rejects(rejects or bulk.default_rejects(path, fmt), path, fmt)
    services.require(jdbc=False)
    bulk.check_database(services.settings)  # before Spark starts: one line, not its noise
    result = bulk.run(
        services.spark(), services.settings, path, fmt, rejects, key_from_row, partitions
    )
    more = f"; duplicates {result.duplicates}; rejects -> {result.rejects}"
    _summary("bulk-schedule", result.read, result.written, result.rejected, result.seconds, more)


@pipeline.command()
@click.option(
    "--rows",
    type=click.IntRange(min=1),
    default=200_000,
    show_default=True,
    help="Rows generated.",
)
@click.option("--partitions", type=click.IntRange(min=1), help="Default: Spark's parallelism.")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=Path("var/bench-pipeline"),
    show_default=True,
    help="Folder for the generated input.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["csv", "parquet"]),
    default="csv",
    show_default=True,
    help="The generated input's format.",
)
@click.pass_obj
def bench(services: Services, rows: int, partitions: int | None, workdir: Path, fmt: str) -> None:
    """Measure the database's own rate for N generated keyed rows, schedule them, then the
    same file again; writes bench-bulk.json. Use a scratch database."""
    services.require(jdbc=False)
    from delaysvc.pipeline.bulk_bench import bench_bulk

    result = bench_bulk(services.spark(), services.settings, rows, workdir, partitions, fmt=fmt)
    click.echo(
        f"bench: {rows} {fmt} rows, database ceiling {result['ceiling_rows_per_s']} rows/s, "
        f"first run {result['first_rows_per_s']} rows/s ({result['first_of_ceiling']:.0%}), "
        f"re-run (all duplicates) {result['rerun_rows_per_s']} rows/s "
        f"-> {workdir / 'bench-bulk.json'}"
    )


if __name__ == "__main__":  # spark-submit delaysvc/pipeline/cli.py ...
    pipeline()
