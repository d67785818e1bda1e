"""Is the service alive? The database answers, beat fires (its fold of the lane counts, fired
every second and run by a delivery worker, is recent), every delivery lane runs (each lane's
runner writes its own heartbeat while it holds the lane) and consumers run (their sweep, fired
every second, is recent). Processes report by writing heartbeats; `/healthz`, `delaysvc stats`
and the `ready` lines of `up` and `worker` read them."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine

from delaysvc import store

log = logging.getLogger(__name__)

STALE_AFTER_SECONDS = {"beat": 15.0, "delivery": 15.0, "consumer": 15.0}
"""A component not seen for this long is reported down (3 of its beat intervals, or more).
`delivery` is its least recently seen lane: one lane that stopped is delivery down."""

LANE_HEARTBEAT_SECONDS = 5.0
"""A lane's runner writes its heartbeat when it takes the lane and at least this often."""


def record_heartbeat(engine: Engine, component: str) -> None:
    with engine.begin() as conn:
        store.record_heartbeat(conn, component, socket.gethostname())


def report_handlers(
    engine: Engine, topics: Callable[[], list[str]], stopped: threading.Event
) -> threading.Thread:
    """Say now, then every HANDLER_HEARTBEAT_SECONDS until `stopped`, that this worker runs
    the handlers of `topics()`: the dashboard, `/api/v1/topics` and `delaysvc stats` call a
    topic no live worker reports "no handler". A thread of the worker's main process."""

    def report() -> None:
        while True:
            try:
                with engine.begin() as conn:
                    store.record_handlers(conn, topics(), socket.gethostname())
            except Exception:  # the database is away: the next round tries again
                log.warning("heartbeat.handlers_failed", exc_info=True)
            if stopped.wait(store.HANDLER_HEARTBEAT_SECONDS):
                return

    thread = threading.Thread(target=report, name="handler-heartbeat", daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True)
class Health:
    database: bool
    seconds_since: dict[str, float | None]

    @property
    def components(self) -> dict[str, bool]:
        return {
            name: age is not None and age <= STALE_AFTER_SECONDS[name]
            for name, age in self.seconds_since.items()
        }

    @property
    def status(self) -> str:
        return "ok" if self.database and all(self.components.values()) else "degraded"


def read_health(engine: Engine) -> Health:
    try:
        with engine.connect() as conn:
            seen: dict[str, float | None] = dict(store.heartbeats(conn))
            seen["delivery"] = store.slowest_lane_heartbeat(conn)
    except Exception:  # the database is away: that is the answer
        return Health(False, dict.fromkeys(STALE_AFTER_SECONDS))
    return Health(True, {name: seen.get(name) for name in STALE_AFTER_SECONDS})


def lane_component(lane: int) -> str:
    """The heartbeat a lane's runner writes."""
    return f"lane {lane}"
