"""Consuming: the claim, starting attempts, outcomes (success, retry, dead letter), leases and
their rescue, topic pauses and limits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from psycopg import Cursor
from psycopg.rows import namedtuple_row
from sqlalchemy import Connection

from delaysvc.db.engines import driver_errors
from delaysvc.db.names import driver_sql as _driver_sql
from delaysvc.db.names import sql
from delaysvc.store.shared import _ENQUEUE_FROM, _NEXT_OFFSET, _PLACED_LANE, MESSAGE_COLUMNS

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
    tests/integration/test_tick_cost.py reproduces it)."""
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

# The lane of one message asking for level :lane with delay :delay_ms (`_PLACED_LANE`).
_PLACED_ONE = (
    "placed AS (SELECT CAST("
    + _PLACED_LANE.format(lane="CAST(:lane AS int)", delay_ms="CAST(:delay_ms AS bigint)")
    + " AS smallint) AS lane)"
)

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

    def params(self) -> dict[str, Any]:
        """The failure as a statement's parameters (error and traceback cut to 4,000 chars)."""
        return {
            "id": self.message_id,
            "claim_id": self.claim_id,
            "error": storable(self.error[:4000]),
            "traceback": storable(self.traceback[-4000:]),
            "duration_ms": self.duration_ms,
        }


def storable(text: str) -> str:
    """Text as PostgreSQL can store it: a NUL and a lone surrogate (a file name that is not
    UTF-8, read through `surrogateescape`) escaped as Python writes them (`\\x00`, `\\udce9`).
    A handler's error holding one failed the write of its whole batch's outcomes."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode()
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode()
    return text


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
        failure.params()
        | {
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
        failure.params() | {"reason": storable(reason[:4000])},
    )
    return result.rowcount == 1


def renew_leases(conn: Connection, held: dict[int, list[int]], lease_seconds: int) -> int:
    """Move the lease of every job still running under its claim (claim id -> job ids) a
    lease ahead; -> jobs renewed. By id: a TID-cheap primary key lookup per job. A job whose
    row is locked by its transactional handler (`lock_running_job`) is skipped: the lock keeps
    it, and renewing it would wait for the handler's commit."""
    pairs = [(message_id, claim_id) for claim_id, ids in held.items() for message_id in ids]
    return conn.execute(
        sql(
            """
WITH free AS (
    SELECT c.id FROM delaysvc.commit_log c
    JOIN unnest(CAST(:ids AS bigint[]), CAST(:claims AS bigint[])) AS v(id, claim_id)
        ON c.id = v.id AND c.claim_id = v.claim_id
    WHERE c.status = 'running' FOR UPDATE OF c SKIP LOCKED
)
UPDATE delaysvc.commit_log c
SET lease_until = clock_timestamp() + :lease_seconds * interval '1 second'
FROM free WHERE c.id = free.id
"""
        ),
        {
            "ids": [message_id for message_id, _ in pairs],
            "claims": [claim_id for _, claim_id in pairs],
            "lease_seconds": lease_seconds,
        },
    ).rowcount


def lock_running_job(conn: Connection, message_id: int, claim_id: int) -> bool:
    """Lock a running job's row for its transactional handler; -> False when it is no longer
    this claim's. Rescue (`rescue_expired_leases`, SKIP LOCKED) and renewal skip it until the
    transaction ends, so it stays this claim's until then."""
    return (
        conn.execute(
            sql(
                "SELECT 1 FROM delaysvc.commit_log WHERE id = :id AND claim_id = :claim "
                "AND status = 'running' FOR UPDATE"
            ),
            {"id": message_id, "claim": claim_id},
        ).first()
        is not None
    )


