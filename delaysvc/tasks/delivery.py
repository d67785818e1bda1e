"""Delivery tasks: thin wrappers around `delaysvc.maintenance.delivery.LaneRunner`.

Each lane is one chain of `deliver_lane` tasks: a run keeps its lane for a budget, then sends
the next run. A delivery worker starts every lane's chain the moment it is ready, so a deploy
or a restart leaves no lane asleep until beat's next interval; a run that dies while it holds
its lane sends the next one at once, and a worker shutting down (SIGTERM: a deploy) hands each
lane over, sending its next run to the queue for another delivery worker to take at once (a
rolling restart: start the new worker, then stop the old one). Beat fires every lane each
budget as the safety net (a second run of a held lane returns at once: `LaneRunner`'s advisory
lock).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps, shared_task
from celery.signals import worker_shutting_down
from sqlalchemy.exc import DBAPIError

from delaysvc.errors import one_line
from delaysvc.maintenance.delivery import LaneRunner
from delaysvc.tasks.app import DATABASE_AWAY, DELIVERY_QUEUE, Stopping, runtime

log = logging.getLogger(__name__)
_stopping = Stopping()
_stop = _stopping.event
REARM_SECONDS = 1.0
"""A run that died holding its lane (its connection broke) sends the next one this soon."""


@worker_shutting_down.connect
def _stop_lanes(**_: object) -> None:
    _stopping.ask()  # in the SIGTERM handler: `Stopping` says why not `_stop.set()`


class LanesOnConnect(bootsteps.StartStopStep):
    """A worker that serves the delivery queue starts every lane each time it connects to the
    broker: at start, not at beat's first interval (beat's entries fire one budget after beat
    starts), and again after the broker was away, when the runs that ended meanwhile could not
    send their next one (nor wake their topics' consumers). It also wakes the consumer of every
    topic with ready jobs then, the wakes lost meanwhile among them. Beat stays the safety net,
    not the engine: a broker restart that beat does not outlive stops nothing. A lane already
    held by a run returns at once (`LaneRunner`'s advisory lock).

    A step of the worker's consumer, which Celery starts again on every new connection. The
    runs go straight to the worker's own thread pool, not through the broker: a burst of
    messages published from the worker's thread at start left the worker stuck after a broker
    restart (the RabbitMQ fault test); from their first hand-over on, the runs are ordinary
    messages."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, parent: Any) -> None:
        app = parent.app
        if DELIVERY_QUEUE not in set(app.amqp.queues.consume_from):
            return
        lanes = range(app.conf.delaysvc_settings.levels.max_level + 1)
        for lane in lanes:
            parent.pool.apply_async(_first_run, args=(lane,))
        parent.pool.apply_async(_wake_ready_topics)
        log.info(
            "delivery.lanes_started",
            extra={"lanes": f"0-{lanes[-1]}", "connections": parent.restart_count},
        )


def _first_run(lane: int) -> None:
    try:
        deliver_lane(lane)
    except Exception:  # said in the log; beat fires the lane again
        log.exception("delivery.first_run_failed", extra={"lane": lane})


def _wake_ready_topics() -> None:
    """Wake every topic with ready jobs, its wake perhaps lost while the broker was away."""
    from delaysvc.tasks.consume import wake_ready_topics

    try:
        wake_ready_topics()
    except Exception:  # said in the log; beat's sweep wakes them
        log.exception("delivery.wake_failed")


def _wake_consumers(topics: tuple[str, ...]) -> None:
    """Wake the topics' consumers now. With the broker away this raises, and the run ends
    without a next one (what it moved is in the database): the worker starts the lane again
    once it has reconnected (`LanesOnConnect`), and beat fires it too. (Runs that went on
    publishing from the pool's threads while the worker reconnected corrupted its AMQP
    connection: py-amqp is not thread-safe.)"""
    from delaysvc.tasks.consume import consume

    for topic in topics:
        consume.apply_async((topic,), expires=60)


@shared_task(name="delaysvc.deliver_lane", ignore_result=True, throws=DATABASE_AWAY)
def deliver_lane(lane: int) -> int:
    """Keep `lane` on time for one budget, then hand over to the next run of this task."""
    rt = runtime()
    budget = rt.settings.lane_budget_seconds
    runner = LaneRunner(
        rt.delivery_engine,
        lane,
        rt.settings.delivery_batch,
        rt.settings.idle_poll_ms / 1000,
        on_moved=_wake_consumers,
        stop=_stop,
    )
    try:
        moved = runner.run(budget)
    except DBAPIError as exc:  # the lane's database connection broke: again at once, on a new one
        if runner.held_lane and not _stop.is_set():
            reason = one_line(exc)[:300]
            log.warning("delivery.lane_rearmed", extra={"lane": lane, "error": reason})
            deliver_lane.apply_async(
                (lane,), countdown=REARM_SECONDS, expires=REARM_SECONDS + budget
            )
        raise
    if runner.held_lane:  # the next run: here, or on another worker when this one stops
        deliver_lane.apply_async((lane,), expires=budget)
    return moved
