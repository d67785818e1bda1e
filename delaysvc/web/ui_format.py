"""View models of the dashboard: one dict per table row, the same for the first server-rendered
page and for the JSON the page polls afterwards, so the two can never disagree.

A row is `{"key": ..., "cells": {field: text}, "flags": {name: bool}}`: templates print
`cells`, the page's script copies `cells` into the elements with a matching `data-field` and
shows the elements whose `data-flag` is true.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from delaysvc.config.levels import format_ms
from delaysvc.producer.sending import Message
from delaysvc.schema.tables import LATENESS_BUCKETS_MS, WAITING, lane_name
from delaysvc.serialize import TopicJson
from delaysvc.store.dashboard import LatenessDistribution

BODY_PREVIEW_BYTES = 64 * 1024
CANCELLABLE = (*WAITING, "ready")
# a chart's line breaks where two samples are further apart than this (nothing is drawn for
# the time nobody sampled): two of beat's 10 s stats samples missed (tasks.app.STATS_SECONDS);
# in the History, an hour without a report row
BACKLOG_GAP_S = 3 * 10.0
HISTORY_GAP_S = 1.5 * 3600


def when(value: datetime | None) -> str:
    """Absolute time, UTC, to the millisecond."""
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def seconds_text(seconds: float) -> str:
    """3 significant-ish digits and a unit a person reads at a glance."""
    ms = abs(seconds) * 1000
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    if ms < 3_600_000:
        return f"{int(ms // 60_000)} min {int(ms % 60_000 // 1000)} s"
    if ms < 86_400_000:
        return f"{int(ms // 3_600_000)} h {int(ms % 3_600_000 // 60_000)} min"
    return f"{int(ms // 86_400_000)} d {int(ms % 86_400_000 // 3_600_000)} h"


def relative(value: datetime | None, now: datetime) -> str:
    if value is None:
        return "-"
    delta = (value - now).total_seconds()
    return f"in {seconds_text(delta)}" if delta > 0 else f"{seconds_text(delta)} ago"


def rate_text(per_second: float | None) -> str:
    if per_second is None:
        return "-"
    return f"{per_second:.0f}/s" if per_second >= 10 else f"{per_second:.1f}/s"


def lane_row(row: Any, rate: float | None) -> dict[str, Any]:
    """One lane of `store.lane_stats` with its moved/s."""
    late = None
    if row.next_due is not None and row.next_due < row.now:
        late = (row.now - row.next_due).total_seconds()
    stuck = row.stuck_error is not None
    offset = (
        f"{row.schedule_offset} / {row.max_offset}" if row.lane > 0 else f"{row.moved_total} moved"
    )
    return {
        "key": lane_name(row.lane),
        "ref": str(row.lane),
        "cells": {
            "lane": f"level {row.lane}" if row.lane else "timer",
            "delay": format_ms(row.delay_ms) if row.lane else "any",
            "pending": str(row.pending),
            "next_due": relative(row.next_due, row.now),
            "next_due_at": when(row.next_due),
            "lateness": seconds_text(late) if late is not None else "-",
            "offset": offset,
            "rate": rate_text(rate),
            "state": "STUCK" if stuck else "ok",
            "stuck_error": row.stuck_error or "",
            "stuck_since": f"since {when(row.stuck_since)}" if stuck else "",
        },
        "flags": {"stuck": stuck},
    }


def topic_row(topic: TopicJson) -> dict[str, Any]:
    """A row of the topics table from the API's view of a topic (`web.api.topic_json`)."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"<= {value:,.0f} ms"

    return {
        "key": topic["topic"],
        "ref": topic["topic"],
        "cells": {
            "topic": topic["topic"],
            "ready": str(topic["ready"]),
            "running": str(topic["running"]),
            "retrying": str(topic["retrying"]),
            "dead": str(topic["dead"]),
            "runs": f"{topic['runs_per_minute']:,.1f}",
            "p50": ms(topic["duration_p50_ms"]),
            "p99": ms(topic["duration_p99_ms"]),
            "state": "paused" if topic["paused"] else "active",
            "handler": "yes" if topic["handled"] else "no handler",
        },
        "flags": {"paused": bool(topic["paused"]), "active": not topic["paused"]},
    }


def backlog_chart(samples: list[Any], now: datetime, window: timedelta) -> dict[str, Any]:
    """Series per lane: [[seconds before now, pending], ...], oldest first."""
    series: dict[int, list[list[float]]] = {}
    for sample in samples:
        age = (sample.sampled_at - now).total_seconds()
        series.setdefault(sample.lane, []).append([round(age, 1), int(sample.pending)])
    return {
        "window_s": window.total_seconds(),
        "gap_s": BACKLOG_GAP_S,
        "ticks": [[-60 * m, f"-{m} min"] for m in (60, 45, 30, 15)] + [[0, "now"]],
        "empty": "no samples yet (beat task delaysvc.sample_stats)",
        "series": [
            {"key": lane_name(lane), "points": points, "last": points[-1][1]}
            for lane, points in sorted(series.items(), key=lambda item: (item[0] == 0, item[0]))
        ],
    }


