"""The pipeline's statements (archive ranges, batched deletes, run records). Spark reads the
rows themselves; everything that writes goes through here."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

FINISHED = ("succeeded", "dead", "cancelled")
ARCHIVE_COLUMNS = (
    "id, topic, key, status, delay_level, stored_at, deliver_ts, delivered_at, started_at, "
    "finished_at, attempts, duration_ms, last_error, body, body_is_json"
)
_FINISHED_BEFORE = (
    "status IN ('succeeded', 'dead', 'cancelled') AND finished_at < CAST(:cutoff AS timestamptz)"
)


def database_now(conn: Connection) -> datetime:
    return conn.execute(text("SELECT now()")).scalar_one()


def archivable_range(conn: Connection, cutoff: datetime) -> tuple[int | None, int | None]:
    row = conn.execute(
        text(f"SELECT min(id), max(id) FROM commit_log WHERE {_FINISHED_BEFORE}"),
        {"cutoff": cutoff},
    ).one()
    return row[0], row[1]


def range_rows(conn: Connection, low: int, high: int, cutoff: datetime) -> list[Any]:
    """The archivable rows with ids in [low, high]: one partition of an archive read."""
    return list(
        conn.execute(
            text(
                f"SELECT {ARCHIVE_COLUMNS} FROM commit_log "
                f"WHERE id BETWEEN :low AND :high AND {_FINISHED_BEFORE} ORDER BY id"
            ),
            {"low": low, "high": high, "cutoff": cutoff},
        )
    )


def range_checksum(conn: Connection, low: int, high: int, cutoff: datetime) -> tuple[int, int]:
    """(rows, sum of ids) of the archivable rows in [low, high]."""
    row = conn.execute(
        text(
            "SELECT count(*), COALESCE(sum(id), 0) FROM commit_log "
            f"WHERE id BETWEEN :low AND :high AND {_FINISHED_BEFORE}"
        ),
        {"low": low, "high": high, "cutoff": cutoff},
    ).one()
    return int(row[0]), int(row[1])


def delete_archived(conn: Connection, low: int, high: int, cutoff: datetime) -> int:
    """Delete one batch of archived rows (and their dead letters); only rows that are still
    finished and old, so a message redriven meanwhile stays."""
    conn.execute(
        text(
            "DELETE FROM dead_letter d USING commit_log c WHERE d.message_id = c.id "
            "AND c.id BETWEEN :low AND :high AND c.status IN ('succeeded', 'dead', 'cancelled') "
            "AND c.finished_at < CAST(:cutoff AS timestamptz)"
        ),
        {"low": low, "high": high, "cutoff": cutoff},
    )
    return conn.execute(
        text(f"DELETE FROM commit_log WHERE id BETWEEN :low AND :high AND {_FINISHED_BEFORE}"),
        {"low": low, "high": high, "cutoff": cutoff},
    ).rowcount


def start_run(
    conn: Connection, kind: str, params: dict[str, Any], low: int | None, high: int | None
) -> int:
    return conn.execute(
        text(
            "INSERT INTO pipeline_run (kind, params, range_from_id, range_to_id) "
            "VALUES (:kind, CAST(:params AS jsonb), :low, :high) RETURNING id"
        ),
        {"kind": kind, "params": json.dumps(params), "low": low, "high": high},
    ).scalar_one()


def unfinished_runs(conn: Connection, kind: str) -> Sequence[Any]:
    return list(
        conn.execute(
            text(
                "SELECT id, params, range_from_id, range_to_id, output_path, checksum "
                "FROM pipeline_run WHERE kind = :kind AND status = 'running' ORDER BY id"
            ),
            {"kind": kind},
        )
    )


def update_run(conn: Connection, run_id: int, **values: Any) -> None:
    allowed = {
        "status",
        "rows_read",
        "rows_written",
        "rows_rejected",
        "checksum",
        "output_path",
        "error",
        "finished",
    }
    assert set(values) <= allowed, set(values) - allowed
    sets = [f"{k} = :{k}" for k in values if k != "finished"]
    if values.pop("finished", False):
        sets.append("finished_at = now()")
    conn.execute(
        text(f"UPDATE pipeline_run SET {', '.join(sets)} WHERE id = :id"),
        {"id": run_id, **values},
    )


def upsert_report(conn: Connection, rows: Sequence[dict[str, Any]], run_id: int) -> None:
    if not rows:
        return
    conn.execute(
        text(
            "INSERT INTO report_hourly (hour, topic, level, messages, lateness_p50_ms, "
            "lateness_p95_ms, lateness_p99_ms, lateness_max_ms, duration_p50_ms, "
            "duration_p95_ms, duration_p99_ms, retried, dead, run_id) VALUES (:hour, :topic, "
            ":level, :messages, :lateness_p50_ms, :lateness_p95_ms, :lateness_p99_ms, "
            ":lateness_max_ms, :duration_p50_ms, :duration_p95_ms, :duration_p99_ms, :retried, "
            ":dead, :run_id) ON CONFLICT (hour, topic, level) DO UPDATE SET "
            "messages = EXCLUDED.messages, lateness_p50_ms = EXCLUDED.lateness_p50_ms, "
            "lateness_p95_ms = EXCLUDED.lateness_p95_ms, "
            "lateness_p99_ms = EXCLUDED.lateness_p99_ms, "
            "lateness_max_ms = EXCLUDED.lateness_max_ms, "
            "duration_p50_ms = EXCLUDED.duration_p50_ms, "
            "duration_p95_ms = EXCLUDED.duration_p95_ms, "
            "duration_p99_ms = EXCLUDED.duration_p99_ms, retried = EXCLUDED.retried, "
            "dead = EXCLUDED.dead, run_id = EXCLUDED.run_id"
        ),
        [{**row, "run_id": run_id} for row in rows],
    )
