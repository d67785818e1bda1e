"""The e2e harness itself: a deployment's processes end with the test process that started
them, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, outside_env, process_alive
from tests.e2e.conftest import wait_for

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
    env = outside_env()
    env["PYTHONPATH"] = str(ROOT)
    test_process = subprocess.Popen(
        [sys.executable, "-c", STARTS_A_DEPLOYMENT, str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert test_process.stdout is not None
    worker = int(test_process.stdout.readline())
    try:
        assert process_alive(worker)
        test_process.kill()
        test_process.wait(timeout=30)
        wait_for(lambda: not process_alive(worker), 10, "the worker to end with its test process")
    finally:
        if test_process.poll() is None:
            test_process.kill()
        if process_alive(worker):
            os.kill(worker, signal.SIGKILL)
