"""The dashboard's own reads (and the stats sampler), each named for what it does.

Every statement here is bounded: a LIMIT, a time window over a small history table, or a
keyset step over a primary key; none counts a hot table. Callers run them inside `bounded()`,
which sets `statement_timeout` for the transaction, so a slow search fails fast with
`QueryCanceled` instead of holding a connection.

History tables: `stats_sample` gets one row per lane per `sample_stats()` call (the beat task
`delaysvc.sample_stats`); `lateness_histogram` is filled by the delivery engine, one row per
lane per minute with counts per `LATENESS_BUCKETS_MS` bucket.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine

from delaysvc import store
from delaysvc.db.names import LOCK_KEY, lock_name, sql
from delaysvc.schema.tables import LATENESS_BUCKETS_MS, STATUSES

SAMPLE_EVERY = timedelta(seconds=10)
"""How often beat samples the stats (`delaysvc.sample_stats`): the dashboard's charts, moved/s."""
SAMPLE_RETENTION = timedelta(days=2)
PRUNE_BATCH = 10_000
CHART_WINDOW = timedelta(hours=1)
CHART_MAX_ROWS = 50_000
DEAD_GROUP_WINDOW = 50_000
"""Dead letters grouped on the page: the newest this many (the table is not hot, but may be big)."""
MAX_PAGE = 500


@contextmanager
def bounded(engine: Engine, timeout_ms: int) -> Iterator[Connection]:
    """A transaction whose every statement is cancelled after `timeout_ms`."""
    with engine.begin() as conn:
        set_statement_timeout(conn, timeout_ms)
        yield conn


def set_statement_timeout(conn: Connection, timeout_ms: int) -> None:
    """SET LOCAL statement_timeout (lasts until the transaction ends), and no JIT: these
    queries are short, and compiling them costs more than it saves."""
    conn.execute(
        sql("SELECT set_config('statement_timeout', :ms, true), set_config('jit', 'off', true)"),
        {"ms": str(int(timeout_ms))},
    )


# ---------------------------------------------------------------- stats samples


@dataclass(frozen=True)
class SampleResult:
    sampled_at: datetime
    lanes: int
    pruned: int


def sample_stats(
    engine: Engine, timeout_ms: int = 5_000, *, at: datetime | None = None
) -> SampleResult:
    """Record one stats_sample row per lane (pending, moved/early totals, head lateness), and
    prune one bounded batch of samples older than SAMPLE_RETENTION. `at` overrides the sample
    time (tests); by default it is the database clock. Nothing is recorded (`lanes` 0) within
    half of SAMPLE_EVERY after a sample, nor while another sampler is at it: with two beats,
    each firing this at its own phase, a sample a moment after another would make the
    dashboard's moved/s, taken between the two newest, a moment's moves over a moment."""
    with bounded(engine, timeout_ms) as conn:
        if not _sampler_lock(conn):
            return SampleResult(at or store.clock_now(conn), 0, 0)
        lanes = store.lane_stats(conn)
        sampled_at = at or (lanes[0].now if lanes else store.clock_now(conn))
        if _sampled_since(conn, sampled_at - SAMPLE_EVERY / 2, sampled_at):
            return SampleResult(sampled_at, 0, 0)
        rows = [
            {
                "at": sampled_at,
                "lane": lane.lane,
                "pending": lane.pending,
                "moved": lane.moved_total,
                "early": lane.early_total,
                "late": head_lateness_ms(lane.next_due, lane.now),
            }
            for lane in lanes
        ]
        if rows:
            conn.execute(
                sql(
                    "INSERT INTO delaysvc.stats_sample (sampled_at, lane, pending, moved_total, "
                    "early_total, head_lateness_ms) VALUES (:at, :lane, :pending, :moved, "
                    ":early, :late) ON CONFLICT (sampled_at, lane) DO NOTHING"
                ),
                rows,
            )
        pruned = prune_samples(conn, sampled_at - SAMPLE_RETENTION)
    return SampleResult(sampled_at, len(rows), pruned)


