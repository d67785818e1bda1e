"""Every statement the service runs, each named for what it does.

Callers pass a SQLAlchemy `Connection` and own the transaction; nothing here commits. The
producer's statements (sending, cancelling, reading a message, the backlog caps) take any
`Statements`: a SQLAlchemy `Connection`, or a connection the caller holds adapted by
`delaysvc.joining` (psycopg 3, psycopg2, Django's, asyncio ones), so they join any transaction
the caller has open. "Now" is the database clock (`statement_timestamp()`) unless a test passes
`now=`.

Lanes (see `delaysvc.schema`): a waiting message sits in lane N >= 1 (consume queue of level N,
FIFO by offset) or lane 0 (the timer lane, by deliver_ts); lane -1 means it is in its topic's
queue (or beyond). `_PLACED_LANE`, `_NEXT_OFFSET` and `_ENQUEUE_FROM` are the pieces every write
that puts a message into a lane shares (send, batch send, retry, bulk schedule).

The database is the one truth for a level's delay (`schedule_offset.delay_ms`): a message goes
into a level's FIFO queue only if its delay is that level's delay in the database, else into the
timer lane at the same due time, so a producer or a worker whose DELAYSVC_DELAY_LEVELS drifted
from the database can never make a level's offset order differ from its due order. Every write
that adds messages to a lane or takes them out appends their count to `lane_count` in the same
statement: the backlog figures and the level caps read exact counts, not offsets.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, NamedTuple, Protocol

from psycopg import Cursor
from psycopg.rows import namedtuple_row
from sqlalchemy import Connection, TextClause
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from delaysvc import store_history
from delaysvc.db import sqlalchemy_error
from delaysvc.errors import DuplicateKey, NotStuck, SchemaNotReady
from delaysvc.levels import DelayLevels, format_ms
from delaysvc.schema import LATENESS_BUCKETS_MS, TIMER_LANE, level_partition, level_sequence
from delaysvc.sql import LOCK_KEY, lock_name, sql
from delaysvc.sql import driver_sql as _driver_sql

NOW = "COALESCE(CAST(:now AS timestamptz), statement_timestamp())"


def driver_sql(statement: TextClause) -> str:
    """Any statement of this module in the form a `%(name)s` driver takes it (psycopg 3,
    psycopg2, Django's cursor), compiled once per statement text."""
    return _driver_sql(statement.text)


class Statements(Protocol):
    """What the producer's statements run on: a SQLAlchemy `Connection`, or a connection the
    caller holds adapted by `delaysvc.joining`. Results are read as SQLAlchemy's are (`first`,
    `one`, `scalar_one`, `scalars`, `rowcount`, iteration; rows by name and position)."""

    def execute(
        self, statement: TextClause, parameters: Mapping[str, Any] | None = None, /
    ) -> Any: ...


# A level's FIFO queue only takes messages whose delay is the level's delay in the database
# (`{delay_ms}` is the delay the sender computed); any other goes to the timer lane (0), due at
# the same time. Cheap: a primary-key probe of a table of a few dozen rows.
_PLACED_LANE = """CASE WHEN {lane} > 0 AND NOT EXISTS (SELECT 1 FROM delaysvc.schedule_offset so
        WHERE so.lane = {lane} AND so.delay_ms = {delay_ms}) THEN 0 ELSE {lane} END"""

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


# ---------------------------------------------------------------- levels and lanes


LEVEL_CHANGE_LOCK_TIMEOUT = "10s"


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
        return what


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
        conn.execute(sql(f"SET LOCAL lock_timeout = '{LEVEL_CHANGE_LOCK_TIMEOUT}'"))
        try:
            conn.execute(
                sql(
                    "LOCK TABLE delaysvc.schedule_offset, delaysvc.consume_queue "
                    "IN ACCESS EXCLUSIVE MODE"
                )
            )
        except OperationalError as exc:
            raise SchemaNotReady(
                "the delay levels could not be changed: another transaction kept "
                f"the levels' tables for {LEVEL_CHANGE_LOCK_TIMEOUT} (a long producer "
                "transaction, or a second migrate); try again"
            ) from exc
        conn.execute(sql("SET LOCAL lock_timeout = 0"))
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
    else:
        conn.execute(
            sql("UPDATE delaysvc.schedule_offset SET delay_ms = :ms WHERE lane = :lane"),
            {"lane": level, "ms": new_ms},
        )
    return LevelChange(level, old_ms, new_ms, relocated)


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


def check_levels(conn: Connection, levels: DelayLevels) -> None:
    """SchemaNotReady unless the database has every configured level with the same delays:
    every long-lived process (worker, beat, web) calls this at start."""
    try:
        stored = stored_levels(conn)
    except ProgrammingError as exc:  # the table itself is missing: never migrated
        raise SchemaNotReady("the database is not migrated; run `delaysvc migrate`") from exc
    wanted = {level: levels.delay_ms(level) for level in range(1, levels.max_level + 1)}
    if stored != wanted:
        differences = [
            f"level {lane}: {_ms_or_none(wanted.get(lane))} configured, "
            f"{_ms_or_none(stored.get(lane))} in the database"
            for lane in sorted(set(stored) | set(wanted))
            if stored.get(lane) != wanted.get(lane)
        ]
        raise SchemaNotReady(
            f"DELAYSVC_DELAY_LEVELS ({levels}) differs from the database's levels ("
            + "; ".join(differences[:5])
            + (f"; {len(differences) - 5} more" if len(differences) > 5 else "")
            + "); run `delaysvc migrate` with these levels to apply them (waiting messages "
            "keep their due times), or start with the database's levels"
        )


def _ms_or_none(ms: int | None) -> str:
    return "none" if ms is None else format_ms(ms)


# ---------------------------------------------------------------- producing

# A send to a level or the timer lane stores nothing if a backlog cap covers its topic or level,
# unless the caller holds the caps' locks (:caps_held): a probe of backlog_cap's primary key per
# target, so every producer keeps to the caps without a setting or a cache. It returns one row of
# NULLs instead, and the producer stores the message under the caps (`delaysvc.caps`).
_UNCAPPED = """uncapped AS (SELECT CAST(:caps_held AS boolean) OR NOT EXISTS (
        SELECT 1 FROM delaysvc.backlog_cap bc WHERE {targets}) AS free), """
_CAPPED_MARK = "\nUNION ALL SELECT NULL, NULL, NULL, NULL FROM uncapped WHERE NOT uncapped.free"

# One statement per send, returning only what the database decides (id, stored_at,
# deliver_ts, and the lane, which for a level is the level only if the database agrees on its
# delay: `_PLACED_LANE`): the producer has the rest. One form per kind of lane.
_INSERT_ONE = """
WITH {placed}msg AS (
    INSERT INTO delaysvc.commit_log (topic, key, tags, body, body_is_json, properties, delay_level,
        priority, lane, queue_offset, status, stored_at, deliver_ts, delivered_at)
    SELECT :topic, :key, CAST(:tags AS text[]), :body, :body_is_json,
        CAST(:properties AS jsonb), CAST(:delay_level AS smallint),
        CAST(:priority AS smallint), {lane},
        {offset}, {status}, statement_timestamp(),
        COALESCE(CAST(:deliver_at AS timestamptz),
                 statement_timestamp() + CAST(:delay_ms AS bigint) * interval '1 millisecond'),
        {delivered_at}{source}
    ON CONFLICT (topic, key) WHERE key IS NOT NULL AND finished_at IS NULL DO NOTHING
    RETURNING id, topic, lane, queue_offset, stored_at, deliver_ts, priority
){enqueue}
SELECT id, stored_at, deliver_ts, lane FROM msg{capped}
"""
# The lane of one message asking for level :lane with delay :delay_ms (`_PLACED_LANE`).
_PLACED_ONE = (
    "placed AS (SELECT CAST("
    + _PLACED_LANE.format(lane="CAST(:lane AS int)", delay_ms="CAST(:delay_ms AS bigint)")
    + " AS smallint) AS lane)"
)
_INSERT_ONE_LEVEL = _INSERT_ONE.format(
    placed=_PLACED_ONE
    + ", "
    + _UNCAPPED.format(
        targets="(bc.scope = 'topic' AND bc.target = :topic) OR "
        "(bc.scope = 'level' AND bc.target = CAST(CAST(:lane AS int) AS text))"
    ),
    lane="placed.lane",
    offset=_NEXT_OFFSET.format(lane="placed.lane"),
    status="'scheduled'",
    delivered_at="NULL",
    source=" FROM placed, uncapped WHERE uncapped.free",
    enqueue=_ENQUEUE_FROM.format(src="msg"),
    capped=_CAPPED_MARK,
)
_INSERT_ONE_TIMER = _INSERT_ONE.format(
    placed=_UNCAPPED.format(targets="bc.scope = 'topic' AND bc.target = :topic"),
    lane="CAST(0 AS smallint)",
    offset="nextval('delaysvc.timer_queue_seq')",
    status="'scheduled'",
    delivered_at="NULL",
    source=" FROM uncapped WHERE uncapped.free",
    capped=_CAPPED_MARK,
    enqueue="""
, timer_rows AS (
    INSERT INTO delaysvc.timer_queue (deliver_ts, queue_offset, message_id, topic, priority)
    SELECT deliver_ts, queue_offset, id, topic, priority FROM msg
), lane_counted AS (
    INSERT INTO delaysvc.lane_count (lane, delta) SELECT 0, 1 FROM msg
)""",
)
_INSERT_ONE_READY = _INSERT_ONE.format(
    placed="",
    lane="CAST(-1 AS smallint)",
    offset="NULL",
    status="'ready'",
    delivered_at="statement_timestamp()",
    source="",
    capped="",
    enqueue="""
, queued AS (
    INSERT INTO delaysvc.topic_queue (message_id, topic, deliver_ts, priority)
    SELECT id, topic, deliver_ts, priority FROM msg
)""",
)


def _insert_one_statement(lane: int) -> str:
    if lane > 0:
        return _INSERT_ONE_LEVEL
    return _INSERT_ONE_TIMER if lane == TIMER_LANE else _INSERT_ONE_READY


def _message_params(message: NewMessage) -> dict[str, Any]:
    return {
        "topic": message.topic,
        "key": message.key,
        "tags": message.tags,
        "body": message.body,
        "body_is_json": message.body_is_json,
        "properties": json.dumps(message.properties) if message.properties is not None else None,
        "delay_level": message.delay_level,
        "priority": message.priority,
        "lane": message.lane,
        "delay_ms": message.delay_ms,
        "deliver_at": message.deliver_at,
    }


class Stored(NamedTuple):
    """What the database decided for a message just stored."""

    id: int
    stored_at: datetime
    deliver_ts: datetime
    lane: int


def insert_message(
    cursor: Cursor[Any], message: NewMessage, caps_held: bool
) -> tuple[Any, bool, int | None] | None:
    """Store one message and put it in its lane, in one statement. -> (row, created, origin)
    as `insert_messages` gives them: a new message's row is `Stored` (the caller has the rest;
    origin 0); a key already held by an unfinished message of the topic gives that message's
    whole row, created=False, origin None. None: a backlog cap covers the message's topic or
    level and the caller does not hold the caps' locks (`caps_held`): nothing was stored.

    `cursor` is a psycopg 3 driver cursor (an autocommitted single send:
    `db.autocommit_cursor`; in a transaction: `driver_errors`): the statement is prepared on
    the server once per connection (unless the connection has prepared statements turned off,
    as for PgBouncer), and SQLAlchemy's execution and result objects, which cost more Python
    than the statement's own execution, are skipped (docs/benchmarks/README.md, "Send").
    `insert_message_on` is the same on any `Statements`."""
    statement = _driver_sql(_insert_one_statement(message.lane))
    params = {**_message_params(message), "caps_held": caps_held}
    prepare = None if cursor.connection.prepare_threshold is None else True

    def find_holder() -> Any:
        with cursor.connection.cursor(row_factory=namedtuple_row) as named:
            lookup = {"topic": message.topic, "key": message.key}
            return named.execute(_driver_sql(_FIND_UNFINISHED_BY_KEY), lookup).fetchone()

    return _insert_or_find(
        message, lambda: cursor.execute(statement, params, prepare=prepare).fetchone(), find_holder
    )


def insert_message_on(conn: Statements, message: NewMessage) -> tuple[Any, bool, int | None]:
    """`insert_message` through any `Statements` (any driver), by a caller holding the caps'
    locks or sending due now (never capped)."""
    inserted = insert_uncapped_on(conn, message, caps_held=True)
    assert inserted is not None  # with the caps held, nothing is left to them
    return inserted


def insert_uncapped_on(
    conn: Statements, message: NewMessage, caps_held: bool = False
) -> tuple[Any, bool, int | None] | None:
    """`insert_message` through any `Statements` (any driver)."""
    params = {**_message_params(message), "caps_held": caps_held}
    return _insert_or_find(
        message,
        lambda: conn.execute(sql(_insert_one_statement(message.lane)), params).first(),
        lambda: find_unfinished_by_key(conn, message.topic, message.key),
    )


def _insert_or_find(
    message: NewMessage, insert: Callable[[], Any], find_holder: Callable[[], Any]
) -> tuple[Any, bool, int | None] | None:
    for _ in range(5):
        row = insert()
        if row is not None:
            if row[0] is None:
                return None  # a cap covers it (`_UNCAPPED`)
            return Stored(*row), True, 0
        if message.key is not None:
            existing = find_holder()
            if existing is not None:
                return existing, False, None
        # The holder of the key finished between the two statements: try again.
    raise DuplicateKey(f"key {message.key!r} of topic {message.topic!r} is changing hands; retry")


# A batch is COPYed into a temporary staging table (one per session, emptied by the insert
# that reads it, and at commit), then stored by one statement: ids are drawn in batch order
# first, so each created row maps back to its item; lanes, offsets, the key rule and
# database-clock deliver_ts are the single send's. A key held already, or earlier in the batch,
# creates nothing (ON CONFLICT DO NOTHING sees rows this statement inserted).
_STAGE_TABLE = "delaysvc_send_stage"
_STAGE_COLUMNS = (
    "ord, topic, key, tags, body, body_is_json, properties, delay_level, lane, delay_ms, "
    "deliver_at, priority"
)
_CREATE_STAGE = f"""CREATE TEMP TABLE IF NOT EXISTS {_STAGE_TABLE} (
    ord int, topic text, key text, tags text[], body bytea, body_is_json boolean,
    properties jsonb, delay_level smallint, lane smallint, delay_ms bigint,
    deliver_at timestamptz, priority smallint
) ON COMMIT DELETE ROWS"""
_COPY_STAGE = f"COPY {_STAGE_TABLE} ({_STAGE_COLUMNS}) FROM STDIN"
INSERT_STAGED = f"""
WITH staged AS (
    DELETE FROM {_STAGE_TABLE} RETURNING *
), numbered AS (
    SELECT nextval('delaysvc.commit_log_id_seq') AS id, s.ord, s.topic, s.key, s.tags, s.body,
        s.body_is_json, s.properties, s.delay_level, s.priority,
        CAST({_PLACED_LANE.format(lane="s.lane", delay_ms="s.delay_ms")} AS smallint) AS lane,
        s.delay_ms, s.deliver_at
    FROM (SELECT * FROM staged ORDER BY ord) s
), msg AS (
    INSERT INTO delaysvc.commit_log (id, topic, key, tags, body, body_is_json, properties,
        delay_level, priority, lane, queue_offset, status, stored_at, deliver_ts, delivered_at)
    SELECT id, topic, key, tags, body, body_is_json, properties, delay_level, priority, lane,
        {_NEXT_OFFSET.format(lane="lane")},
        CASE WHEN lane < 0 THEN 'ready' ELSE 'scheduled' END,
        statement_timestamp(),
        COALESCE(deliver_at, statement_timestamp() + delay_ms * interval '1 millisecond'),
        CASE WHEN lane < 0 THEN statement_timestamp() END
    FROM numbered ORDER BY ord
    ON CONFLICT (topic, key) WHERE key IS NOT NULL AND finished_at IS NULL DO NOTHING
    RETURNING id, topic, lane, queue_offset, stored_at, deliver_ts, priority
){_ENQUEUE_FROM.format(src="msg")}
SELECT n.ord, m.id, m.stored_at, m.deliver_ts FROM msg m JOIN numbered n ON n.id = m.id
"""


# Without a psycopg 3 cursor to COPY with (psycopg2, Django's cursor, asyncio connections), a
# batch is staged by one statement from a JSON document of its rows (`_stage_document`).
_STAGE_FROM_JSON = f"""INSERT INTO {_STAGE_TABLE} ({_STAGE_COLUMNS})
SELECT ord, topic, key, tags, decode(body, 'base64'), body_is_json, properties, delay_level,
    lane, delay_ms, deliver_at, priority
FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS s(ord int, topic text, key text, tags text[],
    body text, body_is_json boolean, properties jsonb, delay_level smallint, lane smallint,
    delay_ms bigint, deliver_at timestamptz, priority smallint)"""


def stage_rows(cursor: Cursor[Any], rows: Iterable[tuple[Any, ...]]) -> None:
    """COPY `stage_row`s into the session's staging table (made if it is missing), for
    INSERT_STAGED to store, in the cursor's transaction."""
    cursor.execute(_CREATE_STAGE)
    with cursor.copy(_COPY_STAGE) as copy:
        for row in rows:
            copy.write_row(row)


def stage_row(ord_: int, message: NewMessage) -> tuple[Any, ...]:
    properties = message.properties
    return (
        ord_,
        message.topic,
        message.key,
        message.tags,
        message.body,
        message.body_is_json,
        json.dumps(properties) if properties is not None else None,
        message.delay_level,
        message.lane,
        message.delay_ms,
        message.deliver_at,
        message.priority,
    )


def _stage_document(messages: Sequence[NewMessage]) -> str:
    return json.dumps(
        [
            {
                "ord": ord_,
                "topic": m.topic,
                "key": m.key,
                "tags": m.tags,
                "body": base64.b64encode(m.body).decode("ascii"),
                "body_is_json": m.body_is_json,
                "properties": m.properties,
                "delay_level": m.delay_level,
                "lane": m.lane,
                "delay_ms": m.delay_ms,
                "deliver_at": m.deliver_at.isoformat() if m.deliver_at is not None else None,
                "priority": m.priority,
            }
            for ord_, m in enumerate(messages)
        ]
    )


def insert_messages(
    conn: Statements, messages: Sequence[NewMessage], cursor: Cursor[Any] | None = None
) -> list[tuple[Any, bool, int | None]]:
    """Store many messages in the caller's transaction: into the staging table (COPY on
    `cursor`, a psycopg 3 cursor of `conn`'s connection; without one, one statement from a
    JSON document), then one insert. -> [(row, created, origin)] in input order. A created row
    holds `id, stored_at, deliver_ts` and `origin` is the item's index; a key taken earlier in
    the batch gives that item's row and index with created=False; a key held by an unfinished
    message already gives that message's whole row, created=False and origin None."""
    if cursor is not None:
        stage_rows(cursor, (stage_row(ord_, message) for ord_, message in enumerate(messages)))
    else:
        conn.execute(sql(_CREATE_STAGE))
        conn.execute(sql(_STAGE_FROM_JSON), {"rows": _stage_document(messages)})
    created: list[Any] = [None] * len(messages)
    for row in conn.execute(sql(INSERT_STAGED)):
        created[row.ord] = row
    results: list[tuple[Any, bool, int | None]] = []
    missing = [m for m, row in zip(messages, created, strict=True) if row is None]
    holders = find_unfinished_by_keys(conn, [(m.topic, m.key) for m in missing if m.key])
    first_in_batch: dict[tuple[str, str], int] = {}
    for index, (message, row) in enumerate(zip(messages, created, strict=True)):
        pair = (message.topic, message.key) if message.key is not None else None
        if row is not None:
            if pair is not None:
                first_in_batch.setdefault(pair, index)
            results.append((row, True, index))
        elif pair is not None and pair in first_in_batch:
            origin = first_in_batch[pair]
            results.append((created[origin], False, origin))
        elif pair is not None and pair in holders:
            results.append((holders[pair], False, None))
        else:
            raise DuplicateKey(
                f"key {message.key!r} of topic {message.topic!r} is changing hands; retry"
            )
    return results


@contextmanager
def driver_errors(conn: Connection, statement: str | None = None) -> Iterator[Any]:
    """A cursor of the connection's driver (for COPY, which SQLAlchemy has no API for, and a
    single send's statement) in the connection's transaction (begun here if it has none yet,
    as `conn.execute` would), whose errors become SQLAlchemy's like those of `conn.execute`:
    a lost connection is invalidated and reported as `connection_invalidated`."""
    if not conn.in_transaction():
        conn.begin()
    dbapi_connection = conn.connection.dbapi_connection
    assert dbapi_connection is not None
    cursor = dbapi_connection.cursor()
    try:
        yield cursor
    except conn.dialect.loaded_dbapi.Error as exc:
        lost = conn.dialect.is_disconnect(exc, dbapi_connection, cursor)
        if lost:
            conn.invalidate(exc)
        raise sqlalchemy_error(exc, conn.dialect, statement, lost=lost) from exc
    finally:
        if not cursor.closed:
            cursor.close()


def find_unfinished_by_keys(
    conn: Statements, pairs: Sequence[tuple[str, str | None]]
) -> dict[tuple[str, str], Any]:
    """The unfinished messages holding these (topic, key) pairs, in one statement."""
    wanted = {(topic, key) for topic, key in pairs if key is not None}
    if not wanted:
        return {}
    topics, keys = zip(*wanted, strict=True)
    rows = conn.execute(
        sql(
            f"SELECT {MESSAGE_STATE} FROM delaysvc.commit_log c WHERE c.key IS NOT NULL AND "
            "c.finished_at IS NULL AND "
            "(c.topic, c.key) IN (SELECT * FROM unnest(CAST(:topics AS text[]), "
            "CAST(:keys AS text[])))"
        ),
        {"topics": list(topics), "keys": list(keys)},
    )
    return {(row.topic, row.key): row for row in rows}


_FIND_UNFINISHED_BY_KEY = f"""SELECT {MESSAGE_STATE} FROM delaysvc.commit_log c
    WHERE c.topic = :topic AND c.key = :key AND c.finished_at IS NULL"""


def find_unfinished_by_key(conn: Statements, topic: str, key: str | None) -> Any:
    if key is None:
        return None
    return conn.execute(sql(_FIND_UNFINISHED_BY_KEY), {"topic": topic, "key": key}).first()


def get_message(conn: Statements, message_id: int) -> Any:
    return conn.execute(
        sql(f"SELECT {MESSAGE_STATE} FROM delaysvc.message c WHERE c.id = :id"),
        {"id": message_id},
    ).first()


# The newest finished message of a key: among commit_log's few finished rows (their partial
# index) or in the history (its days' key indexes), each table's newest on its own. Through
# the view, commit_log's side had no index for a key that may have finished: a scan of the
# whole backlog.
_FIND_FINISHED_BY_KEY = f"""SELECT {MESSAGE_STATE} FROM (
    (SELECT {store_history.COLUMNS} FROM delaysvc.commit_log
        WHERE topic = :topic AND key = :key AND finished_at IS NOT NULL ORDER BY id DESC LIMIT 1)
    UNION ALL
    (SELECT {store_history.COLUMNS} FROM delaysvc.message_history
        WHERE topic = :topic AND key = :key ORDER BY id DESC LIMIT 1)
) c ORDER BY c.id DESC LIMIT 1"""


def find_message_by_key(conn: Statements, topic: str, key: str) -> Any:
    """The unfinished message holding the key, else the newest finished one."""
    unfinished = find_unfinished_by_key(conn, topic, key)
    if unfinished is not None:
        return unfinished
    return conn.execute(sql(_FIND_FINISHED_BY_KEY), {"topic": topic, "key": key}).first()


# ---------------------------------------------------------------- cancelling


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


# ---------------------------------------------------------------- delivery


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


def database_now(conn: Connection) -> datetime:
    return conn.execute(sql("SELECT clock_timestamp()")).scalar_one()


def mark_stuck(conn: Connection, lane: int, offset: int | None, error: str) -> None:
    conn.execute(
        sql(
            "UPDATE delaysvc.schedule_offset SET stuck_offset = :offset, stuck_error = :error, "
            "stuck_since = COALESCE(stuck_since, statement_timestamp()) WHERE lane = :lane"
        ),
        {"lane": lane, "offset": offset, "error": error[:2000]},
    )


def skip_stuck_head(conn: Connection, lane: int) -> int:
    """Operator action: move a stuck lane's head message to the dead letters. -> its id.

    The lane is locked first (no move can run meanwhile), then its stuck offset and head are
    read; the head must still be the row the lane is stuck on, and each change names the state
    it expects, so a message just delivered is never dead-lettered, nor dead and running."""
    name = "the timer lane" if lane == TIMER_LANE else f"level {lane}"
    locked = lock_lane(conn, lane)
    if locked is None:
        raise NotStuck(f"{name} is being delivered right now (or does not exist); try again")
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


# ---------------------------------------------------------------- health and histograms


def record_heartbeat(conn: Connection, component: str, host: str) -> None:
    conn.execute(
        sql(
            "INSERT INTO delaysvc.heartbeat (component, seen_at, host) VALUES (:c, "
            "clock_timestamp(), :h) "
            "ON CONFLICT (component) DO UPDATE SET seen_at = EXCLUDED.seen_at, host = EXCLUDED.host"
        ),
        {"c": component, "h": host},
    )


def heartbeats(conn: Connection) -> dict[str, float]:
    """Seconds since each component was last seen (database clock)."""
    rows = conn.execute(
        sql(
            "SELECT component, extract(epoch FROM clock_timestamp() - seen_at) AS age "
            "FROM delaysvc.heartbeat"
        )
    )
    return {row.component: float(row.age) for row in rows}


def slowest_lane_heartbeat(conn: Connection) -> float | None:
    """Seconds since the least recently seen lane's runner wrote its heartbeat (`lane N`, one
    per lane the database has); None while a lane has never been seen."""
    row = conn.execute(
        sql(
            "SELECT bool_or(h.seen_at IS NULL) AS unseen, "
            "max(extract(epoch FROM clock_timestamp() - h.seen_at)) AS age "
            "FROM delaysvc.schedule_offset s LEFT JOIN delaysvc.heartbeat h ON h.component = "
            "'lane ' || s.lane"
        )
    ).one()
    return None if row.unseen or row.age is None else float(row.age)


def recent_durations(conn: Connection, minutes: int = 60) -> dict[str, tuple[list[int], float]]:
    """Per topic: handler-duration bucket counts of the last `minutes`, and the longest run."""
    rows = conn.execute(
        sql(
            "SELECT topic, array_agg(total ORDER BY i) AS counts, max(top) AS max_ms FROM ("
            "  SELECT topic, i, sum(c) AS total, max(max_ms) AS top "
            "  FROM delaysvc.handler_duration_histogram, unnest(counts) WITH ORDINALITY AS u(c, i) "
            "  WHERE minute > clock_timestamp() - :minutes * interval '1 minute' "
            "  GROUP BY topic, i) t GROUP BY topic"
        ),
        {"minutes": minutes},
    )
    return {row.topic: ([int(c) for c in row.counts], float(row.max_ms)) for row in rows}


# ---------------------------------------------------------------- histograms and totals
#
# Each flush (a lane's lateness every few seconds, a consumer's outcomes every FLUSH_SECONDS)
# adds into two rows in one statement: its key's row of this minute (database clock), which the
# dashboard reads and which is pruned after a week, and its key's running total (`schema`:
# `lateness_total`, `topic_total`), which /metrics reads and which only grows. A separate total,
# not "sum the kept minutes plus whatever the prune folded away": a scrape then reads one row
# per key, not a week of minutes, and pruning never touches what Prometheus sees. The total's
# row lock is taken right after the minute row's, by the same writers: nothing new to wait on
# (Celery-task topics, which record no durations, write their total alone: `add_outcomes`).


def _added(old: str, new: str) -> str:
    """SQL: two bucket arrays added element by element (a shorter one counts as zeros)."""
    return (
        f"COALESCE((SELECT array_agg(COALESCE(a, 0) + COALESCE(b, 0) ORDER BY i) "
        f"FROM unnest({old}, {new}) WITH ORDINALITY AS t(a, b, i)), CAST(ARRAY[] AS bigint[]))"
    )


_ADD_MINUTE = f"""
INSERT INTO delaysvc.{{table}} AS m (minute, {{key}}, counts, max_ms)
VALUES (date_trunc('minute', clock_timestamp()), :key, CAST(:counts AS bigint[]), :max_ms)
ON CONFLICT (minute, {{key}}) DO UPDATE SET
    counts = {_added("m.counts", "EXCLUDED.counts")},
    max_ms = GREATEST(m.max_ms, EXCLUDED.max_ms)"""

_ADD_LATENESS = f"""
WITH minute AS ({_ADD_MINUTE.format(table="lateness_histogram", key="lane")})
INSERT INTO delaysvc.lateness_total (lane, counts, sum_ms)
VALUES (:key, CAST(:counts AS bigint[]), :sum_ms)
ON CONFLICT (lane) DO UPDATE SET
    counts = {_added("delaysvc.lateness_total.counts", "EXCLUDED.counts")},
    sum_ms = delaysvc.lateness_total.sum_ms + EXCLUDED.sum_ms"""

_ADD_TOPIC_TOTAL = f"""
INSERT INTO delaysvc.topic_total (topic, duration_counts, duration_sum_ms, succeeded, retried, dead)
VALUES (:key, CAST(:counts AS bigint[]), :sum_ms, :succeeded, :retried, :dead)
ON CONFLICT (topic) DO UPDATE SET
    duration_counts = {_added("delaysvc.topic_total.duration_counts", "EXCLUDED.duration_counts")},
    duration_sum_ms = delaysvc.topic_total.duration_sum_ms + EXCLUDED.duration_sum_ms,
    succeeded = delaysvc.topic_total.succeeded + EXCLUDED.succeeded,
    retried = delaysvc.topic_total.retried + EXCLUDED.retried,
    dead = delaysvc.topic_total.dead + EXCLUDED.dead"""

_ADD_DURATIONS = f"""
WITH minute AS ({_ADD_MINUTE.format(table="handler_duration_histogram", key="topic")})
{_ADD_TOPIC_TOTAL}"""

MINUTES_KEPT = "7 days"


@dataclass(frozen=True)
class OutcomeCounts:
    """Jobs of a topic that succeeded, were put back for a retry, or went to the dead letters
    (what `topic_total` counts)."""

    succeeded: int = 0
    retried: int = 0
    dead: int = 0

    def __add__(self, other: OutcomeCounts) -> OutcomeCounts:
        return OutcomeCounts(
            self.succeeded + other.succeeded, self.retried + other.retried, self.dead + other.dead
        )

    def __bool__(self) -> bool:
        return bool(self.succeeded or self.retried or self.dead)


def add_lateness(
    conn: Connection, lane: int, counts: Sequence[int], max_ms: float, sum_ms: float
) -> None:
    """Add moved rows' lateness (bucket counts, largest and sum in ms) to the lane's minute row
    and its running total."""
    params = {"key": lane, "counts": list(counts), "max_ms": max_ms, "sum_ms": sum_ms}
    conn.execute(sql(_ADD_LATENESS), params)
    _prune_minutes(conn, "lateness_histogram")


def add_durations(
    conn: Connection,
    topic: str,
    counts: Sequence[int],
    max_ms: float,
    sum_ms: float,
    outcomes: OutcomeCounts,
) -> None:
    """Add a consumer flush to the topic's minute row (handler durations: bucket counts,
    longest) and to its running total (the same, their sum in ms, and the flush's outcomes)."""
    conn.execute(
        sql(_ADD_DURATIONS),
        {"key": topic, "counts": list(counts), "max_ms": max_ms, "sum_ms": sum_ms}
        | dataclasses.asdict(outcomes),
    )
    _prune_minutes(conn, "handler_duration_histogram")


def add_outcomes(conn: Connection, topic: str, outcomes: OutcomeCounts) -> None:
    """Count outcomes recorded without a handler duration (jobs of Celery-task topics) in the
    topic's running total; nothing to count writes nothing. Those jobs finish one transaction
    each, from a Celery callback task each: far fewer per second than one row can take."""
    if outcomes:
        conn.execute(
            sql(_ADD_TOPIC_TOTAL),
            {"key": topic, "counts": [], "sum_ms": 0.0} | dataclasses.asdict(outcomes),
        )


def _prune_minutes(conn: Connection, table: str) -> None:
    """Forget minute rows older than a week (the running totals keep what they counted)."""
    assert table in ("lateness_histogram", "handler_duration_histogram")
    conn.execute(
        sql(f"DELETE FROM delaysvc.{table} WHERE minute < now() - interval '{MINUTES_KEPT}'")
    )


def lateness_totals(conn: Connection) -> list[Any]:
    """Per lane since the database was created: lateness bucket counts (lane, counts, sum_ms)."""
    return list(
        conn.execute(sql("SELECT lane, counts, sum_ms FROM delaysvc.lateness_total ORDER BY lane"))
    )


def topic_totals(conn: Connection) -> list[Any]:
    """Per topic since the database was created: handler-duration bucket counts and their sum
    (ms), and the jobs that succeeded, were retried and went dead."""
    return list(
        conn.execute(
            sql(
                "SELECT topic, duration_counts, duration_sum_ms, succeeded, retried, dead "
                "FROM delaysvc.topic_total ORDER BY topic"
            )
        )
    )


# ---------------------------------------------------------------- backlog caps


def lock_cap(conn: Statements, target: str) -> None:
    """Serialise sends to one capped level or topic (of this schema) until the transaction
    ends."""
    conn.execute(
        sql(f"SELECT pg_advisory_xact_lock({LOCK_KEY})"), {"lock": lock_name(f"cap {target}")}
    )


def set_backlog_cap(
    conn: Connection, scope: str, target: str, max_waiting: int, policy: str
) -> Any:
    """Set a level's or a topic's cap; every send from the next one on keeps to it. -> its row."""
    return conn.execute(
        sql(
            "INSERT INTO delaysvc.backlog_cap (scope, target, max_waiting, policy) "
            "VALUES (:scope, :target, :max_waiting, :policy) ON CONFLICT (scope, target) "
            "DO UPDATE SET max_waiting = EXCLUDED.max_waiting, policy = EXCLUDED.policy, "
            "updated_at = now() RETURNING scope, target, max_waiting, policy"
        ),
        {"scope": scope, "target": target, "max_waiting": max_waiting, "policy": policy},
    ).one()


def lift_backlog_cap(conn: Connection, scope: str, target: str) -> bool:
    """Lift a level's or a topic's cap. -> whether it had one."""
    return bool(
        conn.execute(
            sql("DELETE FROM delaysvc.backlog_cap WHERE scope = :scope AND target = :target"),
            {"scope": scope, "target": target},
        ).rowcount
    )


def backlog_caps(conn: Connection) -> list[Any]:
    return list(
        conn.execute(
            sql(
                "SELECT scope, target, max_waiting, policy FROM delaysvc.backlog_cap "
                "ORDER BY scope, CASE WHEN scope = 'level' THEN lpad(target, 5, '0') "
                "ELSE target END"
            )
        )
    )


def caps_covering(conn: Statements, topics: Sequence[str], levels: Sequence[int]) -> list[Any]:
    """The caps of these topics and levels: a probe of the caps' primary key per target."""
    return list(
        conn.execute(
            sql(
                "SELECT scope, target, max_waiting, policy FROM delaysvc.backlog_cap "
                "WHERE (scope = 'topic' AND target = ANY(CAST(:topics AS text[]))) "
                "OR (scope = 'level' AND target = ANY(CAST(:levels AS text[])))"
            ),
            {"topics": sorted(set(topics)), "levels": sorted({str(n) for n in levels})},
        )
    )


def lane_pending(conn: Statements, lane: int) -> int:
    """Waiting messages of a lane, exactly: the sum of its `lane_count` deltas (a few thousand
    rows at most between two folds)."""
    return conn.execute(
        sql(
            "SELECT CAST(COALESCE(sum(delta), 0) AS bigint) FROM delaysvc.lane_count WHERE lane "
            "= :lane"
        ),
        {"lane": lane},
    ).scalar_one()


def fold_lane_counts(conn: Connection) -> int:
    """Fold every committed delta into one row per lane (exact: a delta committed meanwhile
    is not seen, so not deleted, and is folded next time). -> rows folded."""
    return conn.execute(
        sql(
            """
WITH gone AS (
    DELETE FROM delaysvc.lane_count RETURNING lane, delta
), folded AS (
    INSERT INTO delaysvc.lane_count (lane, delta)
    SELECT lane, sum(delta) FROM gone GROUP BY lane HAVING sum(delta) <> 0
)
SELECT count(*) FROM gone"""
        )
    ).scalar_one()


def topic_pending(conn: Statements, topic: str, up_to: int) -> int:
    """Waiting (scheduled or retrying) messages of a topic, never counted beyond `up_to`."""
    return conn.execute(
        sql(
            "SELECT count(*) FROM (SELECT 1 FROM delaysvc.commit_log c WHERE c.topic = :topic "
            f"AND {WAITING} AND {NOT_MOVED} LIMIT :up_to) w"
        ),
        {"topic": topic, "up_to": up_to},
    ).scalar_one()


def lock_key_holders(
    conn: Statements, pairs: Sequence[tuple[str, str | None]]
) -> dict[tuple[str, str], Any]:
    """The unfinished messages holding these (topic, key) pairs (`id, topic, key, lane,
    status`, as `MESSAGE_STATE` reads them), each locked FOR SHARE until the transaction ends:
    a holder cannot finish meanwhile and leave its key to a send a cap counted as adding
    nothing."""
    wanted = {(topic, key) for topic, key in pairs if key is not None}
    if not wanted:
        return {}
    topics, keys = zip(*wanted, strict=True)
    rows = conn.execute(
        sql(
            f"SELECT c.id, c.topic, c.key, {LANE} AS lane, {STATUS} AS status "
            "FROM delaysvc.commit_log c WHERE c.key IS NOT NULL AND c.finished_at IS NULL AND "
            "(c.topic, c.key) IN (SELECT * FROM unnest(CAST(:topics AS text[]), "
            "CAST(:keys AS text[]))) FOR SHARE OF c"
        ),
        {"topics": list(topics), "keys": list(keys)},
    )
    return {(row.topic, row.key): row for row in rows}


def oldest_waiting_in_level(conn: Statements, level: int, count: int) -> list[int]:
    rows = conn.execute(
        sql(
            "SELECT message_id FROM delaysvc.consume_queue WHERE level = :lane "
            "ORDER BY queue_offset LIMIT :count"
        ),
        {"lane": level, "count": count},
    )
    return [row.message_id for row in rows]


def oldest_waiting_of_topic(conn: Statements, topic: str, count: int) -> list[int]:
    rows = conn.execute(
        sql(
            "SELECT c.id FROM delaysvc.commit_log c WHERE c.topic = :topic "
            f"AND {WAITING} AND {NOT_MOVED} "
            "ORDER BY c.deliver_ts LIMIT :count"
        ),
        {"topic": topic, "count": count},
    )
    return [row.id for row in rows]


_DELIVER_NOW = """
WITH pick AS (
    -- a moved message's row still names its old lane and offset (see MESSAGE_STATE): its lane row
    -- is gone, so nothing below matches it
    SELECT id, lane, queue_offset, deliver_ts FROM delaysvc.commit_log
    WHERE id = ANY(CAST(:ids AS bigint[])) AND status IN ('scheduled', 'retrying')
), from_levels AS (
    DELETE FROM delaysvc.consume_queue q USING pick
    WHERE pick.lane > 0 AND q.level = pick.lane AND q.queue_offset = pick.queue_offset
    RETURNING q.message_id, q.topic, q.deliver_ts, CAST(q.level AS int) AS lane, q.priority
), from_timer AS (
    DELETE FROM delaysvc.timer_queue t USING pick
    WHERE pick.lane = 0 AND t.deliver_ts = pick.deliver_ts AND t.queue_offset = pick.queue_offset
    RETURNING t.message_id, t.topic, t.deliver_ts, 0 AS lane, t.priority
), moved AS (
    SELECT * FROM from_levels UNION ALL SELECT * FROM from_timer
), ready AS (
    INSERT INTO delaysvc.topic_queue (message_id, topic, deliver_ts, priority)
    SELECT message_id, topic, deliver_ts, priority FROM moved ORDER BY deliver_ts, message_id
), marked AS (
    UPDATE delaysvc.commit_log c SET status = 'ready', delivered_at = clock_timestamp(),
        lane = -1, queue_offset = NULL
    FROM moved WHERE c.id = moved.message_id
), counted AS (
    UPDATE delaysvc.schedule_offset s SET early_total = early_total + m.n
    FROM (SELECT lane, count(*) AS n FROM moved GROUP BY lane) m WHERE s.lane = m.lane
), lane_counted AS (
    INSERT INTO delaysvc.lane_count (lane, delta)
    SELECT CAST(lane AS smallint), -count(*) FROM moved GROUP BY lane
)
SELECT count(*) FROM moved"""


def deliver_now(conn: Statements, message_ids: Sequence[int]) -> int:
    """Move waiting messages into their topics' queues before their time (a backlog cap's
    overflow), counted per lane in `early_total`. -> how many moved (a message being moved
    by its lane at the same moment is left to it)."""
    return conn.execute(sql(_DELIVER_NOW), {"ids": list(message_ids)}).scalar_one()


# ---------------------------------------------------------------- observing


def lane_stats(conn: Connection) -> list[Any]:
    """Per lane, without a COUNT(*) of a queue: pending is exact (the lane's `lane_count`
    deltas); max_offset is the last offset the level's sequence gave out (RocketMQ's figure,
    an upper bound of what was ever queued: a rolled-back send takes one too)."""
    return list(
        conn.execute(
            sql(
                """
SELECT s.lane, s.delay_ms, s.schedule_offset, s.moved_total, s.early_total, s.last_moved_at,
       s.stuck_offset, s.stuck_error, s.stuck_since,
       CASE WHEN s.lane > 0 THEN COALESCE(pg_sequence_last_value(
           to_regclass(format('delaysvc.consume_queue_%s_seq', s.lane))), 0) END AS max_offset,
       COALESCE(counts.pending, 0) AS pending,
       head.deliver_ts AS next_due,
       rate.moved_per_s,
       clock_timestamp() AS now
FROM delaysvc.schedule_offset s
LEFT JOIN (
    SELECT lane, CAST(sum(delta) AS bigint) AS pending FROM delaysvc.lane_count GROUP BY lane
) counts
       ON counts.lane = s.lane
LEFT JOIN LATERAL (
    SELECT q.deliver_ts FROM delaysvc.consume_queue q WHERE s.lane > 0 AND q.level = s.lane
    ORDER BY q.queue_offset LIMIT 1
) lh ON true
LEFT JOIN LATERAL (
    SELECT t.deliver_ts FROM delaysvc.timer_queue t WHERE s.lane = 0
    ORDER BY t.deliver_ts, t.queue_offset LIMIT 1
) th ON true
CROSS JOIN LATERAL (SELECT COALESCE(lh.deliver_ts, th.deliver_ts) AS deliver_ts) head
LEFT JOIN LATERAL (
    -- moved per second since the latest stats sample at least a second old
    SELECT round(CAST((s.moved_total - ss.moved_total)
                      / extract(epoch FROM clock_timestamp() - ss.sampled_at) AS numeric), 1)
               AS moved_per_s
    FROM delaysvc.stats_sample ss
    WHERE ss.lane = s.lane AND ss.sampled_at < clock_timestamp() - interval '1 second'
      AND ss.sampled_at > clock_timestamp() - interval '5 minutes'
    ORDER BY ss.sampled_at DESC LIMIT 1
) rate ON true
ORDER BY s.lane = 0, s.lane
"""
            )
        )
    )


def unique_violation(exc: IntegrityError, constraint: str) -> bool:
    diag = getattr(exc.orig, "diag", None)
    return getattr(diag, "constraint_name", None) == constraint


# ---------------------------------------------------------------- consuming

_CLAIM_READY = """
WITH picked AS (
    SELECT ctid FROM delaysvc.topic_queue WHERE topic = :topic
    ORDER BY priority DESC, seq LIMIT {limit} FOR UPDATE SKIP LOCKED
), claimed AS (
    -- by the locked rows' ctids: a TID scan, whatever the planner thinks of the queue's size
    DELETE FROM delaysvc.topic_queue q WHERE q.ctid = ANY(ARRAY(SELECT ctid FROM picked))
    AND NOT EXISTS (SELECT 1 FROM delaysvc.topic_state WHERE topic = :topic AND paused)
    RETURNING q.message_id, q.seq, q.enqueued_at, q.priority
), numbered AS (
    SELECT message_id, seq, enqueued_at, priority,
        row_number() OVER (ORDER BY priority DESC, seq) AS n
    FROM claimed
)
UPDATE delaysvc.commit_log c SET status = 'running',
    -- an attempt is counted when its handler starts (`start_jobs`): here only for the first
    -- `start_first` jobs, which start at once (a rerun is always counted on its own)
    attempts = c.attempts + CASE WHEN claimed.n <= :start_first AND c.attempts = 0
                                 THEN 1 ELSE 0 END,
    started_at = CASE WHEN claimed.n <= :start_first AND c.attempts = 0
                      THEN clock_timestamp() END,
    lease_until = clock_timestamp() + :lease_seconds * interval '1 second',
    -- one per claim: every later change names it
    claim_id = (SELECT nextval('delaysvc.claim_seq')),
    -- moved by the delivery, which left its commit_log row as it was (see MESSAGE_STATE)
    delivered_at = CASE WHEN c.status = 'ready' THEN c.delivered_at ELSE claimed.enqueued_at END,
    lane = -1, queue_offset = NULL
FROM numbered claimed WHERE c.id = claimed.message_id
    -- a queue row of a message that is no longer waiting (never expected) is dropped, not run
    AND c.status IN ('scheduled', 'retrying', 'ready')
RETURNING c.id, c.topic, c.key, c.tags, c.body, c.body_is_json, c.properties, c.attempts,
    c.deliver_ts, c.stored_at, c.claim_id, c.started_at IS NOT NULL AS started, claimed.seq,
    claimed.priority
"""


def _unprepared(conn: Connection, statement: str, params: dict[str, Any]) -> list[Any]:
    """The rows of a queue statement, run on the connection's driver cursor and never
    prepared, in the connection's transaction. psycopg prepares a statement a connection has
    run five times, and PostgreSQL may then keep one plan for the session; the queues are
    empty one minute and hold a backlog the next, and a plan made for an empty queue (sorts of
    sequential scans, a nested loop re-running a subquery per row, a hash of all of commit_log)
    stays until something invalidates it. Planned afresh, a statement follows the tables'
    size; the planning costs about a millisecond per claim or move of up to a batch."""
    compiled = _driver_sql(statement)
    with driver_errors(conn, compiled) as cursor:
        cursor.row_factory = namedtuple_row
        return cursor.execute(compiled, params, prepare=False).fetchall()


def claim_statement(limit: int) -> str:
    """The claim, with its batch size written in (its plan never guesses the LIMIT)."""
    return _CLAIM_READY.format(limit=int(limit))


def claim_ready(
    conn: Connection, topic: str, limit: int, lease_seconds: int, start_first: int = 0
) -> list[Any]:
    """Take up to `limit` ready jobs of a topic in queue order and lease them: they are
    `running` once the caller commits. Nothing is held open while they run. The first
    `start_first` of them, if never attempted, start at once: their attempt is counted here
    (`started`) instead of by `start_jobs`, which would write each row a second time.

    Never prepared (`_unprepared`): a plan kept from a nearly empty topic queue re-ran the
    locking subquery for every queued row, O(queue^2) per claim, and consumers stopped
    claiming for minutes (docs/benchmarks/README.md, "Soak: 10M messages";
    tests/test_tick_cost.py reproduces it)."""
    params = {"topic": topic, "lease_seconds": lease_seconds, "start_first": start_first}
    rows = _unprepared(conn, claim_statement(limit), params)
    return sorted(rows, key=lambda row: (-row.priority, row.seq))


# Committed asynchronously (synchronous_commit off for this statement's own transaction): the
# handlers start without waiting for a WAL flush, which cost a disk flush per start. The next
# outcome written flushes it; a database crash in between can forget the start, and the job
# then runs again as the same attempt (at least once, as before; only the count is lost).
_START_JOBS = """WITH async AS (SELECT set_config('synchronous_commit', 'off', true))
UPDATE delaysvc.commit_log SET attempts = attempts + 1, started_at = clock_timestamp()
WHERE id = ANY(CAST(:ids AS bigint[])) AND claim_id = :claim_id AND status = 'running'
    AND started_at IS NULL AND EXISTS (SELECT 1 FROM async)
RETURNING id, attempts"""


def start_jobs(cursor: Cursor[Any], message_ids: Sequence[int], claim_id: int) -> dict[int, int]:
    """Count the attempts of claimed jobs whose handlers start now, in a commit of their own
    before they run (a handler that kills its process has been charged), on an autocommitting
    driver cursor (`db.autocommit_cursor`). -> {id: attempt number}; a job missing from it
    lost its claim (it was taken again after its lease)."""
    rows = cursor.execute(
        _driver_sql(_START_JOBS), {"ids": list(message_ids), "claim_id": claim_id}, prepare=True
    ).fetchall()
    return {int(message_id): int(attempt) for message_id, attempt in rows}


def running_job(conn: Connection, message_id: int, claim_id: int) -> Any:
    """The job if it is still running under this claim, else None."""
    return conn.execute(
        sql(
            f"SELECT {MESSAGE_COLUMNS} FROM delaysvc.commit_log WHERE id = :id AND claim_id = "
            ":claim_id "
            "AND status = 'running'"
        ),
        {"id": message_id, "claim_id": claim_id},
    ).first()


def finish_succeeded(conn: Connection, jobs: Sequence[tuple[int, int, int]]) -> int:
    """Mark (id, claim_id, duration_ms) succeeded. A job whose lease was lost and taken again
    (another claim holds it) is left to the new owner. -> jobs marked."""
    if not jobs:
        return 0
    return _finish_succeeded(conn, jobs).rowcount


def finish_one_succeeded(
    conn: Connection, message_id: int, claim_id: int, duration_ms: int
) -> str | None:
    """`finish_succeeded` for one job. -> its topic, or None when its claim was lost."""
    return _finish_succeeded(conn, [(message_id, claim_id, duration_ms)]).scalar()


def _finish_succeeded(conn: Connection, jobs: Sequence[tuple[int, int, int]]) -> Any:
    ids, claims, durations = (list(column) for column in zip(*jobs, strict=True))
    return conn.execute(
        sql(
            "UPDATE delaysvc.commit_log c SET status = 'succeeded', finished_at = "
            "clock_timestamp(), "
            "lease_until = NULL, duration_ms = v.duration_ms "
            "FROM unnest(CAST(:ids AS bigint[]), CAST(:claims AS bigint[]), "
            "CAST(:durations AS int[])) AS v(id, claim_id, duration_ms) "
            "WHERE c.id = v.id AND c.status = 'running' AND c.claim_id = v.claim_id "
            "RETURNING c.topic"
        ),
        {"ids": ids, "claims": claims, "durations": durations},
    )


_ERROR_ENTRY = """jsonb_build_object('attempt', c.attempts, 'at', clock_timestamp(),
    'error', CAST(:error AS text), 'traceback', CAST(:traceback AS text))"""
_KEEP_ERRORS = 20

# The retry's lane is placed as a send's is (`_PLACED_LANE`): a worker whose levels differ from
# the database's (a release before a level change) retries into the timer lane, due when it
# meant; and reading schedule_offset serialises the retry with a change of its level.
_SCHEDULE_RETRY = f"""
WITH {_PLACED_ONE}, again AS (
    UPDATE delaysvc.commit_log c SET status = 'retrying', lane = placed.lane,
        delay_level = :delay_level,
        queue_offset = {_NEXT_OFFSET.format(lane="placed.lane")},
        deliver_ts = COALESCE(CAST(:deliver_at AS timestamptz),
            clock_timestamp() + CAST(:delay_ms AS bigint) * interval '1 millisecond'),
        lease_until = NULL, duration_ms = :duration_ms, last_error = :error,
        errors = (SELECT jsonb_agg(e) FROM (
            SELECT e FROM jsonb_array_elements(COALESCE(c.errors, '[]') || {_ERROR_ENTRY}) e
            OFFSET GREATEST(jsonb_array_length(COALESCE(c.errors, '[]')) + 1 - {_KEEP_ERRORS}, 0)
        ) kept)
    FROM placed
    WHERE c.id = :id AND c.status = 'running' AND c.claim_id = :claim_id
    RETURNING c.id, c.topic, c.lane, c.queue_offset, c.deliver_ts, c.priority
){_ENQUEUE_FROM.format(src="again")}
SELECT count(*) FROM again
"""

_BURY = f"""
WITH buried AS (
    UPDATE delaysvc.commit_log c SET status = 'dead', finished_at = clock_timestamp(), lane = -1,
        queue_offset = NULL, lease_until = NULL, duration_ms = :duration_ms,
        last_error = :error,
        errors = (SELECT jsonb_agg(e) FROM (
            SELECT e FROM jsonb_array_elements(COALESCE(c.errors, '[]') || {_ERROR_ENTRY}) e
            OFFSET GREATEST(jsonb_array_length(COALESCE(c.errors, '[]')) + 1 - {_KEEP_ERRORS}, 0)
        ) kept)
    WHERE c.id = :id AND c.status = 'running' AND c.claim_id = :claim_id
    RETURNING c.id, c.topic, c.attempts
)
INSERT INTO delaysvc.dead_letter (message_id, topic, reason, attempts, error)
SELECT id, topic, :reason, attempts, COALESCE(CAST(:error AS text), :reason) FROM buried
ON CONFLICT (message_id) DO UPDATE SET reason = EXCLUDED.reason, died_at = now(),
    attempts = EXCLUDED.attempts, error = EXCLUDED.error
"""


@dataclass(frozen=True)
class Failure:
    """What a failed attempt leaves behind."""

    message_id: int
    claim_id: int
    error: str
    traceback: str
    duration_ms: int


def schedule_retry(
    conn: Connection,
    failure: Failure,
    *,
    lane: int,
    delay_level: int | None,
    delay_ms: int | None,
    deliver_at: datetime | None = None,
) -> bool:
    """Put a failed job back in a lane as `retrying`; it is an ordinary delayed message."""
    count = conn.execute(
        sql(_SCHEDULE_RETRY),
        {
            "id": failure.message_id,
            "claim_id": failure.claim_id,
            "error": failure.error[:4000],
            "traceback": failure.traceback[-4000:],
            "duration_ms": failure.duration_ms,
            "lane": lane,
            "delay_level": delay_level,
            "delay_ms": delay_ms,
            "deliver_at": deliver_at,
        },
    ).scalar_one()
    return count == 1


def bury(conn: Connection, failure: Failure, reason: str) -> bool:
    """Move a running job to the dead letters, keeping its last error."""
    result = conn.execute(
        sql(_BURY),
        {
            "id": failure.message_id,
            "claim_id": failure.claim_id,
            "error": failure.error[:4000],
            "traceback": failure.traceback[-4000:],
            "duration_ms": failure.duration_ms,
            "reason": reason[:4000],
        },
    )
    return result.rowcount == 1


def renew_leases(conn: Connection, held: dict[int, list[int]], lease_seconds: int) -> int:
    """Move the lease of every job still running under its claim (claim id -> job ids) a
    lease ahead; -> jobs renewed. By id: a TID-cheap primary key lookup per job."""
    pairs = [(message_id, claim_id) for claim_id, ids in held.items() for message_id in ids]
    return conn.execute(
        sql(
            """
UPDATE delaysvc.commit_log c
SET lease_until = clock_timestamp() + :lease_seconds * interval '1 second'
FROM unnest(CAST(:ids AS bigint[]), CAST(:claims AS bigint[])) AS v(id, claim_id)
WHERE c.id = v.id AND c.claim_id = v.claim_id AND c.status = 'running'
"""
        ),
        {
            "ids": [message_id for message_id, _ in pairs],
            "claims": [claim_id for _, claim_id in pairs],
            "lease_seconds": lease_seconds,
        },
    ).rowcount


def release_unstarted(conn: Connection, message_ids: Sequence[int], claim_id: int) -> int:
    """Give claimed jobs that never ran back to their topic queue, uncharged (an attempt the
    claim counted for one of them is taken back)."""
    if not message_ids:
        return 0
    return conn.execute(
        sql(
            """
WITH back AS (
    UPDATE delaysvc.commit_log c SET status = 'ready', lease_until = NULL, claim_id = NULL,
        attempts = c.attempts - CASE WHEN c.started_at IS NULL THEN 0 ELSE 1 END,
        started_at = NULL
    WHERE c.id = ANY(CAST(:ids AS bigint[])) AND c.claim_id = :claim_id
      AND c.status = 'running'
    RETURNING c.id, c.topic, c.deliver_ts, c.priority
)
INSERT INTO delaysvc.topic_queue (message_id, topic, deliver_ts, priority)
SELECT id, topic, deliver_ts, priority FROM back ORDER BY id
"""
        ),
        {"ids": list(message_ids), "claim_id": claim_id},
    ).rowcount


def rescue_expired_leases(conn: Connection, limit: int) -> list[Any]:
    """Jobs whose worker vanished (lease expired) go back to their topic queue; an attempt
    that started counts, a job that never started was never charged. -> the rescued (id,
    topic)."""
    return list(
        conn.execute(
            sql(
                """
WITH expired AS (
    SELECT id FROM delaysvc.commit_log WHERE status = 'running' AND lease_until < clock_timestamp()
    ORDER BY lease_until LIMIT :limit FOR UPDATE SKIP LOCKED
), back AS (
    UPDATE delaysvc.commit_log c SET status = 'ready', lease_until = NULL, claim_id = NULL,
        last_error = CASE WHEN c.started_at IS NULL THEN c.last_error
            ELSE 'lease expired: the worker running attempt ' || c.attempts || ' was lost' END
    FROM expired WHERE c.id = expired.id
    RETURNING c.id, c.topic, c.deliver_ts, c.priority
), queued AS (
    INSERT INTO delaysvc.topic_queue (message_id, topic, deliver_ts, priority)
    SELECT id, topic, deliver_ts, priority FROM back
)
SELECT id, topic FROM back
"""
            ),
            {"limit": limit},
        )
    )


def topics_with_ready(conn: Connection) -> list[str]:
    return distinct_topics(conn, "topic_queue")


def distinct_topics(conn: Connection, table: Literal["topic_queue", "dead_letter"]) -> list[str]:
    """Distinct topics of `table` by a loose index scan along its topic index (one probe per
    topic), never a scan of the table."""
    return list(
        conn.execute(
            sql(
                f"""
WITH RECURSIVE t AS (
    (SELECT topic FROM delaysvc.{table} ORDER BY topic LIMIT 1)
    UNION ALL
    SELECT (SELECT topic FROM delaysvc.{table} WHERE topic > t.topic ORDER BY topic LIMIT 1)
    FROM t WHERE t.topic IS NOT NULL
)
SELECT topic FROM t WHERE topic IS NOT NULL
"""
            )
        ).scalars()
    )


def set_paused(conn: Connection, topic: str, paused: bool) -> None:
    conn.execute(
        sql(
            "INSERT INTO delaysvc.topic_state (topic, paused) VALUES (:topic, :paused) "
            "ON CONFLICT (topic) DO UPDATE SET paused = EXCLUDED.paused, updated_at = now()"
        ),
        {"topic": topic, "paused": paused},
    )


def set_limits(
    conn: Connection, topic: str, max_running: int | None, rate_per_s: float | None
) -> Any:
    """Set (None: lift) a topic's limits. -> its state row. A new bucket starts full; one
    the topic has keeps its tokens (`lock_limits` caps them at the new rate's second): every
    delivery worker sets the configured limits at its start, and a refill there would let a
    rolling deploy start a bucket's worth more per worker."""
    return conn.execute(
        sql(
            "INSERT INTO delaysvc.topic_state (topic, max_running, rate_per_s) "
            "VALUES (:topic, :max_running, :rate) ON CONFLICT (topic) DO UPDATE SET "
            "max_running = EXCLUDED.max_running, rate_per_s = EXCLUDED.rate_per_s, "
            "updated_at = now() "
            "RETURNING topic, paused, max_running, rate_per_s"
        ),
        {"topic": topic, "max_running": max_running, "rate": rate_per_s},
    ).one()


def topic_limits(conn: Connection) -> list[Any]:
    return list(
        conn.execute(
            sql(
                "SELECT topic, paused, max_running, rate_per_s FROM delaysvc.topic_state "
                "WHERE max_running IS NOT NULL OR rate_per_s IS NOT NULL ORDER BY topic"
            )
        )
    )


# A limited topic's claims queue behind its topic_state row (FOR UPDATE): the count of its
# running jobs and its tokens are read and spent by one claim at a time. The lock is taken by a
# statement of its own: a statement's subqueries read the snapshot it started with, from before
# it waited for the lock, and would miss the jobs the previous claim took. The bucket holds one
# second's starts (at least one); `available` is what it holds now.
_LOCK_LIMITS = """SELECT max_running, rate_per_s, tokens, tokens_at FROM delaysvc.topic_state
WHERE topic = :topic AND (max_running IS NOT NULL OR rate_per_s IS NOT NULL) FOR UPDATE"""
_READ_LIMITS = """SELECT CAST(:max_running AS integer) AS max_running,
    CAST(:rate AS float8) AS rate_per_s, clock_timestamp() AS now,
    CASE WHEN CAST(:rate AS float8) IS NOT NULL THEN LEAST(GREATEST(:rate, 1),
        COALESCE(CAST(:tokens AS float8), GREATEST(:rate, 1)) + :rate * extract(epoch FROM
        clock_timestamp() - COALESCE(CAST(:tokens_at AS timestamptz), clock_timestamp())))
    END AS available,
    CASE WHEN CAST(:max_running AS integer) IS NOT NULL THEN (SELECT count(*)
        FROM delaysvc.commit_log c WHERE c.status = 'running' AND c.topic = :topic)
    END AS running"""


def lock_limits(conn: Connection, topic: str) -> Any:
    """The topic's limits with its running jobs and available tokens, its row locked until
    the caller commits; None for a topic without limits (nothing locked)."""
    locked = conn.execute(sql(_LOCK_LIMITS), {"topic": topic}).first()
    if locked is None:
        return None
    return conn.execute(
        sql(_READ_LIMITS),
        {
            "topic": topic,
            "max_running": locked.max_running,
            "rate": locked.rate_per_s,
            "tokens": locked.tokens,
            "tokens_at": locked.tokens_at,
        },
    ).one()


def spend_tokens(conn: Connection, topic: str, left: float, at: datetime) -> None:
    conn.execute(
        sql("UPDATE delaysvc.topic_state SET tokens = :left, tokens_at = :at WHERE topic = :topic"),
        {"topic": topic, "left": left, "at": at},
    )


# ---------------------------------------------------------------- dead letters


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
    no sweep moves it while it does, no archive drops its day)."""
    store_history.lock_history(conn, wait=True)
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


# ---------------------------------------------------------------- users (tokens: store_tokens)


def upsert_user(conn: Connection, name: str, password_hash: str, role: str) -> None:
    conn.execute(
        sql(
            "INSERT INTO delaysvc.dashboard_user (name, password_hash, role) VALUES (:name, "
            ":hash, :role) "
            "ON CONFLICT (name) DO UPDATE SET password_hash = EXCLUDED.password_hash, "
            "role = EXCLUDED.role, failed_logins = 0, locked_until = NULL"
        ),
        {"name": name, "hash": password_hash, "role": role},
    )


def find_user(conn: Connection, name: str) -> Any:
    return conn.execute(
        sql(
            "SELECT id, name, password_hash, role, failed_logins, locked_until, "
            "locked_until > now() AS locked FROM delaysvc.dashboard_user WHERE name = :name"
        ),
        {"name": name},
    ).first()


def count_login_attempt(
    conn: Connection, name: str, max_failures: int, lockout_seconds: int
) -> Any:
    """Count a login attempt as failed before its password is checked, and lock the account
    for `lockout_seconds` once `max_failures` are counted (`clear_failed_logins` undoes both
    when the password is right). -> the user row if the account was not locked, else None (as
    for an unknown name). One statement: concurrent attempts queue on the row, and each sees
    the counts of those before it, so at most `max_failures` of any number of simultaneous
    attempts get their password checked. Commit before checking: the row stays locked only
    for this statement, not for the ~100 ms of a password hash."""
    return conn.execute(
        sql(
            "UPDATE delaysvc.dashboard_user SET failed_logins = failed_logins + 1, "
            "locked_until = CASE WHEN failed_logins + 1 >= :max "
            "THEN now() + :lock * interval '1 second' ELSE locked_until END "
            "WHERE name = :name AND (locked_until IS NULL OR locked_until <= now()) "
            "RETURNING id, name, password_hash, role"
        ),
        {"name": name, "max": max_failures, "lock": lockout_seconds},
    ).first()


def clear_failed_logins(conn: Connection, name: str) -> None:
    """A right password: forget the failures counted, and the lockout they set."""
    conn.execute(
        sql(
            "UPDATE delaysvc.dashboard_user SET failed_logins = 0, locked_until = NULL "
            "WHERE name = :name"
        ),
        {"name": name},
    )


# Messages stored are counted exactly, off the send path. Ids are drawn outside transactions
# (a duplicate key or a rollback burns some), so the id sequence over-counts; and a message with
# a lower id may still commit after one with a higher id. `settle_stored` (beat's fold, every
# second) moves a watermark up the ids in two steps: it takes the last id drawn as the
# candidate, then the virtual xids of every transaction running in this database, which include
# any that drew an id up to the candidate and may still commit (the sequence caches no ids:
# CACHE 1, its default); once all of those have ended, the rows up to the candidate are final
# and counted. `messages_stored` is that settled count plus the committed rows beyond the
# watermark, each table by its id index: exact at any moment, and never less than before (a
# row moving into the history is in one of the two tables at a time).
_STORED_BEYOND = """SELECT s.counted
    + (SELECT count(*) FROM delaysvc.commit_log WHERE id > s.watermark)
    + (SELECT count(*) FROM delaysvc.message_history WHERE id > s.watermark)
