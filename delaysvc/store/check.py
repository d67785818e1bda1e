"""The statements of `delaysvc check` (`delaysvc.maintenance.check`), each named for the invariant
it checks and headed by one line saying so.

Each is one set-based statement (anti-joins and hash aggregates, no per-row probes from Python)
and returns its violations, at most `:limit` of them, each with the count of all of them
(`total`, a window over the whole result before the LIMIT): `message_id` (or NULL), `subject`
("message 42", "lane 3", "schedule 'nightly'") and `problem`, written for a person. They only
read: the caller runs them in one READ ONLY transaction at REPEATABLE READ, so all of them see
one snapshot, and a message that moves between tables meanwhile is seen in one place.

Nothing here takes a lock beyond ACCESS SHARE (not even `pg_sequence_last_value`, which takes
ROW EXCLUSIVE on its sequence: a level's sequence is read as a relation instead).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from delaysvc.db.names import sql, table
from delaysvc.schema.tables import level_sequence

UNFINISHED = "('scheduled', 'retrying', 'ready', 'running')"
FINISHED = "('succeeded', 'dead', 'cancelled')"
CLOCK_MARGIN_S = 1.0
"""A level's row behind its schedule offset may be due this much after the check's clock
(two sends' clocks and offsets taken a few microseconds apart, in either order)."""

# What every statement returns: its violations, each counted in `total`.
_SELECT = "SELECT message_id, subject, problem, count(*) OVER () AS total FROM ({body}) v"
_LIMIT = " ORDER BY message_id NULLS FIRST, subject, problem LIMIT :limit"


def _violations(conn: Connection, body: str, **params: Any) -> list[Any]:
    statement = _SELECT.format(body=body) + _LIMIT
    return list(conn.execute(sql(statement), params))


READ = (
    # a level change's order (`store.levels.ensure_levels` locks these two first), so the two
    # never wait for each other both ways
    "schedule_offset",
    "consume_queue",
    "timer_queue",
    "topic_queue",
    "commit_log",
    "lane_count",
    "dead_letter",
    "message_history",
    "periodic_schedule",
)
"""The tables the checks read, each with its partitions."""


def begin_snapshot(conn: Connection, timeout_ms: int, lock_timeout_ms: int) -> None:
    """The first statements of a check's transaction: read only, bounded, and every table it
    reads locked (ACCESS SHARE) before its one snapshot is taken, at the first query after.
    A table dropped by DDL committed after the snapshot (a level removed, a history day
    dropped) would vanish from it all the same, and the check report the rows it held as
    lost; locked first, the DDL has either committed before the snapshot or waits for the
    check. (SET and LOCK are not queries: the snapshot is not taken yet.)"""
    conn.execute(sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"))
    # 1 ms at least: 0 is no timeout at all
    conn.execute(sql(f"SET LOCAL statement_timeout = {max(1, int(timeout_ms))}"))
    conn.execute(sql(f"SET LOCAL lock_timeout = {max(1, int(lock_timeout_ms))}"))
    tables = ", ".join(f"delaysvc.{name}" for name in READ)
    conn.execute(sql(f"LOCK TABLE {tables} IN ACCESS SHARE MODE"))


def summary(conn: Connection) -> Any:
    """What the snapshot holds: unfinished messages, running ones, lanes, topic queues."""
    return conn.execute(
        sql(
            f"""
SELECT (SELECT count(*) FROM delaysvc.commit_log WHERE status IN {UNFINISHED}) AS unfinished,
       (SELECT count(*) FROM delaysvc.commit_log WHERE status = 'running') AS running,
       (SELECT count(*) FROM delaysvc.topic_queue) AS ready,
       (SELECT count(*) FROM delaysvc.schedule_offset) AS lanes,
       (SELECT count(DISTINCT topic) FROM delaysvc.topic_queue) AS topic_queues,
       now() AS checked_at"""
        )
    ).one()


# -- every unfinished message is in exactly one place: a level's queue, the timer queue, its
# topic's queue, or running under a lease (a delivered message keeps its commit_log row as
# `scheduled`/`retrying` until claimed: see store.MESSAGE_STATE)
_PLACES = """
WITH places AS (
    SELECT message_id, 'level ' || level || '''s queue' AS place FROM delaysvc.consume_queue
    UNION ALL SELECT message_id, 'the timer queue' FROM delaysvc.timer_queue
    UNION ALL SELECT message_id, 'its topic queue' FROM delaysvc.topic_queue
), placed AS (
    SELECT message_id, count(*) AS n, string_agg(place, ' and ' ORDER BY place) AS places,
           bool_and(place = 'its topic queue') AS in_topic_queue
    FROM places GROUP BY message_id
)
SELECT c.id AS message_id, 'message ' || c.id AS subject,
    'status ' || c.status
    || CASE WHEN c.lane > 0 THEN ', level ' || c.lane
            WHEN c.lane = 0 THEN ', timer lane' ELSE '' END
    || CASE
        WHEN c.status = 'running' AND p.n IS NOT NULL THEN ', running but also in ' || p.places
        WHEN c.status = 'running' THEN ', running without a lease (lease_until is NULL)'
        WHEN p.n IS NULL THEN ', in no queue'
        WHEN p.n > 1 THEN ', in ' || p.n || ' places: ' || p.places
        ELSE ', in ' || p.places || ' (a ready message is in its topic queue only)'
       END AS problem
FROM delaysvc.commit_log c LEFT JOIN placed p ON p.message_id = c.id
WHERE c.status IN {unfinished} AND CASE
    WHEN c.status = 'running' THEN p.n IS NOT NULL OR c.lease_until IS NULL
    WHEN p.n IS NULL OR p.n > 1 THEN true
    ELSE c.status = 'ready' AND NOT p.in_topic_queue
END"""


def unfinished_out_of_place(conn: Connection, limit: int) -> list[Any]:
    """Unfinished messages in no place, in two places, or in a place their status forbids."""
    return _violations(conn, _PLACES.format(unfinished=UNFINISHED), limit=limit)


# -- every queue row has its message, unfinished, of the same topic, and a lane row agrees with
# the message's lane, offset and due time
_QUEUE_ROWS = f"""
WITH queued_rows AS (
    SELECT message_id, topic, level AS lane, queue_offset, deliver_ts,
        'in level ' || level || '''s queue (offset ' || queue_offset || ')' AS place
    FROM delaysvc.consume_queue
    UNION ALL
    SELECT message_id, topic, 0, queue_offset, deliver_ts,
        'in the timer queue (offset ' || queue_offset || ')'
    FROM delaysvc.timer_queue
    UNION ALL
    SELECT message_id, topic, -1, NULL, deliver_ts, 'in topic queue ' || quote_literal(topic)
    FROM delaysvc.topic_queue
)
SELECT r.message_id, 'message ' || r.message_id AS subject, r.place || ', ' || CASE
        WHEN c.id IS NULL THEN 'without its message in commit_log'
        WHEN c.status NOT IN {UNFINISHED} OR c.status = 'running'
             OR (r.lane >= 0 AND c.status = 'ready')
            THEN 'but the message is ' || c.status
        WHEN c.topic <> r.topic THEN 'but the message''s topic is ' || quote_literal(c.topic)
        WHEN r.lane >= 0 AND c.lane <> r.lane
            THEN 'but the message''s lane is ' || c.lane
        WHEN r.lane >= 0 AND c.queue_offset IS DISTINCT FROM r.queue_offset
            THEN 'but the message''s offset is ' || COALESCE(c.queue_offset::text, 'NULL')
        ELSE 'due ' || r.deliver_ts || ' but the message is due ' || c.deliver_ts
    END AS problem
FROM queued_rows r LEFT JOIN delaysvc.commit_log c ON c.id = r.message_id
WHERE c.id IS NULL OR c.status NOT IN {UNFINISHED} OR c.status = 'running'
    OR c.topic <> r.topic
    OR (r.lane >= 0 AND (c.status = 'ready' OR c.lane <> r.lane
        OR c.queue_offset IS DISTINCT FROM r.queue_offset OR c.deliver_ts <> r.deliver_ts))"""


def queue_rows_without_their_message(conn: Connection, limit: int) -> list[Any]:
    """Queue rows whose message is missing, finished or running, of another topic, or (a lane's
    row) in another lane, at another offset or due at another time."""
    return _violations(conn, _QUEUE_ROWS, limit=limit)


_DEAD_LETTERS = """
SELECT d.message_id, 'message ' || d.message_id AS subject, CASE
        WHEN m.id IS NULL THEN 'dead letter without its message'
        WHEN m.status <> 'dead' THEN 'dead letter, but the message is ' || m.status
        ELSE 'dead letter of topic ' || quote_literal(d.topic) || ', but the message''s is '
            || quote_literal(m.topic)
    END AS problem
FROM delaysvc.dead_letter d LEFT JOIN delaysvc.message m ON m.id = d.message_id
WHERE m.id IS NULL OR m.status <> 'dead' OR m.topic <> d.topic"""


def dead_letters_without_a_dead_message(conn: Connection, limit: int) -> list[Any]:
    """Every dead letter's message is dead (in commit_log or the history), of its topic. The
    other way is no invariant: a purge forgets dead letters and leaves their messages dead."""
    return _violations(conn, _DEAD_LETTERS, limit=limit)


_IN_BOTH = """
SELECT c.id AS message_id, 'message ' || c.id AS subject,
    'in commit_log (' || c.status || ') and in the history (' || h.status || ', '
    || p.relname || ')' AS problem
FROM delaysvc.commit_log c JOIN delaysvc.message_history h ON h.id = c.id
JOIN pg_catalog.pg_class p ON p.oid = h.tableoid"""


def messages_in_log_and_history(conn: Connection, limit: int) -> list[Any]:
    """A message is in commit_log or in the history, never both."""
    return _violations(conn, _IN_BOTH, limit=limit)


_TWICE_IN_HISTORY = """
SELECT id AS message_id, 'message ' || id AS subject,
    count(*) || ' times in the history' AS problem
FROM delaysvc.message_history GROUP BY id HAVING count(*) > 1"""


def messages_twice_in_history(conn: Connection, limit: int) -> list[Any]:
    """A message is in the history once (it has no primary key: it is moved once)."""
    return _violations(conn, _TWICE_IN_HISTORY, limit=limit)


_HISTORY_ROWS = f"""
SELECT h.id AS message_id, 'message ' || h.id AS subject, CASE
        WHEN h.status NOT IN {FINISHED}
            THEN 'in the history (' || p.relname || ') with status ' || h.status
        ELSE 'finished ' || h.finished_at || ' but in ' || p.relname
    END AS problem
FROM delaysvc.message_history h JOIN pg_catalog.pg_class p ON p.oid = h.tableoid
WHERE h.status NOT IN {FINISHED} OR p.relname
    <> 'message_history_' || to_char(h.finished_at AT TIME ZONE 'UTC', 'YYYYMMDD')"""


def unfinished_or_misfiled_history(conn: Connection, limit: int) -> list[Any]:
    """The history holds finished messages only, each in the partition of the UTC day it
    finished (finished_at is NOT NULL by the table's definition)."""
    return _violations(conn, _HISTORY_ROWS, limit=limit)


_FINISHED_AT = f"""
SELECT id AS message_id, 'message ' || id AS subject, CASE
        WHEN status IN {FINISHED} THEN 'status ' || status || ' without finished_at'
        ELSE 'status ' || status || ' with finished_at ' || finished_at
    END AS problem
FROM delaysvc.commit_log
WHERE (status IN {FINISHED}) <> (finished_at IS NOT NULL)"""


def finished_at_disagrees_with_status(conn: Connection, limit: int) -> list[Any]:
    """finished_at is set exactly for finished messages (the unique key among unfinished
    messages, the history sweep and the caps all go by it)."""
    return _violations(conn, _FINISHED_AT, limit=limit)


_DUPLICATE_KEYS = f"""
WITH held AS (
    SELECT topic, key, array_agg(id ORDER BY id) AS ids FROM delaysvc.commit_log
    WHERE key IS NOT NULL AND status IN {UNFINISHED}
    GROUP BY topic, key HAVING count(*) > 1
)
SELECT c.id AS message_id, 'message ' || c.id AS subject,
    'status ' || c.status || ', key ' || quote_literal(c.key) || ' of topic '
    || quote_literal(c.topic) || ' also held by unfinished message '
    || array_to_string(array_remove(h.ids, c.id), ', ') AS problem
FROM held h JOIN delaysvc.commit_log c ON c.id = ANY(h.ids)"""


def keys_held_twice(conn: Connection, limit: int) -> list[Any]:
    """A key is held by at most one unfinished message of its topic."""
    return _violations(conn, _DUPLICATE_KEYS, limit=limit)


_EXPIRED_LEASES = """
SELECT id AS message_id, 'message ' || id AS subject,
    'status running (claim ' || COALESCE(claim_id::text, 'none') || ', attempt ' || attempts
    || '), lease expired ' || round(extract(epoch FROM now() - lease_until)) || ' s ago at '
    || lease_until || ' and not rescued (the rescue runs on a worker, fired by beat: are both '
    || 'running?)' AS problem
FROM delaysvc.commit_log c
WHERE status = 'running' AND lease_until < now() - :tolerance_s * interval '1 second'
    -- not a row a live transaction has locked or is writing (its xmax, while that transaction
    -- holds the lock on its own id): a transactional handler's job, which renewal and rescue
    -- skip until its transaction ends (`lock_running_job`), or a rescue under way
    AND NOT EXISTS (SELECT FROM pg_locks l
        WHERE l.locktype = 'transactionid' AND l.transactionid = c.xmax AND l.granted)"""


def leases_expired_long_ago(conn: Connection, tolerance_s: float, limit: int) -> list[Any]:
    """No running job's lease expired more than `tolerance_s` ago (the rescue returns an
    expired one to its topic queue within seconds), but for one whose row a live transaction
    holds: a transactional handler's, which keeps its job while it runs however long."""
    return _violations(conn, _EXPIRED_LEASES, tolerance_s=tolerance_s, limit=limit)


# -- a level's waiting messages are in a place some lane serves (a level with no
# schedule_offset row has no runner: its messages would never be delivered)
_NO_LANE = """
SELECT q.message_id, 'message ' || q.message_id AS subject,
    'in level ' || q.level || '''s queue, which no lane serves (it has no schedule_offset '
    || 'row): never delivered; delaysvc migrate makes the lane again' AS problem
FROM delaysvc.consume_queue q
WHERE NOT EXISTS (SELECT FROM delaysvc.schedule_offset s WHERE s.lane = q.level)"""


def messages_no_lane_serves(conn: Connection, limit: int) -> list[Any]:
    """Every row of a level's queue has its level's lane (its schedule_offset row)."""
    return _violations(conn, _NO_LANE, limit=limit)


# -- a running job is under a lease a worker renews: never one longer than any worker takes
_LONG_LEASES = """
SELECT id AS message_id, 'message ' || id AS subject,
    'status running (claim ' || COALESCE(claim_id::text, 'none') || '), lease until '
    || lease_until || ', more than the longest lease a worker takes (' || :longest_s
    || ' s) ahead: never rescued if its worker is gone' AS problem
FROM delaysvc.commit_log
WHERE status = 'running'
    AND lease_until > now() + (:longest_s + :tolerance_s) * interval '1 second'"""


def leases_beyond_the_longest(
    conn: Connection, longest_s: int, tolerance_s: float, limit: int
) -> list[Any]:
    """No running job's lease ends further ahead than the longest lease a worker takes
    (`longest_s`, plus `tolerance_s`)."""
    return _violations(
        conn, _LONG_LEASES, longest_s=longest_s, tolerance_s=tolerance_s, limit=limit
    )


# -- nothing runs after its cancel was acknowledged (a cancel takes only a waiting message: a
# cancelled one started before it only, in an attempt before a retry)
_AFTER_CANCEL = """
SELECT id AS message_id, 'message ' || id AS subject,
    'cancelled at ' || finished_at || ' but started at ' || started_at || ', after its cancel'
    AS problem
FROM delaysvc.message
WHERE status = 'cancelled' AND started_at > finished_at"""


def runs_after_their_cancel(conn: Connection, limit: int) -> list[Any]:
    """No cancelled message (in commit_log or the history) started after its cancel."""
    return _violations(conn, _AFTER_CANCEL, limit=limit)


_LANE_COUNTS = """
WITH counted AS (
    SELECT lane, sum(delta) AS n FROM delaysvc.lane_count GROUP BY lane
), queued AS (
    SELECT level AS lane, count(*) AS n FROM delaysvc.consume_queue GROUP BY level
    UNION ALL SELECT 0, count(*) FROM delaysvc.timer_queue
)
SELECT NULL::bigint AS message_id,
    CASE WHEN lane = 0 THEN 'timer lane' ELSE 'lane ' || lane END AS subject,
    'lane_count says ' || counted || ' waiting, its queue holds ' || queued AS problem
FROM (
    SELECT COALESCE(c.lane, q.lane) AS lane, COALESCE(c.n, 0) AS counted,
        COALESCE(q.n, 0) AS queued
    FROM counted c FULL JOIN queued q ON q.lane = c.lane
) l WHERE counted <> queued"""


def lane_counts_off(conn: Connection, limit: int) -> list[Any]:
    """Each lane's exact count (its `lane_count` deltas summed, folded or not) is the number of
    rows in its queue."""
    return _violations(conn, _LANE_COUNTS, limit=limit)


_BEHIND_THE_OFFSET = """
SELECT q.message_id, 'message ' || q.message_id AS subject,
    'level ' || s.lane || ', offset ' || q.queue_offset || ', behind the schedule offset '
    || s.schedule_offset || ' but not due for '
    || round(extract(epoch FROM q.deliver_ts - now())::numeric, 1)
    || ' s (the schedule offset passed a row it never moved)' AS problem
FROM delaysvc.schedule_offset s JOIN delaysvc.consume_queue q
    ON q.level = s.lane AND q.queue_offset <= s.schedule_offset
WHERE s.lane > 0 AND q.deliver_ts > now() + :margin_s * interval '1 second'"""


def rows_behind_the_schedule_offset_not_due(conn: Connection, limit: int) -> list[Any]:
    """A level's schedule offset (the highest offset moved out of it) passes only rows that
    were due when it passed them: a send committed after later offsets of its level were
    moved, a row a cancel held while the move skipped it. So every row at or behind it is
    due."""
    return _violations(conn, _BEHIND_THE_OFFSET, margin_s=CLOCK_MARGIN_S, limit=limit)


def level_offsets(conn: Connection) -> list[Any]:
    """Each level's schedule offset and whether its offset sequence exists."""
    return list(
        conn.execute(
            sql(
                "SELECT lane, schedule_offset, "
                "to_regclass(format(:sequence, lane)) IS NOT NULL AS has_sequence "
                "FROM delaysvc.schedule_offset WHERE lane > 0 ORDER BY lane"
            ),
            {"sequence": table("consume_queue_%s_seq")},
        )
    )


def last_offset_given(conn: Connection, level: int) -> int:
    """The last offset a level's sequence gave out (0: none yet), read as a relation (ACCESS
    SHARE), not by `pg_sequence_last_value` (ROW EXCLUSIVE)."""
    return conn.execute(
        sql(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END "
            f"FROM delaysvc.{level_sequence(level)}"
        )
    ).scalar_one()


_OVERDUE_SCHEDULES = """
SELECT NULL::bigint AS message_id, 'schedule ' || quote_literal(name) AS subject,
    'next tick ' || next_tick || ' is ' || round(extract(epoch FROM now() - next_tick))
    || ' s in the past (is beat running?)' AS problem
FROM delaysvc.periodic_schedule
WHERE NOT paused AND next_tick < now() - :tolerance_s * interval '1 second'"""


def schedules_overdue(conn: Connection, tolerance_s: float, limit: int) -> list[Any]:
    """A running periodic schedule's next tick is in the future, or at most `tolerance_s` in
    the past (beat advances it every second; later than its grace, the tick is missed)."""
    return _violations(conn, _OVERDUE_SCHEDULES, tolerance_s=tolerance_s, limit=limit)
