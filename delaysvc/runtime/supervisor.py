"""Process supervision for `delaysvc up`, `worker`, `beat` and `web`.

`up` starts the embedded PostgreSQL when no database is configured, migrates, then runs the web
app (gunicorn), a delivery worker (threads), a consumer worker (processes) and beat as child
processes sharing one database URL. Ctrl-C or SIGTERM stops the children (Celery's warm
shutdown finishes or releases running jobs), then the embedded server.

Several children share one terminal as honcho and foreman share it: each line is prefixed by
the name of the process that wrote it (`web`, `delivery`, `consume`, `beat`; `delaysvc` for
the supervisor's own). Celery's banners are off (`-q`) and gunicorn's access log is off in
`up` (the dashboard polls every few seconds), so what is left is what needs reading; the
`ready` line comes last, once every part has reported in.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

import click

from delaysvc.config.settings import Settings
from delaysvc.errors import ConfigError
from delaysvc.runtime import reaper
from delaysvc.runtime.commands import (
    STOP_GRACE_SECONDS,
    Command,
    beat_command,
    keeper_command,
    web_command,
    worker_commands,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

log = logging.getLogger(__name__)
SUPERVISOR = "delaysvc"  # the name on the lines `run_processes` writes itself
READY_TIMEOUT_SECONDS = 90.0


class Console:
    """One stream for several processes: each line prefixed by its process's name."""

    def __init__(self, names: Iterable[str]):
        self.width = max(len(name) for name in [SUPERVISOR, *names])
        self._lock = threading.Lock()

    def echo(self, name: str, line: str, err: bool = False) -> None:
        """`line` prefixed by `name`; no name: the line alone, between blank lines."""
        with self._lock:
            click.echo(f"{name:<{self.width}} | {line}" if name else f"\n{line}\n", err=err)

    def relay(self, name: str, stream: IO[bytes]) -> threading.Thread:
        """Copy `stream`'s lines, prefixed, until it ends (the process and its children exit)."""

        def copy() -> None:
            for line in stream:
                self.echo(name, line.decode(errors="replace").rstrip("\r\n"))

        thread = threading.Thread(target=copy, name=f"relay-{name}", daemon=True)
        thread.start()
        return thread


RESTART_BACKOFF_SECONDS = (1, 2, 4, 8, 16, 30)
"""How long a child that exited waits before its restart: the nth quick exit in a row waits the
nth figure (the last one from then on)."""
STEADY_SECONDS = 30.0
"""A child that ran this long before it exited starts its backoff afresh."""
QUICK_EXITS_BEFORE_GIVING_UP = 5
"""A child that exits this many times in a row without running STEADY_SECONDS cannot start
(a setting, the database, a port): the supervisor stops everything and says so."""


def die_with_parent(parent: int | None = None) -> Callable[[], None] | None:
    """On Linux, a function for `preexec_fn` that has the kernel send the child SIGTERM when
    its supervisor dies, however it dies (SIGKILL, the OOM killer, a closed terminal), so no
    child outlives it and keeps a port or a lane for a deployment nobody supervises. The
    signal follows the thread that started the child: `Supervisor` starts every child from
    the thread that runs its loop. `parent`: the supervisor's pid (default: this process's;
    gunicorn's workers call it after their fork with their master's:
    `delaysvc.runtime.gunicorn_hooks`). Elsewhere: None (the children outlive a killed
    supervisor)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up now: nothing to load after fork
    if parent is None:
        parent = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class Reaper:
    """The supervisor's reaper (`delaysvc.runtime.reaper`): told each child as it starts, it
    kills those still running STOP_GRACE_SECONDS after the supervisor died without stopping
    them. None of its failures is the supervisor's: a reaper that cannot be told is left."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        if hasattr(os, "pidfd_open"):  # Linux
            command = [sys.executable, "-m", "delaysvc.runtime.reaper", str(STOP_GRACE_SECONDS)]
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True)

    def watch(self, process: subprocess.Popen[bytes], name: str) -> None:
        self._tell(f"{process.pid} {name}\n".encode())

    def stopped(self) -> None:
        """Every child stopped by the supervisor: the reaper exits."""
        self._tell(reaper.STOPPED + b"\n")
        if self.process is not None:
            with suppress(OSError):
                self.process.stdin.close()  # type: ignore[union-attr]
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)

    def _tell(self, line: bytes) -> None:
        if self.process is None or self.process.stdin is None or self.process.stdin.closed:
            return
        with suppress(OSError):  # it died: the children still die with the supervisor, unkilled
            self.process.stdin.write(line)
            self.process.stdin.flush()


