"""The statements on periodic schedules (`periodic_schedule`), each named for what it does.
Callers own the transaction (see `delaysvc.maintenance.periodic`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Connection

from delaysvc.db.names import sql


class ScheduleFields(Protocol):
    """What the statements read of a validated schedule (`maintenance.periodic.Schedule`)."""

    @property
    def name(self) -> str: ...
    @property
    def topic(self) -> str: ...
    @property
    def body(self) -> bytes: ...
    @property
    def body_is_json(self) -> bool: ...
    @property
    def cron(self) -> str | None: ...
    @property
    def every_ms(self) -> int | None: ...
    @property
    def timezone(self) -> str: ...
    @property
    def on_missed(self) -> str: ...


COLUMNS = """name, topic, body, body_is_json, cron, every_ms, timezone, on_missed, declared_in,
    paused, next_tick, last_tick, last_message_id, created_at, updated_at, declared_at,
    declared_by"""


def statement_now(conn: Connection) -> datetime:
    """This statement's start time (`statement_timestamp()`)."""
    now: datetime = conn.execute(sql("SELECT statement_timestamp()")).scalar_one()
    return now


def put(
    conn: Connection,
    item: ScheduleFields,
    declared_in: str,
    next_tick: datetime,
    topics: Sequence[str] | None = None,
) -> None:
    """Add or update a schedule (its paused flag and history kept); one that is the same is
    not written. Its next tick is computed again only when its timing changed. `topics` (an
    API token's): a schedule of the name whose topic is not among them is left as it is (in
    the same statement, so a schedule created meanwhile by another transaction is too); the
    caller reads the row back to tell."""
    conn.execute(
        sql(
            f"""
INSERT INTO delaysvc.periodic_schedule AS s (name, topic, body, body_is_json, cron, every_ms,
    timezone, on_missed, declared_in, next_tick)
VALUES (:name, :topic, :body, :body_is_json, :cron, :every_ms, :timezone, :on_missed,
    :declared_in, :next_tick)
ON CONFLICT (name) DO UPDATE SET topic = EXCLUDED.topic, body = EXCLUDED.body,
    body_is_json = EXCLUDED.body_is_json, cron = EXCLUDED.cron, every_ms = EXCLUDED.every_ms,
    timezone = EXCLUDED.timezone, on_missed = EXCLUDED.on_missed,
    declared_in = EXCLUDED.declared_in, updated_at = statement_timestamp(),
    next_tick = CASE WHEN (s.cron, s.every_ms, s.timezone)
        IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.every_ms, EXCLUDED.timezone)
        THEN EXCLUDED.next_tick ELSE s.next_tick END
WHERE (s.topic, s.body, s.body_is_json, s.cron, s.every_ms, s.timezone, s.on_missed,
    s.declared_in) IS DISTINCT FROM (EXCLUDED.topic, EXCLUDED.body, EXCLUDED.body_is_json,
    EXCLUDED.cron, EXCLUDED.every_ms, EXCLUDED.timezone, EXCLUDED.on_missed,
    EXCLUDED.declared_in)
    AND (CAST(:topics AS text[]) IS NULL OR s.topic = ANY(CAST(:topics AS text[])))
RETURNING {COLUMNS}"""
        ),
        _params(item, next_tick)
        | {"declared_in": declared_in, "topics": None if topics is None else list(topics)},
    )


def declare(
    conn: Connection, item: ScheduleFields, next_tick: datetime, now: datetime, by: str | None
) -> None:
    """A worker declares a schedule in code: add or update it (its paused flag and history
    kept; its next tick computed again only when its timing changed), and note that `by`
    declared it at `now`, even when nothing else changed (the declaration is a heartbeat)."""
    conn.execute(
        sql(
            """
INSERT INTO delaysvc.periodic_schedule AS s (name, topic, body, body_is_json, cron, every_ms,
    timezone, on_missed, declared_in, declared_at, declared_by, next_tick)
VALUES (:name, :topic, :body, :body_is_json, :cron, :every_ms, :timezone, :on_missed, 'code',
    :now, :by, :next_tick)
ON CONFLICT (name) DO UPDATE SET topic = EXCLUDED.topic, body = EXCLUDED.body,
    body_is_json = EXCLUDED.body_is_json, cron = EXCLUDED.cron, every_ms = EXCLUDED.every_ms,
    timezone = EXCLUDED.timezone, on_missed = EXCLUDED.on_missed, declared_in = 'code',
    declared_at = EXCLUDED.declared_at, declared_by = EXCLUDED.declared_by,
    updated_at = CASE WHEN (s.topic, s.body, s.body_is_json, s.cron, s.every_ms, s.timezone,
        s.on_missed, s.declared_in) IS DISTINCT FROM (EXCLUDED.topic, EXCLUDED.body,
        EXCLUDED.body_is_json, EXCLUDED.cron, EXCLUDED.every_ms, EXCLUDED.timezone,
        EXCLUDED.on_missed, 'code')
        THEN statement_timestamp() ELSE s.updated_at END,
    next_tick = CASE WHEN (s.cron, s.every_ms, s.timezone)
        IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.every_ms, EXCLUDED.timezone)
        THEN EXCLUDED.next_tick ELSE s.next_tick END"""
        ),
        _params(item, next_tick) | {"now": now, "by": by},
    )


