"""The bench's own processes (its peers' workers, a rolling restart's deployment) end with the
bench, however it ends: a bench killed outright (SIGKILL, a closed terminal) leaves no worker
on a shared broker and no server on a port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, outside_env, process_alive
from tests.e2e.conftest import wait_for

# Starts three processes the way a bench suite does, says their pids, and waits to be killed.
STARTS = """
import sys, time
from pathlib import Path
from delaysvc.bench import peers, rolling

class Peer:  # what the suites read of a peer to start its workers
    name = "sleepers"
    folder = Path(sys.argv[2])
    def worker_env(self):
        return {}
    def worker_commands(self, n):
        return [[sys.executable, "-c", "import time; time.sleep(600)"]] * 3

if sys.argv[1] == "peers":
    started = peers._start(Peer(), 3)
else:
    deployment = rolling.Deployment(Peer(), 3)
    started = [deployment.start(name) for name in ("delivery", "consume", "beat")]
print(" ".join(str(process.pid) for process in started), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("starter", ["peers", "rolling"])
def test_a_killed_benchs_processes_end_with_it(starter: str, tmp_path: Path) -> None:
    env = outside_env()
    env["PYTHONPATH"] = str(ROOT)
    bench = subprocess.Popen(
        [sys.executable, "-c", STARTS, starter, str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert bench.stdout is not None
    children = [int(pid) for pid in bench.stdout.readline().split()]
    try:
        assert len(children) == 3
        assert all(process_alive(pid) for pid in children)
        bench.kill()
        bench.wait(timeout=30)
        wait_for(
            lambda: not any(process_alive(pid) for pid in children),
            10,
            f"the {starter} bench's processes to end with it",
        )
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in children:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
