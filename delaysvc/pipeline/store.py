"""Every statement the pipeline runs: archive ranges, checksums and batched deletes, run
records, the report's upsert and bulk scheduling's staged insert. Spark reads rows over JDBC
with the queries built here too (`archive_query`, `finished_query`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from psycopg.errors import UniqueViolation
from sqlalchemy import Connection, Engine

from delaysvc.config.validation import validate_topic
from delaysvc.db.names import LOCK_KEY, lock_name, qualify, sql
from delaysvc.errors import DelaysvcError, ValidationError
from delaysvc.store.shared import _DUE, _ENQUEUE_FROM, _NEXT_OFFSET, _PLACED_LANE

_FINISHED_SQL = "c.status IN ('succeeded', 'dead', 'cancelled')"
# A 60-bit hash of the id: the first 15 hex digits of md5(id as decimal text). Spark computes
# the same (`archive.id_hash`), so a sum of it checks that exactly the same ids are on both
# sides, which a sum of plain ids does not ({1, 4} and {2, 3} agree).
ID_HASH_SQL = "('x' || left(md5(c.id::text), 15))::bit(60)::bigint"
_ARCHIVE_COLUMNS = (
    "c.id, c.topic, c.key, c.tags, c.body, c.body_is_json, c.properties::text AS properties, "
    "c.delay_level, c.priority, c.lane, c.queue_offset, c.status, c.stored_at, c.deliver_ts, "
    "c.delivered_at, "
    "c.started_at, c.finished_at, c.attempts, c.duration_ms, c.last_error, "
    "c.errors::text AS errors, d.reason AS dead_reason, d.died_at"
)
_REPORT_COLUMNS = (
    "c.id, c.topic, c.status, c.delay_level, c.deliver_ts, c.delivered_at, c.finished_at, "
    "c.attempts, c.duration_ms"
)


def _archivable(since: datetime | None, cutoff: datetime) -> str:
    """The archivable condition, on the history, with the bounds as literals (JDBC subqueries
    take no parameters; the bounds are datetimes we computed, never user text). Literal
    bounds let PostgreSQL read only the partitions they cover."""
    condition = f"c.finished_at < TIMESTAMPTZ '{cutoff.isoformat()}'"
    if since is not None:
        condition += f" AND c.finished_at >= TIMESTAMPTZ '{since.isoformat()}'"
    return condition


def transaction_now(conn: Connection) -> datetime:
    """The transaction's start time (`now()`): the same for every statement in it."""
    return conn.execute(sql("SELECT now()")).scalar_one()


def try_lock_archive(conn: Connection) -> bool:
    """Session-level: held until unlock or the connection closes (a killed run frees it)."""
    return bool(
        conn.execute(
            sql(f"SELECT pg_try_advisory_lock({LOCK_KEY})"), {"lock": lock_name("archive")}
        ).scalar_one()
    )


def unlock_archive(conn: Connection) -> None:
    conn.execute(sql(f"SELECT pg_advisory_unlock({LOCK_KEY})"), {"lock": lock_name("archive")})


def archivable_range(
    conn: Connection, since: datetime | None, cutoff: datetime
) -> tuple[int | None, int | None]:
    row = conn.execute(
        sql(
            "SELECT min(c.id), max(c.id) FROM delaysvc.message_history c "
            f"WHERE {_archivable(since, cutoff)}"
        )
    ).one()
    return row[0], row[1]


def archive_query(low: int, high: int, since: datetime | None, cutoff: datetime) -> str:
    """The archivable rows in [low, high] with their dead letter, as a JDBC subquery."""
    return qualify(
        f"(SELECT {_ARCHIVE_COLUMNS} FROM delaysvc.message_history c "
        "LEFT JOIN delaysvc.dead_letter d ON d.message_id = c.id "
        f"WHERE c.id BETWEEN {int(low)} AND {int(high)} AND {_archivable(since, cutoff)}) "
        "AS archivable"
    )


