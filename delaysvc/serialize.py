"""JSON shapes of messages, lanes, topics, dead letters, periodic schedules, caps and limits,
shared by the HTTP API and the CLI's `--json`.

Each shape is a TypedDict that its builder returns, so mypy checks every builder against it,
and the OpenAPI document's schemas are generated from the same types (`delaysvc.web.openapi`,
through pydantic): the answers, their types and the document cannot say different things.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from datetime import datetime
from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, WithJsonSchema, with_config

# pydantic reads TypedDicts from typing_extensions only, before Python 3.12
from typing_extensions import TypedDict

from delaysvc.config.levels import format_ms
from delaysvc.config.settings import BacklogCap, CapPolicy
from delaysvc.maintenance.histogram import percentile_bound
from delaysvc.maintenance.periodic import OnMissed
from delaysvc.producer.sending import Message
from delaysvc.schema.tables import DURATION_BUCKETS_MS, STATUSES, lane_name
from delaysvc.worker.limits import TopicLimits

Time = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]
"""An ISO 8601 time with its UTC offset (`iso()`)."""
Status = Annotated[str, WithJsonSchema({"type": "string", "enum": list(STATUSES)})]
ANSWER = ConfigDict(extra="forbid")
"""An answer holds the fields its type names and no others (the document says so too)."""


@with_config(ANSWER)
class SentMessageJson(TypedDict):
    """A message as a send answers it."""

    id: int
    topic: str
    key: str | None
    status: Status
    delay_level: int | None
    deliver_at: Time | None
    replaced_id: NotRequired[
        Annotated[
            int, Field(description="the message this send replaced (on_duplicate), now cancelled")
        ]
    ]


@with_config(ANSWER)
class SentInBatchJson(SentMessageJson):
    """A message of a batch as the batch answers it."""

    created: Annotated[bool, Field(description="false: the unfinished message with this key")]


@with_config(ANSWER)
class MessageJson(SentMessageJson):
    """A message and its timeline."""

    stored_at: Time | None
    delivered_at: Time | None
    started_at: Time | None
    finished_at: Time | None
    attempts: int
    priority: int
    last_error: str | None
    tags: list[str]
    properties: dict[str, str]


class MessageWithBodyJson(MessageJson):
    """A message with its body (JSON, else base64) and its errors: the CLI's `get --json`."""

    body: NotRequired[Any]
    body_base64: NotRequired[str]
    errors: list[dict[str, Any]]


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def sent_message_json(message: Message, deliver_at: str | None = None) -> SentMessageJson:
    """`message` as a send answers it; `deliver_at`: its due time written already."""
    data: SentMessageJson = {
        "id": message.id,
        "topic": message.topic,
        "key": message.key,
        "status": message.status,
        "delay_level": message.delay_level,
        "deliver_at": deliver_at or iso(message.deliver_at),
    }
    if message.replaced_id is not None:
        data["replaced_id"] = message.replaced_id
    return data


def sent_batch_json(messages: Iterable[Message]) -> list[SentInBatchJson]:
    """A batch's messages as its send answers them, each due time written once: a batch's
    messages share a few (those sent with one delay share one)."""
    times: dict[datetime, str] = {}
    sent: list[SentInBatchJson] = []
    for message in messages:
        due = message.deliver_at
        deliver_at = times.get(due) or times.setdefault(due, due.isoformat())
        sent.append({**sent_message_json(message, deliver_at), "created": message.created})
    return sent


def message_json(message: Message, *, body: bool = False) -> MessageJson:
    """`message` and its timeline; with `body`, its body and errors too
    (`MessageWithBodyJson`)."""
    data: MessageJson = {
        **sent_message_json(message),
        "stored_at": iso(message.stored_at),
        "delivered_at": iso(message.delivered_at),
        "started_at": iso(message.started_at),
        "finished_at": iso(message.finished_at),
        "attempts": message.attempts,
        "priority": message.priority,
        "last_error": message.last_error,
        "tags": message.tags or [],
        "properties": message.properties or {},
    }
    if not body:
        return data
    full: MessageWithBodyJson = {**data, "errors": message.errors}
    if isinstance(message.body, bytes):
        full["body_base64"] = base64.b64encode(message.body).decode()
    else:
        full["body"] = message.body
    return full


@with_config(ANSWER)
class StuckHeadJson(TypedDict):
    """A lane's head that failed to move, and why: it waits for an operator. A token limited
    to topics reads a fixed `error` (a lane is every topic's; its error may name another
    topic's message)."""

    offset: int
    error: str
    since: Time | None


