"""Why is a big backlog slower? One delivery move of 1,000 due level-1 rows and one single
send's insert, each under EXPLAIN (ANALYZE, BUFFERS, WAL) and rolled back, on an empty system
and then with PENDING messages waiting (the scale suite's backlog: spread over the levels of
10 minutes and more and the timer lane, written by set-based SQL, then VACUUM ANALYZE and a
CHECKPOINT). Prints, per statement: median execution time over 20 runs and the shared
buffers hit / read from outside shared_buffers / dirtied, WAL bytes and full-page images.

Run from the repository root:
python docs/benchmarks/scale_profile.py [SERVER_URL] [PENDING] [COMMIT_LOG_FILLFACTOR]
(defaults postgresql://root@127.0.0.1:5432/postgres, 10,000,000 and the schema's); it works
in a database of its own.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scratch import scratch_database

from delaysvc.bench.scale import LONG_LEVEL_MS, _fill_backlog, fill_lane
from delaysvc.config.settings import Settings
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import LATENESS_BUCKETS_MS
from delaysvc.store import delivery as store_delivery
from delaysvc.store import producing

SERVER = sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres"
PENDING = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000_000
DATABASE = "delaysvc_scale_profile"
RUNS, DUE = 20, 1000
COUNTERS = ("Shared Hit Blocks", "Shared Read Blocks", "Shared Dirtied Blocks")
WAL = ("WAL Bytes", "WAL FPI")


def explained(engine: Engine, statement: str, params: dict[str, Any]) -> dict[str, float]:
    """Median time and counters of `statement` over RUNS runs, each rolled back."""
    runs = []
    for _ in range(RUNS):
        with engine.connect() as conn, conn.begin() as transaction:
            plan = conn.execute(
                text("EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) " + statement), params
            ).scalar_one()
            transaction.rollback()
        top = (json.loads(plan) if isinstance(plan, str) else plan)[0]
        # each direct child is one step of the statement (a CTE), inclusive of what it does
        steps = top["Plan"].get("Plans") or [top["Plan"]]
        figures = {name: sum(float(s.get(name, 0)) for s in steps) for name in COUNTERS + WAL}
        for step_ in steps:  # and where they go, per step
            name = step_.get("Subplan Name") or step_["Node Type"]
            for counter in ("Shared Read Blocks", "Shared Dirtied Blocks", "WAL FPI"):
                figures[f"{name}: {counter}"] = float(step_.get(counter, 0))
        figures["ms"] = float(top["Execution Time"])
        runs.append(figures)
    return {name: statistics.median(r[name] for r in runs) for name in runs[0]}


def profile(engine: Engine, settings: Settings, send_level: int) -> dict[str, dict[str, float]]:
    fill_lane(engine, 1, DUE, "now() - interval '1 minute'")
    move = {
        "lane": 1,
        "delay_ms": settings.levels.delay_ms(1),
        "batch": DUE,
        "now": None,
        "bounds": list(LATENESS_BUCKETS_MS),
    }
    new = Producer(settings, engine).prepare("bench.scale", b"{}", delay_level=send_level)
    out = {
        "move of 1,000 due rows": explained(engine, store_delivery._MOVE_DUE_LEVEL, move),
        "a single send's insert (send_one)": explained(
            engine, producing.SEND_ONE, {**producing._message_params(new), "caps_held": False}
        ),
    }
    with engine.begin() as conn:  # the due rows leave, so the next phase starts alike
        conn.execute(text("DELETE FROM consume_queue WHERE level = 1"))
        conn.execute(text("DELETE FROM commit_log WHERE lane = 1"))
    return out


def measure(engine: Engine, settings: Settings) -> dict[str, dict[str, dict[str, float]]]:
    if len(sys.argv) > 3:  # an experiment: commit_log's fillfactor
        with engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE commit_log SET (fillfactor = {int(sys.argv[3])})"))
    levels = [
        n
        for n in range(1, settings.levels.max_level + 1)
        if settings.levels.delay_ms(n) >= LONG_LEVEL_MS
    ]
    phases = {"empty": profile(engine, settings, levels[0])}
    _fill_backlog(engine, PENDING, levels, settings)
    phases[f"{PENDING:,} pending"] = profile(engine, settings, levels[0])
    return phases


def main() -> None:
    with scratch_database(SERVER, DATABASE) as (engine, settings):
        phases = measure(engine, settings)
    print(f"median of {RUNS} runs each, rolled back")
    for statement in phases["empty"]:
        print(f"\n{statement}")
        for phase, figures in phases.items():
            f = figures[statement]
            print(
                f"  {phase:>20}: {f['ms']:7.2f} ms  hit {f['Shared Hit Blocks']:6.0f}  "
                f"read {f['Shared Read Blocks']:6.0f}  dirtied {f['Shared Dirtied Blocks']:6.0f}  "
                f"WAL {f['WAL Bytes']:9.0f} B  FPI {f['WAL FPI']:4.0f}"
            )
            for name, value in f.items():
                if ": " in name and value:
                    print(f"  {'':>20}    {name} {value:.0f}")


if __name__ == "__main__":
    main()