def finished_query() -> str:
    """Every finished message still in PostgreSQL (the report's live half), as a subquery."""
    return qualify(
        f"(SELECT {_REPORT_COLUMNS} FROM delaysvc.message c WHERE {_FINISHED_SQL}) AS finished"
    )


def finished_id_range(conn: Connection) -> tuple[int | None, int | None]:
    row = conn.execute(
        sql(f"SELECT min(c.id), max(c.id) FROM delaysvc.message c WHERE {_FINISHED_SQL}")
    ).one()
    return row[0], row[1]


def range_checksum(
    conn: Connection, low: int, high: int, since: datetime | None, cutoff: datetime
) -> tuple[int, int]:
    """(rows, sum of id hashes) of the archivable rows in [low, high]."""
    row = conn.execute(
        sql(
            f"SELECT count(*), COALESCE(sum({ID_HASH_SQL}::numeric), 0) "
            "FROM delaysvc.message_history c "
            f"WHERE c.id BETWEEN :low AND :high AND {_archivable(since, cutoff)}"
        ),
        {"low": low, "high": high},
    ).one()
    return int(row[0]), int(row[1])


def partition_checksum(conn: Connection, partition: str) -> tuple[int, int]:
    """(rows, sum of id hashes) of a whole day of history."""
    row = conn.execute(
        sql(
            f"SELECT count(*), COALESCE(sum({ID_HASH_SQL}::numeric), 0) FROM delaysvc.{partition} c"
        )
    ).one()
    return int(row[0]), int(row[1])


def delete_archived(
    conn: Connection, ids: Sequence[int], since: datetime | None, cutoff: datetime
) -> int:
    """Delete these archived messages (and their dead letters) from the history, only while
    they are still there: a dead letter redriven since has gone back to commit_log."""
    params = {"ids": list(ids)}
    conn.execute(
        sql(
            "DELETE FROM delaysvc.dead_letter d USING delaysvc.message_history c "
            f"WHERE d.message_id = c.id AND c.id = ANY(:ids) AND {_archivable(since, cutoff)}"
        ),
        params,
    )
    return conn.execute(
        sql(
            "DELETE FROM delaysvc.message_history c "
            f"WHERE c.id = ANY(:ids) AND {_archivable(since, cutoff)}"
        ),
        params,
    ).rowcount


# ---------------------------------------------------------------- run records


def start_run(
    conn: Connection, kind: str, params: dict[str, Any], low: int | None, high: int | None
) -> int:
    return conn.execute(
        sql(
            "INSERT INTO delaysvc.pipeline_run (kind, params, range_from_id, range_to_id) "
            "VALUES (:kind, CAST(:params AS jsonb), :low, :high) RETURNING id"
        ),
        {"kind": kind, "params": json.dumps(params), "low": low, "high": high},
    ).scalar_one()


def unfinished_runs(conn: Connection, kind: str) -> Sequence[Any]:
    return list(
        conn.execute(
            sql(
                "SELECT id, params, range_from_id, range_to_id, output_path, checksum "
                "FROM delaysvc.pipeline_run WHERE kind = :kind AND status = 'running' ORDER BY id"
            ),
            {"kind": kind},
        )
    )


def run_checksum(conn: Connection, run_id: int) -> str:
    return conn.execute(
        sql("SELECT checksum FROM delaysvc.pipeline_run WHERE id = :id"), {"id": run_id}
    ).scalar_one()


def verified_archive_folders(conn: Connection) -> list[str]:
    """Folders of archive runs whose copy was verified (the only ones that count)."""
    return list(
        conn.execute(
            sql(
                "SELECT output_path FROM delaysvc.pipeline_run WHERE kind = 'archive' "
                "AND status <> 'failed' AND checksum IS NOT NULL AND output_path IS NOT NULL "
                "ORDER BY id"
            )
        ).scalars()
    )


