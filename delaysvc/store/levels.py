"""Delay levels and their lanes: the database's levels (the one truth for a level's delay), a
change of them, relocation to the timer lane."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

from delaysvc.config.levels import DelayLevels, format_ms
from delaysvc.db.names import sql
from delaysvc.errors import SchemaNotReady
from delaysvc.schema.tables import TIMER_LANE, level_partition, level_sequence
from delaysvc.store.shared import lock_timeout

LEVEL_CHANGE_LOCK_TIMEOUT_SECONDS = 10.0
LEVEL_CHANGE_LOCK_STEP = "200ms"
"""How long each try for the levels' lock waits (`_lock_the_levels`): what a send waits at most
behind it."""
LEVEL_CHANGE_LOCK_PAUSE_SECONDS = 0.3


def stored_levels(conn: Connection) -> dict[int, int]:
    """{level: delay_ms} as the database has them: the one truth for a level's delay."""
    rows = conn.execute(sql("SELECT lane, delay_ms FROM delaysvc.schedule_offset WHERE lane > 0"))
    return {row.lane: row.delay_ms for row in rows}


@dataclass(frozen=True)
class LevelChange:
    level: int
    old_ms: int
    new_ms: int | None  # None: the level is no longer configured
    relocated: int  # waiting messages moved to the timer lane, due times unchanged
    cap: str | None = None  # the removed level's backlog cap, removed with it

    def describe(self) -> str:
        old = format_ms(self.old_ms)
        what = (
            f"level {self.level} removed (was {old})"
            if self.new_ms is None
            else f"level {self.level}: {old} -> {format_ms(self.new_ms)}"
        )
        if self.relocated:
            what += (
                f"; its {self.relocated} waiting messages moved to the timer lane, "
                "due when they were due"
            )
        if self.cap:
            what += f"; its backlog cap ({self.cap}) removed with it"
        return what


def _lock_the_levels(conn: Connection) -> None:
    """Lock schedule_offset and the levels' queues for the rest of the transaction, trying
    for LEVEL_CHANGE_LOCK_TIMEOUT_SECONDS in steps of LEVEL_CHANGE_LOCK_STEP, each in a savepoint: a
    lock waited for holds every later send, retry and move behind it in PostgreSQL's queue,
    so a change behind a long producer transaction stalled the whole service for the 10 s,
    then failed all the same (found by a reviewer); between steps they go on."""
    deadline = time.monotonic() + LEVEL_CHANGE_LOCK_TIMEOUT_SECONDS
    while True:
        try:
            with conn.begin_nested(), lock_timeout(conn, LEVEL_CHANGE_LOCK_STEP):
                conn.execute(
                    sql(
                        "LOCK TABLE delaysvc.schedule_offset, delaysvc.consume_queue "
                        "IN ACCESS EXCLUSIVE MODE"
                    )
                )
            return  # a lock taken in a savepoint is the transaction's once it is released
        except OperationalError as exc:
            if time.monotonic() >= deadline:
                raise SchemaNotReady(
                    "the delay levels could not be changed: another transaction kept the "
                    f"levels' tables for {LEVEL_CHANGE_LOCK_TIMEOUT_SECONDS:g} s (a long "
                    "producer transaction, or a second migrate); try again"
                ) from exc
            time.sleep(LEVEL_CHANGE_LOCK_PAUSE_SECONDS)