def remove_declared_before(conn: Connection, cutoff: datetime) -> list[str]:
    """Remove the code-declared schedules last declared before `cutoff` (those made through
    the API or the CLI are never removed here). -> their names, in order."""
    rows = conn.execute(
        sql(
            "DELETE FROM delaysvc.periodic_schedule WHERE declared_in = 'code' "
            "AND declared_at < :cutoff RETURNING name"
        ),
        {"cutoff": cutoff},
    )
    return sorted(row.name for row in rows)


def lock_due(conn: Connection, now: datetime, limit: int) -> list[Any]:
    """The running schedules whose next tick has come, locked for this transaction; one that
    another transaction holds is skipped (it is being fired)."""
    return list(
        conn.execute(
            sql(
                f"SELECT {COLUMNS} FROM delaysvc.periodic_schedule "
                "WHERE NOT paused AND next_tick <= :now ORDER BY next_tick LIMIT :limit "
                "FOR UPDATE SKIP LOCKED"
            ),
            {"now": now, "limit": limit},
        )
    )


def advance(
    conn: Connection,
    name: str,
    next_tick: datetime,
    fired_tick: datetime | None,
    message_id: int | None,
) -> None:
    conn.execute(
        sql(
            "UPDATE delaysvc.periodic_schedule SET next_tick = :next_tick, "
            "last_tick = COALESCE(:fired, last_tick), "
            "last_message_id = COALESCE(:message_id, last_message_id) WHERE name = :name"
        ),
        {"name": name, "next_tick": next_tick, "fired": fired_tick, "message_id": message_id},
    )


def all_schedules(conn: Connection) -> list[Any]:
    return list(
        conn.execute(sql(f"SELECT {COLUMNS} FROM delaysvc.periodic_schedule ORDER BY name"))
    )


def get(conn: Connection, name: str, lock: bool = False) -> Any:
    suffix = " FOR UPDATE" if lock else ""
    return conn.execute(
        sql(f"SELECT {COLUMNS} FROM delaysvc.periodic_schedule WHERE name = :name{suffix}"),
        {"name": name},
    ).first()


def set_paused(conn: Connection, name: str, paused: bool, next_tick: datetime | None) -> Any:
    """Pause, or resume from `next_tick` (the first tick after now: a pause is not caught up).
    -> the row, or None if there is no such schedule."""
    return conn.execute(
        sql(
            f"UPDATE delaysvc.periodic_schedule SET paused = :paused, "
            "next_tick = COALESCE(:next_tick, next_tick), updated_at = statement_timestamp() "
            f"WHERE name = :name RETURNING {COLUMNS}"
        ),
        {"name": name, "paused": paused, "next_tick": next_tick},
    ).first()


def delete(conn: Connection, name: str) -> bool:
    return (
        conn.execute(
            sql("DELETE FROM delaysvc.periodic_schedule WHERE name = :name"), {"name": name}
        ).rowcount
        > 0
    )


def _params(item: ScheduleFields, next_tick: datetime) -> dict[str, Any]:
    """A schedule's columns as a statement's parameters."""
    return {
        "name": item.name,
        "topic": item.topic,
        "body": item.body,
        "body_is_json": item.body_is_json,
        "cron": item.cron,
        "every_ms": item.every_ms,
        "timezone": item.timezone,
        "on_missed": item.on_missed,
        "next_tick": next_tick,
    }