FROM delaysvc.stored_count s"""


def messages_stored(conn: Connection) -> int:
    """Messages ever stored and committed (a resend of a held key, a rolled-back send: none)."""
    return int(conn.execute(sql(_STORED_BEYOND)).scalar_one())


def settle_stored(conn: Connection) -> bool:
    """One step of the stored count's watermark (see `_STORED_BEYOND`): settle the candidate
    if every transaction it waits for has ended, else (none yet) take one. -> True when the
    count moved to a new watermark."""
    row = conn.execute(
        sql(
            "SELECT watermark, candidate, candidate_waits_for FROM delaysvc.stored_count FOR UPDATE"
        )
    ).one()
    if row.candidate is None:
        # the last id drawn first, then who is running: whoever drew up to it is among them
        candidate = conn.execute(
            sql(
                "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END "
                "FROM delaysvc.commit_log_id_seq"
            )
        ).scalar_one()
        waits_for = conn.execute(
            sql(
                "SELECT COALESCE(array_agg(virtualxid), '{}') FROM pg_locks "
                "WHERE locktype = 'virtualxid' AND pid <> pg_backend_pid() AND pid IN "
                "(SELECT pid FROM pg_stat_activity WHERE datname = current_database())"
            )
        ).scalar_one()
        conn.execute(
            sql(
                "UPDATE delaysvc.stored_count SET candidate = :candidate, "
                "candidate_waits_for = CAST(:waits_for AS text[])"
            ),
            {"candidate": candidate, "waits_for": waits_for},
        )
        return False
    if conn.execute(
        sql(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'virtualxid' "
            "AND virtualxid = ANY(CAST(:waits_for AS text[])))"
        ),
        {"waits_for": row.candidate_waits_for},
    ).scalar_one():
        return False
    conn.execute(
        sql(
            """
