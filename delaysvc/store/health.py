"""Heartbeats of the running parts and the recent handler durations the health check reads."""

from __future__ import annotations

from sqlalchemy import Connection

from delaysvc.db.names import sql
from delaysvc.store.consuming import topics_with_ready


def record_heartbeat(conn: Connection, component: str, host: str) -> None:
    conn.execute(
        sql(
            "INSERT INTO delaysvc.heartbeat (component, seen_at, host) VALUES (:c, "
            "clock_timestamp(), :h) "
            "ON CONFLICT (component) DO UPDATE SET seen_at = EXCLUDED.seen_at, host = EXCLUDED.host"
        ),
        {"c": component, "h": host},
    )


def deployment_name(conn: Connection) -> str:
    """The database's name for the broker's tasks: its cluster's system identifier (a
    standby's is its primary's) and the database's name, the same from every host, pooler
    and URL."""
    return str(
        conn.execute(
            sql(
                "SELECT system_identifier::text || '/' || current_database() "
                "FROM pg_control_system()"
            )
        ).scalar_one()
    )


HANDLER_HEARTBEAT_SECONDS = 30.0
"""Each worker that serves the consume queue says this often which topics it has handlers for
(`handler <topic>` heartbeats: its `@handler`s and its DELAYSVC_TOPIC_TASKS)."""
HANDLER_STALE_AFTER_SECONDS = 3 * HANDLER_HEARTBEAT_SECONDS
"""A topic whose handler heartbeat is older than this has no live worker: "no handler"."""


def record_handlers(conn: Connection, topics: list[str], host: str) -> None:
    """This worker runs the handlers of `topics` (one statement for all of them)."""
    if not topics:
        return
    conn.execute(
        sql(
            "INSERT INTO delaysvc.heartbeat (component, seen_at, host) "
            "SELECT 'handler ' || t, clock_timestamp(), :h FROM unnest(CAST(:topics AS text[])) t "
            "ON CONFLICT (component) DO UPDATE SET seen_at = EXCLUDED.seen_at, host = EXCLUDED.host"
        ),
        {"topics": sorted(topics), "h": host},
    )


HANDLED = (
    "EXISTS (SELECT 1 FROM delaysvc.heartbeat h WHERE (h.component = 'handler ' || {topic} "
    "OR (h.component LIKE 'handler %*' "
    "AND starts_with({topic}, substr(h.component, 9, length(h.component) - 9)))) "
    f"AND h.seen_at > clock_timestamp() - interval '{HANDLER_STALE_AFTER_SECONDS:g} seconds')"
)
"""SQL: a live worker has a handler for the topic named by the expression `{topic}`, its own
(`handler order.cancel`) or a pattern's (`handler webhook.*`: 'handler ' is 8 characters)."""


def unhandled_ready(conn: Connection, limit_count: int = 100_000) -> list[tuple[str, int]]:
    """Topics whose ready messages no live worker handles, with how many wait (counted up to
    `limit_count`), by topic."""
    rows = conn.execute(
        sql(
            "SELECT t.topic, (SELECT count(*) FROM (SELECT 1 FROM delaysvc.topic_queue q "
            "  WHERE q.topic = t.topic LIMIT :cap) x) AS ready "
            "FROM unnest(CAST(:topics AS text[])) AS t(topic) "
            f"WHERE NOT {HANDLED.format(topic='t.topic')} ORDER BY t.topic"
        ),
        {"topics": topics_with_ready(conn), "cap": limit_count},
    )
    return [(row.topic, row.ready) for row in rows if row.ready]


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
