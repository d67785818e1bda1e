"""What every statement family shares: the `Statements` a producer's statement runs on, the pieces
that put a message into a lane (`_PLACED_LANE`, `_NEXT_OFFSET`, `_ENQUEUE_FROM`), a message's
columns and its state as readers see it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Connection, TextClause

from delaysvc.db.names import sql

NOW = "COALESCE(CAST(:now AS timestamptz), statement_timestamp())"


class Statements(Protocol):
    """What the producer's statements run on: a SQLAlchemy `Connection`, or a connection the
    caller holds adapted by `delaysvc.db.connections`. Results are read as SQLAlchemy's are
    (`first`, `one`, `scalar_one`, `scalars`, `rowcount`, iteration; rows by name and
    position)."""

    def execute(
        self, statement: TextClause, parameters: Mapping[str, Any] | None = None, /
    ) -> Any: ...


@contextmanager
def lock_timeout(conn: Connection, timeout: str) -> Iterator[None]:
    """The block's statements wait for a lock at most `timeout` (PostgreSQL's spelling: `'5s'`,
    `'10000ms'`); after it the transaction's own `lock_timeout` is as it was. (`SET LOCAL`
    alone leaves the wait for the rest of the transaction: a redrive ran its rest with 10 s.)
    On an error the transaction is aborted, and ending it puts the setting back."""
    was = conn.execute(sql("SELECT current_setting('lock_timeout')")).scalar_one()
    conn.execute(sql("SELECT set_config('lock_timeout', :wait, true)"), {"wait": timeout})
    yield
    conn.execute(sql("SELECT set_config('lock_timeout', :was, true)"), {"was": was})


# A level's FIFO queue only takes messages whose delay is the level's delay in the database
# (`{delay_ms}` is the delay the sender computed); any other goes to the timer lane (0), due at
# the same time. Cheap: a primary-key probe of a table of a few dozen rows.
_PLACED_LANE = """CASE WHEN {lane} > 0 AND NOT EXISTS (SELECT 1 FROM delaysvc.schedule_offset so
        WHERE so.lane = {lane} AND so.delay_ms = {delay_ms}) THEN 0 ELSE {lane} END"""

# A message's due time: `{deliver_at}` (a time asked for, or NULL) else its store time plus
# `{delay_ms}`. A time already past is the store time: a year ago went to the timer lane as it
# was and its move was counted a year late in the lateness histogram and /metrics' totals; it is
# due at once either way, and never earlier than asked.
_DUE = """GREATEST(
            COALESCE({deliver_at}, statement_timestamp() + {delay_ms} * interval '1 millisecond'),
            statement_timestamp())"""

# `{deliver_at}` as `send_one` takes it: a time already past the store time (see `_DUE`).
_NOT_PAST = """CASE WHEN {deliver_at} < statement_timestamp() THEN statement_timestamp()
        ELSE {deliver_at} END"""

_NEXT_OFFSET = """CASE WHEN {lane} > 0
        THEN nextval(format('delaysvc.consume_queue_%s_seq', {lane})::regclass)
        WHEN {lane} = 0 THEN nextval('delaysvc.timer_queue_seq') END"""

_ENQUEUE_FROM = """
, level_rows AS (
    INSERT INTO delaysvc.consume_queue (level, queue_offset, message_id, topic, deliver_ts,
        priority)
    SELECT lane, queue_offset, id, topic, deliver_ts, priority FROM {src} WHERE lane > 0
), timer_rows AS (
    INSERT INTO delaysvc.timer_queue (deliver_ts, queue_offset, message_id, topic, priority)
    SELECT deliver_ts, queue_offset, id, topic, priority FROM {src} WHERE lane = 0
), ready_rows AS (
    INSERT INTO delaysvc.topic_queue (message_id, topic, deliver_ts, priority)
    SELECT id, topic, deliver_ts, priority FROM {src} WHERE lane < 0 ORDER BY id
), lane_counted AS (
    INSERT INTO delaysvc.lane_count (lane, delta)
    SELECT lane, count(*) FROM {src} WHERE lane >= 0 GROUP BY lane
)"""

# Rows `{src}` took out of lane :lane, counted out of it.
_COUNTED_OUT = """lane_counted AS (
    INSERT INTO delaysvc.lane_count (lane, delta)
    SELECT CAST(:lane AS smallint), -count(*) FROM {src} HAVING count(*) > 0
)"""

MESSAGE_COLUMNS = """id, topic, key, tags, body, body_is_json, properties, delay_level, priority,
    lane, queue_offset, status, stored_at, deliver_ts, delivered_at, started_at, finished_at,
    attempts, duration_ms, last_error, errors"""

# A message the delivery moved into its topic's queue keeps its commit_log row as it was
# (scheduled or retrying, with its old lane and offset) until a consumer claims it, and the
# claim writes the delivery down: one write of the commit log less per message on the hottest
# path (a third of a drain's time: docs/benchmarks/drain_profile.py). Whoever reads a
# message's state reads it through MESSAGE_STATE: in the topic queue, it is ready, delivered when
# it entered the queue.
WAITING = "c.status IN ('scheduled', 'retrying')"
IN_TOPIC_QUEUE = "EXISTS (SELECT 1 FROM delaysvc.topic_queue tq WHERE tq.message_id = c.id)"
MOVED = f"{WAITING} AND {IN_TOPIC_QUEUE}"
STATUS = f"CASE WHEN {MOVED} THEN 'ready' ELSE c.status END"
LANE = f"CASE WHEN {MOVED} THEN -1 ELSE c.lane END"
DELIVERED_AT = f"""COALESCE((SELECT tq.enqueued_at FROM delaysvc.topic_queue tq
    WHERE tq.message_id = c.id AND {WAITING}), c.delivered_at)"""
MESSAGE_STATE = f"""c.id, c.topic, c.key, c.tags, c.body, c.body_is_json, c.properties,
    c.delay_level, c.priority, {LANE} AS lane, CASE WHEN {MOVED} THEN NULL ELSE c.queue_offset END
    AS queue_offset, {STATUS} AS status, c.stored_at, c.deliver_ts,
    {DELIVERED_AT} AS delivered_at,
    c.started_at, c.finished_at, c.attempts, c.duration_ms, c.last_error, c.errors"""
NOT_MOVED = f"NOT {IN_TOPIC_QUEUE}"


@dataclass(frozen=True)
class NewMessage:
    """A validated message ready to store. Exactly one of delay_ms / deliver_at is set."""

    topic: str
    body: bytes
    body_is_json: bool
    lane: int
    delay_level: int | None
    delay_ms: int | None
    deliver_at: datetime | None
    key: str | None = None
    tags: list[str] | None = None
    properties: dict[str, str] | None = None
    priority: int = 0
