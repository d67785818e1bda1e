"""Delivery: RocketMQ's ScheduleMessageService on PostgreSQL.

`run_once(lane)` is one bounded step: in ONE transaction, lock the lane's schedule_offset row,
move the due head of the lane (in offset order, `FOR UPDATE SKIP LOCKED`) into the topics'
queues, advance the schedule offset, commit. The move is a single DELETE ... RETURNING feeding
the inserts, so a row can leave its lane only once: no loss, no duplicate, whatever crashes.

`LaneRunner.run(budget)` keeps one lane precise for a while: it repeats `run_once` while rows
are due, then sleeps until the head is due (a level is FIFO, so its head's due time is exact),
never longer than a short poll for the timer lane or half the level's delay for an empty
level, so a message sent into an empty lane is never found late. Celery tasks wrap it (see
`delaysvc.tasks.delivery`); beat re-fires each lane as the safety net.

A lane whose head cannot be moved is retried at the same offset, never skipped: the batch is
retried one row at a time, and if the head alone fails the lane is marked stuck (log, stats,
dashboard) until the cause is fixed or an operator skips the head to the dead letters.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from delaysvc import store
from delaysvc.config import tracing
from delaysvc.db.names import LOCK_KEY, lock_name, sql
from delaysvc.maintenance.heartbeats import LANE_HEARTBEAT_SECONDS, lane_component
from delaysvc.schema.tables import LATENESS_BUCKETS_MS, TIMER_LANE

log = logging.getLogger(__name__)

MIN_TICK_SECONDS = 0.002  # coalesce heads due within 2 ms into one move
_moved_into: dict[str, float] = {}
"""Topic -> when this process's lane runners last moved rows into its queue (and woke it),
since the timer lane's last look (`LaneRunner._watch_ready`)."""


class _Look(NamedTuple):
    """What the timer lane's last look saw: the topic queue's mark (its last `seq`) and the
    topics with ready jobs."""

    mark: int
    ready: frozenset[str]


_last_looks: dict[str, _Look] = {}
"""Database -> this process's last look at its topic queues, for the next look (the next
run's first too)."""
LOOK_SHARE = 0.1
"""The timer lane's look at the topic queues takes at most this share of its time."""


@dataclass(frozen=True)
class TickResult:
    lane: int
    moved: int = 0
    topics: tuple[str, ...] = ()
    busy: bool = False
    stuck: bool = False
    max_lateness_ms: float | None = None
    next_due_seconds: float | None = None
    lateness_buckets: dict[int, int] = field(default_factory=dict)
    delay_ms: int | None = None  # the lane's delay, as the database has it
    lateness_sum_ms: float = 0.0  # the lateness the buckets count, added up
    more_due: bool = False  # more rows may be due now (`store.Moved.more_due`)
    narrowed: bool = False  # the batch failed on a row: this tick moved its first row alone


def run_once(conn: Connection, lane: int, batch: int, now: datetime | None = None) -> TickResult:
    """Move one batch of due messages of `lane`, in one transaction of its own on `conn`. The
    lane's delay is the database's (its schedule_offset row), never this process's settings."""
    try:
        with conn.begin():
            locked = store.lock_lane(conn, lane)
            if locked is None:
                return TickResult(lane, busy=True)
            moved = store.move_due(conn, lane, locked.delay_ms, batch, now)
            relocated = (
                _relocate_misplaced(conn, lane, locked.delay_ms, batch, now)
                if moved.misplaced
                else store.Relocated(0, 0, ())
            )
            if locked.stuck_offset is not None and not moved.count:
                _unstick_if_head_left(conn, lane, locked.stuck_offset)
    except OperationalError:
        raise  # the database is away: the caller backs off and tries again later
    except DBAPIError as exc:
        if batch > 1:
            log.warning("delivery.batch_failed", extra={"lane": lane, "error": str(exc.orig)})
            return dataclasses.replace(run_once(conn, lane, 1, now), narrowed=True)
        return _mark_stuck(conn, lane, exc)
    if moved.count:
        log.debug("delivery.moved", extra={"lane": lane, "count": moved.count})
    return TickResult(
        lane,
        moved.count + relocated.delivered,
        tuple(sorted({*moved.topics, *relocated.topics})),
        max_lateness_ms=moved.max_lateness_ms,
        # after a relocation the new head may be due now
        next_due_seconds=0.0 if moved.misplaced else moved.next_due_seconds,
        lateness_buckets=moved.lateness_buckets,
        delay_ms=locked.delay_ms,
        lateness_sum_ms=moved.lateness_sum_ms,
        more_due=moved.more_due,
    )


def _relocate_misplaced(
    conn: Connection, lane: int, delay_ms: int, batch: int, now: datetime | None
) -> store.Relocated:
    relocated = store.relocate_misplaced(conn, lane, delay_ms, batch, now)
    log.warning(
        "delivery.misplaced_head",
        extra={
            "lane": lane,
            "moved_to_timer_lane": relocated.to_timer,  # sent with another delay
            "delivered_now": relocated.delivered,  # stored while the clock was ahead
        },
    )
    return relocated


