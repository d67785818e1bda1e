"""An existing Celery application made durable by one line (`durable(app)`, in
tests/e2e/celery_app.py), with real processes: a producer process, the app's own Celery worker
(killed -9 twice and restarted), delaysvc's delivery and consume workers and beat. On Redis and
on RabbitMQ as the app's broker: every task runs (on Redis, but one a killed worker had just
taken off the queue: `_Publishes.settled`), none before its ETA, its result readable by id; a
task retrying itself with `countdown` survives the worker's restart between retries."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text

from delaysvc import store
from delaysvc.contrib.celery import key_for
from tests.e2e.conftest import Service, rabbitmq_wanted, wait_for

pytestmark = pytest.mark.e2e

COUNT = 1000


def _redis_broker() -> str | None:
    """The Redis of CI's second pass, another database of it for the app."""
    broker = os.environ.get("DELAYSVC_TEST_BROKER_URL", "")
    return broker.rsplit("/", 1)[0] + "/14" if broker.startswith("redis://") else None


BROKERS = [
    pytest.param(
        "redis",
        marks=pytest.mark.skipif(
            _redis_broker() is None,
            reason="the app's broker is the Redis of CI's second pass (DELAYSVC_TEST_BROKER_URL)",
        ),
    ),
    pytest.param(
        "rabbitmq",
        marks=pytest.mark.skipif(
            bool(os.environ.get("DELAYSVC_TEST_BROKER_URL")) or not rabbitmq_wanted(),
            reason="~90 s: runs in CI's first pass, with the RabbitMQ CI starts (127.0.0.1:5672)",
        ),
    ),
]


def _app_worker(service: Service) -> subprocess.Popen[bytes]:
    """The application's own Celery worker, as its users start it."""
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.e2e.celery_app",
        "worker",
        "-c",
        "2",
        "-n",
        f"app{len(service.processes)}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "INFO",
    ]
    return service._start(command, "app")


def _purge(broker: str, queue: str) -> None:
    """The app's queue, gone from the broker (a RabbitMQ queue outlives the test)."""
    from kombu import Connection, Queue

    with Connection(broker) as conn, contextlib.suppress(Exception):  # not there
        Queue(queue).bind(conn.default_channel).delete()


class _Publishes:
    """delaysvc's record of each stored publish (a task, or a retry of it: `key_for`) beside
    the runs the app recorded, and what the app's broker still holds."""

    def __init__(self, service: Service, broker: str, queue: str):
        self.service, self.broker, self.queue = service, broker, queue

    def unrun(self) -> list[Any]:
        """The stored publishes with no run: key, status (succeeded = published to the app's
        broker), when delaysvc recorded it, and whether that was over 15 s ago (a task the
        broker held must have run by then: visibility timeout 10 s, restore sweep 2 s)."""
        runs = self.service.rows("SELECT kind, task_id, n FROM public.celery_run")
        ran = {r.task_id if r.kind == "remind" else key_for(r.task_id, r.n) for r in runs}
        stored = self.service.rows(
            "SELECT key, status, finished_at, "
            "clock_timestamp() - finished_at > interval '15 seconds' AS long_ago "
            "FROM message WHERE topic LIKE 'celery.%'"
        )
        return [row for row in stored if row.key not in ran]

    def broker_holds(self) -> tuple[int, int] | None:
        """Redis: (messages in the queue, unacknowledged); None for RabbitMQ."""
        if not self.broker.startswith("redis://"):
            return None
        import redis

        client = redis.Redis.from_url(self.broker)
        return client.llen(self.queue), client.hlen("unacked")

    def settled(self) -> list[Any] | None:
        """-> the publishes the app's broker lost (empty: every one ran) once nothing is
        pending, else None. Redis loses a message a worker takes off the queue (BRPOP) and is
        killed -9 before recording it as unacknowledged (kombu's Redis transport,
        celery/kombu#305): it was published (succeeded) and is nowhere in Redis. RabbitMQ
        loses nothing."""
        unrun = self.unrun()
        if not unrun:
            return []
        idle = self.broker_holds() == (0, 0)
        if idle and all(row.status == "succeeded" and row.long_ago for row in unrun):
            return unrun
        return None

    def explain(self) -> str:
        unrun = self.unrun()
        return (
            f"{len(unrun)} stored publishes not run, delaysvc has them as "
            f"{dict(collections.Counter(row.status for row in unrun))}; the app's broker holds "
            f"{self.broker_holds()} (queue, unacked); first five: {[tuple(r) for r in unrun[:5]]}"
        )


def _lost_explained(service: Service, broker: str, lost: list[Any], kills: list[Any]) -> str:
    """What the app's logs and its Redis say of the publishes it lost."""
    import redis

    logs = "\n".join(p.read_text(errors="replace") for p in sorted(service.logs.glob("app-*")))
    seen = {row.key: logs.count(row.key.split("/")[0]) for row in lost}
    keys = sorted(k.decode(errors="replace") for k in redis.Redis.from_url(broker).keys("*"))
    return (
        f"{len(lost)} lost (kills at {kills}); mentions of each in the app's logs: {seen}; "
        f"the app's Redis keys: {keys[:40]}\n{service.log_tail(40)}"
    )


@pytest.fixture
def app_broker(request: pytest.FixtureRequest) -> str:
    """The application's broker: the Redis of CI's second pass (another database of it), or
    the machine's RabbitMQ, held by this test while its workers run (the `rabbitmq` fixture)."""
    if request.param == "redis":
        broker = _redis_broker()
        assert broker is not None
        return broker
    return str(request.getfixturevalue("rabbitmq"))


