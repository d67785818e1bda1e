"""The consume worker's Celery tasks run in this process (no broker in between), on the test
database: what they report."""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import text

from delaysvc.config import logs
from delaysvc.db.names import schema
from delaysvc.tasks import deployment
from delaysvc.tasks.app import CONSUME_QUEUE, create_celery_app
from delaysvc.worker.consumer import Consumer

tasks_app = importlib.import_module("delaysvc.tasks.app")  # the package's `app` is the Celery app
consume_tasks = importlib.import_module("delaysvc.tasks.consume")
ELSEWHERE = "7000000000000000001/elsewhere/delaysvc"


@pytest.fixture
def celery_app(settings, monkeypatch) -> Iterator[Celery]:
    """delaysvc's Celery app on the test database, current, with a runtime of its own."""
    monkeypatch.setattr(tasks_app, "_runtime", None)
    monkeypatch.setattr(consume_tasks, "_reported_at", None)
    for name in ("_ours", "_settings", "_tried_at"):
        monkeypatch.setattr(deployment, name, None)
    monkeypatch.setattr(deployment, "_theirs_seen", logs.Sparingly(deployment.SAY_SECONDS))
    app = create_celery_app(settings.model_copy(update={"broker_url": "memory://"}))
    app.set_current()
    yield app
    tasks_app.runtime().engine.dispose()
    app.close()


def consumer_seen(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM heartbeat WHERE component = 'consumer'")
        ).scalar_one()


def test_a_consume_task_reports_the_consumers_in(celery_app, engine, producer) -> None:
    """Only the sweep (fired by beat every second, expiring after a second) reported the
    consumers in, from the consume queue: behind a backlog of consume tasks (5,105 after a
    PostgreSQL restart) every sweep expired unrun, and /healthz said `"consumer": false`,
    degraded, for minutes while the consumers ran 110 jobs a second."""
    assert consumer_seen(engine) == 0
    consume_tasks.consume.run("no.such.topic")
    assert consumer_seen(engine) == 1


def published(app: Celery) -> list:
    """The messages the app published to the consume queue (its memory broker), taken off it."""
    taken = []
    with app.connection_for_read() as conn, conn.SimpleQueue(CONSUME_QUEUE) as queue:
        while queue.qsize():
            message = queue.get(timeout=1)
            message.ack()
            taken.append(message)
    return taken


def test_a_bound_tasks_outcome_from_another_deployment_is_not_written_here(
    celery_app, engine, producer, settings, caplog
) -> None:
    """Two deployments given one broker take each other's tasks (their queues have the same
    names), a bound task and its outcome among them: `task_succeeded` and `task_failed` name a
    message and a claim by their numbers, which this database may hold too, running; written
    here, they ended a job whose task had not finished, or retried one that had not failed
    (found on review; the failure's callback is called inside the worker that ran the task,
    no message, so a header on it was never read). An outcome carries the deployment that
    dispatched its task as an argument, and another deployment's worker drops it, saying so."""
    with engine.connect() as conn:
        ours = deployment.learn(conn)
    assert ours.endswith(f"/{schema()}")
    bound = settings.model_copy(update={"task_topics": {"t.bound": "proj.work"}})
    claims = []
    consumer = Consumer(bound, engine, lambda _task, job, claim: claims.append((job, claim)))
    succeeding, failing = producer.send("t.bound", {"n": 1}), producer.send("t.bound", {"n": 2})
    consumer.run_once("t.bound")
    jobs = {job.id: (job, claim) for job, claim in claims}

    def outcomes_sent_by(sender: str, message_id: int):
        """The success and failure callbacks a deployment named `sender` gives the task."""
        deployment._ours = sender
        tasks_app.dispatch_to_celery("proj.work", *jobs[message_id])
        deployment._ours = ours  # the worker that runs the callbacks is this deployment's
        [task] = published(celery_app)
        embed = task.payload[2]
        [succeeded], [failed] = embed["callbacks"], embed["errbacks"]
        return celery_app.signature(succeeded), celery_app.signature(failed)

    def fail(errback) -> object:  # as Celery calls it: in the worker, (request, exc, traceback)
        return errback(None, RuntimeError("the task failed"), None)

    with caplog.at_level("ERROR", logger="delaysvc.tasks.deployment"):
        theirs_ok, _ = outcomes_sent_by(ELSEWHERE, succeeding.id)
        assert theirs_ok.apply((None,)).get() is False
        _, theirs_failed = outcomes_sent_by(ELSEWHERE, failing.id)
        assert fail(theirs_failed) is False
    assert [producer.get(m.id).status for m in (succeeding, failing)] == ["running", "running"]
    [said] = [r for r in caplog.records if r.message == "tasks.other_deployment"]  # once a 30 s
    assert (said.task, said.theirs, said.ours) == ("delaysvc.task_succeeded", ELSEWHERE, ours)

    ours_ok, _ = outcomes_sent_by(ours, succeeding.id)
    assert ours_ok.apply((None,)).get() is True
    _, ours_failed = outcomes_sent_by(ours, failing.id)
    assert fail(ours_failed) is False  # retried, not dead
    assert [producer.get(m.id).status for m in (succeeding, failing)] == ["succeeded", "retrying"]


def test_delaysvcs_tasks_carry_their_deployment_and_another_ones_are_not_run(
    celery_app, engine, settings
) -> None:
    """Each task of delaysvc's is stamped with its deployment as it is published (`consume`
    here), and a consume task stamped for another deployment runs nothing (it would not even
    report the consumers in); one without the stamp (from an older release) runs."""
    with engine.connect() as conn:
        ours = deployment.learn(conn)
    consume_tasks.consume.apply_async(("t.stamped",))
    [task] = published(celery_app)
    assert task.headers[deployment.HEADER] == ours

    consume = consume_tasks.consume
    assert consume.apply(("t.x",), headers={deployment.HEADER: ELSEWHERE}).get() is None
    assert consumer_seen(engine) == 0
    assert consume.apply(("t.x",), headers={deployment.HEADER: ours}).get() == 0
    assert consumer_seen(engine) == 1


def test_a_process_that_could_not_learn_its_deployment_learns_it_when_next_needed(
    celery_app, settings, caplog
) -> None:
    """A worker started while the database was away never learned its deployment, and ran
    every deployment's tasks for good, unsaid (found on review). It says so, and tries again
    when next needed, every RETRY_SECONDS, until it knows."""
    away = settings.model_copy(update={"database_url": "postgresql://nobody@127.0.0.1:9/none"})
    with caplog.at_level("WARNING", logger="delaysvc.tasks.deployment"):
        deployment.know(away)
        assert deployment.ours() is None  # not tried again at once
    assert [r.message for r in caplog.records] == ["tasks.deployment_unknown"]
    deployment._settings = settings  # the database is back
    assert deployment.ours() is None
    deployment._tried_at = time.monotonic() - deployment.RETRY_SECONDS
    learned = deployment.ours()
    assert learned is not None and learned.endswith(f"/{schema()}")
