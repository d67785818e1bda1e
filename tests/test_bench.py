"""`delaysvc bench` end to end at toy sizes: every suite runs and writes its results, table and
plots. (What the numbers are is the benchmark's business, never a test's.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from delaysvc.bench import SUITES, BenchContext, Size, Suite, all_sizes, run
from delaysvc.bench.suites import Figures
from delaysvc.cli import cli
from delaysvc.settings import Settings


def test_every_suite_runs_and_writes_results_table_and_plots(
    settings: Settings, tmp_path: Path
) -> None:
    out = run(
        settings.model_copy(update={"delay_levels": "1s 2s"}),
        ["send", "delivery", "consume"],
        tmp_path / "run",
        seconds=0.5,
        batch_rows=2000,
        backlog=3000,
        rate=500,
        flow_seconds=2,
        jobs=2000,
        processes=1,
    )
    document = json.loads((out / "results.json").read_text())
    results = document["results"]
    assert set(results) == {
        "send_single_c1",
        "send_single_c4",
        "send_batch_1000",
        "delivery_drain",
        "delivery_flow",
        "consume_drain",
        "consume_flow",
    }
    assert results["delivery_drain"]["messages"] == 3000
    assert results["consume_drain"]["jobs"] == 2000
    assert results["delivery_flow"]["sent"] == results["delivery_flow"]["delivered"] == 1000
    assert document["machine"]["cores"] >= 1
    table = (out / "results.md").read_text()
    assert "| delivery_drain: msgs/s |" in table
    for plot in ("lateness_ms.png", "start_latency_ms.png", "backlog.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"


def test_a_registered_suite_runs_with_its_quick_sizes_and_lands_in_the_report(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[BenchContext] = []

    def toy(ctx: BenchContext) -> Figures:
        seen.append(ctx)
        with ctx.engine.connect() as conn:
            database = conn.execute(text("SELECT current_database()")).scalar_one()
        return Figures(results={"toy": {"skipped": f"toy ran in {database}", "n": ctx.size("n")}})

    monkeypatch.setitem(SUITES, "toy", Suite(toy, (Size("n", 7, 3, "toy size"),)))
    out = run(settings, ["toy"], tmp_path / "toy", quick=True)
    assert [ctx.size("n") for ctx in seen] == [3]
    assert seen[0].settings.database_url == seen[0].url
    document = json.loads((out / "results.json").read_text())
    assert document["results"] == {"toy": {"skipped": "toy ran in delaysvc_bench", "n": 3}}
    assert document["sizes"]["n"] == 3
    assert document["quick"] is True
    assert set(document["suite_seconds"]) == {"toy"}
    assert "| toy: not run | toy ran in delaysvc_bench |" in (out / "results.md").read_text()

    run(settings, ["toy"], tmp_path / "full", n=11)
    assert seen[1].size("n") == 11
    with pytest.raises(ValueError, match="unknown suite"):
        run(settings, ["toy", "nope"], tmp_path / "nope")


def test_the_cli_lists_every_registered_size_as_a_flag_and_refuses_unknown_suites() -> None:
    runner = CliRunner()
    shown = runner.invoke(cli, ["bench", "--help"])
    assert shown.exit_code == 0
    for size in all_sizes().values():
        assert "--" + size.name.replace("_", "-") in shown.output
    refused = runner.invoke(cli, ["bench", "sned"])
    assert refused.exit_code == 2
    assert "unknown suite(s) ['sned']" in refused.output