def lateness_chart(dist: LatenessDistribution) -> dict[str, Any]:
    labels = [format_ms(bound) for bound in LATENESS_BUCKETS_MS]  # upper bounds
    labels.append(f">{format_ms(LATENESS_BUCKETS_MS[-1])}")
    p50, p99 = dist.quantile_bound_ms(0.5), dist.quantile_bound_ms(0.99)
    return {
        "labels": labels,
        "counts": list(dist.counts),
        "total": dist.total,
        "summary": (
            f"{dist.total} deliveries; p50 ≤ {p50:g} ms, p99 ≤ {p99:g} ms, max {dist.max_ms:g} ms"
            if dist.total and p50 is not None and p99 is not None and dist.max_ms is not None
            else "no deliveries in the last hour"
        ),
    }


# ---------------------------------------------------------------- messages


def message_cells(row: Any) -> dict[str, str]:
    """A search result (a commit_log row)."""
    return {
        "id": str(row.id),
        "topic": row.topic,
        "key": row.key or "",
        "status": row.status,
        "level": str(row.delay_level) if row.delay_level is not None else "",
        "stored": when(row.stored_at),
        "due": when(row.deliver_ts),
        "finished": when(row.finished_at),
        "attempts": str(row.attempts),
        "error": (row.last_error or "")[:120],
    }


def timeline(message: Message) -> list[dict[str, str]]:
    """What happened to the message, in time order: stored, due, delivered (moved to its topic
    queue), each failed attempt with its error, the last start, and how it finished."""
    events: list[tuple[datetime, int, dict[str, str]]] = []

    def add(at: datetime | None, order: int, label: str, detail: str = "", trace: str = ""):
        if at is not None:
            events.append((at, order, _event(at, label, detail, trace)))

    add(
        message.stored_at,
        0,
        "stored",
        f"level {message.delay_level}" if message.delay_level else "",
    )
    add(message.deliver_at, 1, "due")
    add(message.delivered_at, 2, "delivered", "moved to the topic queue")
    for entry in message.errors:
        at = _parse_time(entry.get("at"))
        add(
            at,
            3,
            f"attempt {entry.get('attempt', '?')} failed",
            str(entry.get("error") or ""),
            str(entry.get("traceback") or ""),
        )
    if message.started_at is not None:
        add(message.started_at, 3, f"attempt {message.attempts} started")
    if message.finished_at is not None:
        # after every attempt, even an error entry stamped a moment later in the same statement
        # (two clock readings in it): sorted and shown at that later time, so the times shown
        # stay in order
        last = max([message.finished_at, *(at for at, order, _ in events if order == 3)])
        ran = message.duration_ms is not None and message.status != "cancelled"
        detail = f"handler ran {message.duration_ms} ms" if ran else ""
        events.append((last, 9, _event(last, message.status, detail)))
    events.sort(key=lambda event: (event[0], event[1]))
    return [event for _, _, event in events]


def _event(at: datetime, label: str, detail: str = "", trace: str = "") -> dict[str, str]:
    return {"at": when(at), "label": label, "detail": detail, "trace": trace}


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def body_text(message: Message) -> str:
    """The body as a person reads it: indented JSON, or a hex dump of the first bytes."""
    body = message.body
    if isinstance(body, bytes):
        shown = body[:BODY_PREVIEW_BYTES]
        text = f"{len(body)} bytes (not JSON):\n" + hex_dump(shown)
    else:
        text = json.dumps(body, indent=2, ensure_ascii=False, sort_keys=True)
    if len(text) > BODY_PREVIEW_BYTES:
        return text[:BODY_PREVIEW_BYTES] + f"\n… ({len(text) - BODY_PREVIEW_BYTES} more characters)"
    return text


def hex_dump(data: bytes, width: int = 16) -> str:
    """`00000010  6865 6c6c 6f0a`: offset, then the bytes in pairs, `width` per line."""
    lines = []
    for start in range(0, len(data), width):
        chunk = data[start : start + width]
        pairs = " ".join(chunk[i : i + 2].hex() for i in range(0, len(chunk), 2))
        lines.append(f"{start:08x}  {pairs}")
    return "\n".join(lines)


