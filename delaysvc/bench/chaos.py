"""The `chaos` suite and the history-checked concurrency test's machinery (Jepsen's approach on
a queue): client processes send, cancel, redrive and change topic limits while two delivery
workers, two consumer workers and two beats run, and faults come on a seeded schedule; every
operation and what it was told is recorded, every handler run too, and a checker proves the
properties of `delaysvc.bench.chaos_check` from that history and a final read.

One place for both forms: the CI test (tests/faults/test_history_checked.py, a short seeded
run on the e2e harness) and `delaysvc bench chaos` (a long one) call `run_chaos` with a
`Deployment` that starts the real worker and beat commands their own way.

`python -m delaysvc.bench.chaos client ...` is one client process; `python -m
delaysvc.bench.chaos recheck FOLDER` checks a run's history again from its files.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from delaysvc import store
from delaysvc.bench import chaos_check
from delaysvc.bench.chaos_faults import (
    BASE_LEVELS,
    FAULT_KINDS,
    BenchDeployment,
    Deployment,
    Nemesis,
    fault_schedule,
)
from delaysvc.bench.chaos_history import (
    CHECK,
    FAULTS,
    FINAL,
    META,
    RUNS,
    Final,
    Op,
    Recorder,
    Run,
    Violation,
    epoch,
    load,
    write_all,
)
from delaysvc.bench.chaos_workload import client_main
from delaysvc.db.names import sql
from delaysvc.maintenance.check import run_check
from delaysvc.producer.sending import Producer
from delaysvc.runtime.supervisor import die_with_parent
from delaysvc.worker.limits import set_limits

__all__ = ["FAULT_KINDS", "ChaosConfig", "Deployment", "Outcome", "evaluate", "run_chaos"]

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext
    from delaysvc.bench.suites import Figures

# ---------------------------------------------------------------- a run


@dataclass(frozen=True)
class ChaosConfig:
    seed: int
    seconds: float = 75.0
    clients: int = 4
    rate: float = 30.0  # operations a second, per client
    faults: tuple[str, ...] = FAULT_KINDS
    fault_count: int = 6
    lease_seconds: float = 10.0
    drain_seconds: float = 120.0


@dataclass
class Outcome:
    """What a run did and what the checker found."""

    config: ChaosConfig
    folder: Path
    ops: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> phase -> count
    faults: dict[str, int] = field(default_factory=dict)  # kind -> injected
    runs: int = 0
    messages: int = 0
    reruns: dict[str, int] = field(default_factory=dict)
    violations: dict[str, list[Violation]] = field(default_factory=dict)
    checked: dict[str, int] = field(default_factory=dict)  # what each property looked at
    check_summary: str = ""  # `delaysvc check`'s summary line
    drained: bool = False
    backlog: list[Backlog] = field(default_factory=list)  # sampled over the run and drain

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def lines(self, shown: int = 10) -> list[str]:
        c = self.config
        out = [
            f"chaos seed {c.seed}: {c.clients} clients x {c.rate:g} ops/s for {c.seconds:g}s; "
            f"history in {self.folder}",
            "operations: "
            + "; ".join(
                f"{kind} " + ", ".join(f"{p} {n}" for p, n in sorted(phases.items()))
                for kind, phases in sorted(self.ops.items())
            ),
            "faults: " + ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items())),
            f"messages {self.messages}, runs {self.runs}, reruns by cause {self.reruns}, "
            f"drained {self.drained}",
            self.backlog_line(),
            self.check_summary,
        ]
        for name, found in self.violations.items():
            verdict = "holds" if not found else f"VIOLATED {len(found)} times"
            out.append(f"property {name}: {verdict} (checked {self.checked.get(name, 0)})")
            out.extend(f"  {v}" for v in found[:shown])
        if not self.ok:
            out.append(
                f"FAILED with seed {c.seed} (check again: python -m delaysvc.bench.chaos "
                f"recheck {self.folder})"
            )
        return out

    def backlog_line(self) -> str:
        if not self.backlog:
            return "backlog: not sampled"
        top = max(self.backlog, key=lambda b: b.overdue)
        end = self.backlog[-1]
        return (
            f"backlog: {len(self.backlog)} samples; most overdue {top.overdue:,} "
            f"(of {top.unfinished:,} unfinished) at {top.at:.0f} s; at the end {end.unfinished:,} "
            f"unfinished at {end.at:.0f} s"
        )

    def figures(self) -> dict[str, Any]:
        return {
            "seed": self.config.seed,
            "seconds": self.config.seconds,
            "clients": self.config.clients,
            "fault_kinds": list(self.config.faults),
            "operations": self.ops,
            "faults_injected": self.faults,
            "messages": self.messages,
            "runs": self.runs,
            "reruns_by_cause": self.reruns,
            "drained": self.drained,
            "backlog": self.backlog_line(),
            "properties": {
                name: {
                    "violations": len(found),
                    "checked": self.checked.get(name, 0),
                    "first": [str(v) for v in found[:10]],
                }
                for name, found in self.violations.items()
            },
            "delaysvc_check": self.check_summary,
            "history": str(self.folder),
        }


@dataclass(frozen=True)
class Backlog:
    """One sample: seconds since the clients began, messages not finished, and of those the
    ones due more than `OVERDUE` ago (what the workers are behind by)."""

    at: float
    unfinished: int
    overdue: int


OVERDUE = "5 seconds"
BACKLOG_EVERY = 5.0
BACKLOG = "backlog.jsonl"


class BacklogSampler(threading.Thread):
    """Samples the backlog every BACKLOG_EVERY seconds into the run's folder until stopped (a
    sample the database does not answer, as in a restart, is skipped)."""

    def __init__(self, engine: Engine, folder: Path):
        super().__init__(name="chaos-backlog", daemon=True)
        self.engine = engine
        self.path = folder / BACKLOG
        self.began = time.time()
        self.samples: list[Backlog] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        with self.path.open("w") as out:
            while not self._stop_event.wait(BACKLOG_EVERY):
                sample = self.sample()
                if sample is not None:
                    self.samples.append(sample)
                    out.write(json.dumps(sample.__dict__) + "\n")
                    out.flush()

    def sample(self) -> Backlog | None:
        try:
            with self.engine.connect() as conn:
                row = conn.execute(
                    sql(
                        "SELECT count(*) AS unfinished, count(*) FILTER (WHERE deliver_ts < "
                        f"now() - interval '{OVERDUE}') AS overdue FROM delaysvc.commit_log "
                        "WHERE finished_at IS NULL"
                    )
                ).one()
        except DBAPIError:
            return None
        return Backlog(round(time.time() - self.began, 1), row.unfinished, row.overdue)

    def stop(self) -> list[Backlog]:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=30)
        return self.samples


RUN_TABLE = """CREATE TABLE IF NOT EXISTS public.chaos_run (
    message_id bigint, attempt int, deliver_ts timestamptz, pid int, pgid int, note text,
    at timestamptz DEFAULT clock_timestamp())"""


def prepare(engine: Engine) -> None:
    """The table the handlers record their runs in (`chaos_handlers`)."""
    with engine.begin() as conn:
        conn.execute(sql(RUN_TABLE))
        conn.execute(sql("TRUNCATE public.chaos_run"))


def run_chaos(config: ChaosConfig, deployment: Deployment, engine: Engine, folder: Path) -> Outcome:
    """The whole run: processes up, clients and faults for `config.seconds`, drained, checked.
    Every process it starts is ended before it returns or raises."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / META).write_text(
        json.dumps({"seed": config.seed, "lease_seconds": config.lease_seconds})
    )
    prepare(engine)
    nemesis = Nemesis(deployment, random.Random(config.seed))
    clients: list[subprocess.Popen[bytes]] = []
    faults = Recorder(folder / FAULTS)
    backlog = BacklogSampler(engine, folder)
    try:
        nemesis.up()
        _wait_until_serving(engine, deployment, folder)
        clients = [_start_client(deployment, config, n, folder) for n in range(config.clients)]
        began = time.time()
        backlog.start()
        for offset, kind in fault_schedule(
            config.seed, config.seconds, config.faults, config.fault_count
        ):
            time.sleep(max(0.0, began + offset - time.time()))
            faults.write(nemesis.inject(kind))
        for process in clients:
            process.wait(timeout=config.seconds + 120)
        _lift_limits(engine)
        drained = _drain(backlog, config.drain_seconds)
        (folder / CHECK).write_text("".join(f"{line}\n" for line in _delaysvc_check(engine)))
        nemesis.stop_all()  # nothing runs while the ends are read
        write_all(folder / FINAL, _read_finals(engine))
        write_all(folder / RUNS, _read_runs(engine))  # after: a run's record precedes its end
    finally:
        faults.close()
        backlog.stop()
        for process in clients:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        nemesis.stop_all()
    outcome = evaluate(config, folder, drained)
    outcome.backlog = backlog.samples
    return outcome


