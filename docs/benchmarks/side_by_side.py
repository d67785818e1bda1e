"""Two commits' benches side by side, alternating in one run (this machine's disk flush time
varies several-fold from minute to minute, so runs far apart do not compare):
A B A B ..., each `delaysvc bench SUITES` from a clone of its commit, then one table of each
measure's runs.

Run from the repository root:
    python docs/benchmarks/side_by_side.py BEFORE AFTER OUT [ROUNDS] [SUITES...]
e.g. python docs/benchmarks/side_by_side.py b8548cc HEAD docs/benchmarks/2026-11-26-house 2 \
    send delivery consume
Extra bench flags (such as --quick) go in DELAYSVC_BENCH_FLAGS; the database is the bench's
(DELAYSVC_DATABASE_URL, else the embedded one). `side_by_side.py table OUT TITLE COMMAND`
writes the table again from OUT's runs.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

MEASURES = {
    "send_single_c1": "msgs_per_s",
    "send_single_c4": "msgs_per_s",
    "send_batch_1000": "msgs_per_s",
    "delivery_drain": "msgs_per_s",
    "consume_drain": "jobs_per_s",
}
LATENESS = {"delivery_flow": "lateness_ms", "consume_flow": "lateness_ms"}


def clone(commit: str, into: Path) -> str:
    subprocess.run(["git", "clone", "-q", ".", str(into)], check=True)
    subprocess.run(["git", "-C", str(into), "checkout", "-q", commit], check=True)
    return subprocess.run(
        ["git", "-C", str(into), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def bench(tree: Path, out: Path, suites: list[str]) -> dict:
    flags = shlex.split(os.environ.get("DELAYSVC_BENCH_FLAGS", ""))
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, "-m", "delaysvc", "bench", *suites, *flags, "--out", str(out)]
    print("$", " ".join(command), f"(PYTHONPATH={tree})", flush=True)
    subprocess.run(command, env=env, check=True, cwd=tree)
    return json.loads((out / "results.json").read_text())["results"]


def main(before: str, after: str, out: Path, rounds: int, suites: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="delaysvc-side-by-side-"))
    trees = {"before": work / "before", "after": work / "after"}
    names = {
        label: clone(commit, trees[label])
        for label, commit in (("before", before), ("after", after))
    }
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for n in range(1, rounds + 1):
        for label in ("before", "after"):
            runs[label].append(bench(trees[label], out / f"{label}-{n}", suites))
    command = (
        f"python docs/benchmarks/side_by_side.py {before} {after} {out} {rounds} "
        f"{' '.join(suites)} (DELAYSVC_BENCH_FLAGS="
        f"{os.environ.get('DELAYSVC_BENCH_FLAGS', '')!r})"
    )
    table(out, f"{names['before']} (before) and {names['after']} (after)", command)


def table(out: Path, title: str, command: str) -> None:
    """The table of every run in `out` (before-N/, after-N/), into out/README.md."""
    runs = {
        label: [
            json.loads((folder / "results.json").read_text())["results"]
            for folder in sorted(out.glob(f"{label}-*"))
        ]
        for label in ("before", "after")
    }
    lines = [
        f"# {title}, side by side",
        "",
        f"Command: `{command}`; runs alternate before, after, before, after; each run's full "
        "report is in its folder. This machine's disk flush time varies from minute to minute, "
        "so a send's rate is best read as its share of the raw insert measured in the same run "
        "(the `ratio` rows).",
        "",
        "| measure | before (each run) | after (each run) | after / before (medians) |",
        "|---|---|---|---|",
    ]

    def row(name: str, values: list[list[float]]) -> None:
        if all(values) and None not in values[0] + values[1]:
            ratio = statistics.median(values[1]) / statistics.median(values[0])
            cells = [", ".join(f"{v:,}" for v in side) for side in values]
            lines.append(f"| {name} | {cells[0]} | {cells[1]} | {ratio:.2f} |")

    def pick(name: str, read: Callable[[dict], float]) -> list[list[float]]:
        return [[read(r[name]) for r in runs[label] if name in r] for label in runs]

    for name, key in MEASURES.items():
        row(f"{name}: {key}", pick(name, lambda m, key=key: m[key]))
        row(f"{name}: ratio to raw", pick(name, lambda m: m.get("ratio")))
    for name, key in LATENESS.items():
        row(f"{name}: p99 {key}", pick(name, lambda m, key=key: m[key]["p99"]))
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1] == "table":  # table OUT TITLE COMMAND: the table again from OUT's runs
        table(Path(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
