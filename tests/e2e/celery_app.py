"""The application of tests/e2e/test_celery_durable_e2e.py: an ordinary Celery app, made durable
by its one line (`durable(app)`). Its broker comes from `APP_BROKER_URL` (Redis or RabbitMQ),
its results go to the test's database (Celery's SQLAlchemy backend), its queue is `APP_QUEUE`.
Each task run is a row of `celery_run` in the test's database, so the test counts runs exactly.

Three kinds of process import it: the producer (`python -m tests.e2e.celery_app N`), the app's
Celery worker (`celery -A tests.e2e.celery_app worker`) and delaysvc's workers
(`DELAYSVC_HANDLERS=tests.e2e.celery_app`), which publish the stored tasks when due."""

from __future__ import annotations

import json
import os
import random
import sys
import time

import psycopg
from celery import Celery

from delaysvc.contrib.celery import durable
from delaysvc.db.engines import libpq_url

DATABASE_URL = os.environ["DELAYSVC_DATABASE_URL"]

app = Celery(
    "durable_e2e",
    broker=os.environ.get("APP_BROKER_URL", "memory://"),
    backend="db+" + DATABASE_URL,
)
app.conf.update(
    task_default_queue=os.environ.get("APP_QUEUE", "durable_e2e"),
    # a task a killed worker was running is given again (at least once), as Celery offers it
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    # Redis: a task a killed worker held is back after 10 s, found by a sweep every 2 s (kombu
    # 5.7 sweeps every interval x throttle: 100 s by default, which the test's waits outlast
    # only on a quiet machine)
    broker_transport_options={
        "visibility_timeout": 10,
        "unacked_restore_interval": 2,
        "unacked_restore_throttle": 1,
    },
    result_extended=True,
)
durable(app)


def _record(kind: str, task_id: str, n: int, due: float | None) -> None:
    with psycopg.connect(libpq_url(DATABASE_URL), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO public.celery_run (kind, task_id, n, due, pid) "
            "VALUES (%s, %s, %s, to_timestamp(%s), %s)",
            (kind, task_id, n, due, os.getpid()),
        )


@app.task(bind=True, name="e2e.remind")
def remind(self, n: int, due: float) -> int:  # type: ignore[no-untyped-def]
    _record("remind", self.request.id, n, due)
    return n * 2


@app.task(bind=True, name="e2e.flaky", max_retries=5)
def flaky(self) -> str:  # type: ignore[no-untyped-def]
    """Fails its first three runs, each time retrying itself 8 s later."""
    _record("flaky", self.request.id, self.request.retries, None)
    if self.request.retries < 3:
        raise self.retry(countdown=8)
    return "done"


def produce(count: int) -> dict[str, object]:
    """`count` reminders with countdowns of 5-60 s, and one flaky task: their ids and due
    times (as epoch seconds, taken before each send, so never after its ETA)."""
    rng = random.Random(7)
    reminders = {}
    for n in range(count):
        countdown = rng.uniform(5, 60)
        due = time.time() + countdown
        reminders[remind.apply_async((n, due), countdown=countdown).id] = due
    return {"reminders": reminders, "flaky": flaky.apply_async(countdown=5).id}


if __name__ == "__main__":
    print(json.dumps(produce(int(sys.argv[1]))))
