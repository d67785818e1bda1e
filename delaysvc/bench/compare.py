"""`delaysvc bench compare REF`: the regression guard. The same suites (send, delivery and
consume by default) on the working tree and on commit REF, alternately in one run on one
database server (tree, REF, tree, REF ...: this machine's disk flush time varies several-fold
from minute to minute, so runs far apart do not compare), then one table with each figure's
runs and its ratio, tree over REF.

REF is exported from git (`git archive`) and installed into a virtualenv of its own that sees
this environment's packages (`--system-site-packages`, `pip install --no-deps`): the two sides
differ in delaysvc's code alone. Each side runs `python -m delaysvc bench SUITES --out DIR` as
a process of its own, so neither imports the other's modules.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import venv
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

from delaysvc.bench.progress import step
from delaysvc.errors import ValidationError

DEFAULT_SUITES = ("send", "delivery", "consume")
MEASURES: dict[str, tuple[str, ...]] = {
    "send_single_c1": ("msgs_per_s",),
    "send_single_c4": ("msgs_per_s",),
    "send_single_level_vs_timer": ("level_msgs_per_s",),
    "send_batch_1000": ("msgs_per_s",),
    "send_batch_10000": ("msgs_per_s",),
    "send_batch_database_write": ("msgs_per_s",),
    "delivery_drain": ("msgs_per_s",),
    "consume_drain": ("jobs_per_s",),
    "http": ("requests_per_s",),
    "http_asgi": ("requests_per_s",),
    **{
        f"pgbouncer_send_{size}": ("pgbouncer_msgs_per_s", "direct_msgs_per_s")
        for size in ("c1", "c4", "c16", "batch_1000")
    },
}
"""Each figure compared: a suite's result and the numbers in it (higher is better)."""
LATENESS = {"delivery_flow": "lateness_ms", "consume_flow": "deliver_to_start_ms"}
"""Each latency compared by its p99 (lower is better)."""


def checkout() -> Path:
    """The git checkout this delaysvc runs from (the working tree compared)."""
    here = Path(__file__).resolve().parent
    found = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--show-toplevel"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode != 0:
        raise ValidationError(
            "REF", "bench compare needs delaysvc run from a git checkout (pip install -e .)"
        )
    return Path(found.stdout.strip())


def install_ref(tree: Path, ref: str, into: Path) -> tuple[str, Path]:
    """REF's code installed into a virtualenv under `into`: -> (REF's short commit, python)."""
    named = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if named.returncode != 0:
        raise ValidationError("REF", f"{ref!r} is not a commit of {tree}")
    commit = named.stdout.strip()
    step(f"compare: installing {commit} into a virtualenv of its own")
    archive = subprocess.run(
        ["git", "-C", str(tree), "archive", "--format=tar", commit],
        capture_output=True,
        check=True,
    ).stdout
    source = into / f"delaysvc-{commit}"
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    # built by this environment's pip (a virtualenv's own setuptools may be too old to build
    # it), installed into the virtualenv by the same pip
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(into / "wheel"), str(source)], check=True)
    (wheel,) = (into / "wheel").glob("delaysvc-*.whl")
    env_dir = into / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)], check=True)
    return commit, python


def bench_once(
    python: Path, cwd: Path, env: dict[str, str], out: Path, suites: list[str], flags: list[str]
) -> dict:
    """One `delaysvc bench` run of one side (its own process, its own code) -> its results."""
    command = [str(python), "-m", "delaysvc", "bench", *suites, *flags, "--out", str(out)]
    step(f"compare: $ {shlex.join(command)}")
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=sys.stderr)
    results: dict[str, Any] = json.loads((out / "results.json").read_text())["results"]
    return results


def compare(
    ref: str, suites: list[str], rounds: int, out: Path, flags: list[str], command: str
) -> str:
    """Alternate the working tree and REF `rounds` times; write out/README.md; -> its table."""
    tree = checkout()
    out = out.resolve()  # each side runs in a folder of its own: REF's in its venv's
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"tree": [], "ref": []}
    with tempfile.TemporaryDirectory(prefix="delaysvc-compare-") as work:
        commit, ref_python = install_ref(tree, ref, Path(work))
        # each side imports its own code alone: the tree's from the tree, REF's from its venv
        clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        sides = {
            "tree": (Path(sys.executable), tree, dict(clean, PYTHONPATH=str(tree))),
            "ref": (ref_python, Path(work), clean),
        }
        for n in range(1, rounds + 1):
            for side, (python, cwd, env) in sides.items():
                folder = out / f"{side}-{n}"
                runs[side].append(bench_once(python, cwd, env, folder, suites, flags))
    text = table(runs, f"the working tree against {commit} ({ref})", command)
    (out / "README.md").write_text(text)
    return text


def table(runs: dict[str, list[dict]], title: str, command: str) -> str:
    lines = [
        f"# {title}, side by side",
        "",
        f"Command: `{command}`. Runs alternate the tree and REF, tree first; each run's report "
        "is in its folder (tree-N/, ref-N/). The disk's flush time varies from minute to "
        "minute, so a rate is best read beside its share of the raw limit measured in the same "
        "run (the `ratio` rows).",
        "",
        "| figure | tree (each run) | REF (each run) | tree / REF (medians) |",
        "|---|---|---|---|",
    ]

    def row(label: str, read: Callable[[dict], float | None]) -> None:
        found = [[read(results) for results in runs[side]] for side in ("tree", "ref")]
        values = [[v for v in side if v is not None] for side in found]
        if not all(values) or sum(map(len, values)) < sum(map(len, found)):
            return  # a figure one side does not have (a suite added since REF)
        medians = [statistics.median(side) for side in values]
        ratio = f"{medians[0] / medians[1]:.2f}" if medians[1] else "-"
        cells = [", ".join(f"{v:,}" for v in side) for side in values]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")

    header = len(lines)
    for name, keys in MEASURES.items():
        for key in keys:
            row(f"{name}: {key}", _reader(name, key))
        row(f"{name}: ratio", _reader(name, "ratio"))
        row(f"{name}: ratio", _reader(name, "ratio_to_raw"))  # http's name for it
    for name, key in LATENESS.items():
        row(f"{name}: p99 {key} (lower is better)", _reader(name, key, "p99"))
    if len(lines) == header:
        lines += ["", "No figure of these suites is compared here: see each run's results.md."]
    return "\n".join(lines) + "\n"


def _reader(name: str, key: str, within: str | None = None) -> Callable[[dict], float | None]:
    """Reads results[name][key] (or [key][within]) of one run, None where it is missing."""

    def read(results: dict) -> float | None:
        value = results.get(name, {}).get(key)
        if within is not None:
            value = value.get(within) if isinstance(value, dict) else None
        return value if isinstance(value, int | float) else None

    return read