_RUN_FIELDS = {
    "status",
    "rows_read",
    "rows_written",
    "rows_rejected",
    "checksum",
    "output_path",
    "error",
}


def update_run(conn: Connection, run_id: int, *, finished: bool = False, **values: Any) -> None:
    unknown = set(values) - _RUN_FIELDS
    if unknown:
        raise ValueError(f"not a pipeline_run field: {sorted(unknown)}")
    sets = [f"{k} = :{k}" for k in values]
    if finished:
        sets.append("finished_at = now()")
    conn.execute(
        sql(f"UPDATE delaysvc.pipeline_run SET {', '.join(sets)} WHERE id = :id"),
        {"id": run_id, **values},
    )


def merge_run_params(conn: Connection, run_id: int, params: dict[str, Any]) -> None:
    conn.execute(
        sql("UPDATE delaysvc.pipeline_run SET params = params || CAST(:p AS jsonb) WHERE id = :id"),
        {"id": run_id, "p": json.dumps(params)},
    )


# ---------------------------------------------------------------- report


_REPORT_FIELDS = (
    "hour, topic, level, messages, lateness_p50_ms, lateness_p95_ms, lateness_p99_ms, "
    "lateness_max_ms, duration_p50_ms, duration_p95_ms, duration_p99_ms, retried, dead, run_id"
)


def upsert_report(conn: Connection, rows: Sequence[dict[str, Any]], run_id: int) -> None:
    """Insert or replace one row per (hour, topic, level)."""
    if not rows:
        return
    names = [n.strip() for n in _REPORT_FIELDS.split(",")]
    updates = ", ".join(f"{n} = EXCLUDED.{n}" for n in names[3:])
    conn.execute(
        sql(
            f"INSERT INTO delaysvc.report_hourly ({_REPORT_FIELDS}) "
            f"VALUES ({', '.join(':' + n for n in names)}) "
            f"ON CONFLICT (hour, topic, level) DO UPDATE SET {updates}"
        ),
        [{**row, "run_id": run_id} for row in rows],
    )


# ---------------------------------------------------------------- bulk scheduling

_STAGE = """CREATE TEMP TABLE IF NOT EXISTS pipeline_bulk_stage (
    topic text, key text, tags text[], body bytea, body_is_json boolean, properties jsonb,
    delay_level smallint, lane smallint, delay_ms bigint, deliver_at timestamptz
) ON COMMIT DELETE ROWS"""
_STAGE_COLUMNS = (
    "topic, key, tags, body, body_is_json, properties, delay_level, lane, delay_ms, deliver_at"
)
# The service's own insert (store.INSERT_STAGED) fed from a staging table filled by COPY:
# the same lanes (a level only if the database agrees on its delay), offsets, key rule,
# database-clock deliver_ts and lane counts, and the same enqueue
# fragment, but no parameter arrays and no rows sent back. Rows are taken in (topic, key)
# order so parallel partitions holding the same keys lock them in the same order, and a key's
# rows in the order they were COPYed (`ctid`: the staging table is emptied before each COPY,
# which fills it page after page), so that the first row of a key repeated in a batch is the one
# stored, as in a `send_batch` (the sort alone kept either: 2,269 of 5,000 keys kept the later).
_INSERT_STAGED = f"""
WITH msg AS (
    INSERT INTO delaysvc.commit_log (topic, key, tags, body, body_is_json, properties, delay_level,
        lane, queue_offset, status, stored_at, deliver_ts, delivered_at)
    SELECT topic, key, tags, body, body_is_json, properties, delay_level, placed.lane,
        {_NEXT_OFFSET.format(lane="placed.lane")},
        CASE WHEN placed.lane < 0 THEN 'ready' ELSE 'scheduled' END,
        statement_timestamp(),
        {_DUE.format(deliver_at="deliver_at", delay_ms="delay_ms")},
        CASE WHEN placed.lane < 0 THEN statement_timestamp() END
    FROM pipeline_bulk_stage b
    CROSS JOIN LATERAL (SELECT CAST({
    _PLACED_LANE.format(lane="b.lane", delay_ms="b.delay_ms")
} AS smallint) AS lane) placed
    ORDER BY topic, key, b.ctid
    {{on_conflict}}
    RETURNING id, topic, lane, queue_offset, deliver_ts, priority
){_ENQUEUE_FROM.format(src="msg")}
SELECT count(*) FROM msg
"""
# A batch with no key held yet is stored by a plain insert: ON CONFLICT's speculative
# insertion (an index probe before each row, a confirmation record after it) costs a quarter
# of the insert. A key already held makes the plain insert fail on the key's unique index;
# the batch is then stored again, from the same staging rows, by the insert that skips them.
INSERT_STAGED_NEW = _INSERT_STAGED.format(on_conflict="")
INSERT_STAGED_SKIPPING_HELD_KEYS = _INSERT_STAGED.format(
    on_conflict="ON CONFLICT (topic, key) WHERE key IS NOT NULL AND finished_at IS NULL DO NOTHING"
)
KEY_INDEX = "uq_commit_log_topic_key"


