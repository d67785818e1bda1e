"""The Celery peer: `apply_async(countdown=...)` on the Redis broker, configured for
durability as Celery's docs advise (late acks, reject on worker loss, one prefetch). Its
worker is `celery -A delaysvc.bench.peer_celery worker`; the broker URL comes from
`DELAYSVC_BENCH_CELERY_BROKER` (the bench sets it for the worker it starts).

Not durable, whatever the settings: a countdown task is taken off the broker at once and held
in the worker's RAM until due (unbounded: ETA tasks ignore the prefetch limit); an ETA past
the broker's visibility_timeout is delivered again to another worker (duplicates)."""

from __future__ import annotations

import os

from celery import Celery

from delaysvc.bench.record import record

BROKER_ENV = "DELAYSVC_BENCH_CELERY_BROKER"
QUEUE = "delaysvc_bench_peer"
TASK = "delaysvc_bench.peer_noop"
VISIBILITY_TIMEOUT = 3600  # Redis transport default, stated so the report can quote it


def received(i: int, due: float) -> None:
    record(i, due)


def make_app(broker: str) -> Celery:
    # not the process's current app: importing it (the bench does) must not take over the
    # `shared_task`s of the service's own tasks
    app = Celery("delaysvc_bench_peer", broker=broker, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=QUEUE,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    app.task(name=TASK, ignore_result=True)(received)
    return app


app = make_app(os.environ.get(BROKER_ENV, "redis://127.0.0.1:6379/14"))
