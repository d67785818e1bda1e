"""`delaysvc bench` end to end at toy sizes: every suite runs and writes its results, table and
plots. (What the numbers are is the benchmark's business, never a test's.)"""

from __future__ import annotations

import json
from pathlib import Path

from delaysvc.bench import run
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
