"""Histograms and running totals (lateness per lane, durations and outcomes per topic) and the
exact count of messages stored."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from delaysvc.db.names import sql

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