COPY_COLUMNS = (
    "topic, key, tags, properties, delay_level, lane, delay_ms, deliver_at, body_is_json, body"
)


def insert_copy_text(conn: Connection, rows: str, *, keys_may_be_held: bool = True) -> int:
    """Store validated messages, given as COPY text lines of `COPY_COLUMNS`, in the caller's
    transaction: COPY into the staging table, then one set-based insert (the service's key
    rule, lanes, offsets and database-clock deliver_ts). -> how many were created (the rest
    hold a key an unfinished message of their topic already holds).

    `keys_may_be_held=False` tries the plain insert first (inside a savepoint), which is
    cheaper when no key is held and falls back to the skipping insert when one is."""
    driver = conn.connection.driver_connection
    cursor = driver.cursor()  # type: ignore[union-attr]
    with cursor:
        cursor.execute("SET LOCAL work_mem = '64MB'")  # the (topic, key) sort stays in memory
        cursor.execute(_STAGE)
        cursor.execute("TRUNCATE pipeline_bulk_stage")  # a second batch in one transaction
        with cursor.copy(f"COPY pipeline_bulk_stage ({COPY_COLUMNS}) FROM STDIN") as copy:
            copy.write(rows)
        if not keys_may_be_held:
            try:
                with driver.transaction():  # type: ignore[union-attr]  # a savepoint
                    cursor.execute(qualify(INSERT_STAGED_NEW))
                    return _count(cursor.fetchone())
            except UniqueViolation as exc:
                if exc.diag.constraint_name != KEY_INDEX:
                    raise
        cursor.execute(qualify(INSERT_STAGED_SKIPPING_HELD_KEYS))
        return _count(cursor.fetchone())


def _count(row: Any) -> int:
    return int(row[0]) if row else 0


# ---------------------------------------------------------------- bulk batches


def claim_bulk_batch(
    conn: Connection, run: str, first_rid: int, last_rid: int, rows: int
) -> int | None:
    """Record, in the caller's transaction, that `run` stores its batch of `rows` rows whose
    ids run from `first_rid` to `last_rid`. -> None when no attempt stored it yet (store it
    now), else how many messages the attempt that did created. An attempt still storing it
    in another session holds this row's key: this one waits for it to end. A batch with the
    same first row but other rows than the stored one is refused: storing it could store
    some of its rows a second time."""
    claimed = conn.execute(
        sql(
            "INSERT INTO delaysvc.bulk_batch (run, first_rid, last_rid, rows) "
            "VALUES (:run, :first, :last, :rows) ON CONFLICT DO NOTHING RETURNING 1"
        ),
        {"run": run, "first": first_rid, "last": last_rid, "rows": rows},
    ).first()
    if claimed:
        return None
    held = conn.execute(
        sql(
            "SELECT last_rid, rows, created FROM delaysvc.bulk_batch "
            "WHERE run = :run AND first_rid = :first"
        ),
        {"run": run, "first": first_rid},
    ).one()
    if (held.last_rid, held.rows) != (last_rid, rows):
        raise DelaysvcError(
            f"bulk-schedule run {run}: a task run again made its batch from row {first_rid} "
            f"of {rows} rows up to row {last_rid}, its first attempt stored {held.rows} up to "
            f"row {held.last_rid}; refused, as it could store some rows twice"
        )
    return int(held.created or 0)


