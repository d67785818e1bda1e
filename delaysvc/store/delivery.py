"""The move: a lane's due head into its topics' queues in one statement, the lane's lock and
schedule offset, misplaced and stuck heads."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Connection

from delaysvc.db.names import sql
from delaysvc.errors import NotFound, NotStuck
from delaysvc.schema.tables import LATENESS_BUCKETS_MS, TIMER_LANE
from delaysvc.store.cancelling import take_out_of_lane
from delaysvc.store.consuming import _unprepared
from delaysvc.store.levels import _INTO_TIMER_LANE
from delaysvc.store.shared import _COUNTED_OUT, NOT_MOVED, NOW, WAITING


def lock_lane(conn: Connection, lane: int) -> Any:
    """Lock the lane's schedule_offset row for this transaction, or None if another mover
    holds it. Movers of one lane never overlap, so offsets advance in order."""
    return conn.execute(
        sql(
            "SELECT lane, delay_ms, schedule_offset, stuck_offset, stuck_error "
            "FROM delaysvc.schedule_offset WHERE lane = :lane FOR UPDATE SKIP LOCKED"
        ),
        {"lane": lane},
    ).first()


CLOCK_MARGIN_MS = 1000
_MOVED_TO_TOPIC = f"""
, ready AS (
    -- commit_log is not written: see MESSAGE_STATE (the claim writes the delivery down)
    INSERT INTO delaysvc.topic_queue (message_id, topic, deliver_ts, enqueued_at, priority)
    SELECT message_id, topic, deliver_ts, clock_timestamp(), priority FROM moved
    ORDER BY queue_offset
), advanced AS (
    UPDATE delaysvc.schedule_offset SET
        schedule_offset = GREATEST(schedule_offset,
            CASE WHEN lane > 0 THEN (SELECT max(queue_offset) FROM moved) ELSE 0 END),
        moved_total = moved_total + (SELECT count(*) FROM moved),
        last_moved_at = {NOW},
        stuck_offset = NULL, stuck_error = NULL, stuck_since = NULL
    WHERE lane = :lane AND EXISTS (SELECT 1 FROM moved)
), {_COUNTED_OUT.format(src="moved")}
SELECT count(*) AS moved, max(queue_offset) AS max_offset,
       -- hashed, not sorted: a sort of the batch's topic names compares them by the locale
       (SELECT array_agg(topic) FROM (SELECT DISTINCT topic FROM moved) d) AS topics,
       max(date_part('epoch', {NOW} - deliver_ts) * 1000) AS max_lateness_ms,
       -- the lateness the buckets count (below 0: 0), summed: the histogram's `_sum`
       sum(GREATEST(date_part('epoch', clock_timestamp() - deliver_ts), 0)) * 1000
           AS lateness_sum_ms,
       (SELECT date_part('epoch', deliver_ts - clock_timestamp()) FROM next_head)
           AS next_due_seconds,
       -- the window looked at was full and all due: rows beyond it may be due too (a window
       -- holding a row another transaction has locked moves one row short of the batch)
       (SELECT count(*) FROM head) = CAST(:batch AS int) AND NOT EXISTS (SELECT 1 FROM next_head)
           AS more_due,
       -- a level's first row not due is due within one delay of now, unless the database
       -- clock went back or it was sent with another delay (`relocate_misplaced`). Compared
       -- with the clock after this statement's snapshot, plus a margin: a send that committed
       -- before the snapshot computed its due time from an earlier clock, so it never trips it
       (SELECT CAST(:lane AS int) > 0 AND deliver_ts > COALESCE(CAST(:now AS timestamptz),
                   clock_timestamp()) + (:delay_ms + {CLOCK_MARGIN_MS}) * interval '1 millisecond'
        FROM next_head) AS misplaced,
       (SELECT json_object_agg(bucket, n) FROM (
            -- date_part, not extract: a float8, not a numeric (which costs 4x per row)
            SELECT width_bucket(date_part('epoch', clock_timestamp() - deliver_ts) * 1000,
                                CAST(:bounds AS float8[])) AS bucket, count(*) AS n
            FROM moved GROUP BY 1) b) AS lateness_buckets