def release_unstarted(
    conn: Connection, message_ids: Sequence[int], claim_id: int, never_started: bool = False
) -> int:
    """Give claimed jobs that never ran back to their topic queue, uncharged (an attempt the
    claim counted for one of them is taken back). `never_started`: only those whose attempt
    was not counted (one that was may be running)."""
    if not message_ids:
        return 0
    only = "AND c.started_at IS NULL" if never_started else ""
    return conn.execute(
        sql(
            f"""
WITH back AS (
    UPDATE delaysvc.commit_log c SET status = 'ready', lease_until = NULL, claim_id = NULL,
        attempts = c.attempts - CASE WHEN c.started_at IS NULL THEN 0 ELSE 1 END,
        started_at = NULL
    WHERE c.id = ANY(CAST(:ids AS bigint[])) AND c.claim_id = :claim_id
      AND c.status = 'running' {only}
    RETURNING c.id, c.topic, c.deliver_ts, c.priority
)
INSERT INTO delaysvc.topic_queue (message_id, topic, deliver_ts, priority)
SELECT id, topic, deliver_ts, priority FROM back ORDER BY id
"""
        ),
        {"ids": list(message_ids), "claim_id": claim_id},
    ).rowcount


def rescue_expired_leases(conn: Connection, limit: int, grace_seconds: float) -> list[Any]:
    """Jobs whose worker vanished (lease expired) go back to their topic queue; an attempt
    that started counts, a job that never started was never charged. A lease that expired
    before the database server last started (it was away: restarting, failing over) is
    rescued only `grace_seconds` after that start: its worker, alive all along, renews it once
    it reaches the database again (a 45 s outage reran every job in flight, though each had
    succeeded). -> the rescued (id, topic)."""
    return list(
        conn.execute(
            sql(
                """
WITH expired AS (
    SELECT id FROM delaysvc.commit_log WHERE status = 'running' AND lease_until < clock_timestamp()
      AND (lease_until >= pg_postmaster_start_time()
           OR clock_timestamp() >= pg_postmaster_start_time()
                                   + CAST(:grace AS float8) * interval '1 second')
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
            {"limit": limit, "grace": grace_seconds},
        )
    )


def topics_with_ready(conn: Connection) -> list[str]:
    return distinct_topics(conn, "topic_queue")


_READY_HEADS = """
WITH RECURSIVE t AS (
    (SELECT topic, seq FROM delaysvc.topic_queue ORDER BY topic, priority DESC, seq LIMIT 1)
    UNION ALL
    SELECT n.topic, n.seq FROM t, LATERAL (
        SELECT topic, seq FROM delaysvc.topic_queue WHERE topic > t.topic
        ORDER BY topic, priority DESC, seq LIMIT 1
    ) n
)
SELECT topic, seq FROM t
"""


def ready_heads(conn: Connection) -> tuple[int, dict[str, int]]:
    """(the last `seq` given, read first; each topic with ready jobs -> its head's `seq`, the
    job its next claim takes), the heads by a loose index scan along the topic queue's index:
    one probe per topic. A head whose `seq` is above an earlier call's mark came in since."""
    mark = conn.execute(
        # a sequence not called yet holds the first value it will give
        sql(
            "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END "
            "FROM delaysvc.topic_queue_seq"
        )
    ).scalar_one()
    return int(mark), {row.topic: row.seq for row in conn.execute(sql(_READY_HEADS))}


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


def set_topic_paused(conn: Connection, topic: str, paused: bool) -> None:
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
# second's starts (at least one); `available` is what it holds now, read from one clock
# reading (two `clock_timestamp()` calls in one expression can differ by a microsecond either
# way: a fresh bucket then held 4.99999 of its 5 tokens).
_LOCK_LIMITS = """SELECT max_running, rate_per_s, tokens, tokens_at FROM delaysvc.topic_state
WHERE topic = :topic AND (max_running IS NOT NULL OR rate_per_s IS NOT NULL) FOR UPDATE"""
_READ_LIMITS = """SELECT CAST(:max_running AS integer) AS max_running,
    CAST(:rate AS float8) AS rate_per_s, clock.now,
    CASE WHEN CAST(:rate AS float8) IS NOT NULL THEN LEAST(GREATEST(:rate, 1),
        COALESCE(CAST(:tokens AS float8), GREATEST(:rate, 1)) + :rate * GREATEST(0,
        extract(epoch FROM clock.now - COALESCE(CAST(:tokens_at AS timestamptz), clock.now))))
    END AS available,
    CASE WHEN CAST(:max_running AS integer) IS NOT NULL THEN (SELECT count(*)
        FROM delaysvc.commit_log c WHERE c.status = 'running' AND c.topic = :topic)
    END AS running
FROM (SELECT clock_timestamp() AS now) AS clock"""


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
