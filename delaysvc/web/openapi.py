"""The OpenAPI 3 document of the HTTP API, served at `/api/v1/openapi.json`. A test checks that
it names exactly the routes the app serves and that responses match its schemas."""

from __future__ import annotations

from typing import Any

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
        }
    },
}
_TIME = {"type": ["string", "null"], "format": "date-time"}
_STATUS = {
    "type": "string",
    "enum": ["scheduled", "ready", "running", "retrying", "succeeded", "dead", "cancelled"],
}
_MESSAGE_BRIEF: dict[str, Any] = {
    "type": "object",
    "required": ["id", "topic", "key", "status", "delay_level", "deliver_at"],
    "properties": {
        "id": {"type": "integer"},
        "topic": {"type": "string"},
        "key": {"type": ["string", "null"]},
        "status": _STATUS,
        "delay_level": {"type": ["integer", "null"]},
        "deliver_at": _TIME,
        "replaced_id": {
            "type": "integer",
            "description": "the message this send replaced (on_duplicate), now cancelled",
        },
    },
}
_MESSAGE = {
    "type": "object",
    "required": [
        *_MESSAGE_BRIEF["required"],
        "stored_at",
        "delivered_at",
        "started_at",
        "finished_at",
        "attempts",
        "last_error",
    ],
    "properties": {
        **_MESSAGE_BRIEF["properties"],
        "stored_at": _TIME,
        "delivered_at": _TIME,
        "started_at": _TIME,
        "finished_at": _TIME,
        "attempts": {"type": "integer"},
        "priority": {"type": "integer"},
        "last_error": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "properties": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
# optional fields may also be null, which means "not given"
_NEW_MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["topic", "body"],
    "additionalProperties": False,
    "properties": {
        "topic": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,126}$"},
        "body": {},
        "delay_level": {"type": ["integer", "null"]},
        "delay": {
            "type": ["string", "null"],
            "pattern": "^([0-9]+(ms|s|m|h|d))+$",
            "example": "30m",
        },
        "delay_ms": {"type": ["integer", "null"], "minimum": 0},
        "deliver_at": {"type": ["string", "null"], "format": "date-time"},
        "key": {"type": ["string", "null"], "pattern": "^[^\\u0000-\\u001f\\u007f]{1,256}$"},
        "tags": {
            "type": ["array", "null"],
            "maxItems": 16,
            "items": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,64}$"},
        },
        "properties": {
            "type": ["object", "null"],
            "maxProperties": 64,
            "propertyNames": {"pattern": "^[^\\u0000]{1,128}$"},
            "additionalProperties": {"type": "string", "pattern": "^[^\\u0000]{0,4096}$"},
        },
        "priority": {
            "type": "integer",
            "minimum": -1000,
            "maximum": 1000,
            "description": "higher is claimed first within the topic; 0 by default",
        },
        "on_duplicate": {
            "type": "string",
            "enum": ["keep", "replace", "debounce"],
            "description": "when an unfinished message of the topic holds the key: return it "
            "(keep, the default), put this body and due time in its place (replace), or do so "
            "but never due earlier than it was (debounce); single sends only",
        },
    },
}
_LANE = {
    "type": "object",
    "required": ["lane", "pending", "schedule_offset", "moved_total", "next_due", "stuck"],
    "properties": {
        "level": {"type": ["integer", "null"]},
        "lane": {"type": "string"},
        "delay": {"type": ["string", "null"]},
        "delay_ms": {"type": ["integer", "null"]},
        "pending": {"type": "integer"},
        "schedule_offset": {"type": "integer"},
        "max_offset": {"type": ["integer", "null"]},
        "moved_total": {"type": "integer"},
        "moved_per_s": {"type": ["number", "null"]},
        "next_due": _TIME,
        "lateness_ms": {"type": ["number", "null"]},
        "stuck": {"type": ["object", "null"]},
    },
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    names = {
        400: "invalid field (named in the message)",
        401: "no or unknown token",
        403: "the token lacks the scope, or is limited to topics and this is not one of them",
        404: "not found, or of a topic outside the token's topics",
        409: "not cancellable, or a schedule declared in code",
        413: "too large",
        415: "not JSON",
        429: "backlog cap reached",
        503: "the database is unavailable (a restart, a failover): retry after Retry-After",
    }
    return {str(s): _json(_ERROR, names[s]) for s in (*statuses, 503)}


_TOKENS = (
    "A token from `delaysvc create-token NAME [--scope send|admin] [--topic T ...]`. `send` "
    "sends, reads and cancels; `admin` also lists and redrives dead letters. A token made "
    "with --topic does so only for those topics: sending to another is 403, and a message, "
    "dead letter or periodic schedule of another topic is 404, as if it did not exist (a PUT "
    "of a schedule name another topic holds too); /topics lists only its topics."
)
_ID = [{"name": "message_id", "in": "path", "required": True, "schema": {"type": "integer"}}]
_LIMITS: dict[str, Any] = {
    "type": "object",
    "required": ["topic", "max_running", "rate_per_s"],
    "properties": {
        "topic": {"type": "string"},
        "max_running": {"type": ["integer", "null"]},
        "rate_per_s": {"type": ["number", "null"]},
    },
}
_NAME = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
_CAP: dict[str, Any] = {
    "type": "object",
    "required": ["scope", "target", "max_waiting", "policy"],
    "properties": {
        "scope": {"enum": ["level", "topic"]},
        "target": {"type": "string", "description": "the topic, or the level's number"},
        "max_waiting": {"type": ["integer", "null"]},
        "policy": {"enum": ["reject", "deliver-early", None]},
    },
}
_CAP_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "max_waiting": {"type": ["integer", "null"], "minimum": 1},
                    "policy": {"enum": ["reject", "deliver-early", None]},
                },
            }
        }
    },
}