def _unstick_if_head_left(conn: Connection, lane: int, stuck_offset: int) -> None:
    """A lane stuck on a head that is no longer in it (cancelled, or taken to the timer lane by
    a level change) is not stuck: a move that moves something clears the flag, and an idle lane
    would otherwise keep it (and skip-head refuse it) for good."""
    head = store.lane_head(conn, lane)
    if head is None or head.queue_offset != stuck_offset:
        store.clear_stuck(conn, lane)
        log.info("delivery.lane_unstuck", extra={"lane": lane, "offset": stuck_offset})


def _mark_stuck(conn: Connection, lane: int, exc: DBAPIError) -> TickResult:
    # on one line (a PL/pgSQL error's CONTEXT comes on lines of its own): stats shows it in a
    # table row
    error = " ".join(f"{type(exc.orig).__name__}: {exc.orig}".split())
    with conn.begin():
        head = store.lane_head(conn, lane)
        store.mark_stuck(conn, lane, head.queue_offset if head else None, error)
    log.error(
        "delivery.lane_stuck",
        extra={"lane": lane, "offset": head.queue_offset if head else None, "error": error},
    )
    return TickResult(lane, stuck=True)


class LatenessHistogram:
    """Lateness of the rows a runner moved (buckets of LATENESS_BUCKETS_MS, largest, sum),
    written every FLUSH_SECONDS to the lane's minute row (the dashboard's distribution) and
    running total (/metrics'): `store.add_lateness`."""

    FLUSH_SECONDS = 10.0

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.counts = [0] * (len(LATENESS_BUCKETS_MS) + 1)
        self.max_ms = 0.0
        self.sum_ms = 0.0
        self.since = time.monotonic()

    def add(self, result: TickResult) -> None:
        for bucket, count in result.lateness_buckets.items():
            self.counts[bucket] += count
        self.max_ms = max(self.max_ms, result.max_lateness_ms or 0.0)
        self.sum_ms += result.lateness_sum_ms

    def due(self) -> bool:
        return time.monotonic() - self.since >= self.FLUSH_SECONDS

    def flush(self, conn: Connection, lane: int) -> None:
        if any(self.counts):
            try:
                with conn.begin():
                    store.add_lateness(conn, lane, self.counts, self.max_ms, self.sum_ms)
            except DBAPIError:
                log.warning("delivery.lateness_not_recorded", extra={"lane": lane})
        self.reset()


