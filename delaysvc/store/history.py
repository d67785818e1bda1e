"""Every statement on the finished messages' history (`delaysvc.maintenance.history`): picking
finished rows out of commit_log, moving them into their day's partition of `message_history`, making
and dropping those partitions, and taking a dead message back for a redrive.

Whatever writes the history (the sweep, a redrive, retention, the archive's drop) first takes
the history lock (`lock_history`, a transaction-level advisory lock named after the table, so
two schemas in one database do not share it): a drop never races a row moving in or out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from psycopg.errors import LockNotAvailable
from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError

from delaysvc.db.names import sql, table
from delaysvc.errors import Busy
from delaysvc.schema.tables import history_partition, is_history_partition, message_history
from delaysvc.store.shared import lock_timeout

COLUMNS = ", ".join(column.name for column in message_history.columns)
HISTORY_WAIT_S = 10.0
"""How long a redrive waits for the history lock (`lock_history`) before it says the history is
busy: the sweep holds it for a batch's moment, an archive for as long as it checks and drops a
day."""
DDL_LOCK_TIMEOUT = "2s"
"""How long making or dropping a partition waits for readers of the history: a query on the
parent table holds a lock that the DDL needs, and a DDL waiting for it would hold up every
reader behind it; past this it gives up and the next sweep tries again."""


@dataclass(frozen=True)
class Partition:
    day: date

    @property
    def name(self) -> str:
        return history_partition(self.day)

    @property
    def starts(self) -> datetime:
        return _utc_midnight(self.day)

    @property
    def ends(self) -> datetime:
        return _utc_midnight(self.day + timedelta(days=1))


def _utc_midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def lock_history(conn: Connection, wait: bool) -> bool:
    """Take the history lock until the transaction ends; without `wait`, False when another
    transaction holds it."""
    function = "pg_advisory_xact_lock" if wait else "pg_try_advisory_xact_lock"
    locked = conn.execute(
        sql(f"SELECT {function}(hashtext(:name))::text"), {"name": table("message_history")}
    ).scalar_one()
    return wait or locked == "true"


def lock_history_within(conn: Connection, what: str) -> None:
    """Take the history lock until the transaction ends, waiting for it at most
    `HISTORY_WAIT_S`; then Busy, naming `what` (the transaction is left aborted: the caller's
    block ends it). The transaction's own lock_timeout is back as it was once the lock is
    held."""
    try:
        with lock_timeout(conn, f"{round(HISTORY_WAIT_S * 1000)}ms"):
            lock_history(conn, wait=True)
    except OperationalError as exc:
        if not isinstance(exc.orig, LockNotAvailable):
            raise
        raise Busy(
            f"{what}: the history is held by an archive or a sweep for over "
            f"{HISTORY_WAIT_S:g} s; try again when it is done"
        ) from None


def pick_finished(conn: Connection, limit: int) -> list[tuple[int, date]]:
    """Up to `limit` finished messages still in commit_log, oldest first, locked: (id, UTC day
    it finished)."""
    rows = conn.execute(
        sql(
            "SELECT id, CAST(finished_at AT TIME ZONE 'UTC' AS date) AS day "
            "FROM delaysvc.commit_log WHERE finished_at IS NOT NULL "
            "ORDER BY finished_at LIMIT :limit FOR UPDATE SKIP LOCKED"
        ),
        {"limit": limit},
    )
    return [(row.id, row.day) for row in rows]


_MOVE = (
    f"WITH moved AS (DELETE FROM delaysvc.commit_log c WHERE c.id = ANY(CAST(:ids AS bigint[])) "
    f"RETURNING {COLUMNS}) INSERT INTO delaysvc.message_history ({COLUMNS}) "
    f"SELECT {COLUMNS} FROM moved"
)


def move_to_history(conn: Connection, ids: Sequence[int]) -> int:
    """Move these finished messages, locked by `pick_finished` in this transaction, from
    commit_log into message_history, in one statement. -> rows moved. (By id alone: a
    `finished_at IS NOT NULL` here would let the planner, whose statistics see commit_log with
    hardly a finished row, walk the finished index past every row waiting to move.)"""
    return conn.execute(sql(_MOVE), {"ids": list(ids)}).rowcount


@dataclass(frozen=True)
class Backlog:
    """Finished messages the sweep has not moved yet: how many (counted up to a cap) and how
    long the oldest has waited (0 when none)."""

    rows: int
    oldest_seconds: float


def unswept(conn: Connection, cap: int) -> Backlog:
    """Through the finished index alone: cheap while the sweep keeps up, bounded when not."""
    row = conn.execute(
        sql(
            "SELECT (SELECT count(*) FROM (SELECT 1 FROM delaysvc.commit_log "
            "WHERE finished_at IS NOT NULL LIMIT :cap) f), "
            "COALESCE(extract(epoch FROM clock_timestamp() - (SELECT min(finished_at) "
            "FROM delaysvc.commit_log WHERE finished_at IS NOT NULL)), 0)"
        ),
        {"cap": cap},
    ).one()
    return Backlog(int(row[0]), max(float(row[1]), 0.0))


def partitions(conn: Connection) -> list[Partition]:
    """The history's day partitions, oldest first."""
    names = conn.execute(
        sql(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = CAST(:parent AS regclass)"
        ),
        {"parent": table("message_history")},
    ).scalars()
    days = [datetime.strptime(n[-8:], "%Y%m%d").date() for n in names if is_history_partition(n)]
    return [Partition(day) for day in sorted(days)]


def make_partitions(conn: Connection, days: Iterable[date]) -> list[str]:
    """Make the partitions of these days that do not exist yet. -> the names made."""
    missing = sorted(set(days) - {p.day for p in partitions(conn)})
    if not missing:
        return []
    made = []
    with lock_timeout(conn, DDL_LOCK_TIMEOUT):
        for partition in map(Partition, missing):
            conn.execute(
                sql(
                    f"CREATE TABLE IF NOT EXISTS delaysvc.{partition.name} PARTITION OF "
                    f"delaysvc.message_history FOR VALUES FROM ('{partition.starts.isoformat()}') "
                    f"TO ('{partition.ends.isoformat()}')"
                )
            )
            made.append(partition.name)
    return made


def drop_partition(conn: Connection, partition: str) -> int:
    """Drop a day of history, and the dead letters of its messages with it. -> the dead
    letters forgotten."""
    forgotten = conn.execute(
        sql(
            f"DELETE FROM delaysvc.dead_letter d USING delaysvc.{partition} h "
            "WHERE d.message_id = h.id"
        )
    ).rowcount
    with lock_timeout(conn, DDL_LOCK_TIMEOUT):
        conn.execute(sql(f"DROP TABLE delaysvc.{partition}"))
    return forgotten


def take_back_dead(conn: Connection, message_id: int) -> int:
    """A dead message already in the history goes back into commit_log, as it was (to be
    redriven in the same transaction). -> 1, or 0 when it is not there."""
    return conn.execute(
        sql(
            f"WITH back AS (DELETE FROM delaysvc.message_history h WHERE h.id = :id AND "
            f"h.status = 'dead' RETURNING {COLUMNS}) "
            f"INSERT INTO delaysvc.commit_log ({COLUMNS}) SELECT {COLUMNS} FROM back"
        ),
        {"id": message_id},
    ).rowcount
