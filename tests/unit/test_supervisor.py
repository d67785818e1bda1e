"""The supervisor behind `delaysvc up`, `worker`, `beat` and `web` (`delaysvc.runtime.supervisor`),
with real child processes: a child that dies is restarted after a backoff while the others run on,
one that cannot start stops everything with a line saying so, and no child outlives a supervisor
killed with SIGKILL. (tests/e2e/test_up.py does the same to a whole `delaysvc up`.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from delaysvc.runtime import supervisor as up
from delaysvc.runtime.commands import Command
from delaysvc.runtime.supervisor import run_processes
from tests.conftest import process_alive
from tests.e2e.conftest import wait_for

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "RESTART_BACKOFF_SECONDS", (0.1, 0.2))
    monkeypatch.setattr(up, "STEADY_SECONDS", 5.0)


class ThenStop:
    """An `on_started` that runs `steps`, then stops the supervisor as Ctrl-C would, whatever
    happened: `on_started` runs in a daemon thread, where a failed assertion would only end
    the thread and leave `run_processes` running until the test's timeout. The failure is
    raised by `check()`, once `run_processes` has returned."""

    def __init__(self, steps: Callable[[up.Supervisor], None]):
        self.steps = steps
        self.failure: BaseException | None = None

    def __call__(self, supervisor: up.Supervisor) -> None:
        try:
            self.steps(supervisor)
        except BaseException as exc:
            self.failure = exc
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure


def test_a_child_that_dies_is_restarted_and_the_others_run_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: dict[str, list[int]] = {}

    def kill_one(supervisor: up.Supervisor) -> None:
        first, second = supervisor.children
        assert first.process is not None and second.process is not None
        seen["second"] = [second.process.pid]
        seen["first"] = [first.process.pid]
        first.process.kill()
        wait_for(lambda: first.process.pid != seen["first"][0], 10, "the restart")
        seen["first"].append(first.process.pid)
        seen["second"].append(second.process.pid)

    kill_one_then_stop = ThenStop(kill_one)
    code = run_processes(
        [Command("first", SLEEPER), Command("second", SLEEPER)], on_started=kill_one_then_stop
    )
    kill_one_then_stop.check()
    out = capsys.readouterr()
    assert code == 0
    assert "first exited with -9; restarting it in 0.1 s" in out.err
    assert "restarting first" in out.out
    assert seen["second"][0] == seen["second"][1]  # the other child ran on, untouched
    assert not any(process_alive(pid) for pid in seen["first"] + seen["second"])  # all stopped


def test_a_child_that_cannot_start_stops_everything_with_a_clear_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    failing = Command("broken", [sys.executable, "-c", "import sys; sys.exit(3)"])
    started = time.monotonic()
    code = run_processes([failing, Command("sleeper", SLEEPER)])
    err = capsys.readouterr().err
    assert code == 1
    assert time.monotonic() - started < 10
    assert err.count("broken exited with 3; restarting it in") == 4
    assert (
        "broken exited with 3 5 times in a row, each within 5 s of starting: it cannot start "
        "(see its lines above); stopping all"
    ) in err


def test_no_child_outlives_a_supervisor_killed_with_sigkill(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from delaysvc.up import Command, run_processes; "
            f"sys.exit(run_processes([Command('child', [sys.executable, '-c', {child!r}])]))",
        ],
        start_new_session=True,
    )
    try:
        wait_for(lambda: pidfile.exists() and pidfile.read_text(), 30, "the child to start")
        child_pid = int(pidfile.read_text())
        assert process_alive(child_pid)
        supervisor.kill()
        supervisor.wait(timeout=10)
        wait_for(lambda: not process_alive(child_pid), 10, "the child to die with its supervisor")
    finally:
        supervisor.kill()
        if pidfile.exists() and pidfile.read_text() and process_alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_a_child_that_ignores_its_parents_death_is_killed_after_the_grace(tmp_path: Path) -> None:
    """A supervisor killed with SIGKILL: the kernel's SIGTERM reached each child, but a child
    that did not stop on it (a Celery worker's warm shutdown hung, seen once after `up` was
    killed: the worker ran on for good, holding var/up.pid) ran on unsupervised. The grace
    later (STOP_GRACE_SECONDS, as a stop gives), the supervisor's reaper kills it."""
    pidfile = tmp_path / "child.pid"
    stubborn = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from delaysvc.runtime import supervisor as up; "
            "up.STOP_GRACE_SECONDS = 2; "
            f"sys.exit(up.run_processes([up.Command('stubborn', [sys.executable, '-c', "
            f"{stubborn!r}])]))",
        ],
        start_new_session=True,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: pidfile.exists() and pidfile.read_text(), 30, "the child to start")
        child_pid = int(pidfile.read_text())
        supervisor.kill()
        supervisor.wait(timeout=10)
        time.sleep(1)
        assert process_alive(child_pid)  # the grace is its own
        wait_for(lambda: not process_alive(child_pid), 15, "the stubborn child to be killed")
        assert supervisor.stderr is not None
        said = supervisor.stderr.read().decode()
        assert f"stubborn (pid {child_pid}) still ran 2 s after its supervisor died: killed" in said
    finally:
        supervisor.kill()
        if pidfile.exists() and pidfile.read_text() and process_alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_a_flood_of_sighups_neither_stops_nor_hangs_the_supervisor(tmp_path: Path) -> None:
    """SIGHUP's handler runs in the loop's thread, between any two of its steps: one that took
    a lock the loop might hold (an Event's, while the loop clears it) waited on its own thread
    forever (here: nested handlers until a RecursionError killed the supervisor, one run in
    two). Thousands of SIGHUPs (each a reload: a signal passed to the child), then SIGTERM:
    the supervisor stops at once, its child with it."""
    pidfile = tmp_path / "child.pid"
    child = (
        "import os, signal, time; signal.signal(signal.SIGUSR1, lambda *_: None); "
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys; from delaysvc.runtime.commands import Command; "
            "from delaysvc.runtime.supervisor import run_processes; "
            "child = Command('child', [sys.executable, '-c', "
            f"{child!r}], reload_signal=signal.SIGUSR1); "
            "sys.exit(run_processes([child]))",
        ],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: pidfile.exists() and pidfile.read_text(), 30, "the child to start")
        child_pid = int(pidfile.read_text())
        flood_until = time.monotonic() + 3
        while time.monotonic() < flood_until:
            for _ in range(100):
                os.kill(supervisor.pid, signal.SIGHUP)
            time.sleep(0.001)
        assert supervisor.poll() is None  # a reload stops nothing
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=15) == 0
        wait_for(lambda: not process_alive(child_pid), 10, "the child to stop with it")
    finally:
        supervisor.kill()
        if pidfile.exists() and pidfile.read_text() and process_alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_a_killed_up_not_yet_reaped_is_not_running() -> None:
    """A second `up` right after a kill -9 was refused as "already running" while the killed
    one was a zombie its parent had not reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: not up._alive(child.pid), 10, "the exited child to count as gone")
    assert Path(f"/proc/{child.pid}").exists()  # a zombie: not reaped yet
    child.wait()
    assert up._alive(os.getpid())


def test_a_var_dir_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "var").write_text("a file, not a folder")
    with pytest.raises(up.click.ClickException) as refused:
        up.deployment_lock(tmp_path / "var", print)
    assert refused.value.message.startswith(f"cannot write {tmp_path / 'var' / 'up.pid'} (")
    assert "set DELAYSVC_VAR_DIR to one" in refused.value.message


def test_an_embedded_database_folder_never_finished_is_named_not_a_traceback(
    tmp_path: Path,
) -> None:
    """A first `up` stopped while initdb made var/pg left it half made; every later start
    failed with initdb's traceback ("exists but is not empty")."""
    from delaysvc.db.engines import start_embedded
    from delaysvc.errors import ConfigError

    pgdata = tmp_path / "var" / "pg"
    (pgdata / "base").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds a database that was never finished"):
        start_embedded(tmp_path / "var")


