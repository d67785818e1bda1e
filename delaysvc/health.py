"""Is the service alive? The database answers, beat fires (its stats sample, run by a delivery
worker, is recent) and consumers run (their sweep, fired every second, is recent). Processes
report by writing heartbeats; `/healthz` and `delaysvc stats` read them."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from sqlalchemy import Engine

from delaysvc import store

STALE_AFTER_SECONDS = {"beat": 30.0, "consumer": 15.0}
"""A component not seen for this long is reported down (3 of its beat intervals, or more)."""


def record_heartbeat(engine: Engine, component: str) -> None:
    with engine.begin() as conn:
        store.record_heartbeat(conn, component, socket.gethostname())


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


def check(engine: Engine) -> Health:
    try:
        with engine.connect() as conn:
            seen = store.heartbeats(conn)
    except Exception:  # the database is away: that is the answer
        return Health(False, dict.fromkeys(STALE_AFTER_SECONDS))
    return Health(True, {name: seen.get(name) for name in STALE_AFTER_SECONDS})
