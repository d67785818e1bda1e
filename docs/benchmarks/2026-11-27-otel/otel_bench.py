"""Send and consume with OpenTelemetry off and on, side by side in one run (issue 37).

    DELAYSVC_DATABASE_URL=postgresql://root@127.0.0.1:5432/postgres \
        python docs/benchmarks/2026-11-27-otel/otel_bench.py suites [--rounds 2] [--out DIR]
    DELAYSVC_DATABASE_URL=... python docs/benchmarks/2026-11-27-otel/otel_bench.py loop [--rounds 3]
    python docs/benchmarks/2026-11-27-otel/otel_bench.py report [--out DIR]  # the tables again

Each round runs every mode once, in a process of its own, modes alternating (the disk's flush
time drifts from minute to minute). The modes, set up as this file is imported, so the consumer
processes the suites spawn (which import it again) are in the same mode:

- `absent`: the application never imports OpenTelemetry (installed or not: delaysvc does not
  import it either);
- `off`: the application imported the OpenTelemetry API and set no TracerProvider (the API's
  proxy): every hook looks and returns;
- `on`: the SDK's TracerProvider with a BatchSpanProcessor and an exporter that drops what it
  is given: every send, run and lane run makes, links and ends a span, and the processor
  queues it and hands it over in batches, as with a real exporter minus the network.

`suites`: the `send` and `consume` suites of `delaysvc bench` (`delaysvc.bench.suites`), modes
`off` and `on`, in a database of their own (`delaysvc_bench_otel` on DELAYSVC_DATABASE_URL's
server; `delaysvc bench` always uses `delaysvc_bench`, which another run on the same server may
drop). Writes `<out>/<mode>-<round>.json` and prints a table.

`loop`: the client's own cost, all three modes: 3,000 single sends in one process, then 20,000
ready jobs (sent one by one, so each carries its send's context when `on`) run by one
in-process Consumer with a no-op handler, in `delaysvc_bench_otel_loop` with
`synchronous_commit = off` so the disk's flush time does not drown the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODE = os.environ.get("OTEL_BENCH_MODE", "absent")


def _set_up_tracing(mode: str) -> None:
    if mode == "absent":
        return
    from opentelemetry import trace

    if mode == "off":
        return
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Dropped(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)


_set_up_tracing(MODE)


def _server_url() -> str:
    return os.environ["DELAYSVC_DATABASE_URL"]


def run_suites(out: Path) -> dict[str, Any]:
    from delaysvc.bench import bench_database, suites
    from delaysvc.config.settings import Settings
    from delaysvc.db.engines import make_engine

    settings = Settings(database_url=_server_url())
    url = bench_database(settings, "delaysvc_bench_otel")
    settings = settings.model_copy(update={"database_url": url})
    engine = make_engine(settings)
    results: dict[str, Any] = {"mode": MODE}
    sent = suites.send_suite(settings, engine, url, 5.0, [1, 4], 20_000)
    results.update(sent.results)
    suites.reset_tables(engine)
    consumed = suites.consume_suite(settings, engine, 50_000, 2, 5_000, 15.0)
    results.update(consumed.results)
    engine.dispose()
    out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def run_loop(out: Path) -> dict[str, Any]:
    from delaysvc.bench import bench_database
    from delaysvc.config.settings import Settings
    from delaysvc.db.engines import make_engine
    from delaysvc.db.names import sql
    from delaysvc.producer.sending import Producer
    from delaysvc.worker.consumer import Consumer, handler

    settings = Settings(database_url=_server_url(), delay_levels="1s 2s 3s 5s 8s")
    url = bench_database(settings, "delaysvc_bench_otel_loop")
    admin = make_engine(settings, url)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sql("ALTER DATABASE delaysvc_bench_otel_loop SET synchronous_commit = off"))
    admin.dispose()
    settings = settings.model_copy(update={"database_url": url})
    engine = make_engine(settings)
    producer = Producer(settings, engine)
    for _ in range(200):  # warm: the pool, prepared statements
        producer.send("loop.sent", {"n": 0}, delay="5m")
    sends = 3000
    began = time.perf_counter()
    for n in range(sends):
        producer.send("loop.sent", {"n": n}, delay="5m")
    send_rate = sends / (time.perf_counter() - began)

    handler("loop.run")(lambda message: None)
    jobs = 20_000
    for n in range(jobs):
        producer.send("loop.run", {"n": n})  # due now: ready
    consumer = Consumer(settings, engine)
    began = time.perf_counter()
    ran = 0
    while claimed := consumer.run_once("loop.run").claimed:
        ran += claimed
    consume_rate = ran / (time.perf_counter() - began)
    engine.dispose()
    results = {
        "mode": MODE,
        "sends_per_s": round(send_rate),
        "jobs": ran,
        "jobs_per_s": round(consume_rate),
    }
    out.write_text(json.dumps(results, indent=2) + "\n")
    return results


SUITE_FIGURES = (
    ("send_single_c1", "msgs_per_s"),
    ("send_single_c1", "ratio"),
    ("send_single_c4", "msgs_per_s"),
    ("send_single_c4", "ratio"),
    ("send_single_level_vs_timer", "level_msgs_per_s"),
    ("send_single_level_vs_timer", "timer_msgs_per_s"),
    ("send_batch_1000", "msgs_per_s"),
    ("send_batch_10000", "msgs_per_s"),
    ("consume_drain", "jobs_per_s"),
    ("consume_flow", "lateness_ms.p99"),
    ("consume_flow", "deliver_to_start_ms.p99"),
)

LOOP_FIGURES = (("sends_per_s", ""), ("jobs_per_s", ""))


def _figure(result: dict[str, Any], name: str, path: str) -> float:
    value: Any = result[name]
    for part in path.split("."):
        value = value[part]
    return float(value)


def table(part: str, runs: dict[str, list[dict[str, Any]]]) -> str:
    """Each figure per mode: its runs in order, and the median."""
    figures = SUITE_FIGURES if part == "suites" else LOOP_FIGURES
    modes = list(runs)
    lines = [
        "| figure | " + " | ".join(f"{m}: runs (median)" for m in modes) + " | on / off |",
        "|---|" + "---|" * len(modes) + "---|",
    ]
    for name, path in figures:
        if any(name not in r for found in runs.values() for r in found):
            continue  # a figure the suites of that code did not measure
        medians = {}
        cells = []
        for mode in modes:
            values = [_figure(r, name, path) if path else float(r[name]) for r in runs[mode]]
            medians[mode] = statistics.median(values)
            cells.append(", ".join(f"{v:g}" for v in values) + f" ({medians[mode]:g})")
        ratio = medians["on"] / medians["off"] if medians.get("off") else float("nan")
        label = f"{name}.{path}" if path else name
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=["suites", "loop", "one", "report"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--what", choices=["suites", "loop"])
    args = parser.parse_args()
    if args.part == "one":  # a child: one mode (OTEL_BENCH_MODE), one run
        run = run_suites if args.what == "suites" else run_loop
        print(json.dumps(run(args.out)))
        return
    if args.part == "report":  # the tables again, from the runs' files under --out
        for what in ("suites", "loop"):
            folder = args.out / what
            runs = {
                mode: [
                    json.loads(path.read_text()) for path in sorted(folder.glob(f"{mode}-*.json"))
                ]
                for mode in ("absent", "off", "on")
            }
            if not any(runs.values()):
                continue
            report = table(what, {mode: found for mode, found in runs.items() if found})
            (folder / "results.md").write_text(report + "\n")
            print(report)
        return
    modes = ["off", "on"] if args.part == "suites" else ["absent", "off", "on"]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    folder = args.out / args.part
    folder.mkdir(parents=True, exist_ok=True)
    for number in range(1, args.rounds + 1):
        for mode in modes:
            out = folder / f"{mode}-{number}.json"
            print(f"== {args.part}: round {number}, {mode}", file=sys.stderr, flush=True)
            subprocess.run(
                [sys.executable, __file__, "one", "--what", args.part, "--out", str(out)],
                env=os.environ | {"OTEL_BENCH_MODE": mode},
                check=True,
                stdout=subprocess.DEVNULL,
            )
            runs[mode].append(json.loads(out.read_text()))
    report = table(args.part, runs)
    (folder / "results.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