UPDATE delaysvc.stored_count SET watermark = GREATEST(watermark, candidate), candidate = NULL,
    candidate_waits_for = NULL,
    counted = counted
        + (SELECT count(*) FROM delaysvc.commit_log WHERE id > :watermark AND id <= :candidate)
        + (SELECT count(*) FROM delaysvc.message_history
           WHERE id > :watermark AND id <= :candidate)"""
        ),
        {"watermark": row.watermark, "candidate": row.candidate},
    )
    return True


def topic_stats(conn: Connection, limit_count: int = 100_000) -> list[Any]:
    """Per topic: ready (counted up to `limit_count`, through the topic index), running (the
    small lease index), dead letters, paused. Never a full COUNT(*) of a hot table."""
    return list(
        conn.execute(
            sql(
                f"""
WITH topics AS (
    SELECT topic FROM delaysvc.topic_state
    UNION SELECT unnest(CAST(:dead_topics AS text[]))
    -- each branch matches a partial index's predicate exactly, so neither scans the table
    UNION SELECT topic FROM delaysvc.commit_log WHERE status = 'running'
    UNION SELECT topic FROM delaysvc.commit_log WHERE status = 'retrying'
    UNION SELECT topic FROM delaysvc.handler_duration_histogram
          WHERE minute > clock_timestamp() - interval '1 hour'
    UNION SELECT unnest(CAST(:ready_topics AS text[]))
)
SELECT t.topic,
    (SELECT count(*) FROM (SELECT 1 FROM delaysvc.topic_queue q WHERE q.topic = t.topic
                           LIMIT :cap) x) AS ready,
    (SELECT count(*) FROM delaysvc.commit_log c WHERE c.status = 'running' AND c.topic = t.topic)
        AS running,
    (SELECT count(*) FROM (SELECT 1 FROM delaysvc.commit_log c WHERE c.status = 'retrying'
                           AND c.topic = t.topic AND {NOT_MOVED} LIMIT :cap) r) AS retrying,
    (SELECT count(*) FROM (SELECT 1 FROM delaysvc.dead_letter d WHERE d.topic = t.topic
                           LIMIT :cap) y) AS dead,
    COALESCE((SELECT paused FROM delaysvc.topic_state s WHERE s.topic = t.topic), false) AS paused
FROM topics t ORDER BY t.topic
"""
            ),
            {
                "ready_topics": topics_with_ready(conn),
                "dead_topics": distinct_topics(conn, "dead_letter"),
                "cap": limit_count,
            },
        )
    )