class Child:
    """One supervised process: its command, the running process, its restart record, and the
    process a reload started to replace it, until that one is ready (`successor`)."""

    def __init__(self, command: Command):
        self.command = command
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.quick_exits = 0
        self.restart_at: float | None = None
        self.successor: Successor | None = None


class Successor:
    """A reload's new process for a child, until it says it is ready (its `ready_file`)."""

    def __init__(self, process: subprocess.Popen[bytes], ready_file: Path, deadline: float):
        self.process = process
        self.ready_file = ready_file
        self.deadline = deadline


class Supervisor:
    """Starts the commands and keeps them running: a child that exits is restarted after a
    backoff, with a line saying so; one that keeps exiting at start stops everything. Several
    commands share the terminal through `console`; one alone writes to it directly.
    `keep_open` is a file descriptor every child inherits (`deployment_lock`)."""

    def __init__(
        self,
        commands: Sequence[Command],
        env: dict[str, str] | None,
        console: Console | None,
        keep_open: int | None = None,
    ):
        self.children = [Child(command) for command in commands]
        self.env = env
        self.console = console
        self.keep_open = () if keep_open is None else (keep_open,)
        self.relays: list[threading.Thread] = []
        self.retiring: list[subprocess.Popen[bytes]] = []  # replaced by a reload, finishing
        self.preexec = die_with_parent()
        self.reaper = Reaper()

    def say(self, line: str, err: bool = False) -> None:
        if self.console is None:
            click.echo(line, err=err)
        else:
            self.console.echo(SUPERVISOR, line, err=err)

    def start(self, child: Child) -> None:
        child.started, child.restart_at = time.monotonic(), None
        child.process = self._spawn(child.command, self.env)

    def _spawn(self, command: Command, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
        common: dict[str, Any] = {
            "start_new_session": True,  # the terminal's Ctrl-C reaches the supervisor alone
            "preexec_fn": self.preexec,
            "pass_fds": self.keep_open,
        }
        if self.console is None:
            process = subprocess.Popen(list(command), env=env, **common)
            self.reaper.watch(process, command.name)
            return process
        process = subprocess.Popen(
            list(command),
            env=dict(env or os.environ, PYTHONUNBUFFERED="1"),  # lines as they are written
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **common,
        )
        self.reaper.watch(process, command.name)
        assert process.stdout is not None
        self.relays.append(self.console.relay(command.name, process.stdout))
        return process

    def reload(self) -> None:
        """SIGHUP, as gunicorn takes it: new code and handler modules without a gap. gunicorn
        gets the signal and replaces its workers itself; any other child is replaced: the new
        process starts first, and once it is ready (it takes work: `Command.says_ready`) the
        old one gets SIGTERM and finishes what it runs (Celery's warm shutdown). A new one
        that cannot start (a handler module that does not import, levels the database does
        not have) leaves the old one running, and says so (`_follow`)."""
        for child in self.children:
            process = child.process
            if process is None or process.poll() is not None:
                continue  # waiting for its restart: it starts with the new code anyway
            if child.successor is not None:
                continue  # a reload under way: its new process is the new code already
            name = child.command.name
            if child.command.reload_signal is not None:
                self.say(f"reloading {name} (it starts new workers itself)")
                process.send_signal(child.command.reload_signal)
                continue
            if not child.command.says_ready:
                self.say(f"reloading {name}: a new one starts, the old one finishes and exits")
                self.start(child)
                process.send_signal(signal.SIGTERM)
                self.retiring.append(process)
                continue
            from delaysvc.tasks.app import READY_FILE_ENV

            self.say(f"reloading {name}: a new one starts, the old one finishes once it is ready")
            ready_file = Path(tempfile.mkdtemp(prefix="delaysvc-reload-")) / "ready"
            env = dict(self.env or os.environ, **{READY_FILE_ENV: str(ready_file)})
            deadline = time.monotonic() + READY_TIMEOUT_SECONDS
            child.successor = Successor(self._spawn(child.command, env), ready_file, deadline)

    def _follow(self, child: Child, now: float) -> None:
        """A reload's new process for `child`: once ready it takes the old one's place and
        the old one is stopped; one that exits first, or is not ready in time, is let go and
        the old one runs on."""
        successor, name = child.successor, child.command.name
        assert successor is not None
        code = successor.process.poll()
        old = child.process
        if code is not None:
            self.say(
                f"{name}: the new one exited with {code} before it was ready (see its lines "
                "above): the old one keeps running; mend the release and reload again",
                err=True,
            )
        elif successor.ready_file.exists() or old is None or old.poll() is not None:
            child.process, child.started, child.quick_exits = successor.process, now, 0
            if old is not None and old.poll() is None:
                self.say(f"{name}: the new one is ready; the old one finishes and exits")
                old.send_signal(signal.SIGTERM)
                self.retiring.append(old)
        elif now >= successor.deadline:
            self.say(
                f"{name}: the new one was not ready within {READY_TIMEOUT_SECONDS:g} s: "
                "stopped; the old one keeps running",
                err=True,
            )
            successor.process.send_signal(signal.SIGTERM)
            self.retiring.append(successor.process)
        else:
            return
        child.successor = None
        shutil.rmtree(successor.ready_file.parent, ignore_errors=True)

    def check(self) -> str | None:
        """Follow the reloads under way, restart what is due and schedule the restart of what
        exited; -> why everything must stop (a child that cannot start), or None."""
        now = time.monotonic()
        self.retiring = [process for process in self.retiring if process.poll() is None]
        for child in self.children:
            if child.successor is not None:
                self._follow(child, now)
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self.say(f"restarting {child.command.name}")
                    self.start(child)
                continue
            assert child.process is not None
            code = child.process.poll()
            if code is None:
                continue
            name = child.command.name
            child.quick_exits = (
                1 if now - child.started >= STEADY_SECONDS else child.quick_exits + 1
            )
            if child.quick_exits >= QUICK_EXITS_BEFORE_GIVING_UP:
                return (
                    f"{name} exited with {code} {child.quick_exits} times in a row, each within "
                    f"{STEADY_SECONDS:g} s of starting: it cannot start (see its lines above); "
                    "stopping all"
                )
            wait = RESTART_BACKOFF_SECONDS[min(child.quick_exits, len(RESTART_BACKOFF_SECONDS)) - 1]
            self.say(f"{name} exited with {code}; restarting it in {wait} s", err=True)
            child.restart_at = now + wait
        return None

    def stop_all(self) -> None:
        running = [c.process for c in self.children if c.process is not None] + self.retiring
        running += [c.successor.process for c in self.children if c.successor is not None]
        for process in running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(
                    f"{self._name_of(process)} did not stop within {STOP_GRACE_SECONDS} s: "
                    "killed (a job it was running runs again once its lease ends)",
                    err=True,
                )
                process.kill()
                process.wait()
        self.reaper.stopped()
        for child in self.children:  # a reload under way: its ready file's folder goes too
            if child.successor is not None:
                shutil.rmtree(child.successor.ready_file.parent, ignore_errors=True)
        for relay in self.relays:
            relay.join(timeout=2)  # the children's last lines

    def _name_of(self, process: subprocess.Popen[bytes]) -> str:
        for child in self.children:
            if child.process is process:
                return child.command.name
        return f"a replaced process (pid {process.pid})"


def run_processes(
    commands: Sequence[Command],
    env: dict[str, str] | None = None,
    on_started: Callable[[Supervisor], None] | None = None,
    console: Console | None = None,
    keep_open: int | None = None,
) -> int:
    """Run the commands, restarting any that exits (`Supervisor`), until we are told to stop
    (Ctrl-C, SIGTERM: -> 0) or a child cannot start (-> 1); then stop them all. SIGHUP reloads
    them (`Supervisor.reload`). Every child dies with this process (`die_with_parent`)."""
    if len(commands) > 1 and console is None:
        console = Console(command.name for command in commands)
    supervisor = Supervisor(commands, env, console, keep_open)
    stopping = {"signal": 0}

    def stop(signum: int, _frame: object) -> None:
        stopping["signal"] = signum

    def reload(_signum: int, _frame: object) -> None:
        # done by the loop, which alone starts children (`die_with_parent`). A plain flag, as
        # `stopping`: a handler runs in the loop's thread, between any two of its steps, and
        # one taking a lock the loop held (an Event's, being cleared) waited for it forever
        reloads["asked"] = True

    reloads = {"asked": False}
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, reload)
    failed = False
    try:
        for child in supervisor.children:
            supervisor.start(child)
        if on_started is not None:  # beside the loop, which must see a child exit at once
            threading.Thread(
                target=on_started, args=(supervisor,), name="on-started", daemon=True
            ).start()
        while not stopping["signal"]:
            if reloads["asked"]:
                reloads["asked"] = False
                supervisor.reload()
            why = supervisor.check()
            if why is not None:
                supervisor.say(why, err=True)
                failed = True
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        if stopping["signal"] and console is not None:
            console.echo(SUPERVISOR, "stopping all")
        supervisor.stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 1 if failed else 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server to start on)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until_answering(
    url: str, timeout: float = 60.0, process: subprocess.Popen[Any] | None = None
) -> bool:
    """Until `url` answers (True), `timeout` passes or `process` (the server) exits (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (process is None or process.poll() is None):
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status < 500:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


Ages = Callable[[], dict[str, float | None]]
"""Seconds since each part last wrote its heartbeat (None: never); raises while unreachable."""


def not_yet_reported(ages: Ages, started: float, timeout: float) -> list[str]:
    """Wait until every part `ages` names has written a heartbeat since `started` (a
    `time.monotonic()`); -> those that had not by `timeout` (none: all run)."""
    deadline = started + timeout
    late: list[str] = ["web"]
    while time.monotonic() < deadline:
        try:
            seen = ages()
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
            continue
        since = time.monotonic() - started
        late = [name for name, age in seen.items() if age is None or age > since]
        if not late:
            return []
        time.sleep(0.1)
    return late


def healthz_ages(url: str) -> Ages:
    """The heartbeats as the web app reports them: it answers, and the parts run."""

    def ages() -> dict[str, float | None]:
        with urllib.request.urlopen(url, timeout=2) as response:
            return dict(json.loads(response.read())["seconds_since"])

    return ages


def database_ages(settings: Settings, parts: Sequence[str]) -> Ages:
    """The heartbeats of `parts` as the database has them (`heartbeats.read_health`)."""
    from delaysvc.db.engines import make_engine
    from delaysvc.maintenance import heartbeats

    engine = make_engine(settings)

    def ages() -> dict[str, float | None]:
        checked = heartbeats.read_health(engine)
        if not checked.database:
            raise OSError("the database does not answer")
        return {part: checked.seconds_since[part] for part in parts}

    return ages


def announce_when_ready(ages: Ages, started: float, ready: str) -> Callable[[Supervisor], None]:
    """An `on_started` for `run_processes` printing `ready` once every part has reported in."""

    def announce(supervisor: Supervisor) -> None:
        late = not_yet_reported(ages, started, READY_TIMEOUT_SECONDS)
        if late:
            supervisor.say(
                f"not ready after {READY_TIMEOUT_SECONDS:g} s: no word from {', '.join(late)} "
                "(see its lines above)",
                err=True,
            )
        elif supervisor.console is not None:  # unprefixed, between blank lines
            supervisor.console.echo("", ready)
        else:
            supervisor.say(ready)

    return announce


def run_worker(settings: Settings, commands: Sequence[Command]) -> int:
    """`delaysvc worker`: its Celery workers, and a line once their parts run."""
    parts = [
        part
        for part, name in (("delivery", "delivery"), ("consumer", "consume"))
        if any(command.name == name for command in commands)
    ]
    ready = f"delaysvc worker ready: {' and '.join(parts)} running"
    announce = announce_when_ready(database_ages(settings, parts), time.monotonic(), ready)
    return run_processes(commands, on_started=announce)


DEPLOYMENT_WAIT_SECONDS = 60.0


def deployment_lock(var_dir: Path, say: Callable[[str], None]) -> int:
    """Hold `<var_dir>/up.pid` (an exclusive flock, this process's pid inside) for as long as
    this `up` or any of its children lives: every child inherits the descriptor, so a `up`
    killed with SIGKILL keeps it held until its children, told by the kernel, have stopped.
    -> the descriptor. A second `up` on the same var/ is refused while the first runs, and
    waits (at most DEPLOYMENT_WAIT_SECONDS) while a killed one's children finish."""
    path = var_dir.resolve() / "up.pid"
    try:
        var_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise click.ClickException(
            f"cannot write {path} ({exc.strerror}): make {var_dir.resolve()} a folder this "
            "user can write, or set DELAYSVC_VAR_DIR to one"
        ) from None
    deadline = time.monotonic() + DEPLOYMENT_WAIT_SECONDS
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _pid_in(path)
            if holder is not None and _alive(holder):
                os.close(fd)
                raise click.ClickException(
                    f"delaysvc up is already running on {var_dir.resolve()} (pid {holder}); "
                    f"stop it first (Ctrl-C in its terminal, or kill {holder}), or start this "
                    "one with another DELAYSVC_VAR_DIR"
                ) from None
            if time.monotonic() > deadline:
                os.close(fd)
                raise click.ClickException(
                    f"the processes of a delaysvc up that was killed (pid {holder}) still run "
                    f"on {var_dir.resolve()} after {DEPLOYMENT_WAIT_SECONDS:g} s; find them with "
                    f"`fuser {path}` and stop them"
                ) from None
            if not waiting:
                say(f"waiting for the processes of a killed delaysvc up (pid {holder}) to stop")
                waiting = True
            time.sleep(0.5)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): os.kill's answer
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # the state, after the command's name