@pytest.mark.parametrize("app_broker", BROKERS, indirect=True)
def test_countdowns_survive_killed_workers(app_broker, service_factory, engine, database_url):
    broker = app_broker
    broker_kind = "redis" if broker.startswith("redis://") else "rabbitmq"
    queue = f"durable_e2e_{uuid.uuid4().hex[:8]}"
    if broker_kind == "redis":
        import redis

        redis.Redis.from_url(broker).flushdb()
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE public.celery_run (kind text, task_id text, n int, due timestamptz, "
                "pid int, ran_at timestamptz DEFAULT clock_timestamp())"
            )
        )
    service = service_factory(handlers="tests.e2e.handlers,tests.e2e.celery_app")
    service.env.update(APP_BROKER_URL=broker, APP_QUEUE=queue)
    service.start(concurrency=2)
    try:
        worker = _app_worker(service)
        produced = subprocess.run(
            [sys.executable, "-m", "tests.e2e.celery_app", str(COUNT)],
            env=service.env,
            cwd=service.env["PYTHONPATH"],
            capture_output=True,
            check=True,
            timeout=180,
        )
        sent = json.loads(produced.stdout)
        reminders: dict[str, float] = sent["reminders"]
        # nothing waits in the broker: all of it is in delaysvc, one message per task (in
        # `message`: on a slow machine the first countdowns, 5 s, have run and their rows moved
        # to the history before the last task is sent)
        assert (
            service.scalar("SELECT count(*) FROM message WHERE topic = 'celery.e2e.remind'")
            == COUNT
        )

        def runs() -> int:
            return service.scalar("SELECT count(DISTINCT task_id) FROM public.celery_run")

        def flaky_runs() -> int:
            return service.scalar("SELECT count(*) FROM public.celery_run WHERE kind = 'flaky'")

        kills = []  # the database's clock at each kill
        for _ in range(2):  # killed while tasks are due and running, then started again
            target = runs() + 150
            wait_for(lambda t=target: runs() >= t, 90, "150 more tasks to run")
            kills.append(service.scalar("SELECT clock_timestamp()"))
            service.kill(worker)
            time.sleep(1)
            worker = _app_worker(service)

        publishes = _Publishes(service, broker, queue)
        lost: list[Any] = []

        def settled() -> bool:
            """Every stored publish ran (the flaky task's four included), but those Redis lost."""
            found = publishes.settled()
            if found is None:
                return False
            if not any(row.key.startswith(sent["flaky"]) for row in found) and flaky_runs() < 4:
                return False  # its next retry is being stored
            lost[:] = found
            return True

        wait_for(
            settled,
            150,
            f"all {COUNT} reminders and the flaky task's four runs",
            explain=publishes.explain,
        )
    except BaseException:
        print(service.log_tail(60))
        raise

    # each publish that never ran was taken off Redis's queue by a worker killed that moment
    for row in lost:
        assert broker_kind == "redis", f"{broker_kind} lost {row.key}"
        assert any(abs((row.finished_at - kill).total_seconds()) < 2 for kill in kills), (
            f"{row.key}, published at {row.finished_at}, never ran, yet no kill was near: {kills}"
        )
    assert len(lost) <= 2 * len(kills), _lost_explained(service, broker, lost, kills)
    lost_keys = {row.key for row in lost}
    print(f"{broker_kind}: lost by the broker in a kill: {sorted(lost_keys)}")

    rows = service.rows("SELECT kind, task_id, n, due, ran_at FROM public.celery_run")
    reminded = [r for r in rows if r.kind == "remind"]
    assert {r.task_id for r in reminded} == set(reminders) - lost_keys
    # at least once: a task a killed worker held (2 processes, prefetch 1) may run again
    assert len(reminded) - len(set(reminders) - lost_keys) <= 2 * 2 * 2
    early = [r for r in reminded if r.ran_at < r.due]
    assert not early, f"{len(early)} ran before their ETA: {early[:3]}"
    late = max((r.ran_at - r.due).total_seconds() for r in reminded)
    print(f"{broker_kind}: {len(reminded)} runs of {COUNT} tasks, latest {late:.1f} s after due")

    # the flaky task: runs 0..3 of one id, each retry 8 s after the run before, across restarts
    # (unless a kill lost one of its publishes, which ends it there)
    flaky = sorted((r for r in rows if r.kind == "flaky"), key=lambda r: r.n)
    flaky_lost = any(key.startswith(sent["flaky"]) for key in lost_keys)
    assert [r.n for r in flaky] == list(range(len(flaky) if flaky_lost else 4))
    assert {r.task_id for r in flaky} <= {sent["flaky"]}
    for before, after in itertools.pairwise(flaky):
        assert (after.ran_at - before.ran_at).total_seconds() >= 8

    # results readable by id, from the backend as any client reads them
    reader = Celery("reader", backend="db+" + database_url, set_as_current=False)
    try:
        for task_id in [task_id for task_id in reminders if task_id not in lost_keys][:50]:
            result = reader.AsyncResult(task_id)
            assert result.get(timeout=30) % 2 == 0 and result.state == "SUCCESS"
        if not flaky_lost:
            assert reader.AsyncResult(sent["flaky"]).get(timeout=30) == "done"
    finally:
        reader.close()

    # delaysvc ran each stored publish once: the reminders and the flaky task's 4 publishes
    assert service.count_status("succeeded", "celery.e2e.remind") == COUNT
    assert service.count_status("succeeded", "celery.e2e.flaky") == len(flaky)
    # the dashboard's topics: the tasks under their names, handled by the `celery.*` handler
    with engine.connect() as conn:
        stats = {row.topic: row for row in store.topic_stats(conn)}
    assert stats["celery.e2e.remind"].handled and stats["celery.e2e.flaky"].handled
    service.stop()  # the app's worker first: it would declare its queue again
    _purge(broker, queue)
