"""Delivery tasks: thin wrappers around `delaysvc.delivery.LaneRunner`."""

from __future__ import annotations

import threading

from celery import shared_task
from celery.signals import worker_shutting_down

from delaysvc.delivery import LaneRunner
from tasks.app import runtime

_stop = threading.Event()


@worker_shutting_down.connect
def _stop_lanes(**_: object) -> None:
    _stop.set()


def _wake_consumers(topics: tuple[str, ...]) -> None:
    from tasks.consume import consume

    for topic in topics:
        consume.apply_async((topic,), expires=60)


@shared_task(name="delaysvc.deliver_lane", ignore_result=True)
def deliver_lane(lane: int) -> int:
    """Keep `lane` on time for one budget, then hand over to the next run of this task."""
    rt = runtime()
    runner = LaneRunner(
        rt.engine,
        lane,
        rt.settings.delivery_batch,
        rt.settings.idle_poll_ms / 1000,
        on_moved=_wake_consumers,
        stop=_stop,
    )
    moved = runner.run(rt.settings.lane_budget_seconds)
    if runner.held_lane and not _stop.is_set():
        deliver_lane.apply_async((lane,), expires=rt.settings.lane_budget_seconds)
    return moved
