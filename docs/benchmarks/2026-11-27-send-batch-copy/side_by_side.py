"""send_batch of 10,000 on the code before the COPY path and on this tree, alternately in one run
on one server, beside a raw COPY of as many rows into one plain table (`bench.raw.copy_rows`),
so that every figure of a round is measured within seconds of the others (this machine's disk
flush time drifts several-fold from one minute to the next).

    python docs/benchmarks/2026-11-27-send-batch-copy/side_by_side.py \
        postgresql://root@127.0.0.1:5432/batchprof --before 56bb3b5 --rounds 12

Each side runs in a process of its own (the older code from `git archive` of `--before`), kept
for the whole run; a round is: raw COPY, then the two sides in turn (the order swapped every
round), each also through its batch's database statements alone (`_batch_database_write` of its
own bench). Each send_batch's items are made before its clock starts, each with its own body.
`--gc-off` adds, for where the time goes, a send_batch with Python's cyclic garbage collector
off (the service never turns it off). Prints each round and the medians as JSON lines; the
database's tables are emptied every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]

WORKER = r"""
import gc, json, sys, time
from datetime import datetime
import delaysvc
from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.producer.sending import Producer
from delaysvc.bench.suites import _batch_database_write, reset_tables
url, size = sys.argv[1], int(sys.argv[2])
settings = Settings(database_url=url)
engine = make_engine(settings)
producer = Producer(settings, engine)
producer.send_batch([{"topic": "warm", "body": 0, "delay": "1h"}] * 2)  # pool, plans
print(json.dumps({"ready": delaysvc.__file__}), flush=True)
for line in sys.stdin:
    what = line.strip()
    if what == "reset":
        reset_tables(engine)
        print("{}", flush=True)
    elif what in ("send_batch", "send_batch_gc_off"):
        items = [
            {"topic": "bench.noop", "body": {"order_id": n, "action": "cancel"}, "delay": "1h"}
            for n in range(size)
        ]
        if what == "send_batch_gc_off":  # where the time goes: Python's cyclic GC's share
            gc.disable()
        wall, cpu = time.perf_counter(), time.process_time()
        sent = producer.send_batch(items)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        gc.enable()
        assert len(sent) == size
        print(json.dumps({"msgs_per_s": size / wall, "client_cpu_ms": cpu * 1000}), flush=True)
    elif what == "database_write":
        rate = _batch_database_write(url.replace("+psycopg", ""), producer, size)
        print(json.dumps({"msgs_per_s": rate}), flush=True)
"""


def older_tree(ref: str, into: Path) -> Path:
    """delaysvc as committed at `ref`, unpacked under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "delaysvc"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


class Side:
    def __init__(self, name: str, path: Path, url: str, size: int):
        env = {**os.environ, "PYTHONPATH": str(path)}
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, url, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        self.origin = self.ask(None)["ready"]

    def ask(self, what: str | None) -> dict:
        assert self.proc.stdin and self.proc.stdout
        if what is not None:
            self.proc.stdin.write(what + "\n")
            self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--before", default="56bb3b5")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument(
        "--gc-off", action="store_true", help="also each send_batch with Python's GC off"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from delaysvc.bench.raw import copy_rows
    from delaysvc.db.engines import libpq_url

    with tempfile.TemporaryDirectory() as scratch:
        sides = [
            Side("before", older_tree(args.before, Path(scratch)), args.url, args.size),
            Side("after", ROOT, args.url, args.size),
        ]
        print(json.dumps({side.name: side.origin for side in sides}), flush=True)
        figures: dict[str, list[float]] = {}
        for round_ in range(args.rounds):
            sides[0].ask("reset")
            row = {"round": round_, "time": time.strftime("%H:%M:%S")}
            row["raw_copy"] = copy_rows(libpq_url(args.url), args.size)
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                sent = side.ask("send_batch")
                row[f"{side.name}_send_batch"] = sent["msgs_per_s"]
                row[f"{side.name}_client_cpu_ms"] = sent["client_cpu_ms"]
                if args.gc_off:
                    sent = side.ask("send_batch_gc_off")
                    row[f"{side.name}_send_batch_gc_off"] = sent["msgs_per_s"]
                    row[f"{side.name}_client_cpu_ms_gc_off"] = sent["client_cpu_ms"]
                row[f"{side.name}_database_write"] = side.ask("database_write")["msgs_per_s"]
            for key, value in row.items():
                if key not in ("round", "time"):
                    figures.setdefault(key, []).append(value)
            print(json.dumps({k: round(v) if isinstance(v, float) else v for k, v in row.items()}))
        medians = {key: statistics.median(values) for key, values in figures.items()}
        raw = medians["raw_copy"]
        summary = {key: round(value) for key, value in medians.items()}
        for side in ("before", "after"):
            for what in ("send_batch", "database_write"):
                summary[f"{side}_{what}_vs_raw"] = round(medians[f"{side}_{what}"] / raw, 3)
        summary["after_vs_before"] = round(
            medians["after_send_batch"] / medians["before_send_batch"], 2
        )
        print(json.dumps({"medians": summary}), flush=True)
        for side in sides:
            side.close()


if __name__ == "__main__":
    main()