def _sampler_lock(conn: Connection) -> bool:
    """This transaction holds the sampler's advisory lock (False: another sampler does)."""
    statement = sql(f"SELECT pg_try_advisory_xact_lock({LOCK_KEY})")
    return bool(conn.execute(statement, {"lock": lock_name("stats sample")}).scalar_one())


def _sampled_since(conn: Connection, after: datetime, until: datetime) -> bool:
    """Is there a sample taken after `after`, up to `until`?"""
    statement = sql(
        "SELECT EXISTS (SELECT FROM delaysvc.stats_sample "
        "WHERE sampled_at > :after AND sampled_at <= :until)"
    )
    return bool(conn.execute(statement, {"after": after, "until": until}).scalar_one())


def head_lateness_ms(next_due: datetime | None, now: datetime) -> float | None:
    """How long a lane's head has been due (0 when it is not due yet; None when empty)."""
    if next_due is None:
        return None
    return max((now - next_due).total_seconds() * 1000, 0.0)


def prune_samples(conn: Connection, older_than: datetime, limit: int = PRUNE_BATCH) -> int:
    """Delete up to `limit` samples older than `older_than` (oldest first, by the primary key)."""
    return conn.execute(
        sql(
            "DELETE FROM delaysvc.stats_sample WHERE (sampled_at, lane) IN ("
            "SELECT sampled_at, lane FROM delaysvc.stats_sample WHERE sampled_at < :cutoff "
            "ORDER BY sampled_at LIMIT :limit)"
        ),
        {"cutoff": older_than, "limit": limit},
    ).rowcount


def lane_rates(conn: Connection) -> dict[int, float]:
    """Messages moved per second per lane, from the two newest samples (by the primary key:
    two index probes, then the rows of those two instants), the newest of the last 5 minutes
    (as the API's levels: an older one is no rate of now)."""
    rows = conn.execute(
        sql(
            """
WITH newest AS (SELECT max(sampled_at) AS t FROM delaysvc.stats_sample),
previous AS (
    SELECT max(sampled_at) AS t FROM delaysvc.stats_sample WHERE sampled_at < (SELECT t FROM newest)
)
SELECT a.lane,
       (a.moved_total - b.moved_total) / NULLIF(extract(epoch FROM a.sampled_at - b.sampled_at), 0)
           AS per_second
FROM delaysvc.stats_sample a JOIN delaysvc.stats_sample b ON b.lane = a.lane
WHERE a.sampled_at = (SELECT t FROM newest) AND b.sampled_at = (SELECT t FROM previous)
    AND a.sampled_at > clock_timestamp() - interval '5 minutes'
"""
        )
    )
    return {row.lane: max(float(row.per_second), 0.0) for row in rows if row.per_second is not None}


def backlog_series(
    conn: Connection, window: timedelta = CHART_WINDOW, now: datetime | None = None
) -> list[Any]:
    """(sampled_at, lane, pending) over the last `window`, oldest first, at most CHART_MAX_ROWS."""
    return list(
        conn.execute(
            sql(
                "SELECT sampled_at, lane, pending FROM delaysvc.stats_sample "
                f"WHERE sampled_at > {store.NOW} - :window "
                "ORDER BY sampled_at, lane LIMIT :limit"
            ),
            {"now": now, "window": window, "limit": CHART_MAX_ROWS},
        )
    )


