"""The e2e harness itself: a deployment's processes end with the test process that started
them, however it ends."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.conftest import children_end_with_their_killed_parent

# Starts a process the way a test's deployment starts its workers (`Service._start`), says its
# pid, and waits to be killed.
STARTS_A_DEPLOYMENT = """
import sys, time
from pathlib import Path
from tests.e2e.conftest import Service
service = Service("postgresql://nobody@127.0.0.1:1/none", Path(sys.argv[1]), None)
worker = service._start([sys.executable, "-c", "import time; time.sleep(600)"], "sleeper")
print(worker.pid, flush=True)
time.sleep(600)
"""


def test_a_deployments_processes_end_when_the_test_process_is_killed(tmp_path: Path) -> None:
    """A test process killed outright (a CI timeout's SIGKILL) runs no teardown; its
    deployment's workers end with it all the same (the kernel's parent-death signal), so none
    lives on to take the next run's tasks from a shared broker."""
    children_end_with_their_killed_parent(
        STARTS_A_DEPLOYMENT,
        str(tmp_path),
        children=1,
        what="the worker to end with its test process",
    )
