"""JSON shapes of messages, lanes, topics, dead letters and periodic schedules, shared by the
HTTP API and the CLI's `--json`."""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Any

from delaysvc.config.levels import format_ms
from delaysvc.maintenance.histogram import percentile_bound
from delaysvc.producer.sending import Message
from delaysvc.schema.tables import DURATION_BUCKETS_MS


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def message_json(message: Message, *, full: bool = True, body: bool = False) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": message.id,
        "topic": message.topic,
        "key": message.key,
        "status": message.status,
        "delay_level": message.delay_level,
        "deliver_at": iso(message.deliver_at),
    }
    if message.replaced_id is not None:
        data["replaced_id"] = message.replaced_id
    if full:
        data.update(
            stored_at=iso(message.stored_at),
            delivered_at=iso(message.delivered_at),
            started_at=iso(message.started_at),
            finished_at=iso(message.finished_at),
            attempts=message.attempts,
            priority=message.priority,
            last_error=message.last_error,
            tags=message.tags or [],
            properties=message.properties or {},
        )
    if body:
        if isinstance(message.body, bytes):
            data["body_base64"] = base64.b64encode(message.body).decode()
        else:
            data["body"] = message.body
        data["errors"] = message.errors
    return data


def lane_json(row: Any) -> dict[str, Any]:
    lateness = None
    if row.next_due is not None and row.next_due < row.now:
        lateness = round((row.now - row.next_due).total_seconds() * 1000, 1)
    return {
        "level": row.lane if row.lane else None,
        "lane": "timer" if row.lane == 0 else f"level-{row.lane}",
        "delay": format_ms(row.delay_ms) if row.lane else None,
        "delay_ms": row.delay_ms if row.lane else None,
        "pending": row.pending,
        "schedule_offset": row.schedule_offset,
        "max_offset": row.max_offset,
        "moved_total": row.moved_total,
        "moved_per_s": float(row.moved_per_s) if row.moved_per_s is not None else None,
        "next_due": iso(row.next_due),
        "lateness_ms": lateness,
        "stuck": None
        if row.stuck_error is None
        else {"offset": row.stuck_offset, "error": row.stuck_error, "since": iso(row.stuck_since)},
    }


def topic_json(row: Any, durations: tuple[list[int], float] | None) -> dict[str, Any]:
    """A topic's jobs by state, whether a live worker has its handler (`handled`: false while
    none has reported it for 90 s; its ready jobs wait), and its last hour of handler runs:
    how many per minute and duration percentiles (bucket upper bounds: "p99 <= this"; past
    the last bucket, the longest run)."""
    counts, longest = durations or ([], 0.0)
    return {
        "topic": row.topic,
        "ready": row.ready,
        "running": row.running,
        "retrying": row.retrying,
        "dead": row.dead,
        "paused": row.paused,
        "handled": row.handled,
        "runs_per_minute": round(sum(counts) / 60, 1),
        "duration_p50_ms": percentile_bound(counts, DURATION_BUCKETS_MS, 0.5, longest),
        "duration_p99_ms": percentile_bound(counts, DURATION_BUCKETS_MS, 0.99, longest),
    }


def dead_letter_json(row: Any) -> dict[str, Any]:
    return {
        "id": row.message_id,
        "topic": row.topic,
        "key": row.key,
        "died_at": iso(row.died_at),
        "reason": row.reason,
        "attempts": row.attempts,
        "last_error": row.last_error,
    }


def schedule_json(row: Any) -> dict[str, Any]:
    """A periodic schedule (`periodic_schedule` row)."""
    body = bytes(row.body)
    return {
        "name": row.name,
        "topic": row.topic,
        "schedule": row.cron if row.cron is not None else f"every {format_ms(row.every_ms)}",
        "timezone": row.timezone,
        "on_missed": row.on_missed,
        "declared_in": row.declared_in,
        "paused": row.paused,
        "next_tick": iso(row.next_tick),
        "last_tick": iso(row.last_tick),
        "last_message_id": row.last_message_id,
        **(
            {"body": json.loads(body)}
            if row.body_is_json
            else {"body_base64": base64.b64encode(body).decode()}
        ),
    }


def cap_json(cap: Any) -> dict[str, Any]:
    """A level's or a topic's backlog cap (`delaysvc.config.settings.BacklogCap`)."""
    return {
        "scope": cap.scope,
        "target": cap.target,
        "max_waiting": cap.limit,
        "policy": cap.policy,
    }


def limits_json(item: Any) -> dict[str, Any]:
    """A topic's limits (`delaysvc.worker.limits.TopicLimits`)."""
    return {"topic": item.topic, "max_running": item.max_running, "rate_per_s": item.rate_per_s}
