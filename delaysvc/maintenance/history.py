"""The finished messages' history: commit_log keeps the messages in flight; finished ones are
moved, a bounded batch at a time, into `message_history`, one partition per UTC day they
finished, so that the hot table stays the size of the backlog, and old history goes by
dropping a day's partition (retention here, or `delaysvc pipeline archive` after its Parquet
copy is verified) instead of DELETE + VACUUM.

`sweep` is what beat runs every few seconds (`delaysvc.move_history`): make today's and
tomorrow's partitions ahead, move finished rows until none are left or the time is up, then
drop the days older than `DELAYSVC_HISTORY_RETENTION` when it is set. Each step is one short
transaction under the history lock (`store_history.lock_history`); a sweep that finds the
lock taken (another host's beat is sweeping) leaves the work to it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import TypeVar

from psycopg.errors import LockNotAvailable
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import OperationalError

from delaysvc import store
from delaysvc.errors import DelaysvcError
from delaysvc.store import history as store_history
from delaysvc.store.history import Partition

log = logging.getLogger(__name__)
T = TypeVar("T")
MOVE_BATCH = 5_000
SWEEP_SECONDS = 5.0
"""How often beat sweeps, and how long one sweep moves rows at most."""


@dataclass
class Swept:
    moved: int = 0
    made: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def move_once(engine: Engine, limit: int = MOVE_BATCH, wait: bool = False) -> Swept:
    """Move one batch of finished messages into their days' partitions (made when missing).
    Without `wait`, does nothing when another sweep holds the history lock."""
    swept = Swept()
    with engine.begin() as conn:
        if not store_history.lock_history(conn, wait):
            return swept
        picked = store_history.pick_finished(conn, limit)
        if picked:
            swept.made = store_history.make_partitions(conn, {day for _, day in picked})
            swept.moved = store_history.move_to_history(conn, [id_ for id_, _ in picked])
    return swept


def make_ahead(engine: Engine, today: date) -> list[str]:
    """Today's and tomorrow's partitions, so that moving rows never waits on making one."""
    with engine.begin() as conn:
        if not store_history.lock_history(conn, wait=False):
            return []
        return store_history.make_partitions(conn, (today, today + timedelta(days=1)))


def drop_older_than(engine: Engine, before: datetime) -> list[str]:
    """Drop every day of history that ended at or before `before`. -> the partitions dropped."""
    dropped = []
    for partition in _partitions(engine):
        if partition.ends > before:
            break
        with engine.begin() as conn:
            store_history.lock_history(conn, wait=True)
            forgotten = store_history.drop_partition(conn, partition.name)
        log.info("history.dropped", extra={"partition": partition.name, "dead_letters": forgotten})
        dropped.append(partition.name)
    return dropped


def sweep(
    engine: Engine,
    retention_ms: int | None,
    at: datetime | None = None,
    budget_seconds: float = SWEEP_SECONDS,
) -> Swept:
    """One run of beat's history task: partitions ahead, finished rows moved (for at most
    `budget_seconds`), days past the retention dropped. `at`: now, by the database's clock
    unless given."""
    started = time.monotonic()
    if at is None:
        with engine.connect() as conn:
            at = store.clock_now(conn)
    at = at.astimezone(UTC)
    swept = Swept(made=make_ahead(engine, at.date()))
    while time.monotonic() - started < budget_seconds:
        batch = move_once(engine)
        swept.moved += batch.moved
        swept.made += batch.made
        if batch.moved < MOVE_BATCH:
            break
    if retention_ms is not None:
        swept.dropped = drop_older_than(engine, at - timedelta(milliseconds=retention_ms))
    if swept.moved or swept.made or swept.dropped:
        log.info(
            "history.swept",
            extra={"moved": swept.moved, "made": swept.made, "dropped": swept.dropped},
        )
    return swept


def move_all(engine: Engine) -> int:
    """Move every finished message into the history now, waiting for a sweep in progress
    (the archive starts with this). -> rows moved."""
    moved = 0
    while (batch := move_once(engine, wait=True).moved) > 0:
        moved += batch
    return moved


def patiently(
    engine: Engine, work: Callable[[Connection], T], what: str, patience: float, pause: float = 1.0
) -> T:
    """`work` in a transaction of its own, run again (after `pause` seconds) while its partition
    DDL gives up behind a reader of the history (`store_history.DDL_LOCK_TIMEOUT`: a report
    reading for minutes, say), for at most `patience` seconds; then a DelaysvcError saying so.
    For the commands that must do the DDL now (the archive); beat's sweep just tries again at
    its next run."""
    deadline = time.monotonic() + patience
    while True:
        try:
            with engine.begin() as conn:
                return work(conn)
        except OperationalError as exc:
            if not isinstance(exc.orig, LockNotAvailable):
                raise
            if time.monotonic() + pause > deadline:
                raise DelaysvcError(
                    f"{what}: a reader of the history (a long query or report) kept it busy for "
                    f"{patience:.0f} s; run the command again when it has finished"
                ) from exc
            log.info("history.waiting_for_readers", extra={"what": what})
            time.sleep(pause)


def _partitions(engine: Engine) -> list[Partition]:
    with engine.connect() as conn:
        return store_history.partitions(conn)
