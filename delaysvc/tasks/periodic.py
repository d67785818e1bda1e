"""Periodic schedules (`delaysvc.periodic_schedules`) in the worker: beat fires
`delaysvc.fire_schedules` every second on the delivery queue, and a delivery worker stores the
schedules its handler modules declare (`@periodic`) and the configured topic limits
(`delaysvc.limits`) when it starts."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from celery.signals import worker_ready

from delaysvc import limits
from delaysvc import periodic_schedules as periodic
from delaysvc.tasks.app import DELIVERY_QUEUE, runtime

log = logging.getLogger(__name__)


@shared_task(name="delaysvc.fire_schedules", ignore_result=True)
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
    declared = periodic.store_declared(runtime().engine)
    log.info("periodic.declared", extra={"schedules": declared})
    configured = runtime().settings.topic_limits
    if configured:
        limits.apply_configured(runtime().engine, configured)
        log.info("limits.configured", extra={"topics": ",".join(sorted(configured))})
