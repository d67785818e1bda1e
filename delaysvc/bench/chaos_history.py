"""The history of a `chaos` run, as Jepsen keeps one: what each client asked and what it was told
(`Op`), the faults injected (`Fault`), every handler run (`Run`) and the messages as a final read
found them (`Final`). Each is a dataclass written as JSON lines into the run's folder, so a
failed run can be checked again from its files (`load`, then `chaos_check.check`).

Times: `Op.at` and a fault's `start`/`end` are this machine's wall clock (`time.time()`);
everything the database decided (stored, due, moved, finished, a run's start) is its own clock,
read back as epoch seconds. Both clocks are the same machine's here (the database is local).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

PHASES = ("invoke", "ok", "fail", "info")
"""invoke: asked; ok: acknowledged; fail: refused, surely without effect; info: the outcome is
unknown (the connection was lost mid-call: it may have taken effect)."""


@dataclass(frozen=True)
class Op:
    process: int  # the client (its number); -1 is the orchestrator
    index: int  # the op's number in its client: its invoke and its completion share it
    kind: str  # send | cancel | redrive | limits
    phase: str  # one of PHASES
    at: float
    args: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fault:
    kind: str  # kill_delivery | kill_consume | kill_beat | pg_restart | deploy | level_change ...
    start: float
    end: float
    pgids: tuple[int, ...] = ()  # process groups killed (SIGKILL), none for a clean stop
    stopped: tuple[int, ...] = ()  # process groups stopped with SIGTERM (a warm shutdown)
    detail: str = ""


@dataclass(frozen=True)
class Run:
    """One handler run: its start record and, unless the run was cut off, its end record."""

    message_id: int
    attempt: int
    deliver_ts: float  # the due time the worker was given (the claim's deliver_ts)
    start: float
    pid: int
    pgid: int
    end: float | None = None
    outcome: str | None = None  # ok | fail | dead; None: cut off (no end record)


@dataclass(frozen=True)
class Final:
    id: int
    topic: str
    key: str | None
    status: str
    stored_at: float
    deliver_ts: float
    delivered_at: float | None
    finished_at: float | None
    attempts: int
    last_error: str | None
    dead_reason: str | None


@dataclass(frozen=True)
class Violation:
    property: str
    message_id: int | None
    what: str

    def __str__(self) -> str:
        subject = f"message {self.message_id}" if self.message_id is not None else "run"
        return f"{self.property}: {subject}: {self.what}"


@dataclass
class History:
    ops: list[Op]
    faults: list[Fault]
    runs: list[Run]
    finals: dict[int, Final]
    check_lines: list[str] = field(default_factory=list)
    """`delaysvc check`'s violations at the end (empty: clean)."""
    check_summary: str = ""
    """Its summary line, or why it did not run."""
    lease_seconds: float = 30.0


def epoch(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


class Recorder:
    """Appends entries to a JSON-lines file, one flushed line each (a killed writer loses at
    most the line it was writing)."""

    def __init__(self, path: Path):
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def write(self, entry: Any) -> None:
        self._file.write(json.dumps(asdict(entry), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_all(path: Path, entries: Iterable[Any]) -> None:
    recorder = Recorder(path)
    try:
        for entry in entries:
            recorder.write(entry)
    finally:
        recorder.close()


def _read(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed writer
                continue


OPS_GLOB = "ops-*.jsonl"
FAULTS = "faults.jsonl"
RUNS = "runs.jsonl"
FINAL = "final.jsonl"
CHECK = "check.txt"
META = "meta.json"


def load(folder: Path) -> History:
    """A run's history from its folder (as `chaos.run_chaos` wrote it)."""
    ops = [Op(**entry) for path in sorted(folder.glob(OPS_GLOB)) for entry in _read(path)]
    faults = [
        Fault(**{**e, "pgids": tuple(e["pgids"]), "stopped": tuple(e["stopped"])})
        for e in _read(folder / FAULTS)
    ]
    runs = [Run(**entry) for entry in _read(folder / RUNS)]
    finals = {entry["id"]: Final(**entry) for entry in _read(folder / FINAL)}
    check_path = folder / CHECK
    lines = check_path.read_text().splitlines() if check_path.exists() else ["not run"]
    meta = json.loads((folder / META).read_text()) if (folder / META).exists() else {}
    return History(ops, faults, runs, finals, lines[:-1], lines[-1], meta.get("lease_seconds", 30))
