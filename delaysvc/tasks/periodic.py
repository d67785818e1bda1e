"""Periodic schedules (`delaysvc.maintenance.periodic`) in the worker: beat fires
`delaysvc.fire_schedules` every second on the delivery queue, and a delivery worker stores the
schedules its handler modules declare (`@periodic`), the configured topic limits
(`delaysvc.worker.limits`) and backlog caps (`delaysvc.producer.caps`) when it starts. From then on
a thread of the worker declares its schedules again every minute and removes those no worker
declares any more (`periodic.Declarer`), and keeps the capped topics' index in step with the caps
(`delaysvc.maintenance.caps_index`): the rounds run in every delivery worker, which a task fired
by beat would not (it runs in one)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import shared_task
from celery.signals import worker_ready, worker_shutting_down

from delaysvc.maintenance import caps_index, periodic
from delaysvc.producer import caps
from delaysvc.tasks.app import DATABASE_AWAY, DELIVERY_QUEUE, Stopping, runtime
from delaysvc.worker import limits

log = logging.getLogger(__name__)
_stopping = Stopping()
_stop = _stopping.event


@shared_task(name="delaysvc.fire_schedules", ignore_result=True, throws=DATABASE_AWAY)
def fire_schedules() -> int:
    """Fire every due tick; -> messages stored."""
    fired = periodic.fire_due(runtime().engine)
    if fired.fired or fired.skipped:
        log.info("periodic.fired", extra={"fired": fired.fired, "skipped": fired.skipped})
    return fired.fired


@worker_ready.connect
def _store_declared(sender: Any, **_: object) -> None:
    if DELIVERY_QUEUE not in set(sender.app.amqp.queues.consume_from):
        return
    declarer = periodic.Declarer(runtime().engine, sender.hostname)
    result = _declare(declarer)
    if result is not None:
        log.info("periodic.declared", extra={"schedules": result.declared})
    threading.Thread(
        target=_keep_declaring, args=(declarer,), name="delaysvc-declare", daemon=True
    ).start()
    configured = runtime().settings.topic_limits
    if configured:
        limits.apply_configured(runtime().engine, configured)
        log.info("limits.configured", extra={"topics": ",".join(sorted(configured))})
    configured_caps = runtime().settings.caps
    if configured_caps:
        caps.apply_configured(runtime().engine, configured_caps)
        names = ",".join(f"{cap.scope}:{cap.target}" for cap in configured_caps)
        log.info("caps.configured", extra={"caps": names})


def _keep_declaring(declarer: periodic.Declarer) -> None:
    _index_caps()
    while not _stop.wait(periodic.DECLARE_EVERY.total_seconds()):
        _declare(declarer)
        _index_caps()


def _index_caps() -> None:
    """The capped topics' index in step with the topic caps (`caps_index`), in this thread:
    its build waits for older transactions to end, which the worker's start must not."""
    try:
        caps_index.run_once(runtime().engine)
    except Exception:
        log.warning("caps.index_failed", exc_info=True)


def _declare(declarer: periodic.Declarer) -> periodic.Declared | None:
    """One round; a failure is logged, and the next round tries again."""
    try:
        result = declarer.run_once()
    except Exception:
        log.warning("periodic.declare_failed", exc_info=True)
        return None
    if result.removed:
        log.info("periodic.undeclared_removed", extra={"schedules": ",".join(result.removed)})
    return result


@worker_shutting_down.connect
def _stop_declaring(**_: object) -> None:
    _stopping.ask()  # in the SIGTERM handler: `Stopping` says why not `_stop.set()`
