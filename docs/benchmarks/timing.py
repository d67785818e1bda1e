"""Timing for the measuring scripts in this folder: a call's time, variants measured in turn
round after round (this machine's speed varies from minute to minute), and each variant's
median and spread."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path


def per_call_us(
    call: Callable[[], object],
    n: int,
    warm: int = 100,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """`call`'s time in microseconds, over `n` calls after `warm` untimed ones (`clock`:
    `time.process_time` for this process's CPU alone)."""
    for _ in range(warm):
        call()
    started = clock()
    for _ in range(n):
        call()
    return (clock() - started) / n * 1e6


def server_cpu_clock(backend_pid: int) -> Callable[[], float]:
    """A clock (`per_call_us`'s `clock`) of the CPU seconds the PostgreSQL server process
    `backend_pid` (a connection's `info.backend_pid`) has run, from the kernel's scheduler
    statistics, in ns: for a server on this machine. It leaves out the client and the disk."""
    stat = Path(f"/proc/{backend_pid}/schedstat")
    return lambda: int(stat.read_text().split()[0]) / 1e9


def alternate(measures: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each measure once a round, in turn, for `rounds` rounds: its results in round order."""
    results: dict[str, list[float]] = {name: [] for name in measures}
    for round_ in range(1, rounds + 1):
        for name, measure in measures.items():
            results[name].append(measure())
        print(f"round {round_} of {rounds} done", file=sys.stderr, flush=True)
    return results


def print_spread(results: Mapping[str, list[float]], what: str) -> None:
    """A table of each measure's median, min and max, its first column headed `what`."""
    width = max(len(what), *(len(name) for name in results))
    print(f"{what:{width}} {'median':>7} {'min':>7} {'max':>7}")
    for name, values in results.items():
        median = statistics.median(values)  # of an even count, the mean of the middle two
        print(f"{name:{width}} {median:7.1f} {min(values):7.1f} {max(values):7.1f}")


def checkouts_in_turn(
    script: str, server: str, ways: list[tuple[str, str, dict[str, str]]], rounds: int
) -> None:
    """Run `script --measure SERVER LABEL` once a round for each (label, checkout, environment)
    of `ways`, in turn, each in a process of its own that imports `delaysvc` from its checkout
    (a `git worktree` of another commit, or this tree)."""
    for _ in range(rounds):
        for label, checkout, env in ways:
            subprocess.run(
                [sys.executable, script, "--measure", server, label],
                check=True,
                env={**os.environ, **env, "PYTHONPATH": checkout},
            )
