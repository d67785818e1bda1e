"""`delaysvc bench compare REF`: REF's code in a virtualenv of its own, and the table of each
figure's runs and its ratio, tree over REF."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from delaysvc.bench.compare import checkout, install_ref, table
from delaysvc.cli import cli
from delaysvc.errors import ValidationError
from tests.support.passes import first_pass_only


@first_pass_only("builds a wheel, no database")
def test_ref_is_installed_alone_into_a_virtualenv_that_imports_its_code(tmp_path: Path) -> None:
    tree = checkout()
    commit, python = install_ref(tree, "HEAD", tmp_path)
    head = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert commit == head.stdout.strip()
    imported = subprocess.run(
        [str(python), "-c", "import delaysvc.bench as m; print(m.__file__)"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # as compare runs it
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert imported.startswith(str(tmp_path / "venv")), imported  # not the tree's files
    with pytest.raises(ValidationError, match="'no-such-ref' is not a commit"):
        install_ref(tree, "no-such-ref", tmp_path / "other")


def test_the_table_gives_each_figures_runs_and_the_ratio_of_the_medians() -> None:
    def run(c1: float, ratio: float, p99: float, extra: bool) -> dict:
        results = {
            "send_single_c1": {"msgs_per_s": c1, "ratio": ratio},
            "delivery_flow": {"lateness_ms": {"p50": 1, "p99": p99}},
            "http": {"requests_per_s": c1 / 2, "ratio_to_raw": ratio / 4},
        }
        if extra:  # a suite's figure REF does not have yet
            results["send_single_level_vs_timer"] = {"level_msgs_per_s": 9, "ratio": 1.0}
        return results

    runs = {
        "tree": [run(3000, 0.6, 40, True), run(3200, 0.62, 50, True), run(2800, 0.58, 45, True)],
        "ref": [run(2000, 0.4, 80, False), run(2400, 0.44, 90, False), run(2200, 0.5, 85, False)],
    }
    lines = table(runs, "t", "delaysvc bench compare X").splitlines()
    rows = [line for line in lines if line.startswith(("| send_", "| deliv", "| http"))]
    assert rows == [
        "| send_single_c1: msgs_per_s | 3,000, 3,200, 2,800 | 2,000, 2,400, 2,200 | 1.36 |",
        "| send_single_c1: ratio | 0.6, 0.62, 0.58 | 0.4, 0.44, 0.5 | 1.36 |",
        "| http: requests_per_s | 1,500.0, 1,600.0, 1,400.0 | 1,000.0, 1,200.0, 1,100.0 | 1.36 |",
        "| http: ratio | 0.15, 0.155, 0.145 | 0.1, 0.11, 0.125 | 1.36 |",
        "| delivery_flow: p99 lateness_ms (lower is better) | 40, 50, 45 | 80, 90, 85 | 0.53 |",
    ]


def test_the_pgbouncer_suite_is_compared_and_a_suite_without_figures_says_so() -> None:
    """Found comparing the kept connections through PgBouncer: `compare REF pgbouncer` wrote a
    table with no row at all."""

    def run(through: float, direct: float) -> dict:
        figures = {"pgbouncer_msgs_per_s": through, "direct_msgs_per_s": direct}
        return {
            f"pgbouncer_send_c{n}": {**figures, "ratio": round(through / direct, 3)}
            for n in (1, 4, 16)
        }

    runs = {"tree": [run(1600, 2000), run(1500, 2100)], "ref": [run(1500, 2000), run(1450, 1950)]}
    lines = table(runs, "t", "delaysvc bench compare X pgbouncer").splitlines()
    through = "| pgbouncer_send_c1: pgbouncer_msgs_per_s | 1,600, 1,500 | 1,500, 1,450 | 1.05 |"
    assert through in lines
    assert "| pgbouncer_send_c1: ratio | 0.8, 0.714 | 0.75, 0.744 | 1.01 |" in lines
    assert "| pgbouncer_send_c16: direct_msgs_per_s | 2,000, 2,100 | 2,000, 1,950 | 1.04 |" in lines
    empty = table({"tree": [{"peers": {}}], "ref": [{"peers": {}}]}, "t", "c").splitlines()
    assert empty[-1] == "No figure of these suites is compared here: see each run's results.md."


def test_the_cli_needs_a_ref_and_known_suites() -> None:
    runner = CliRunner()
    missing = runner.invoke(cli, ["bench", "compare"])
    assert missing.exit_code == 2 and "bench compare needs REF" in missing.output
    unknown = runner.invoke(cli, ["bench", "compare", "HEAD", "sned"])
    assert unknown.exit_code == 2 and "unknown suite(s) ['sned']" in unknown.output
    assert sys.executable  # the tests run in the environment the tree is installed in


def test_each_side_writes_into_the_out_folder_given_relative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found running `compare REF --out docs/benchmarks/...`: REF's side runs in its venv's
    folder, so a relative --out was written there and the run then failed to read it."""
    from delaysvc.bench import compare as comparing

    given: list[Path] = []

    def bench_once(python, cwd, env, out, suites, flags):  # type: ignore[no-untyped-def]
        given.append(out)
        return {}

    monkeypatch.setattr(comparing, "install_ref", lambda tree, ref, work: ("abc1234", tmp_path))
    monkeypatch.setattr(comparing, "bench_once", bench_once)
    monkeypatch.chdir(tmp_path)
    comparing.compare("HEAD", ["send"], 1, Path("runs"), [], "delaysvc bench compare HEAD")
    assert given == [tmp_path / "runs" / "tree-1", tmp_path / "runs" / "ref-1"]
    assert (tmp_path / "runs" / "README.md").exists()