def message_view(message: Message) -> dict[str, Any]:
    return {
        "id": message.id,
        "cells": {
            "status": message.status,
            "attempts": str(message.attempts),
            "last_error": message.last_error or "",
        },
        "flags": {"cancellable": message.status in CANCELLABLE, "dead": message.status == "dead"},
        "timeline": timeline(message),
        "replaced_by": _replaced_by(message),
    }


def _replaced_by(message: Message) -> int | None:
    """The message that replaced this one (`on_duplicate`), as its last error names it."""
    found = re.fullmatch(r"replaced by message (\d+)", message.last_error or "")
    return int(found.group(1)) if found and message.status == "cancelled" else None


# ---------------------------------------------------------------- history

HISTORY_TABLE_ROWS = 300
_TICK_DAYS = {1: 0.25, 7: 1, 30: 5, 90: 15}  # days between axis labels, per window


def _ms_text(value: float | None) -> str:
    return "-" if value is None else seconds_text(value / 1000)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _ago(seconds: float, step: float) -> str:
    """An axis label, in hours when the labels are less than a day apart."""
    return f"-{seconds / 86_400:g} d" if step >= 86_400 else f"-{seconds / 3600:g} h"


def history_row(row: Any) -> dict[str, Any]:
    """One (hour, topic, level) row of `report_hourly`."""
    return {
        "key": f"{row.hour.isoformat()}|{row.topic}|{row.level}",
        "ref": row.topic,
        "cells": {
            "hour": row.hour.astimezone(UTC).strftime("%Y-%m-%d %H:00"),
            "topic": row.topic,
            "level": "timer" if row.level == 0 else str(row.level),
            "messages": str(row.messages),
            "late_p50": _ms_text(row.lateness_p50_ms),
            "late_p95": _ms_text(row.lateness_p95_ms),
            "late_p99": _ms_text(row.lateness_p99_ms),
            "late_max": _ms_text(row.lateness_max_ms),
            "run_p50": _ms_text(row.duration_p50_ms),
            "run_p99": _ms_text(row.duration_p99_ms),
            "retried": _share(row.retried, row.messages),
            "dead": _share(row.dead, row.messages),
        },
        "flags": {},
    }


def history_view(rows: list[Any], now: datetime, days: int) -> dict[str, Any]:
    """Three charts per topic and hour (messages; worst level's lateness p99; worst level's
    handler p99) and the newest rows as a table."""
    window = timedelta(days=days).total_seconds()
    step = _TICK_DAYS.get(days, days / 4) * 86_400
    ago = [window - n * step for n in range(round(window / step))]
    ticks: list[list[Any]] = [[-s, _ago(s, step)] for s in ago if s > 0] + [[0, "now"]]
    per_topic: dict[str, dict[str, dict[datetime, float]]] = {}
    for row in rows:
        charts = per_topic.setdefault(row.topic, {"messages": {}, "lateness": {}, "duration": {}})
        charts["messages"][row.hour] = charts["messages"].get(row.hour, 0) + row.messages
        for name, value in (("lateness", row.lateness_p99_ms), ("duration", row.duration_p99_ms)):
            if value is not None:
                charts[name][row.hour] = max(charts[name].get(row.hour, 0.0), value)

    def chart(name: str, empty: str, unit: str) -> dict[str, Any]:
        series = []
        for topic, charts in sorted(per_topic.items()):
            points = [
                [round((hour - now).total_seconds()), round(value, 2)]
                for hour, value in sorted(charts[name].items())
            ]
            if points:
                series.append({"key": topic, "points": points, "last": f"{points[-1][1]:g}{unit}"})
        return {
            "window_s": window,
            "gap_s": HISTORY_GAP_S,
            "ticks": ticks,
            "empty": empty,
            "series": series,
        }

    nothing = "no report yet: run `delaysvc pipeline report`"
    return {
        "messages": chart("messages", nothing, ""),
        "lateness": chart("lateness", nothing, " ms"),
        "duration": chart("duration", "no handler durations in the report", " ms"),
        "rows": [history_row(row) for row in reversed(rows[-HISTORY_TABLE_ROWS:])],
        "total_rows": len(rows),
    }


def schedule_row(row: Any, now: datetime) -> dict[str, Any]:
    """One periodic schedule for the Schedules page."""
    spec = row.cron if row.cron is not None else f"every {format_ms(row.every_ms)}"
    return {
        "name": row.name,
        "spec": spec,
        "timezone": row.timezone,
        "topic": row.topic,
        "on_missed": row.on_missed,
        "declared_in": row.declared_in,
        "paused": row.paused,
        "next_tick": row.next_tick,
        "next_in": "paused" if row.paused else relative(row.next_tick, now),
        "last_tick": row.last_tick,
        "last_ago": relative(row.last_tick, now),
        "last_message_id": row.last_message_id,
    }
