"""JSON shapes of messages, shared by the HTTP API and the CLI."""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Any

from delaysvc.producer import Message


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
    if full:
        data.update(
            stored_at=iso(message.stored_at),
            delivered_at=iso(message.delivered_at),
            started_at=iso(message.started_at),
            finished_at=iso(message.finished_at),
            attempts=message.attempts,
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