@dataclass(frozen=True)
class LatenessDistribution:
    bounds_ms: tuple[int, ...]
    """Upper bound of each bucket; the last count is everything above the last bound."""
    counts: tuple[int, ...]
    max_ms: float | None

    @property
    def total(self) -> int:
        return sum(self.counts)

    def quantile_bound_ms(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (max_ms for the overflow)."""
        if self.total == 0:
            return None
        rank, seen = q * self.total, 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= rank and count:
                if index < len(self.bounds_ms):
                    return float(self.bounds_ms[index])
                break
        return self.max_ms


def lateness_distribution(
    conn: Connection, window: timedelta = CHART_WINDOW, now: datetime | None = None
) -> LatenessDistribution:
    """Lateness histogram buckets summed over every lane and minute of the last `window`."""
    buckets = len(LATENESS_BUCKETS_MS) + 1
    rows = conn.execute(
        sql(
            f"""
WITH recent AS (
    SELECT counts, max_ms FROM delaysvc.lateness_histogram
    WHERE minute > {store.NOW} - :window ORDER BY minute DESC LIMIT :limit
)
SELECT u.i AS bucket, sum(u.c) AS deliveries, (SELECT max(max_ms) FROM recent) AS max_ms
FROM recent, unnest(recent.counts) WITH ORDINALITY AS u(c, i)
WHERE u.i <= :buckets
GROUP BY u.i ORDER BY u.i
"""
        ),
        {"now": now, "window": window, "limit": CHART_MAX_ROWS, "buckets": buckets},
    ).all()
    counts = [0] * buckets
    for row in rows:
        counts[row.bucket - 1] = int(row.deliveries)
    max_ms = float(rows[0].max_ms) if rows and rows[0].max_ms is not None else None
    return LatenessDistribution(LATENESS_BUCKETS_MS, tuple(counts), max_ms)


# ---------------------------------------------------------------- message search


@dataclass(frozen=True)
class MessageSearch:
    """Filters of the message search; all optional. `before`/`after` are keyset cursors (ids):
    newest first below `before`, or the page just above `after`."""

    id: int | None = None
    topic: str | None = None
    key: str | None = None
    status: str | None = None
    stored_from: datetime | None = None
    stored_to: datetime | None = None
    before: int | None = None
    after: int | None = None
    limit: int = 50


@dataclass(frozen=True)
class MessagePage:
    rows: list[Any]
    older: int | None
    """Cursor for the next (older) page: pass as `before`; None at the end."""
    newer: int | None
    """Cursor for the previous (newer) page: pass as `after`; None on the newest page."""


# read through store.MESSAGE_STATE: a moved message's commit_log row is as it was; finished
# ones may be in the history already (where a search looks: _BY_STATUS below)
_SEARCH_COLUMNS = (
    f"c.id, c.topic, c.key, {store.STATUS} AS status, c.delay_level, {store.LANE} AS lane, "
    f"c.stored_at, c.deliver_ts, {store.DELIVERED_AT} AS delivered_at, "
    "c.started_at, c.finished_at, c.attempts, c.last_error"
)
_PAGE_COLUMNS = (  # what _SEARCH_COLUMNS reads, named (the two tables' column orders differ)
    "c.id, c.topic, c.key, c.status, c.delay_level, c.lane, c.stored_at, c.deliver_ts, "
    "c.delivered_at, c.started_at, c.finished_at, c.attempts, c.last_error"
)


# Where a search by status looks, and its condition. A message not finished yet is in
# commit_log, never in the history; only a waiting status may be a moved message's
# (store.MESSAGE_STATE); the topic queue holds exactly the ready messages. A finished one, or
# any when no status is given, is in commit_log or the history: each table's page is taken on
# its own (commit_log's finished rows through their partial index, `finished_at IS NOT NULL`),
# then the page of the two. (Through the view, one merged walk, commit_log's side walked its
# whole backlog when none of it matched: the planner costs that walk as if matches were spread
# evenly.)
_COMMIT_LOG = ("delaysvc.commit_log c",)
_READY = ("delaysvc.commit_log c JOIN delaysvc.topic_queue tq ON tq.message_id = c.id",)
_BOTH = ("delaysvc.commit_log c", "delaysvc.message_history c")
_FINISHED = (_BOTH, "c.status = :status AND c.finished_at IS NOT NULL")
_BY_STATUS: dict[str | None, tuple[tuple[str, ...], str | None]] = {
    "scheduled": (_COMMIT_LOG, f"{store.STATUS} = :status"),
    "retrying": (_COMMIT_LOG, f"{store.STATUS} = :status"),
    "ready": (_READY, None),
    "running": (_COMMIT_LOG, "c.status = :status"),
    "succeeded": _FINISHED,
    "dead": _FINISHED,
    "cancelled": _FINISHED,
    None: (_BOTH, None),
}


def _search_statement(search: MessageSearch, limit: int) -> tuple[str, dict[str, Any]]:
    """SQL for one keyset page. Only the filters given appear in the WHERE clause (no
    `:x IS NULL OR ...`), so the planner walks the primary key from the cursor."""
    sources, status_condition = _BY_STATUS[search.status]
    where, params = [], {"limit": limit}
    fields = [
        ("id", "c.id = :id"),
        ("topic", "c.topic = :topic"),
        ("key", "c.key = :key"),
        ("status", status_condition),
        ("stored_from", "c.stored_at >= :stored_from"),
        ("stored_to", "c.stored_at < :stored_to"),
        ("before", "c.id < :before"),
        ("after", "c.id > :after"),
    ]
    for name, condition in fields:
        value = getattr(search, name)
        if value is not None and condition is not None:
            where.append(condition)
            params[name] = value
    order = "ASC" if search.after is not None and search.before is None else "DESC"
    clause = f"WHERE {' AND '.join(where)} " if where else ""
    # the page's rows first, then their state: a moved message's state probes the topic queue
    # once per row of the page (computed over the whole walk, the planner would hash all of it)
    pages = [
        f"(SELECT {_PAGE_COLUMNS} FROM {source} {clause}ORDER BY c.id {order} LIMIT :limit)"
        for source in sources
    ]
    page = (
        pages[0]
        if len(pages) == 1
        else f"SELECT c.* FROM ({' UNION ALL '.join(pages)}) c ORDER BY c.id {order} LIMIT :limit"
    )
    statement = f"SELECT {_SEARCH_COLUMNS} FROM ({page}) c ORDER BY c.id {order}"
    return statement, params


def search_messages(conn: Connection, search: MessageSearch) -> MessagePage:
    """One page of messages matching `search`, newest first, keyset-paginated by id."""
    if search.status is not None and search.status not in STATUSES:
        raise ValueError(f"status {search.status!r} is not one of {STATUSES}")
    limit = max(1, min(search.limit, MAX_PAGE))
    statement, params = _search_statement(search, limit + 1)
    rows = list(conn.execute(sql(statement), params))
    more = len(rows) > limit
    rows = rows[:limit]
    going_up = search.after is not None and search.before is None
    if going_up:
        rows.reverse()
        older = rows[-1].id if rows else None
        newer = rows[0].id if rows and more else None
    else:
        older = rows[-1].id if rows and more else None
        newer = rows[0].id if rows and search.before is not None else None
    return MessagePage(rows, older, newer)


# ---------------------------------------------------------------- dead letters


_LAST_ERROR = """LEFT JOIN LATERAL (
        SELECT c.key, c.last_error FROM delaysvc.message c WHERE c.id = d.message_id LIMIT 1
    ) c ON true"""
"""The letter's message row by one index probe per table per letter (LIMIT 1 keeps the planner
from turning it into a hash join over the whole commit log)."""


def dead_groups(conn: Connection, topic: str | None = None, limit: int = 200) -> list[Any]:
    """Dead letters grouped by (topic, error), biggest group first, over the newest
    DEAD_GROUP_WINDOW letters, reading dead_letter alone: its `error` is the last handler
    error, else the reason the letter died (kept on the letter when it died)."""
    topic_filter = "WHERE d.topic = :topic" if topic is not None else ""
    return list(
        conn.execute(
            sql(
                f"""