def _cap_path(what: str, parameter: dict[str, Any]) -> dict[str, Any]:
    return {
        "parameters": [parameter],
        "put": {
            "summary": f"Cap the waiting messages of {what} for every producer; max_waiting "
            "left out or null lifts it, policy reject by default (admin)",
            "requestBody": _CAP_BODY,
            "responses": {
                "200": _json(_CAP, "the cap (max_waiting null: lifted)"),
                **_errors(400, 401, 403, 404, 415),
            },
        },
    }


_SCHEDULE: dict[str, Any] = {
    "type": "object",
    "required": [
        "name",
        "topic",
        "schedule",
        "timezone",
        "on_missed",
        "declared_in",
        "paused",
        "next_tick",
        "last_tick",
        "last_message_id",
    ],
    "properties": {
        "name": {"type": "string"},
        "topic": {"type": "string"},
        "schedule": {"type": "string", "description": "a cron expression, or `every 5m`"},
        "timezone": {"type": "string"},
        "on_missed": {"type": "string", "enum": ["skip", "latest"]},
        "declared_in": {"type": "string", "enum": ["code", "api"]},
        "paused": {"type": "boolean"},
        "next_tick": _TIME,
        "last_tick": _TIME,
        "last_message_id": {"type": ["integer", "null"]},
        "body": {},
        "body_base64": {"type": "string"},
    },
}
_NEW_SCHEDULE: dict[str, Any] = {
    "type": "object",
    "required": ["schedule", "topic"],
    "properties": {
        "schedule": {
            "type": "string",
            "description": "a cron expression of five fields (`*/5 * * * *`), or an interval "
            "of at least 1s (`30s`, `every 1h`)",
        },
        "topic": {"type": "string"},
        "body": {"description": "any JSON value (default null), at most 64 KiB encoded"},
        "timezone": {"type": "string", "description": "IANA name, default UTC"},
        "on_missed": {"type": "string", "enum": ["skip", "latest"]},
    },
}


