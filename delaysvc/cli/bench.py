"""Commands that measure: bench, load."""

from __future__ import annotations

import itertools
import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from delaysvc.cli.app import Context, cli, pass_ctx
from delaysvc.errors import ValidationError


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
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Folder for results.json/.md/png [default: var/bench/DATE-SUITES].",
)
@click.option("--quick", is_flag=True, help="Small sizes: every suite in minutes.")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="With `compare`: runs of each side.",
)
@_bench_options
@pass_ctx
def bench(
    ctx: Context,
    suites: tuple[str, ...],
    out: Path | None,
    quick: bool,
    rounds: int,
    **sizes: float | None,
) -> None:
    """Measure the service against this machine's raw PostgreSQL limits and its peers, in
    databases of its own; write results.json, results.md and plots. SUITES: any of the
    registered suites (send, delivery, consume, peers, pipeline, ...) or `all` (the default).
    `delaysvc bench compare REF [SUITES]`: the working tree against commit REF, alternately
    (send, delivery and consume by default; each figure's ratio, tree over REF)."""
    from delaysvc.bench import SUITES, chosen_suites, failed_suites, require_parts, run
    from delaysvc.config import extras

    if suites[:1] == ("compare",):
        _compare(ctx, suites[1:], out, quick, rounds, sizes)
        return

    try:
        chosen = chosen_suites(list(suites))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="SUITES") from None
    if suites and "all" not in suites:  # asked for by name: `all` reports them as not run
        extras.require("delaysvc bench", "bench")
        require_parts(chosen)
    label = "all" if len(chosen) == len(SUITES) else "-".join(chosen)
    # delaysvc's own folder (DELAYSVC_VAR_DIR), never a docs/ of whatever project runs it
    folder = out or ctx.settings.var_dir / "bench" / (
        datetime.now().strftime("%Y-%m-%d-") + label + ("-quick" if quick else "")
    )
    written = run(ctx.settings, chosen, folder, quick=quick, **sizes)
    click.echo((written / "results.md").read_text())
    click.echo(f"written to {written}/")
    failed = failed_suites(written)
    if failed:
        click.echo(f"error: suite(s) failed: {', '.join(failed)} (see the report)", err=True)
        sys.exit(1)


def _compare(
    ctx: Context,
    args: tuple[str, ...],
    out: Path | None,
    quick: bool,
    rounds: int,
    sizes: dict[str, float | None],
) -> None:
    from delaysvc.bench import chosen_suites
    from delaysvc.bench.compare import DEFAULT_SUITES, compare

    if not args:
        raise click.UsageError("bench compare needs REF: a commit, branch or tag to compare with")
    ref, suites = args[0], list(args[1:]) or list(DEFAULT_SUITES)
    try:
        chosen_suites(suites)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="SUITES") from None
    flags = ["--quick"] if quick else []
    for name, value in sizes.items():
        if value is not None:
            flags += ["--" + name.replace("_", "-"), f"{value:g}"]
    folder = out or ctx.settings.var_dir / "bench" / (
        datetime.now().strftime("%Y-%m-%d-") + f"compare-{ref}"
    )
    command = shlex.join(["delaysvc", "bench", "compare", ref, *suites, *flags])
    click.echo(compare(ref, suites, rounds, folder, flags, f"{command} --rounds {rounds}"))
    click.echo(f"written to {folder}/")


@cli.command()
@click.option("--rate", default=200, show_default=True, help="Messages per second.")
@click.option("--seconds", default=60.0, show_default=True, help="How long to send.")
@click.option("--topic", default="load.demo", show_default=True, help="The topic sent to.")
@click.option("--levels", default="1,2,3", show_default=True, help="Delay levels to spread over.")
@pass_ctx
def load(ctx: Context, rate: int, seconds: float, topic: str, levels: str) -> None:
    """Send a steady stream into the service's own database (watch the dashboard meanwhile).
    Messages for TOPIC need a handler, or they wait in its queue: `delaysvc up` with no
    DELAYSVC_HANDLERS runs a demo handler for load.demo."""
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