FROM moved
"""

_MOVE_DUE_LEVEL = f"""
WITH head AS (
    SELECT queue_offset, deliver_ts FROM delaysvc.consume_queue
    WHERE level = :lane ORDER BY queue_offset LIMIT :batch
), next_head AS (
    -- the head's first row not yet due: the move stops before it, so topic order stays send
    -- order (one more than a delay ahead is `misplaced`, handled by `relocate_misplaced`)
    SELECT queue_offset, deliver_ts FROM head WHERE deliver_ts > {NOW}
    ORDER BY queue_offset LIMIT 1
), locked AS (
    -- the due prefix of the head (up to the row before next_head, else all of it): one range
    -- scan of the index
    SELECT ctid FROM delaysvc.consume_queue
    WHERE level = :lane
      AND queue_offset <= COALESCE((SELECT queue_offset - 1 FROM next_head),
                                   (SELECT max(queue_offset) FROM head))
    ORDER BY queue_offset
    FOR UPDATE SKIP LOCKED
), moved AS (
    -- by the locked rows' ctids: a TID scan of the level's partition
    DELETE FROM delaysvc.consume_queue q
    WHERE q.level = :lane AND q.ctid = ANY(ARRAY(SELECT ctid FROM locked))
    RETURNING q.queue_offset, q.message_id, q.topic, q.deliver_ts, q.priority
){_MOVED_TO_TOPIC}"""

_MOVE_DUE_TIMER = f"""
WITH due AS (
    SELECT ctid FROM delaysvc.timer_queue WHERE deliver_ts <= {NOW}
    ORDER BY deliver_ts, queue_offset LIMIT :batch FOR UPDATE SKIP LOCKED
), head AS (
    SELECT ctid FROM due  -- the window looked at (rows locked elsewhere are skipped in it)
), next_head AS (
    SELECT deliver_ts FROM delaysvc.timer_queue WHERE deliver_ts > {NOW}
    ORDER BY deliver_ts, queue_offset LIMIT 1
), moved AS (
    -- by the locked rows' ctids: a TID scan, whatever the planner thinks of the table's size
    DELETE FROM delaysvc.timer_queue t WHERE t.ctid = ANY(ARRAY(SELECT ctid FROM due))
    RETURNING t.queue_offset, t.message_id, t.topic, t.deliver_ts, t.priority
){_MOVED_TO_TOPIC}"""


@dataclass(frozen=True)
class Moved:
    count: int
    max_offset: int | None
    topics: tuple[str, ...]
    max_lateness_ms: float | None
    next_due_seconds: float | None
    """Seconds until the lane's next head is due (None: nothing waits behind the moved rows,
    or the batch was full)."""
    lateness_buckets: dict[int, int]
    """Moved rows per lateness bucket (index into LATENESS_BUCKETS_MS; the last is beyond)."""
    misplaced: bool = False
    """The level's first row not due is more than one delay ahead (`relocate_misplaced`)."""
    lateness_sum_ms: float = 0.0
    """The moved rows' lateness added up (what the buckets count)."""
    more_due: bool = False
    """The rows looked at were a full batch, all due: more beyond them may be due now."""