def document() -> dict[str, Any]:
    secured: list[dict[str, list[str]]] = [{"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "delaysvc", "version": "1"},
        "servers": [{"url": "/api/v1"}],
        "components": {
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": _TOKENS,
                }
            }
        },
        "security": secured,
        "paths": {
            "/messages": {
                "post": {
                    "summary": "Schedule a message",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _NEW_MESSAGE}},
                    },
                    "responses": {
                        "201": _json(_MESSAGE_BRIEF, "stored"),
                        "200": _json(_MESSAGE_BRIEF, "the unfinished message with this key"),
                        **_errors(400, 401, 403, 413, 415, 429),
                    },
                },
                "get": {
                    "summary": (
                        "Find the message of a topic with a key: the unfinished one, "
                        "else the newest finished"
                    ),
                    "parameters": [
                        {
                            "name": "topic",
                            "in": "query",
                            "required": True,
                            "schema": {"type": "string"},
                        },
                        {
                            "name": "key",
                            "in": "query",
                            "required": True,
                            "schema": {"type": "string"},
                        },
                    ],
                    "responses": {"200": _json(_MESSAGE, "the message"), **_errors(400, 401, 404)},
                },
            },
            "/messages/batch": {
                "post": {
                    "summary": "Schedule up to 10,000 messages, all or nothing",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["messages"],
                                    "properties": {
                                        "messages": {
                                            "type": "array",
                                            "minItems": 1,
                                            "maxItems": 10000,
                                            "items": _NEW_MESSAGE,
                                        }
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "201": _json(
                            {
                                "type": "object",
                                "required": ["messages"],
                                "properties": {
                                    "messages": {"type": "array", "items": _MESSAGE_BRIEF}
                                },
                            },
                            "stored",
                        ),
                        **_errors(400, 401, 403, 413, 415, 429),
                    },
                }
            },
            "/messages/{message_id}": {
                "parameters": _ID,
                "get": {
                    "summary": "A message and its timeline",
                    "responses": {"200": _json(_MESSAGE, "the message"), **_errors(401, 404)},
                },
                "delete": {
                    "summary": "Cancel a message that is not running or finished",
                    "responses": {"200": _json(_MESSAGE, "cancelled"), **_errors(401, 404, 409)},
                },
            },
            "/levels": {
                "get": {
                    "summary": "Delay levels and the timer lane",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["levels"],
                                "properties": {"levels": {"type": "array", "items": _LANE}},
                            },
                            "per lane",
                        ),
                        **_errors(401),
                    },
                }
            },
            "/topics": {
                "get": {
                    "summary": "Topics with ready, running and dead jobs",
                    "responses": {"200": _json({"type": "object"}, "per topic"), **_errors(401)},
                }
            },
            "/dead": {
                "get": {
                    "summary": "Dead letters (admin)",
                    "parameters": [
                        {"name": "topic", "in": "query", "schema": {"type": "string"}},
                        {"name": "after", "in": "query", "schema": {"type": "integer"}},
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                    ],
                    "responses": {
                        "200": _json({"type": "object"}, "dead letters"),
                        **_errors(400, 401, 403),
                    },
                }
            },
            "/dead/{message_id}/redrive": {
                "parameters": _ID,
                "post": {
                    "summary": "Run a dead letter again (admin)",
                    "responses": {"200": _json(_MESSAGE, "ready again"), **_errors(401, 403, 404)},
                },
            },
            "/limits": {
                "get": {
                    "summary": "Topics with limits (admin)",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["limits"],
                                "properties": {"limits": {"type": "array", "items": _LIMITS}},
                            },
                            "the limits of the token's topics",
                        ),
                        **_errors(401, 403),
                    },
                }
            },
            "/topics/{topic}/limits": {
                "parameters": [
                    {"name": "topic", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "put": {
                    "summary": "Set a topic's limits; a field left out or null lifts it (admin)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "max_running": {
                                            "type": ["integer", "null"],
                                            "minimum": 1,
                                            "maximum": 100000,
                                        },
                                        "rate": {
                                            "type": ["string", "number", "null"],
                                            "description": "starts per time ('10/s', '600/m') "
                                            "or per second",
                                        },
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _json(_LIMITS, "the topic's limits"),
                        **_errors(400, 401, 403, 415),
                    },
                },
            },
            "/caps": {
                "get": {
                    "summary": "Levels and topics with backlog caps (admin)",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["caps"],
                                "properties": {"caps": {"type": "array", "items": _CAP}},
                            },
                            "the caps of the token's topics (every cap for a token of all)",
                        ),
                        **_errors(401, 403),
                    },
                }
            },
            "/topics/{topic}/cap": _cap_path(
                "a topic",
                {"name": "topic", "in": "path", "required": True, "schema": {"type": "string"}},
            ),
            "/levels/{level}/cap": _cap_path(
                "a level (not for a token limited to topics)",
                {"name": "level", "in": "path", "required": True, "schema": {"type": "integer"}},
            ),
            "/schedules": {
                "get": {
                    "summary": "Periodic schedules (admin)",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["schedules"],
                                "properties": {"schedules": {"type": "array", "items": _SCHEDULE}},
                            },
                            "every schedule of the token's topics",
                        ),
                        **_errors(401, 403),
                    },
                }
            },
            "/schedules/{name}": {
                "parameters": _NAME,
                "get": {
                    "summary": "A periodic schedule (admin)",
                    "responses": {
                        "200": _json(_SCHEDULE, "the schedule"),
                        **_errors(401, 403, 404),
                    },
                },
                "put": {
                    "summary": "Create or replace a periodic schedule (admin)",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _NEW_SCHEDULE}},
                    },
                    "responses": {
                        "201": _json(_SCHEDULE, "created"),
                        "200": _json(_SCHEDULE, "replaced"),
                        **_errors(400, 401, 403, 404, 409, 413, 415),
                    },
                },
                "delete": {
                    "summary": (
                        "Delete a periodic schedule (admin; one declared in code only once "
                        "no running worker declares it)"
                    ),
                    "responses": {
                        "200": _json(
                            {"type": "object", "required": ["deleted"]}, "deleted (its name)"
                        ),
                        **_errors(401, 403, 404, 409),
                    },
                },
            },
            "/schedules/{name}/pause": {
                "parameters": _NAME,
                "post": {
                    "summary": "Pause a periodic schedule (admin)",
                    "responses": {"200": _json(_SCHEDULE, "paused"), **_errors(401, 403, 404)},
                },
            },
            "/schedules/{name}/resume": {
                "parameters": _NAME,
                "post": {
                    "summary": "Resume a periodic schedule from its next tick (admin)",
                    "responses": {"200": _json(_SCHEDULE, "resumed"), **_errors(401, 403, 404)},
                },
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "security": [],
                    "responses": {"200": _json({"type": "object"}, "")},
                }
            },
        },
    }