def _first_admin(engine: Engine) -> str | None:
    """The embedded database's first dashboard login, made on the first `up` and shown once
    (a configured database gets its users from `delaysvc create-user` only)."""
    from delaysvc import auth

    password = auth.create_first_admin(engine)
    if password is None:
        return None
    return (
        f"dashboard login: {auth.FIRST_ADMIN} / {password}  (shown only now; "
        f"`delaysvc create-user {auth.FIRST_ADMIN}` sets another password)"
    )


def require_free_port(host: str, port: int) -> None:
    """Refuse a web address the web server could not listen on, above all one another server
    listens on: gunicorn would try it for a few seconds, exit, and be started again until the
    supervisor gave up, while the rest ran."""
    if not host.strip():
        raise ConfigError("--host is empty: give an address or a name (0.0.0.0: all addresses)")
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"--host {host!r} is no address this machine has a name for ({exc})"
        ) from None
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ConfigError(
                    f"cannot listen on {host}:{port} ({exc.strerror}): give an address of this "
                    "machine (0.0.0.0: all)"
                ) from None
            raise ConfigError(
                f"{host}:{port} is in use ({exc.strerror}: another delaysvc up or web, or "
                "another server): stop it, or give another --port"
            ) from None


class _StopWhileStarting:
    """`up`'s SIGTERM and SIGINT until `run_processes` takes them. SIGTERM's default ends the
    process without its exit handlers, which stop an embedded server it started: a SIGTERM
    here exits through them. While the embedded server starts (`holding`), either signal
    waits until it has: the wheel counts this process as the server's user only once the
    server runs, and a process stopped before that left it running, counted by nobody; and
    initdb, stopped halfway by Python's KeyboardInterrupt (SIGKILL to the child), left a
    folder no later start could use."""

    def __init__(self) -> None:
        self.holding = False
        self.held = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.holding:
            self.held = signum
            return
        self.stop(signum)

    @staticmethod
    def stop(signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(0)  # exit handlers run: an embedded server started so far stops

    @contextmanager
    def held_back(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.held:
            self.stop(self.held)


def run_all(settings: Settings, host: str, port: int) -> int:
    from delaysvc.db.engines import database_url, make_engine, wait_for_database
    from delaysvc.schema.migrate import upgrade

    stopping = _StopWhileStarting()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopping)

    commands = [
        web_command(host, port, access_log=False, log_format=settings.log_format),
        *worker_commands(settings),
        beat_command(settings),
    ]
    console = Console(command.name for command in commands)

    def say(line: str) -> None:
        console.echo(SUPERVISOR, line)

    lock = deployment_lock(settings.var_dir, say)
    require_free_port(host, port)  # after the lock: a second `up` here is named as such
    with stopping.held_back():
        url = database_url(settings, embedded=True)
    engine = make_engine(settings, url)
    if not settings.embedded_database:  # a database of its own: booting with this host, maybe
        wait_for_database(engine, settings.start_wait_seconds, say)
    for change in upgrade(engine, settings.levels):
        console.echo(SUPERVISOR, change.describe())
    first_login = _first_admin(engine) if settings.embedded_database else None
    engine.dispose()
    env = dict(os.environ, DELAYSVC_DATABASE_URL=url)
    if not settings.handler_modules:
        from delaysvc.runtime import demo

        env["DELAYSVC_HANDLERS"] = demo.__name__
        console.echo(
            SUPERVISOR,
            f"handlers: the demo's, for {', '.join(demo.TOPICS)} (no DELAYSVC_HANDLERS; "
            "DELAYSVC_HANDLERS=your.module runs yours instead)",
        )
    else:
        modules = ", ".join(settings.handler_modules)
        console.echo(SUPERVISOR, f"handlers: from {modules} (DELAYSVC_HANDLERS)")
    base = f"http://{host}:{port}"
    if settings.embedded_database:
        where = settings.var_dir.resolve() / "pg"
        console.echo(SUPERVISOR, f"database: embedded PostgreSQL under {where}")
    if not settings.broker_url:
        console.echo(
            SUPERVISOR, f"broker: filesystem under {settings.var_dir.resolve() / 'broker'}"
        )
    console.echo(SUPERVISOR, f"starting {', '.join(command.name for command in commands)}")
    if settings.embedded_database:  # kept running while up runs, stopped when it dies
        commands.append(keeper_command(settings.var_dir))
    if first_login:
        console.echo(SUPERVISOR, first_login)
    announce = announce_when_ready(
        healthz_ages(base + "/healthz"),
        time.monotonic(),
        f"delaysvc ready: dashboard at {base}/  (Ctrl-C stops everything)",
    )
    return run_processes(commands, env=env, on_started=announce, console=console, keep_open=lock)
