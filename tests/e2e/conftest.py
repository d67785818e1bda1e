"""A real delaysvc deployment per test: Celery delivery and consume workers and beat as separate
processes (the commands `delaysvc up` runs), on the test's own database, with Redis when
`DELAYSVC_TEST_BROKER_URL` names it and the embedded filesystem broker otherwise."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.db.names import qualify
from delaysvc.producer.sending import Producer
from delaysvc.runtime.commands import WEB_SERVERS, beat_command, web_command, worker_commands
from delaysvc.runtime.supervisor import (
    die_with_parent,
)
from tests.conftest import ROOT, TEST_LEVELS, embedded_pg_ctl, outside_env, process_alive

pytestmark = pytest.mark.e2e


def rabbitmq_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


def rabbitmq_wanted() -> bool:
    """A RabbitMQ answers here, or CI says one must (then a test needing it cannot skip)."""
    return rabbitmq_up() or bool(os.environ.get("DELAYSVC_TEST_REQUIRE_RABBITMQ"))


def send_many(
    producer: Producer, count: int, topic: str = "e2e.unhandled", **options: object
) -> list[int]:
    """`count` messages of `topic` (bodies numbered), in batches of 5,000; -> their ids."""
    ids: list[int] = []
    for start in range(0, count, 5000):
        items = [
            {"topic": topic, "body": {"n": n}, **options}
            for n in range(start, min(count, start + 5000))
        ]
        ids.extend(m.id for m in producer.send_batch(items))
    return ids


def wait_for(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    every: float = 0.1,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll `condition` until it returns something truthy; fail naming `what` after timeout,
    with what `explain` finds then (where things stand) when given."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            found = f": {explain()}" if explain else ""
            pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {value!r}){found}")
        time.sleep(every)


def children_end_with_their_killed_parent(
    script: str, *args: str, children: int, what: str
) -> None:
    """Run `script` (Python) as a process that starts `children` children, prints their pids
    on one line and waits; kill it outright (SIGKILL: no teardown runs) and fail unless every
    child ends too within 10 s. Whatever is left is killed after."""
    env = outside_env()
    env["PYTHONPATH"] = str(ROOT)
    parent = subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    started = [int(pid) for pid in parent.stdout.readline().split()]
    try:
        assert len(started) == children
        assert all(process_alive(pid) for pid in started)
        parent.kill()
        parent.wait(timeout=30)
        wait_for(lambda: not any(process_alive(pid) for pid in started), 10, what)
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in started:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


class Service:
    def __init__(self, database_url: str, var_dir: Path, engine: Engine, **settings: str):
        self.engine = engine
        self.env = outside_env()
        self.env.update(
            DELAYSVC_DATABASE_URL=database_url,
            DELAYSVC_DELAY_LEVELS=TEST_LEVELS,
            DELAYSVC_HANDLERS="tests.e2e.handlers",
            DELAYSVC_VAR_DIR=str(var_dir),
            DELAYSVC_LANE_BUDGET_SECONDS="2",
            PYTHONPATH=str(ROOT),
        )
        broker = os.environ.get("DELAYSVC_TEST_BROKER_URL")
        if broker:
            self.env["DELAYSVC_BROKER_URL"] = broker
        self.env.update({f"DELAYSVC_{k.upper()}": v for k, v in settings.items()})
        self.settings = Settings.from_env(self.env)
        self.var_dir = var_dir
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs = var_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def _start(self, command: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}-{len(self.processes)}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(
            command,
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # a test process killed outright runs no teardown: its deployment ends with it
            # all the same, and no worker lives on to take the next run's tasks
            preexec_fn=die_with_parent(),
        )
        self.processes.append(process)
        return process

    def delivery_worker(self, name: str = "delivery") -> subprocess.Popen[bytes]:
        (command,) = worker_commands(self.settings, delivery=True, consume=False)
        return self._start(_named(command, f"{name}{len(self.processes)}@%h"), name)

    def consume_worker(self, concurrency: int = 1) -> subprocess.Popen[bytes]:
        (command,) = worker_commands(
            self.settings, delivery=False, consume=True, concurrency=concurrency
        )
        return self._start(_named(command, f"consume{len(self.processes)}@%h"), "consume")

    def beat(self) -> subprocess.Popen[bytes]:
        return self._start(beat_command(self.settings), "beat")

    def web(
        self, port: int, workers: int = 2, server: str = WEB_SERVERS[0]
    ) -> subprocess.Popen[bytes]:
        """gunicorn serving the API and dashboard, as `delaysvc web --server SERVER` runs it
        (by default as `delaysvc web` does)."""
        return self._start(web_command("127.0.0.1", port, workers, server=server), "web")

    def start(self, consumers: int = 1, concurrency: int = 1) -> None:
        """The usual deployment: a delivery worker, consumer workers, beat."""
        self.delivery_worker()
        for _ in range(consumers):
            self.consume_worker(concurrency)
        self.beat()

    def kill(self, process: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        """Signal the process and its children (a prefork pool) at once, as a crash would."""
        os.killpg(process.pid, sig)
        process.wait(timeout=30)

    def stop(self) -> None:
        """Warm shutdown, as `delaysvc up` does it: SIGTERM to each main process only (a
        prefork pool whose children are signalled too hangs on shutdown)."""
        stop_all([self])

    def log_tail(self, lines: int = 40) -> str:
        out = []
        for path in sorted(self.logs.iterdir()):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # -- what the tests look at ----------------------------------------------------

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(text(qualify(sql)), params).scalar()

    def rows(self, sql: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(text(qualify(sql)), params))

    def count_status(self, status: str, topic: str | None = None) -> int:
        return self.scalar(
            # the state as readers see it (a moved message's commit_log row is as it was), finished
            # messages wherever they are (commit_log or the history: beat sweeps them)
            f"SELECT count(*) FROM message c WHERE {store.STATUS} = :status "
            "AND (CAST(:topic AS text) IS NULL OR c.topic = :topic)",
            status=status,
            topic=topic,
        )


def stop_all(services: list[Service]) -> None:
    """`Service.stop` of several deployments at once: every process is told first, then each
    is waited for, so their warm shutdowns (~3 s for a consume worker: its pool's teardown)
    overlap instead of adding up."""
    processes = [process for service in services for process in service.processes]
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _named(command: list[str], name: str) -> list[str]:
    command = list(command)
    command[command.index("-n") + 1] = name
    return command


@pytest.fixture(autouse=True)
def check_clean_at_the_end(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test on a database of its own ends with `delaysvc check` clean on it, once the
    deployments it started are stopped (set up before them, this is torn down after them)."""
    if "database_url" not in request.fixturenames:
        yield  # a test that brings its own database (`delaysvc up`'s)
        return
    url = request.getfixturevalue("database_url")
    yield
    assert_check_clean(url)


def assert_check_clean(url: str) -> None:
    """`delaysvc check` on the database at `url` finds nothing, or the test fails with its
    lines."""
    from sqlalchemy.pool import NullPool

    from delaysvc.db.engines import make_engine
    from delaysvc.maintenance.check import run_check

    engine = make_engine(Settings(), url, poolclass=NullPool)
    try:
        result = run_check(engine)
    finally:
        engine.dispose()
    if not result.ok:
        pytest.fail("delaysvc check after the test:\n" + "\n".join(result.lines()))


@pytest.fixture
def service_factory(
    database_url: str, engine: Engine, tmp_path: Path
) -> Iterator[Callable[..., Service]]:
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE public.e2e_run (message_id bigint, attempt int, pid int, note text, "
                "at timestamptz DEFAULT clock_timestamp())"
            )
        )
    broker = os.environ.get("DELAYSVC_TEST_BROKER_URL")
    if broker and broker.startswith("redis://"):
        import redis

        redis.Redis.from_url(broker).flushdb()
    made: list[Service] = []

    def make(**settings: str) -> Service:
        """A deployment on the test's database (at `database_url`, when given: through a
        pooler) with these `DELAYSVC_*` settings."""
        url = settings.pop("database_url", database_url)
        service = Service(url, tmp_path / f"var{len(made)}", engine, **settings)
        made.append(service)
        return service

    yield make
    stop_all(made)


@pytest.fixture
def service(service_factory: Callable[..., Service]) -> Service:
    return service_factory()


def restart_postgres() -> None:
    """Crash-restart the test PostgreSQL (`-m immediate`: no checkpoint, clients cut off, as in
    a power loss of the server process) and wait until it accepts connections again."""
    if os.environ.get("DELAYSVC_TEST_DATABASE_URL"):
        (version,) = os.listdir("/etc/postgresql")
        subprocess.run(
            [
                "pg_ctlcluster",
                "--skip-systemctl-redirect",
                "-m",
                "immediate",
                version,
                "main",
                "restart",
            ],
            check=True,
            timeout=120,
        )
    else:
        embedded_pg_ctl("-w", "-m", "immediate", "restart")


def tolerant(
    query: Callable[[], Any], errors: type[Exception] | tuple[type[Exception], ...] = ()
) -> Callable[[], Any]:
    """A wait_for condition that treats a dropped database connection as 'not yet' (or, given
    `errors`, those: a server not answering yet)."""
    from sqlalchemy.exc import OperationalError

    caught = errors or OperationalError

    def attempt() -> Any:
        try:
            return query()
        except caught:
            return None

    return attempt
