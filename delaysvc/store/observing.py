"""What the dashboard, the CLI and /metrics read of lanes and topics, never a COUNT(*) of a hot
table."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from delaysvc.db.names import sql
from delaysvc.store.consuming import distinct_topics, topics_with_ready
from delaysvc.store.health import HANDLED
from delaysvc.store.shared import NOT_MOVED


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
    COALESCE((SELECT paused FROM delaysvc.topic_state s WHERE s.topic = t.topic), false) AS paused,
    {HANDLED.format(topic="t.topic")} AS handled
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