@with_config(ANSWER)
class LaneJson(TypedDict):
    """A delay level's lane, or the timer lane (`level` null)."""

    level: int | None
    lane: str
    delay: str | None
    delay_ms: int | None
    pending: int
    schedule_offset: int
    max_offset: int | None
    moved_total: int
    moved_per_s: float | None
    next_due: Time | None
    lateness_ms: float | None
    stuck: StuckHeadJson | None


HIDDEN_STUCK_ERROR = "the lane's head cannot be moved; a token of every topic shows why"
"""A stuck lane's error as a token limited to topics reads it: a lane is every topic's, and
its error may be about another topic's message."""


def lane_json(row: Any, *, every_topic: bool = True) -> LaneJson:
    """`every_topic`: for a reader of every topic (else a stuck head's error is not shown)."""
    lateness = None
    if row.next_due is not None and row.next_due < row.now:
        lateness = round((row.now - row.next_due).total_seconds() * 1000, 1)
    return {
        "level": row.lane if row.lane else None,
        "lane": lane_name(row.lane),
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
        else {
            "offset": row.stuck_offset,
            "error": row.stuck_error if every_topic else HIDDEN_STUCK_ERROR,
            "since": iso(row.stuck_since),
        },
    }


@with_config(ANSWER)
class TopicJson(TypedDict):
    """A topic's jobs by state, whether a live worker has its handler (`handled`: false while
    none has reported it for 90 s; its ready jobs wait), and its last hour of handler runs:
    how many per minute and duration percentiles (bucket upper bounds: "p99 <= this"; past
    the last bucket, the longest run; null: no run)."""

    topic: str
    ready: int
    running: int
    retrying: int
    dead: int
    paused: bool
    handled: bool
    runs_per_minute: float
    duration_p50_ms: float | None
    duration_p99_ms: float | None


def topic_json(row: Any, durations: tuple[list[int], float] | None) -> TopicJson:
    """A topic's jobs by state, whether a live worker has its handler, and its last hour of
    handler runs (`TopicJson`)."""
    counts, longest = durations or ([], 0.0)
    data: TopicJson = {
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
    return data


@with_config(ANSWER)
class DeadLetterJson(TypedDict):
    """A dead letter: its message, when and why it died (`reason`), after how many attempts,
    and the handler's last error."""

    id: int
    topic: str
    key: str | None
    died_at: Time | None
    reason: str
    attempts: int
    last_error: str | None


def dead_letter_json(row: Any) -> DeadLetterJson:
    return {
        "id": row.message_id,
        "topic": row.topic,
        "key": row.key,
        "died_at": iso(row.died_at),
        "reason": row.reason,
        "attempts": row.attempts,
        "last_error": row.last_error,
    }


@with_config(ANSWER)
class ScheduleJson(TypedDict):
    """A periodic schedule: what it sends (`body`, or `body_base64` for bytes), when, and its
    last and next ticks."""

    name: str
    topic: str
    schedule: Annotated[str, Field(description="a cron expression, or `every 5m`")]
    timezone: str
    on_missed: OnMissed
    declared_in: Literal["code", "api"]
    paused: bool
    next_tick: Time | None
    last_tick: Time | None
    last_message_id: int | None
    body: NotRequired[Any]
    body_base64: NotRequired[str]


def schedule_json(row: Any) -> ScheduleJson:
    """A periodic schedule (`periodic_schedule` row)."""
    body = bytes(row.body)
    data: ScheduleJson = {
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
    }
    if row.body_is_json:
        data["body"] = json.loads(body)
    else:
        data["body_base64"] = base64.b64encode(body).decode()
    return data


@with_config(ANSWER)
class CapJson(TypedDict):
    """A level's or a topic's backlog cap; `max_waiting` and `policy` null: none (lifted)."""

    scope: Literal["level", "topic"]
    target: Annotated[str, Field(description="the topic, or the level's number")]
    max_waiting: int | None
    policy: CapPolicy | None


def cap_json(cap: BacklogCap) -> CapJson:
    return {
        "scope": cap.scope,
        "target": cap.target,
        "max_waiting": cap.limit,
        "policy": cap.policy,
    }


def lifted_cap_json(scope: Literal["level", "topic"], target: str) -> CapJson:
    return {"scope": scope, "target": target, "max_waiting": None, "policy": None}


@with_config(ANSWER)
class LimitsJson(TypedDict):
    """A topic's limits; null: none."""

    topic: str
    max_running: int | None
    rate_per_s: float | None


def limits_json(item: TopicLimits) -> LimitsJson:
    return {"topic": item.topic, "max_running": item.max_running, "rate_per_s": item.rate_per_s}