def ensure_levels(conn: Connection, levels: DelayLevels) -> list[LevelChange]:
    """Make the database's levels the configured ones, keeping every waiting message's due
    time: create the queue, offset sequence and schedule_offset row of each new level; a level
    whose delay gets shorter, or that is no longer configured, first hands its waiting messages
    to the timer lane (same due times; in its FIFO queue they would now be due before their time
    or out of order), then takes its new delay or goes. A longer delay keeps its messages: they
    are due before any sent from now on, so offset order stays due order.

    A change locks schedule_offset and every level's queue exclusively until the caller
    commits. Every writer of a level reads schedule_offset in the statement that writes the
    level (`_PLACED_LANE`: sends, batches, retries; the mover locks its lane's row), so a
    writer either committed before the change, which then relocates its row, or waits and
    sees the new levels; the queue lock waits out anything else still writing a level (a
    cancel, a replace) before a level is read or dropped."""
    changed = {
        lane: ms
        for lane, ms in stored_levels(conn).items()
        if lane > levels.max_level or levels.delay_ms(lane) != ms
    }
    if changed:
        _lock_the_levels(conn)
    conn.execute(
        sql(
            "INSERT INTO delaysvc.schedule_offset (lane, delay_ms) VALUES (:lane, 0) "
            "ON CONFLICT (lane) DO NOTHING"
        ),
        {"lane": TIMER_LANE},
    )
    for level in range(1, levels.max_level + 1):
        partition, sequence = level_partition(level), level_sequence(level)
        conn.execute(sql(f"CREATE SEQUENCE IF NOT EXISTS delaysvc.{sequence}"))
        conn.execute(
            sql(
                f"CREATE TABLE IF NOT EXISTS delaysvc.{partition} PARTITION OF "
                "delaysvc.consume_queue "
                f"FOR VALUES IN ({level}) WITH (autovacuum_vacuum_scale_factor = 0.01, "
                "autovacuum_vacuum_insert_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0)"
            )
        )
        conn.execute(
            sql(
                "INSERT INTO delaysvc.schedule_offset (lane, delay_ms) VALUES (:lane, :delay_ms) "
                "ON CONFLICT (lane) DO NOTHING"
            ),
            {"lane": level, "delay_ms": levels.delay_ms(level)},
        )
    return [_change_level(conn, lane, old_ms, levels) for lane, old_ms in sorted(changed.items())]


def _change_level(conn: Connection, level: int, old_ms: int, levels: DelayLevels) -> LevelChange:
    new_ms = levels.delay_ms(level) if level <= levels.max_level else None
    relocated = 0
    cap = None
    if new_ms is None or new_ms < old_ms:
        relocated = relocate_to_timer(conn, level)
    if new_ms is None:
        left = conn.execute(
            sql(f"SELECT count(*) FROM delaysvc.{level_partition(level)}")
        ).scalar_one()
        if left:  # never expected: every writer of the level waited for the lock
            raise SchemaNotReady(
                f"level {level} still holds {left} messages after relocating its queue; "
                "it was not removed (nothing changed); try again"
            )
        conn.execute(sql(f"DROP TABLE delaysvc.{level_partition(level)}"))
        conn.execute(sql(f"DROP SEQUENCE IF EXISTS delaysvc.{level_sequence(level)}"))
        conn.execute(
            sql("DELETE FROM delaysvc.schedule_offset WHERE lane = :lane"), {"lane": level}
        )
        conn.execute(sql("DELETE FROM delaysvc.lane_count WHERE lane = :lane"), {"lane": level})
        # a cap chosen for this level's delay would bind a level added later under its number
        removed = conn.execute(
            sql(
                "DELETE FROM delaysvc.backlog_cap WHERE scope = 'level' AND target = :target "
                "RETURNING max_waiting, policy"
            ),
            {"target": str(level)},
        ).first()
        if removed is not None:
            cap = f"at most {removed.max_waiting} waiting, {removed.policy}"
    else:
        conn.execute(
            sql("UPDATE delaysvc.schedule_offset SET delay_ms = :ms WHERE lane = :lane"),
            {"lane": level, "ms": new_ms},
        )
    return LevelChange(level, old_ms, new_ms, relocated, cap)