SELECT topic, error, count(*) AS letters, min(died_at) AS first_died,
       max(died_at) AS last_died, max(message_id) AS newest_id
FROM (SELECT message_id, topic, died_at, error FROM delaysvc.dead_letter d {topic_filter}
      ORDER BY message_id DESC LIMIT :window) recent
GROUP BY topic, error
ORDER BY count(*) DESC, topic, max(message_id) DESC LIMIT :limit
"""
            ),
            {"topic": topic, "window": DEAD_GROUP_WINDOW, "limit": limit},
        )
    )


_CR_LF = "chr(13) || chr(10) || '?'"  # a regular expression: CR, then an LF if one follows


def error_named(conn: Connection, topic: str | None, digest: str) -> str | None:
    """The error text of a dead-letter group named by its digest (`error_digest`), if any
    letter of that topic (or any) has it."""
    topic_filter = "AND d.topic = :topic" if topic is not None else ""
    return conn.execute(
        sql(
            f"SELECT d.error FROM delaysvc.dead_letter d "
            f"WHERE md5(regexp_replace(d.error, {_CR_LF}, chr(10), 'g')) = :digest "
            f"{topic_filter} LIMIT 1"
        ),
        {"digest": digest, "topic": topic},
    ).scalar()


def error_digest(error: str) -> str:
    """A group's short name in the dashboard's links: the md5 of its error text with its line
    breaks as LF (as `_group_filter` compares it), as PostgreSQL's md5 gives it. An error may
    be kilobytes long, a link in full too long for a server (414) or a proxy."""
    return hashlib.md5(re.sub("\r\n?", "\n", error).encode()).hexdigest()


def _group_filter(topic: str | None, error: str | None) -> tuple[str, dict[str, Any]]:
    where, params = [], {}
    if topic is not None:
        where.append("d.topic = :topic")
        params["topic"] = topic
    if error is not None:
        # line breaks as LF on both sides: a browser sends a form field's as CRLF, and an
        # error of several lines (a psycopg error's DETAIL) came back matching nothing
        where.append(f"regexp_replace(d.error, {_CR_LF}, chr(10), 'g') = :error")
        params["error"] = re.sub("\r\n?", "\n", error)
    return " AND ".join(where), params


def dead_letters_page(
    conn: Connection,
    topic: str | None = None,
    error: str | None = None,
    before: int | None = None,
    limit: int = 50,
) -> tuple[list[Any], int | None]:
    """Dead letters of one group (or all), newest first; -> (rows, cursor of the next page)."""
    limit = max(1, min(limit, MAX_PAGE))
    where, params = _group_filter(topic, error)
    if before is not None:
        where = " AND ".join(filter(None, [where, "d.message_id < :before"]))
        params["before"] = before
    rows = list(
        conn.execute(
            sql(
                "SELECT d.message_id, d.topic, d.died_at, d.reason, d.attempts, c.key, "
                f"c.last_error FROM delaysvc.dead_letter d {_LAST_ERROR} "
                + (f"WHERE {where} " if where else "")
                + "ORDER BY d.message_id DESC LIMIT :limit"
            ),
            {**params, "limit": limit + 1},
        )
    )
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (rows[-1].message_id if more else None)


def dead_ids_in_group(
    conn: Connection,
    topic: str | None,
    error: str | None,
    limit: int,
    after: int | None = None,
) -> list[int]:
    """Up to `limit` ids of dead letters with exactly this topic and error, ascending after
    `after` (a keyset step, so a caller can walk past letters it chose to leave)."""
    where, params = _group_filter(topic, error)
    if after is not None:
        where = " AND ".join(filter(None, [where, "d.message_id > :after"]))
        params["after"] = after
    return list(
        conn.execute(
            sql(
                "SELECT d.message_id FROM delaysvc.dead_letter d "
                + (f"WHERE {where} " if where else "")
                + "ORDER BY d.message_id LIMIT :limit"
            ),
            {**params, "limit": limit},
        ).scalars()
    )


# ---------------------------------------------------------------- history (report_hourly)

HISTORY_DAYS = (1, 7, 30, 90)
HISTORY_MAX_ROWS = 20_000


def report_history(conn: Connection, days: int, topic: str | None = None) -> list[Any]:
    """`report_hourly` rows (written by `delaysvc pipeline report`) of the last `days`,
    oldest hour first, at most HISTORY_MAX_ROWS."""
    topic_filter = "AND topic = :topic" if topic is not None else ""
    return list(
        conn.execute(
            sql(
                "SELECT hour, topic, level, messages, lateness_p50_ms, lateness_p95_ms, "
                "lateness_p99_ms, lateness_max_ms, duration_p50_ms, duration_p95_ms, "
                "duration_p99_ms, retried, dead FROM delaysvc.report_hourly "
                f"WHERE hour > {store.NOW} - make_interval(days => :days) {topic_filter} "
                "ORDER BY hour, topic, level LIMIT :limit"
            ),
            {"now": None, "days": days, "topic": topic, "limit": HISTORY_MAX_ROWS},
        )
    )
