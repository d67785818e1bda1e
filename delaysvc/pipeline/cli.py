"""`delaysvc pipeline archive | bulk-schedule`: each ends with one summary line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from delaysvc.levels import parse_duration_ms


@click.group()
@click.option("--master", default="local[*]", show_default=True, help="Spark master URL.")
@click.option("--jars", help="Extra jars for Spark (comma-separated).")
@click.pass_context
def pipeline(ctx: click.Context, master: str, jars: str | None) -> None:
    """Data pipeline jobs on Spark (PySpark)."""
    ctx.meta["spark_options"] = {"master": master, "jars": jars}


def _spark(ctx: click.Context) -> Any:
    from delaysvc.pipeline.spark import session

    return session(**ctx.meta["spark_options"])


@pipeline.command()
@click.option("--older-than", default="30d", show_default=True, help="Retention, e.g. 30d.")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("var/archive"), show_default=True
)
@click.pass_context
def archive(ctx: click.Context, older_than: str, out: Path) -> None:
    """Finished messages older than --older-than -> Parquet, verified, then deleted."""
    from delaysvc.cli import Context
    from delaysvc.pipeline import archive as job

    retention_ms = parse_duration_ms(older_than)
    service = ctx.find_object(Context) or Context()
    result = job.run(_spark(ctx), service.settings, service.engine, retention_ms, out)
    click.echo(
        f"archive: read {result.read}, written {result.written}, deleted {result.deleted}, "
        f"rejected 0, {result.seconds:.1f}s -> {result.folder or 'nothing to archive'}"
    )


@pipeline.command("bulk-schedule")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["csv", "jsonl", "parquet"]))
@click.option("--rejects", type=click.Path(path_type=Path), help="Default: PATH.rejects.jsonl")
@click.option("--key-from-row", is_flag=True, help="Keyless rows get a key from their content.")
@click.option("--partitions", type=int, help="Spark partitions to write with.")
@click.pass_context
def bulk_schedule(
    ctx: click.Context,
    path: Path,
    fmt: str | None,
    rejects: Path | None,
    key_from_row: bool,
    partitions: int | None,
) -> None:
    """Schedule every valid row of a CSV, JSON Lines or Parquet file."""
    from delaysvc.cli import Context
    from delaysvc.pipeline import bulk

    fmt = fmt or {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}.get(path.suffix, "parquet")
    rejects = rejects or path.with_name(path.name + ".rejects.jsonl")
    service = ctx.find_object(Context) or Context()
    result = bulk.run(_spark(ctx), service.settings, path, fmt, rejects, key_from_row, partitions)
    click.echo(
        f"bulk-schedule: read {result.read}, written {result.written}, "
        f"duplicates {result.duplicates}, rejected {result.rejected} (-> {rejects}), "
        f"{result.seconds:.1f}s"
    )


@pipeline.command()
@click.option(
    "--archive",
    "archive_dir",
    type=click.Path(path_type=Path),
    default=Path("var/archive"),
    show_default=True,
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("var/report"), show_default=True
)
@click.pass_context
def report(ctx: click.Context, archive_dir: Path, out: Path) -> None:
    """Per topic, level and hour: counts, lateness and handler-duration percentiles, retried
    and dead, from the archive and the live tables -> Parquet and report_hourly."""
    from delaysvc.cli import Context
    from delaysvc.pipeline import report as job

    service = ctx.find_object(Context) or Context()
    result = job.run(_spark(ctx), service.settings, service.engine, archive_dir, out)
    click.echo(
        f"report: read {result.read}, written {result.rows} rows (report_hourly, {out}), "
        f"rejected 0, {result.seconds:.1f}s"
    )
