"""Consumer tasks: thin wrappers around `delaysvc.worker.consumer.Consumer`."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import shared_task
from celery.signals import worker_process_init, worker_ready, worker_shutdown
from sqlalchemy.pool import NullPool

from delaysvc.db.engines import make_engine
from delaysvc.maintenance.heartbeats import record_heartbeat, report_handlers
from delaysvc.tasks.app import CONSUME_QUEUE, DATABASE_AWAY, runtime
from delaysvc.tasks.deployment import foreign
from delaysvc.worker.consumer import Job
from delaysvc.worker.handlers import registered_topics

log = logging.getLogger(__name__)
LIMITED_BUDGET_SECONDS = 2.0  # a limited topic's task claims again this long before requeueing
REPORT_SECONDS = 5.0  # a consume process running tasks reports the consumers in this often
_reported_at: float | None = None  # when this process last did (time.monotonic())


_stopped = threading.Event()


@worker_ready.connect
def _consumers_ready(sender: Any, **_: object) -> None:
    """A worker serving the consume queue reports in as soon as its processes run (the sweep,
    fired by beat, keeps the heartbeat fresh from then on), and says from then on which topics
    it has handlers for (its handler modules are imported in this process too)."""
    if CONSUME_QUEUE in set(sender.app.amqp.queues.consume_from):
        settings = sender.app.conf.delaysvc_settings
        # an engine of its own that keeps no connection open: the pool's processes are forked
        # from this one, and must not share its connections
        engine = make_engine(settings, poolclass=NullPool)
        record_heartbeat(engine, "consumer")
        report_handlers(engine, lambda: [*registered_topics(), *settings.task_topics], _stopped)


@worker_shutdown.connect
def _stop_reporting(**_: object) -> None:
    _stopped.set()


@worker_process_init.connect
def _warm_consumer(**_: object) -> None:
    """Each consumer process loads its handlers and opens its first connection before its
    first job, not while that job waits."""
    try:
        with runtime().consumer.engine.connect():
            pass
    except Exception:  # the first job will retry the connection, and say why it fails
        log.warning("consume.warm_up_failed", exc_info=True)


@shared_task(name="delaysvc.consume", ignore_result=True, throws=DATABASE_AWAY)
def consume(topic: str) -> int:
    """Run one batch of `topic`; while batches come back full, queue the next one. A topic
    with limits goes on while its claims take jobs (each process that ran one tries for the
    next slot), and when out of tokens, once the next token is due."""
    rt = runtime()
    _report_in(rt.engine)
    result = rt.consumer.run_once(topic)
    claimed = result.claimed
    if result.claimed and result.free_slots:
        consume.apply_async((topic,), expires=60)  # another process for the next free slot
    until = time.monotonic() + LIMITED_BUDGET_SECONDS
    while result.limited and result.claimed and time.monotonic() < until:
        result = rt.consumer.run_once(topic)  # the slot it freed, without a broker round trip
        claimed += result.claimed
    if result.claimed >= rt.settings.consume_batch or (result.limited and result.claimed):
        consume.apply_async((topic,), expires=60)
    elif result.wait_s is not None:
        consume.apply_async((topic,), countdown=result.wait_s, expires=60)
    return claimed


def _report_in(engine: Any) -> None:
    """The consumers' heartbeat, from a process running consume tasks, every REPORT_SECONDS:
    the sweep's alone expired unrun behind a backlog of consume tasks (after a PostgreSQL
    restart, thousands), and /healthz called the busy consumers down."""
    global _reported_at
    now = time.monotonic()
    if _reported_at is None or now - _reported_at >= REPORT_SECONDS:
        _reported_at = now
        record_heartbeat(engine, "consumer")


@shared_task(name="delaysvc.consume_sweep", ignore_result=True, throws=DATABASE_AWAY)
def consume_sweep() -> int:
    """Safety net: wake the consumer of every topic that has ready jobs (fired by beat, run by a
    consume worker, which reports in by it)."""
    record_heartbeat(runtime().engine, "consumer")
    return wake_ready_topics()


def wake_ready_topics() -> int:
    """Wake the consumer of every topic that has ready jobs. -> how many topics."""
    from delaysvc import store

    with runtime().engine.connect() as conn:
        topics = store.topics_with_ready(conn)
    for topic in topics:
        consume.apply_async((topic,), expires=60)
    return len(topics)


@shared_task(name="delaysvc.rescue_leases", ignore_result=True, throws=DATABASE_AWAY)
def rescue_leases() -> int:
    rescued = runtime().consumer.rescue_once()
    for topic in {row.topic for row in rescued}:
        consume.apply_async((topic,), expires=60)
    return len(rescued)


# -- topics bound to existing Celery tasks ---------------------------------------------------


@shared_task(name="delaysvc.task_succeeded", ignore_result=True, throws=DATABASE_AWAY)
def task_succeeded(
    _result: Any, message_id: int, claim_id: int, sent_at: float, deployment: str | None = None
) -> bool:
    """A bound task's success (`deployment`: the dispatcher's; another's is not written)."""
    if foreign("delaysvc.task_succeeded", deployment):
        return False
    return runtime().consumer.record_success(message_id, claim_id, _elapsed_ms(sent_at))


@shared_task(name="delaysvc.task_failed", ignore_result=True, throws=DATABASE_AWAY)
def task_failed(
    request: Any,
    exc: BaseException,
    _traceback: Any,
    message_id: int,
    claim_id: int,
    sent_at: float,
    deployment: str | None = None,
) -> bool:
    """A bound task's failure, called by Celery inside the worker that ran the task (no
    message, so no header: `deployment` is the dispatcher's; another's is not written)."""
    if foreign("delaysvc.task_failed", deployment):
        return False
    rt = runtime()
    with rt.engine.connect() as conn:
        from delaysvc import store

        row = store.running_job(conn, message_id, claim_id)
    if row is None:
        return False
    job = Job.from_row(row)
    if not isinstance(exc, BaseException):
        exc = RuntimeError(str(exc))
    return rt.consumer.record_failure_of(job, claim_id, exc, _elapsed_ms(sent_at))


def _elapsed_ms(sent_at: float) -> int:
    return max(0, int((time.time() - sent_at) * 1000))