def record_bulk_created(conn: Connection, run: str, first_rid: int, created: int) -> None:
    conn.execute(
        sql(
            "UPDATE delaysvc.bulk_batch SET created = :created "
            "WHERE run = :run AND first_rid = :first"
        ),
        {"run": run, "first": first_rid, "created": created},
    )


BULK_BATCHES_KEPT = "7 days"
"""A run that ended leaves no batch rows; one that crashed leaves them this long."""


def forget_bulk_run(conn: Connection, run: str) -> None:
    """The run ended: drop its batches, and those of runs that crashed long ago."""
    conn.execute(
        sql(
            "DELETE FROM delaysvc.bulk_batch WHERE run = :run "
            f"OR stored_at < now() - interval '{BULK_BATCHES_KEPT}'"
        ),
        {"run": run},
    )


# ---------------------------------------------------------------- reading the report

REPORT_ROW_COLUMNS = (
    "hour",
    "topic",
    "level",
    "messages",
    "lateness_p50_ms",
    "lateness_p95_ms",
    "lateness_p99_ms",
    "lateness_max_ms",
    "duration_p50_ms",
    "duration_p95_ms",
    "duration_p99_ms",
    "retried",
    "dead",
    "retry_rate",
    "dead_rate",
    "run_id",
)
MAX_REPORT_HOURS = 24 * 400


def recent_report_rows(
    engine_or_conn: Engine | Connection, hours: int, topic: str | None = None
) -> list[dict[str, Any]]:
    """`report_hourly` rows whose hour began within the last `hours` (database clock), oldest
    first, ordered by (hour, topic, level), one dict per row with REPORT_ROW_COLUMNS:
    `level` -1 is the timer lane; lateness and duration percentiles in ms (None when the
    hour had no delivered or no run message); `retry_rate` = retried / messages and
    `dead_rate` = dead / messages (0..1). Reads the primary key's range only."""
    if isinstance(hours, bool) or not isinstance(hours, int) or not 1 <= hours <= MAX_REPORT_HOURS:
        raise ValidationError(
            "hours", f"must be a whole number 1-{MAX_REPORT_HOURS}, got {hours!r}"
        )
    if topic is not None:
        validate_topic(topic)
    query = sql(
        "SELECT hour, topic, level, messages, lateness_p50_ms, lateness_p95_ms, "
        "lateness_p99_ms, lateness_max_ms, duration_p50_ms, duration_p95_ms, duration_p99_ms, "
        "retried, dead, retried::float8 / NULLIF(messages, 0) AS retry_rate, "
        "dead::float8 / NULLIF(messages, 0) AS dead_rate, run_id FROM delaysvc.report_hourly "
        "WHERE hour >= date_trunc('hour', now()) - make_interval(hours => :hours - 1) "
        + ("AND topic = :topic " if topic is not None else "")
        + "ORDER BY hour, topic, level"
    )
    params = {"hours": hours, "topic": topic}
    if isinstance(engine_or_conn, Engine):
        with engine_or_conn.connect() as conn:
            rows = conn.execute(query, params).mappings().all()
    else:
        rows = engine_or_conn.execute(query, params).mappings().all()
    return [dict(row) for row in rows]
