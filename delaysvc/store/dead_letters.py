"""Dead letters: listing, redriving, purging."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from delaysvc.db.names import sql
from delaysvc.store import history as store_history
from delaysvc.store.shared import MESSAGE_COLUMNS


def list_dead(
    conn: Connection, topic: str | None = None, after_id: int | None = None, limit: int = 100
) -> list[Any]:
    """Dead letters newest first, keyset-paginated on message id."""
    return list(
        conn.execute(
            sql(
                "SELECT d.message_id, d.topic, d.died_at, d.reason, d.attempts, c.key, "
                "c.last_error FROM delaysvc.dead_letter d JOIN delaysvc.message c ON c.id = "
                "d.message_id "
                "WHERE (CAST(:topic AS text) IS NULL OR d.topic = :topic) "
                "AND (CAST(:after AS bigint) IS NULL OR d.message_id < :after) "
                "ORDER BY d.message_id DESC LIMIT :limit"
            ),
            {"topic": topic, "after": after_id, "limit": limit},
        )
    )


def redrive_dead(conn: Connection, message_id: int) -> Any:
    """A dead message runs again now, with a fresh retry budget. -> its row, or None. One
    already moved into the history comes back into commit_log first (under the history lock:
    no sweep moves it while it does, no archive drops its day; Busy when another holds that
    lock for over `store_history.HISTORY_WAIT_S`)."""
    store_history.lock_history_within(conn, f"message {message_id}")
    store_history.take_back_dead(conn, message_id)
    return conn.execute(
        sql(
            f"""
WITH revived AS (
    DELETE FROM delaysvc.dead_letter WHERE message_id = :id RETURNING message_id
), again AS (
    UPDATE delaysvc.commit_log c SET status = 'ready', finished_at = NULL, attempts = 0,
        lane = -1, queue_offset = NULL, deliver_ts = clock_timestamp(),
        delivered_at = clock_timestamp()
    FROM revived WHERE c.id = revived.message_id AND c.status = 'dead'
    RETURNING c.*
), queued AS (
    INSERT INTO delaysvc.topic_queue (message_id, topic, deliver_ts, priority)
    SELECT id, topic, deliver_ts, priority FROM again
)
SELECT {MESSAGE_COLUMNS} FROM again
"""
        ),
        {"id": message_id},
    ).first()


def dead_ids(
    conn: Connection, topic: str | None, error_contains: str | None, limit: int
) -> list[int]:
    return list(
        conn.execute(
            sql(
                "SELECT d.message_id FROM delaysvc.dead_letter d JOIN delaysvc.message c ON "
                "c.id = d.message_id "
                "WHERE (CAST(:topic AS text) IS NULL OR d.topic = :topic) "
                "AND (CAST(:pattern AS text) IS NULL OR "
                "     strpos(coalesce(c.last_error, '') || ' ' || d.reason, :pattern) > 0) "
                "ORDER BY d.message_id LIMIT :limit"
            ),
            {"topic": topic, "pattern": error_contains, "limit": limit},
        ).scalars()
    )


def purge_dead(conn: Connection, ids: Sequence[int]) -> int:
    """Forget dead letters (their messages stay `dead`, in commit_log or the history, until
    archived or past the retention)."""
    return conn.execute(
        sql("DELETE FROM delaysvc.dead_letter WHERE message_id = ANY(CAST(:ids AS bigint[]))"),
        {"ids": list(ids)},
    ).rowcount