def evaluate(config: ChaosConfig, folder: Path, drained: bool = True) -> Outcome:
    """Check a run's history from its folder."""
    history = load(folder)
    ix = chaos_check.Index(history)
    ops: dict[str, Counter[str]] = {}
    for pair in ix.pairs:
        ops.setdefault(pair.invoke.kind, Counter())[pair.phase] += 1
    return Outcome(
        config,
        folder,
        ops={kind: dict(counts) for kind, counts in ops.items()},
        faults=dict(Counter(f.kind for f in history.faults)),
        runs=len(history.runs),
        messages=len(history.finals),
        reruns=chaos_check.rerun_causes(ix),
        violations={name: prop(ix) for name, prop in chaos_check.PROPERTIES.items()},
        checked={name: count(ix) for name, count in chaos_check.COVERAGE.items()},
        check_summary=history.check_summary,
        drained=drained,
    )


def _start_client(
    deployment: Deployment, config: ChaosConfig, number: int, folder: Path
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "delaysvc.bench.chaos",
        "client",
        str(number),
        str(config.seed),
        str(config.seconds),
        str(config.rate),
        str(folder / f"ops-{number}.jsonl"),
    ]
    log = (folder / f"client-{number}.log").open("wb")
    return subprocess.Popen(
        command,
        env=deployment.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent(),  # a killed bench leaves no client sending
    )


