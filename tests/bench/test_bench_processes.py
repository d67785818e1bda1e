"""The bench's own processes (its peers' workers, a rolling restart's deployment) end with the
bench, however it ends: a bench killed outright (SIGKILL, a closed terminal) leaves no worker
on a shared broker and no server on a port."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import children_end_with_their_killed_parent

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
    children_end_with_their_killed_parent(
        STARTS,
        starter,
        str(tmp_path),
        children=3,
        what=f"the {starter} bench's processes to end with it",
    )