def move_due(
    conn: Connection, lane: int, delay_ms: int, batch: int, now: datetime | None = None
) -> Moved:
    """Move the due head of a lane into the topics' queues and advance its schedule_offset,
    in the caller's transaction (which must hold `lock_lane`)."""
    statement = _MOVE_DUE_TIMER if lane == TIMER_LANE else _MOVE_DUE_LEVEL
    params = {
        "lane": lane,
        "delay_ms": delay_ms,
        "batch": batch,
        "now": now,
        "bounds": list(LATENESS_BUCKETS_MS),
    }
    (row,) = _unprepared(conn, statement, params)  # never prepared: see `_unprepared`
    return Moved(
        row.moved,
        row.max_offset,
        tuple(t for t in (row.topics or ()) if t is not None),
        float(row.max_lateness_ms) if row.max_lateness_ms is not None else None,
        float(row.next_due_seconds) if row.next_due_seconds is not None else None,
        {int(b): int(n) for b, n in (row.lateness_buckets or {}).items()},
        bool(row.misplaced),
        float(row.lateness_sum_ms or 0.0),
        bool(row.more_due),
    )


# The head rows of a level more than one delay (+ margin) ahead. Sent when the database clock
# was ahead (stored "in the future"): delivered now, as RocketMQ's correctDeliverTimestamp
# does, so the level is not blocked for as long as the clock was off. Sent with another delay
# than the level's (a producer in a transaction that began before a level change): moved to
# the timer lane, due when they were always due, never early.
_RELOCATE_MISPLACED = f"""
WITH head AS (
    SELECT ctid, message_id, deliver_ts FROM delaysvc.consume_queue
    WHERE level = :lane ORDER BY queue_offset LIMIT :batch
), beyond AS (
    SELECT h.ctid, h.message_id, c.stored_at > clock.t AS clock_back
    FROM head h
    CROSS JOIN (SELECT COALESCE(CAST(:now AS timestamptz), clock_timestamp()) AS t) clock
    JOIN delaysvc.commit_log c ON c.id = h.message_id
    WHERE h.deliver_ts > clock.t + (:delay_ms + {CLOCK_MARGIN_MS}) * interval '1 millisecond'
), taken AS (
    DELETE FROM delaysvc.consume_queue q
    WHERE q.level = :lane AND q.ctid = ANY(ARRAY(SELECT ctid FROM beyond))
    RETURNING q.queue_offset, q.message_id, q.topic, q.deliver_ts, q.priority
), sorted AS (
    SELECT t.*, b.clock_back FROM taken t JOIN beyond b USING (message_id)
){_INTO_TIMER_LANE.format(taken="sorted", where="NOT clock_back")}, now_due AS (
    INSERT INTO delaysvc.topic_queue (message_id, topic, deliver_ts, enqueued_at, priority)
    SELECT message_id, topic, deliver_ts, clock_timestamp(), priority FROM sorted
    WHERE clock_back
    ORDER BY queue_offset
)
SELECT (SELECT count(*) FROM placed) AS to_timer,
       (SELECT count(*) FROM sorted WHERE clock_back) AS delivered,
       (SELECT array_agg(DISTINCT topic) FROM sorted WHERE clock_back) AS topics
"""


class Relocated(NamedTuple):
    to_timer: int  # sent with another delay than the level's: now in the timer lane
    delivered: int  # stored while the database clock was ahead: delivered now
    topics: tuple[str, ...]  # of the delivered ones


def relocate_misplaced(
    conn: Connection, lane: int, delay_ms: int, batch: int, now: datetime | None = None
) -> Relocated:
    """Take the level's head rows that are more than one delay ahead out of its FIFO queue
    (see _RELOCATE_MISPLACED), in the caller's transaction, which holds `lock_lane`."""
    params = {"lane": lane, "delay_ms": delay_ms, "batch": batch, "now": now}
    (row,) = _unprepared(conn, _RELOCATE_MISPLACED, params)
    return Relocated(int(row.to_timer), int(row.delivered), tuple(row.topics or ()))


def lane_head(conn: Connection, lane: int) -> Any:
    """The first waiting row of a lane (offset, deliver_ts, message_id) or None."""
    if lane == TIMER_LANE:
        statement = (
            "SELECT queue_offset, deliver_ts, message_id FROM delaysvc.timer_queue "
            "ORDER BY deliver_ts, queue_offset LIMIT 1"
        )
    else:
        statement = (
            "SELECT queue_offset, deliver_ts, message_id FROM delaysvc.consume_queue "
            "WHERE level = :lane ORDER BY queue_offset LIMIT 1"
        )
    return conn.execute(sql(statement), {"lane": lane}).first()