@dataclass
class LaneRunner:
    """Keeps one lane delivered on time for a bounded while. `on_moved(topics)` is called after
    each commit that moved rows (Celery uses it to wake the topics' consumers), and, by the
    timer lane's runner, for the topics a send due at once reached (`_watch_ready`)."""

    engine: Engine
    lane: int
    batch: int
    idle_poll_seconds: float
    on_moved: Callable[[tuple[str, ...]], None] = lambda topics: None
    stop: threading.Event = field(default_factory=threading.Event)
    moved_total: int = 0
    held_lane: bool = False
    lateness: LatenessHistogram = field(default_factory=LatenessHistogram)
    _beaten: float = 0.0  # monotonic time of the last heartbeat
    # this run's lateness, for its span (`tracing.lane_ran`): rows measured, largest, sum (ms)
    _lateness: tuple[int, float, float] = (0, 0.0, 0.0)
    _held: dict[str, int] = field(default_factory=dict)  # topic -> an older mark to look with
    _looked: float = 0.0  # monotonic time of the last look (`_watch_ready`)
    _next_look: float = 0.0

    def run(self, budget_seconds: float) -> int:
        """Deliver until the budget is spent; -> messages moved. Returns at once (0) when
        another runner holds the lane."""
        deadline = time.monotonic() + budget_seconds
        with self.engine.connect() as conn:
            if not self._try_lock(conn):
                return 0
            self.held_lane = True
            with tracing.lane_run(self.lane) as span:
                try:
                    self._heartbeat(conn)
                    self._loop(conn, deadline)
                finally:
                    self.lateness.flush(conn, self.lane)
                    self._unlock(conn)
                    if span is not None:
                        tracing.lane_ran(span, self.moved_total, self._lateness)
        return self.moved_total

    def _loop(self, conn: Connection, deadline: float) -> None:
        alone = 0  # rows to move one at a time: a batch failed on one of them
        while not self.stop.is_set() and time.monotonic() < deadline:
            self._watch_ready(conn)
            batch = 1 if alone else self.batch
            result = run_once(conn, self.lane, batch)
            if result.narrowed:
                # the rows ahead of the one that fails go one by one, at once, up to it (then
                # the lane is marked stuck on it), not one a tick
                alone = self.batch - 1
            elif alone:
                alone = alone - 1 if result.moved else 0
            if result.moved:
                self.moved_total += result.moved
                self.lateness.add(result)
                measured, largest, total = self._lateness
                self._lateness = (
                    measured + sum(result.lateness_buckets.values()),
                    max(largest, result.max_lateness_ms or 0.0),
                    total + result.lateness_sum_ms,
                )
                self.on_moved(result.topics)
                _moved_into.update(dict.fromkeys(result.topics, time.monotonic()))
            if self.lateness.due():
                self.lateness.flush(conn, self.lane)
            if time.monotonic() - self._beaten >= LANE_HEARTBEAT_SECONDS:
                self._heartbeat(conn)
            if result.moved and (result.moved == batch or result.more_due or alone):
                continue  # more may be due right now
            if result.stuck:
                wait = 1.0
            elif result.busy:
                wait = self.idle_poll_seconds
            else:
                wait = self._wait(result.next_due_seconds, result.delay_ms or 0)
            self.stop.wait(max(MIN_TICK_SECONDS, min(wait, deadline - time.monotonic())))

    def _watch_ready(self, conn: Connection) -> None:
        """The timer lane's runner also wakes each topic whose head (the job its next claim
        takes) came into its queue since its last look: a send due at once (no delay, a level
        <= 0) goes straight to its topic's queue, which no lane moves and so none woke (beat's
        1 s sweep did, behind the consume tasks). It looks every idle poll, or less often when
        a look takes long (`LOOK_SHARE`). A topic a move of this process woke since the last
        look is looked at again at the next look, against the older mark: a send due at once
        that came into it meanwhile is woken then (with the moved jobs, if they are still
        there: a wake more). A topic that had no ready job at the last look is woken whatever
        its head's `seq`: a send due at once committed after a look its `seq` preceded (in a
        long transaction of the caller's), or a claim undone. Not woken here: a topic whose
        head is older and that had ready jobs at the last look (being consumed, or waiting for
        a reason: paused, at its limit, no handler), and a send due at once committed before
        this process's first look, which only takes its mark (a run goes on from the mark of
        the process's last). Those wait for their consumer's next claim, or for the sweep, as
        before."""
        started = time.monotonic()
        if self.lane != TIMER_LANE or started < self._next_look:
            return
        with conn.begin():
            mark, heads = store.ready_heads(conn)
        database = str(self.engine.url)
        last = _last_looks.get(database)  # this run's last look, or the process's last
        if last is not None and mark < last.mark:  # the database went back (a restore): anew
            last = None
        looked = self._looked
        self._looked, _last_looks[database] = started, _Look(mark, frozenset(heads))
        took = time.monotonic() - started
        self._next_look = started + max(self.idle_poll_seconds, took / LOOK_SHARE)
        for topic, at in list(_moved_into.items()):  # only moves since the last look count
            if at < looked:
                del _moved_into[topic]
        if last is None:
            return
        woken, held = [], {}
        for topic, head in sorted(heads.items()):
            since = self._held.get(topic, last.mark)  # older for a topic a move woke meanwhile
            if head <= since and topic in last.ready:
                continue
            if topic in _moved_into and _moved_into[topic] >= looked:  # woken by its move
                held[topic] = since
            else:
                woken.append(topic)
        self._held = held
        if woken:
            self.on_moved(tuple(woken))

    def _wait(self, until_head: float | None, delay_ms: int) -> float:
        if self.lane == TIMER_LANE:
            # a new send may be due before the current head
            return (
                self.idle_poll_seconds
                if until_head is None
                else min(until_head, self.idle_poll_seconds)
            )
        if until_head is None:
            # a send into this empty level is due one level-delay later: half of it is early
            return max(self.idle_poll_seconds, min(delay_ms / 2000, 1.0))
        return until_head

    def _heartbeat(self, conn: Connection) -> None:
        """This lane runs (`health`: `delivery` is its least recently seen lane)."""
        with conn.begin():
            store.record_heartbeat(conn, lane_component(self.lane), socket.gethostname())
        self._beaten = time.monotonic()

    def _lock_name(self) -> str:
        return lock_name(f"lane {self.lane}")

    def _try_lock(self, conn: Connection) -> bool:
        with conn.begin():
            return bool(
                conn.execute(
                    sql(f"SELECT pg_try_advisory_lock({LOCK_KEY})"), {"lock": self._lock_name()}
                ).scalar()
            )

    def _unlock(self, conn: Connection) -> None:
        try:
            with conn.begin():
                conn.execute(
                    sql(f"SELECT pg_advisory_unlock({LOCK_KEY})"), {"lock": self._lock_name()}
                )
        except DBAPIError:
            log.warning("delivery.unlock_failed", extra={"lane": self.lane})


def lanes(engine: Engine) -> list[tuple[int, int]]:
    """(lane, delay_ms) of every lane the database has."""
    with engine.connect() as conn:
        rows = conn.execute(
            sql("SELECT lane, delay_ms FROM delaysvc.schedule_offset ORDER BY lane")
        )
        return [(row.lane, row.delay_ms) for row in rows]