def _wait_until_serving(
    engine: Engine, deployment: Deployment, folder: Path, timeout: float = 90.0
) -> None:
    """Until a message sent now has run: the workers and beat are up."""
    from delaysvc.config.settings import Settings

    producer = Producer(Settings.from_env(deployment.env()), engine)
    sent = producer.send("chaos.ok", {"probe": True})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if producer.get(sent.id).status == "succeeded":
            recorder = Recorder(folder / "ops-probe.jsonl")
            result = {
                "id": sent.id,
                "created": True,
                "stored_at": epoch(sent.stored_at),
                "deliver_at": epoch(sent.deliver_at),
            }
            recorder.write(Op(-1, 1, "send", "invoke", time.time(), {"topic": "chaos.ok"}))
            recorder.write(Op(-1, 1, "send", "ok", time.time(), {"topic": "chaos.ok"}, result))
            recorder.close()
            return
        time.sleep(0.2)
    raise RuntimeError(f"the workers ran no message within {timeout:g}s")


def _lift_limits(engine: Engine) -> None:
    """The last limit a client set may be a slow rate: the drain runs without limits."""
    for _ in range(30):
        try:
            set_limits(engine, "chaos.limited")
            return
        except DBAPIError:
            time.sleep(1)


def _drain(backlog: BacklogSampler, seconds: float, every: float = 30.0) -> bool:
    """Until every message is finished (retries and redriven ones run) or `seconds` pass;
    says how many are left every `every` seconds."""
    from delaysvc.bench.progress import step

    began = time.monotonic()
    said = began
    while time.monotonic() < began + seconds:
        sample = backlog.sample()
        if sample is not None and sample.unfinished == 0:
            return True
        if sample is not None and time.monotonic() - said >= every:
            said = time.monotonic()
            step(f"chaos: draining, {sample.unfinished:,} messages left after {said - began:.0f} s")
        time.sleep(0.5)
    return False


def _delaysvc_check(engine: Engine) -> list[str]:
    """`delaysvc check`'s lines: its violations, then its summary line."""
    return run_check(engine).lines()