def clock_now(conn: Connection) -> datetime:
    """The database server's wall clock at this moment (`clock_timestamp()`), moving within a
    transaction."""
    return conn.execute(sql("SELECT clock_timestamp()")).scalar_one()


def mark_stuck(conn: Connection, lane: int, offset: int | None, error: str) -> None:
    conn.execute(
        sql(
            "UPDATE delaysvc.schedule_offset SET stuck_offset = :offset, stuck_error = :error, "
            "stuck_since = COALESCE(stuck_since, statement_timestamp()) WHERE lane = :lane"
        ),
        {"lane": lane, "offset": offset, "error": error[:2000]},
    )


def clear_stuck(conn: Connection, lane: int) -> None:
    conn.execute(
        sql(
            "UPDATE delaysvc.schedule_offset SET stuck_offset = NULL, stuck_error = NULL, "
            "stuck_since = NULL WHERE lane = :lane"
        ),
        {"lane": lane},
    )


def skip_stuck_head(conn: Connection, lane: int) -> int:
    """Operator action: move a stuck lane's head message to the dead letters. -> its id.

    The lane is locked first (no move can run meanwhile), then its stuck offset and head are
    read; the head must still be the row the lane is stuck on, and each change names the state
    it expects, so a message just delivered is never dead-lettered, nor dead and running."""
    name = "the timer lane" if lane == TIMER_LANE else f"level {lane}"
    locked = lock_lane(conn, lane)
    if locked is None:
        lanes = conn.execute(sql("SELECT array_agg(lane) FROM delaysvc.schedule_offset")).scalar()
        if lane not in (lanes or ()):
            raise NotFound(
                f"there is no lane {lane}: 0 is the timer lane, 1..{max(lanes or [0])} the levels"
            )
        raise NotStuck(f"{name} is being delivered right now; try again")
    if locked.stuck_offset is None:
        raise NotStuck(f"{name} is not stuck: its head moves; nothing to skip")
    head = lane_head(conn, lane)
    if head is None or head.queue_offset != locked.stuck_offset:
        raise NotStuck(f"{name}'s head is no longer the message it was stuck on; nothing skipped")
    if not take_out_of_lane(conn, lane, head.queue_offset, head.deliver_ts):
        raise NotStuck(f"{name}'s head was just taken by a cancel; nothing skipped")
    reason = f"skipped by an operator: {locked.stuck_error or 'head could not be moved'}"
    buried = conn.execute(
        sql(
            f"""
WITH buried AS (
    UPDATE delaysvc.commit_log c
    SET status = 'dead', finished_at = statement_timestamp(), lane = -1, queue_offset = NULL,
        last_error = :reason
    WHERE c.id = :id AND {WAITING} AND {NOT_MOVED}
    RETURNING c.id, c.topic, c.attempts
)
INSERT INTO delaysvc.dead_letter (message_id, topic, reason, attempts, error)
SELECT id, topic, :reason, attempts, :reason FROM buried
ON CONFLICT (message_id) DO NOTHING
RETURNING message_id"""
        ),
        {"id": head.message_id, "reason": reason},
    ).first()
    if buried is None:
        raise NotStuck(f"message {head.message_id} is not waiting any more; nothing skipped")
    conn.execute(
        sql(
            "UPDATE delaysvc.schedule_offset SET stuck_offset = NULL, stuck_error = NULL, "
            "stuck_since = NULL, schedule_offset = GREATEST(schedule_offset, :offset) "
            "WHERE lane = :lane"
        ),
        {"lane": lane, "offset": head.queue_offset if lane > 0 else 0},
    )
    return int(head.message_id)
