"""Delivery: RocketMQ's ScheduleMessageService on PostgreSQL.

`run_once(lane)` is one bounded step: in ONE transaction, lock the lane's schedule_offset row,
move the due head of the lane (in offset order, `FOR UPDATE SKIP LOCKED`) into the topics'
queues, advance the schedule offset, commit. The move is a single DELETE ... RETURNING feeding
the inserts, so a row can leave its lane only once: no loss, no duplicate, whatever crashes.

`LaneRunner.run(budget)` keeps one lane precise for a while: it repeats `run_once` while rows
are due, then sleeps until the head is due (a level is FIFO, so its head's due time is exact),
never longer than a short poll for the timer lane or half the level's delay for an empty
level, so a message sent into an empty lane is never found late. Celery tasks wrap it (see
`tasks.delivery`); beat re-fires each lane as the safety net.

A lane whose head cannot be moved is retried at the same offset, never skipped: the batch is
retried one row at a time, and if the head alone fails the lane is marked stuck (log, stats,
dashboard) until the cause is fixed or an operator skips the head to the dead letters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, OperationalError

from delaysvc import store
from delaysvc.schema import TIMER_LANE

log = logging.getLogger(__name__)

LANE_LOCK_BASE = 0x64656C00  # advisory lock key of lane N is LANE_LOCK_BASE + N
MIN_TICK_SECONDS = 0.002  # coalesce heads due within 2 ms into one move


@dataclass(frozen=True)
class TickResult:
    lane: int
    moved: int = 0
    topics: tuple[str, ...] = ()
    busy: bool = False
    stuck: bool = False
    max_lateness_ms: float | None = None


def run_once(
    conn: Connection, lane: int, delay_ms: int, batch: int, now: datetime | None = None
) -> TickResult:
    """Move one batch of due messages of `lane`, in one transaction of its own on `conn`."""
    try:
        with conn.begin():
            if store.lock_lane(conn, lane) is None:
                return TickResult(lane, busy=True)
            moved = store.move_due(conn, lane, delay_ms, batch, now)
    except OperationalError:
        raise  # the database is away: the caller backs off and tries again later
    except DBAPIError as exc:
        if batch > 1:
            log.warning("delivery.batch_failed", extra={"lane": lane, "error": str(exc.orig)})
            return run_once(conn, lane, delay_ms, 1, now)
        return _mark_stuck(conn, lane, exc)
    if moved.count:
        log.debug("delivery.moved", extra={"lane": lane, "count": moved.count})
    return TickResult(lane, moved.count, moved.topics, max_lateness_ms=moved.max_lateness_ms)


def _mark_stuck(conn: Connection, lane: int, exc: DBAPIError) -> TickResult:
    error = f"{type(exc.orig).__name__}: {exc.orig}".strip()
    with conn.begin():
        head = store.lane_head(conn, lane)
        store.mark_stuck(conn, lane, head.queue_offset if head else None, error)
    log.error(
        "delivery.lane_stuck",
        extra={"lane": lane, "offset": head.queue_offset if head else None, "error": error},
    )
    return TickResult(lane, stuck=True)


def seconds_until_head(conn: Connection, lane: int) -> float | None:
    """Seconds until the lane's head is due on the database clock (<= 0: due), None if empty."""
    statement = (
        "SELECT extract(epoch FROM min(deliver_ts) - clock_timestamp()) FROM ("
        + (
            "SELECT deliver_ts FROM timer_queue ORDER BY deliver_ts, queue_offset LIMIT 1"
            if lane == TIMER_LANE
            else "SELECT deliver_ts FROM consume_queue WHERE level = :lane "
            "ORDER BY queue_offset LIMIT 1"
        )
        + ") head"
    )
    with conn.begin():
        value = conn.execute(text(statement), {"lane": lane}).scalar()
    return float(value) if value is not None else None


@dataclass
class LaneRunner:
    """Keeps one lane delivered on time for a bounded while. `on_moved(topics)` is called after
    each commit that moved rows (Celery uses it to wake the topics' consumers)."""

    engine: Engine
    lane: int
    delay_ms: int
    batch: int
    idle_poll_seconds: float
    on_moved: Callable[[tuple[str, ...]], None] = lambda topics: None
    stop: threading.Event = field(default_factory=threading.Event)
    moved_total: int = 0
    held_lane: bool = False

    def run(self, budget_seconds: float) -> int:
        """Deliver until the budget is spent; -> messages moved. Returns at once (0) when
        another runner holds the lane."""
        deadline = time.monotonic() + budget_seconds
        with self.engine.connect() as conn:
            if not self._try_lock(conn):
                return 0
            self.held_lane = True
            try:
                self._loop(conn, deadline)
            finally:
                self._unlock(conn)
        return self.moved_total

    def _loop(self, conn: Connection, deadline: float) -> None:
        while not self.stop.is_set() and time.monotonic() < deadline:
            result = run_once(conn, self.lane, self.delay_ms, self.batch)
            if result.moved:
                self.moved_total += result.moved
                self.on_moved(result.topics)
            if result.moved == self.batch:
                continue  # more may be due right now
            wait = 1.0 if result.stuck else self._wait(seconds_until_head(conn, self.lane))
            self.stop.wait(max(MIN_TICK_SECONDS, min(wait, deadline - time.monotonic())))

    def _wait(self, until_head: float | None) -> float:
        if self.lane == TIMER_LANE:
            # a new send may be due before the current head
            return (
                self.idle_poll_seconds
                if until_head is None
                else min(until_head, self.idle_poll_seconds)
            )
        if until_head is None:
            # a send into this empty level is due one level-delay later: half of it is early
            return max(self.idle_poll_seconds, min(self.delay_ms / 2000, 1.0))
        return until_head

    def _try_lock(self, conn: Connection) -> bool:
        with conn.begin():
            return bool(
                conn.execute(
                    text("SELECT pg_try_advisory_lock(:key)"), {"key": LANE_LOCK_BASE + self.lane}
                ).scalar()
            )

    def _unlock(self, conn: Connection) -> None:
        try:
            with conn.begin():
                conn.execute(
                    text("SELECT pg_advisory_unlock(:key)"), {"key": LANE_LOCK_BASE + self.lane}
                )
        except DBAPIError:
            log.warning("delivery.unlock_failed", extra={"lane": self.lane})


def lanes(engine: Engine) -> list[tuple[int, int]]:
    """(lane, delay_ms) of every lane the database has."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT lane, delay_ms FROM schedule_offset ORDER BY lane"))
        return [(row.lane, row.delay_ms) for row in rows]
