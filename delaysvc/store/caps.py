"""Backlog caps: the caps, their lock, the waiting counts they compare, early delivery, and the
index of the capped topics' waiting messages."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection

from delaysvc.db.names import LOCK_KEY, MIGRATE_LOCK, lock_name, sql
from delaysvc.schema.tables import CAPPED_INDEX_PREFIX
from delaysvc.store.producing import find_unfinished_by_keys
from delaysvc.store.shared import NOT_MOVED, WAITING, Statements


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
    is not seen, so not deleted, and is folded next time). -> rows folded.

    Not while the schema is migrated (its lock, `schema.migrate.lock_migrations`, held to the
    end of this transaction; a fold that finds it taken folds nothing): a level removed drops
    its lane's count rows, and a fold that had deleted them uncommitted made that DELETE wait,
    then miss the total the fold put back."""
    taken = conn.execute(
        sql(f"SELECT pg_try_advisory_xact_lock({LOCK_KEY})"), {"lock": lock_name(MIGRATE_LOCK)}
    ).scalar_one()
    if not taken:
        return 0
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
    """Waiting (scheduled or retrying) messages of a topic, never counted beyond `up_to`: on
    the capped topics' index (`_of_topic`)."""
    return conn.execute(
        sql(
            "SELECT count(*) FROM (SELECT 1 FROM delaysvc.commit_log c "
            f"WHERE {_of_topic(topic)} AND {WAITING} AND {NOT_MOVED} LIMIT :up_to) w"
        ),
        {"up_to": up_to},
    ).scalar_one()


def _of_topic(topic: str) -> str:
    """`c.topic = 'topic'`, the topic written into the statement: PostgreSQL uses an index whose
    predicate names the topic among others (the capped topics' index) only for a plan made
    knowing the value, which a prepared statement's generic plan is not. A topic is letters,
    digits, '.', '_' and '-' (`validate_topic`); a quote is doubled all the same."""
    return f"c.topic = {_literal(topic)}"


def _literal(value: str) -> str:
    """`value` as an SQL string literal (standard_conforming_strings: a quote doubled)."""
    return "'" + value.replace("'", "''") + "'"


def lock_key_holders(
    conn: Statements, pairs: Sequence[tuple[str, str | None]]
) -> dict[tuple[str, str], Any]:
    """The unfinished messages holding these (topic, key) pairs, each locked FOR SHARE until
    the transaction ends: a holder cannot finish meanwhile and leave its key to a send a cap
    counted as adding nothing."""
    return find_unfinished_by_keys(conn, pairs, lock=True)


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
            f"SELECT c.id FROM delaysvc.commit_log c WHERE {_of_topic(topic)} "
            f"AND {WAITING} AND {NOT_MOVED} "
            "ORDER BY c.deliver_ts LIMIT :count"
        ),
        {"count": count},
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


def deliver_now(conn: Statements, message_ids: Sequence[int]) -> int | None:
    """Move waiting messages into their topics' queues before their time (a backlog cap's
    overflow), counted per lane in `early_total`. -> how many moved (a message being moved
    by its lane at the same moment is left to it); None when the move failed (a message that
    cannot be moved, which its lane marks stuck), undone in a savepoint: the send that set it
    off is stored all the same, and the cap is over by it until the oldest moves."""
    conn.execute(sql("SAVEPOINT delaysvc_early"))
    try:
        moved = conn.execute(sql(_DELIVER_NOW), {"ids": list(message_ids)}).scalar_one()
    except Exception as failed:  # the driver's own type (psycopg, psycopg2, Django, SQLAlchemy)
        try:
            conn.execute(sql("ROLLBACK TO SAVEPOINT delaysvc_early"))
            conn.execute(sql("RELEASE SAVEPOINT delaysvc_early"))
        except Exception:
            raise failed from None  # the connection is gone: the send's error is the move's
        return None
    conn.execute(sql("RELEASE SAVEPOINT delaysvc_early"))
    return int(moved)


# ---------------------------------------------------------------- the capped topics' index

LISTED_AT_MOST = 100
"""Capped topics the index names in its predicate at most. PostgreSQL proves that
`topic = 'x'` implies `topic IN (...)` for a list of up to 100 values (MAX_SAOP_ARRAY_SIZE in
its predtest.c); with more topic caps the index holds every waiting message, as before 0020."""


class CappedIndex(NamedTuple):
    """One of the capped topics' indexes found on the commit log."""

    name: str
    valid: bool  # built; false while a build runs, and after one failed
    building: bool  # a CREATE INDEX CONCURRENTLY is building it now


def capped_topics(conn: Connection) -> list[str]:
    """The topics a backlog cap covers, in order."""
    return list(
        conn.execute(
            sql("SELECT target FROM delaysvc.backlog_cap WHERE scope = 'topic' ORDER BY target")
        ).scalars()
    )


def capped_index_for(topics: Sequence[str]) -> tuple[str, list[str] | None] | None:
    """The index that fits these capped topics: (its name, the topics its predicate names, or
    None for every waiting message); None when no topic is capped. The name is the topics'
    digest, so an index names what it holds, and two workers making it make one."""
    if not topics:
        return None
    if len(topics) > LISTED_AT_MOST:
        return CAPPED_INDEX_PREFIX + "all", None
    listed = sorted(topics)
    digest = hashlib.sha256(",".join(listed).encode()).hexdigest()[:16]
    return CAPPED_INDEX_PREFIX + digest, listed


def capped_indexes(conn: Connection) -> list[CappedIndex]:
    """The capped topics' indexes on the commit log, built or not."""
    rows = conn.execute(
        sql(
            "SELECT i.relname AS name, x.indisvalid AS valid, EXISTS ("
            "SELECT 1 FROM pg_stat_progress_create_index p WHERE p.index_relid = i.oid"
            ") AS building FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
            "WHERE x.indrelid = CAST('delaysvc.commit_log' AS regclass) "
            "AND starts_with(i.relname, :prefix) ORDER BY i.relname"
        ),
        {"prefix": CAPPED_INDEX_PREFIX},
    )
    return [CappedIndex(row.name, row.valid, row.building) for row in rows]


def build_capped_index(conn: Connection, name: str, topics: Sequence[str] | None) -> None:
    """Build the index `name` of the waiting messages of `topics` (None: of every topic) without
    stopping a send (CONCURRENTLY: on a connection that autocommits); nothing if it exists."""
    waiting = "status IN ('scheduled', 'retrying')"
    listed = None if topics is None else ", ".join(map(_literal, topics))
    where = waiting if listed is None else f"topic IN ({listed}) AND {waiting}"
    conn.execute(
        sql(
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} "
            f"ON delaysvc.commit_log (topic, deliver_ts) WHERE {where}"
        )
    )


def drop_capped_index(conn: Connection, name: str) -> None:
    """Drop one of the capped topics' indexes, without stopping a send (autocommitting)."""
    conn.execute(sql(f"DROP INDEX CONCURRENTLY IF EXISTS delaysvc.{name}"))