def _read_runs(engine: Engine) -> list[Run]:
    """Each run's start record paired with its end record (same message, pid and attempt)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sql(
                "SELECT message_id, attempt, deliver_ts, pid, pgid, note, at "
                "FROM public.chaos_run ORDER BY at"
            )
        ).all()
    runs: list[Run] = []
    open_runs: dict[tuple[int, int, int], int] = {}
    for row in rows:
        key = (row.message_id, row.pid, row.attempt)
        if row.note == "start":
            open_runs[key] = len(runs)
            runs.append(
                Run(
                    row.message_id,
                    row.attempt,
                    row.deliver_ts.timestamp(),
                    row.at.timestamp(),
                    row.pid,
                    row.pgid,
                )
            )
        elif key in open_runs:
            i = open_runs.pop(key)
            r = runs[i]
            runs[i] = Run(
                r.message_id,
                r.attempt,
                r.deliver_ts,
                r.start,
                r.pid,
                r.pgid,
                row.at.timestamp(),
                row.note,
            )
    return runs


def _read_finals(engine: Engine) -> list[Final]:
    with engine.connect() as conn:
        rows = conn.execute(
            sql(
                f"SELECT c.id, c.topic, c.key, {store.STATUS} AS status, c.stored_at, "
                "c.deliver_ts, c.delivered_at, c.finished_at, c.attempts, c.last_error, d.reason "
                "FROM delaysvc.message c LEFT JOIN delaysvc.dead_letter d ON d.message_id = c.id "
                "WHERE c.topic LIKE 'chaos.%' ORDER BY c.id"
            )
        ).all()
    return [
        Final(
            row.id,
            row.topic,
            row.key,
            row.status,
            row.stored_at.timestamp(),
            row.deliver_ts.timestamp(),
            epoch(row.delivered_at),
            epoch(row.finished_at),
            row.attempts,
            row.last_error,
            row.reason,
        )
        for row in rows
    ]


# ---------------------------------------------------------------- the bench suite


def chaos_suite(ctx: BenchContext) -> Figures:
    """`delaysvc bench chaos`: `run_chaos` for `--chaos-seconds` on a database of its own."""
    from delaysvc.bench import bench_database, drop_database
    from delaysvc.bench.progress import step
    from delaysvc.bench.suites import Figures
    from delaysvc.config.levels import DelayLevels
    from delaysvc.db.engines import make_engine
    from delaysvc.schema.migrate import upgrade

    kinds = tuple(k for k in FAULT_KINDS if k != "pg_restart" or ctx.size("chaos_pg_restart"))
    config = ChaosConfig(
        seed=ctx.size("chaos_seed"),
        seconds=ctx.seconds("chaos_seconds"),
        clients=ctx.size("chaos_clients"),
        rate=ctx.seconds("chaos_rate"),
        faults=kinds,
        fault_count=max(ctx.size("chaos_faults"), len(kinds)),
        drain_seconds=ctx.seconds("chaos_drain"),
    )
    step(
        f"chaos: seed {config.seed}, {config.clients} clients for {config.seconds:g} s, "
        f"{config.fault_count} faults of {', '.join(kinds)}"
    )
    settings = ctx.settings
    url = bench_database(settings, "delaysvc_bench_chaos", migrate=False)
    engine = make_engine(settings, url)
    upgrade(engine, DelayLevels.parse(BASE_LEVELS))  # the levels the workers start with
    folder = (ctx.out or Path(tempfile.mkdtemp(prefix="delaysvc-bench-chaos-"))) / "chaos"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        deployment = BenchDeployment(
            engine, url, folder, config.lease_seconds, ctx.size("chaos_concurrency")
        )
        outcome = run_chaos(config, deployment, engine, folder)
    finally:
        engine.dispose()
        drop_database(settings, "delaysvc_bench_chaos")
    for line in outcome.lines():
        step(line)
    return Figures(
        results={"chaos": outcome.figures()},
        series={
            "chaos_backlog:unfinished": [(b.at, b.unfinished) for b in outcome.backlog],
            f"chaos_backlog:due over {OVERDUE} ago": [(b.at, b.overdue) for b in outcome.backlog],
        },
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["client"]:
        number, seed, seconds, rate, out = argv[1:6]
        client_main(int(number), int(seed), float(seconds), float(rate), Path(out))
        return 0
    if argv[:1] == ["recheck"]:
        folder = Path(argv[1])
        meta = json.loads((folder / META).read_text())
        outcome = evaluate(ChaosConfig(seed=meta["seed"]), folder)
        print("\n".join(outcome.lines()))
        return 0 if outcome.ok else 1
    print("usage: python -m delaysvc.bench.chaos client N SEED SECONDS RATE OUT | recheck FOLDER")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