# Rows taken out of level :lane (`{taken}`: message_id, topic, deliver_ts; `{where}` picks those
# that go) enter the timer lane with their due times unchanged; their commit_log rows follow
# (lane 0, a timer offset), and `{taken}` is counted out of the level, `placed` into the timer
# lane. Shared by a level change (`relocate_to_timer`) and the mover (`relocate_misplaced`).
_INTO_TIMER_LANE = """
, placed AS (
    SELECT message_id, topic, deliver_ts, priority,
        nextval('delaysvc.timer_queue_seq') AS queue_offset
    FROM {taken} WHERE {where}
), timed AS (
    INSERT INTO delaysvc.timer_queue (deliver_ts, queue_offset, message_id, topic, priority)
    SELECT deliver_ts, queue_offset, message_id, topic, priority FROM placed
), relaned AS (
    UPDATE delaysvc.commit_log c SET lane = 0, queue_offset = p.queue_offset
    FROM placed p WHERE c.id = p.message_id
), counted AS (
    INSERT INTO delaysvc.lane_count (lane, delta)
    SELECT lane, n FROM (VALUES (CAST(:lane AS smallint), -(SELECT count(*) FROM {taken})),
                                (CAST(0 AS smallint), (SELECT count(*) FROM placed))) v(lane, n)
    WHERE n <> 0
)"""

_RELOCATE_TO_TIMER = f"""
WITH taken AS (
    DELETE FROM delaysvc.consume_queue q WHERE q.level = :lane
    RETURNING q.message_id, q.topic, q.deliver_ts, q.priority
){_INTO_TIMER_LANE.format(taken="taken", where="true")}
SELECT count(*) FROM placed
"""


def relocate_to_timer(conn: Connection, level: int) -> int:
    """Move all of a level's waiting messages to the timer lane, due times unchanged.
    -> how many moved."""
    return conn.execute(sql(_RELOCATE_TO_TIMER), {"lane": level}).scalar_one()


# no such schema, table, function, column: a column is what most migrations add, so a database
# an older release migrated (a deploy that restarted before `delaysvc migrate`) meets that one
_MISSING = frozenset({"3F000", "42P01", "42883", "42703"})


def not_migrated(exc: DBAPIError) -> SchemaNotReady | None:
    """The `SchemaNotReady` a database error of one of delaysvc's statements stands for when the
    database lacks delaysvc's schema, one of its tables, functions or columns (never
    migrated, or migrated by an older delaysvc); None for any other error."""
    state = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    if state not in _MISSING:
        return None
    found = " ".join(str(exc.orig).strip().splitlines()[:1]) or f"SQLSTATE {state}"
    return SchemaNotReady(f"the database is not migrated ({found}); run `delaysvc migrate`")


def check_levels(conn: Connection, levels: DelayLevels) -> None:
    """SchemaNotReady unless the database has every configured level with the same delays:
    every long-lived process (worker, beat, web) checks this at start, after the schema's
    revision (`delaysvc.schema.migrate.check_schema`)."""
    try:
        stored = stored_levels(conn)
    except ProgrammingError as exc:  # the table itself is missing: never migrated
        raise SchemaNotReady("the database is not migrated; run `delaysvc migrate`") from exc
    differs = levels_differ(stored, levels)
    if differs is not None:
        raise SchemaNotReady(differs)


def levels_differ(stored: dict[int, int], levels: DelayLevels) -> str | None:
    """How the configured `levels` differ from the database's (`stored_levels`), or None."""
    wanted = {level: levels.delay_ms(level) for level in range(1, levels.max_level + 1)}
    if stored == wanted:
        return None
    differences = [
        f"level {lane}: {_ms_or_none(wanted.get(lane))} configured, "
        f"{_ms_or_none(stored.get(lane))} in the database"
        for lane in sorted(set(stored) | set(wanted))
        if stored.get(lane) != wanted.get(lane)
    ]
    return (
        f"DELAYSVC_DELAY_LEVELS ({levels}) differs from the database's levels ("
        + "; ".join(differences[:5])
        + (f"; {len(differences) - 5} more" if len(differences) > 5 else "")
        + "); run `delaysvc migrate` with these levels to apply them (waiting messages "
        "keep their due times), or start with the database's levels"
    )


def _ms_or_none(ms: int | None) -> str:
    return "none" if ms is None else format_ms(ms)
