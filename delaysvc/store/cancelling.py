"""Taking a waiting message out of its lane or topic queue, and marking it cancelled or replaced."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from delaysvc.db.names import sql
from delaysvc.schema.tables import TIMER_LANE
from delaysvc.store.shared import _COUNTED_OUT, MESSAGE_COLUMNS, NOW, NewMessage, Statements


def take_out_of_lane(conn: Statements, lane: int, offset: int, deliver_ts: datetime) -> bool:
    """Delete a waiting message's lane row (counted out of the lane). False when it is not
    there any more (moved)."""
    if lane > 0:
        delete = "DELETE FROM delaysvc.consume_queue WHERE level = :lane AND queue_offset = :offset"
    elif lane == TIMER_LANE:
        delete = (
            "DELETE FROM delaysvc.timer_queue WHERE deliver_ts = :ts AND queue_offset = :offset"
        )
    else:
        return False
    statement = (
        f"WITH gone AS ({delete} RETURNING 1), {_COUNTED_OUT.format(src='gone')} "
        "SELECT count(*) FROM gone"
    )
    params = {"lane": lane, "offset": offset, "ts": deliver_ts}
    return conn.execute(sql(statement), params).scalar_one() == 1


def take_out_of_topic_queue(conn: Statements, message_id: int) -> bool:
    result = conn.execute(
        sql("DELETE FROM delaysvc.topic_queue WHERE message_id = :id"), {"id": message_id}
    )
    return result.rowcount == 1


def mark_cancelled(conn: Statements, message_id: int) -> Any:
    return conn.execute(
        sql(
            "UPDATE delaysvc.commit_log SET status = 'cancelled', finished_at = "
            "statement_timestamp(), "
            f"lane = -1, queue_offset = NULL WHERE id = :id RETURNING {MESSAGE_COLUMNS}"
        ),
        {"id": message_id},
    ).one()


def note_replaced(conn: Statements, message_id: int, by_id: int) -> None:
    """A message cancelled for a send that replaced it says which (`on_duplicate`)."""
    conn.execute(
        sql("UPDATE delaysvc.commit_log SET last_error = :note WHERE id = :id"),
        {"id": message_id, "note": f"replaced by message {by_id}"},
    )


def due_before(conn: Statements, message: NewMessage, due: datetime) -> bool:
    """Would `message`, stored now, be due before `due` (the database's clock)?"""
    return bool(
        conn.execute(
            sql(f"SELECT COALESCE(CAST(:at AS timestamptz), {NOW} + :ms * interval '1 ms') < :due"),
            {"at": message.deliver_at, "now": None, "ms": message.delay_ms or 0, "due": due},
        ).scalar_one()
    )


def remember_revoked(conn: Statements, task_ids: list[str], keep_ms: int) -> None:
    """Store these Celery task ids as revoked (`delaysvc.contrib.celery`), and forget those
    revoked more than `keep_ms` ago."""
    conn.execute(
        sql(
            "INSERT INTO delaysvc.celery_revoked (task_id) "
            "SELECT DISTINCT unnest(CAST(:ids AS text[])) ON CONFLICT (task_id) DO NOTHING"
        ),
        {"ids": task_ids},
    )
    _forget_revokes(conn, "celery_revoked", keep_ms)


def revoked(conn: Statements, task_id: str) -> bool:
    """Whether this Celery task id was revoked (`remember_revoked`)."""
    row = conn.execute(
        sql("SELECT 1 FROM delaysvc.celery_revoked WHERE task_id = :id"), {"id": task_id}
    ).first()
    return row is not None


def remember_revoked_stamps(conn: Statements, stamps: list[tuple[str, str]], keep_ms: int) -> None:
    """Store these Celery stamps, (header, value as JSON), as revoked, and forget those revoked
    more than `keep_ms` ago."""
    conn.execute(
        sql(
            "INSERT INTO delaysvc.celery_revoked_stamp (header, value) "
            "SELECT DISTINCT * FROM unnest(CAST(:headers AS text[]), CAST(:values AS text[])) "
            "ON CONFLICT (header, value) DO UPDATE SET revoked_at = now()"
        ),
        {"headers": [h for h, _ in stamps], "values": [v for _, v in stamps]},
    )
    _forget_revokes(conn, "celery_revoked_stamp", keep_ms)


def _forget_revokes(conn: Statements, table: str, keep_ms: int) -> None:
    """Prune a table of Celery revokes (`celery_revoked`, `celery_revoked_stamp`) of those
    revoked more than `keep_ms` ago."""
    conn.execute(
        sql(
            f"DELETE FROM delaysvc.{table} "
            "WHERE revoked_at < now() - CAST(:keep_ms AS bigint) * interval '1 millisecond'"
        ),
        {"keep_ms": keep_ms},
    )


def revoked_stamp(conn: Statements, stamps: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The first of these Celery stamps, (header, value as JSON), that was revoked, or None."""
    row = conn.execute(
        sql(
            "SELECT s.header, s.value FROM delaysvc.celery_revoked_stamp s "
            "JOIN unnest(CAST(:headers AS text[]), CAST(:values AS text[])) AS m(header, value) "
            "USING (header, value) LIMIT 1"
        ),
        {"headers": [h for h, _ in stamps], "values": [v for _, v in stamps]},
    ).first()
    return None if row is None else (row.header, row.value)