def test_a_child_killed_after_the_grace_is_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A consumer still running a job when the grace ended was killed without a word."""
    monkeypatch.setattr(up, "STOP_GRACE_SECONDS", 1)
    stubborn = Command(
        "stubborn",
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
         "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
    )  # fmt: skip
    supervisor = up.Supervisor([stubborn], None, None)
    supervisor.start(supervisor.children[0])
    time.sleep(0.5)
    supervisor.stop_all()
    assert "stubborn did not stop within 1 s: killed" in capsys.readouterr().err


def test_a_reload_stops_the_old_process_only_once_the_new_one_is_ready(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGHUP told the old process to stop as the new one started: a release whose handler
    module did not import (its new workers dying at start) left no worker running, and the
    supervisor, seeing them die, stopped everything (found by a reviewer). The old one runs
    until the new one says it is ready (`Command.says_ready`); a new one that dies first is
    let go, and the old one runs on."""
    child = f"""
import os, pathlib, signal, sys, time
folder = pathlib.Path({str(tmp_path)!r})
ready = os.environ.get("DELAYSVC_READY_FILE")
if ready and (folder / "release").read_text() == "broken":
    sys.exit(1)  # as a worker whose handler module does not import
def stop(*_):
    (folder / f"stopped-{{os.getpid()}}").write_text(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
if ready:
    time.sleep(1)  # as Celery starting
    (folder / f"ready-{{os.getpid()}}").write_text(repr(time.time()))
    pathlib.Path(ready).write_text(str(os.getpid()))
time.sleep(120)
"""
    seen: dict[str, int] = {}

    def reload_twice(supervisor: up.Supervisor) -> None:
        (worker,) = supervisor.children
        assert worker.process is not None
        seen["old"] = old = worker.process.pid
        (tmp_path / "release").write_text("broken")
        os.kill(os.getpid(), signal.SIGHUP)
        wait_for(lambda: worker.successor is not None, 10, "the broken release to start")
        wait_for(lambda: worker.successor is None, 30, "the broken release to be let go")
        assert worker.process.pid == old and process_alive(old)  # the old one runs on
        (tmp_path / "release").write_text("mended")
        os.kill(os.getpid(), signal.SIGHUP)
        wait_for(lambda: worker.process.pid != old, 30, "the mended release to take over")
        seen["new"] = worker.process.pid
        wait_for(lambda: not process_alive(old), 30, "the old one to finish")

    steps = ThenStop(reload_twice)
    code = run_processes([Command("worker", [sys.executable, "-c", child], says_ready=True)],
                         on_started=steps)  # fmt: skip
    steps.check()
    out = capsys.readouterr()
    assert code == 0
    assert (
        "worker: the new one exited with 1 before it was ready (see its lines above): the old "
        "one keeps running; mend the release and reload again"
    ) in out.err
    assert "worker: the new one is ready; the old one finishes and exits" in out.out
    ready_at = float((tmp_path / f"ready-{seen['new']}").read_text())
    assert float((tmp_path / f"stopped-{seen['old']}").read_text()) >= ready_at
    assert not process_alive(seen["new"])  # stopped with the supervisor
