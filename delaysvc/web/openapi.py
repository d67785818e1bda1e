"""The OpenAPI 3.1 document of the HTTP API, served at `/api/v1/openapi.json`: each route with
its parameters, body and answers.

The schemas (`components.schemas`) are generated through pydantic from the types the API
answers with (`delaysvc.serialize`) and takes (`delaysvc.web.models`), whose limits are the
constants the checks use: nothing here restates a field or a limit. Tests check that the
document names exactly the routes the app serves and that every route's real answers match
its schemas (tests/integration/test_openapi.py; schemathesis in test_api_fuzz.py).
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode, JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from delaysvc.producer.sending import MAX_BATCH
from delaysvc.serialize import (
    CapJson,
    DeadLetterJson,
    LaneJson,
    LimitsJson,
    MessageJson,
    ScheduleJson,
    SentInBatchJson,
    SentMessageJson,
    TopicJson,
)
from delaysvc.web.models import (
    MAX_DEAD_PAGE,
    CapChangeJson,
    DeletedJson,
    ErrorJson,
    LimitsChangeJson,
    NewBatchJson,
    NewMessageJson,
    NewScheduleJson,
    ScheduleName,
    Topic,
)

_REQUESTS = (NewMessageJson, NewBatchJson, LimitsChangeJson, CapChangeJson, NewScheduleJson)
_ANSWERS = (
    SentMessageJson,
    SentInBatchJson,
    MessageJson,
    LaneJson,
    TopicJson,
    DeadLetterJson,
    LimitsJson,
    CapJson,
    ScheduleJson,
    DeletedJson,
    ErrorJson,
)


class _DocumentSchemas(GenerateJsonSchema):
    """pydantic's JSON Schema as the document shows it: a component named as its type less
    the `Json` suffix, no title on each field (its name says it), and a pattern on an object's
    keys as `propertyNames` (pydantic writes `patternProperties`, which lets a key that does
    not match through unchecked)."""

    def normalize_name(self, name: str) -> str:
        return super().normalize_name(name).removesuffix("Json")

    def field_title_should_be_set(self, schema: CoreSchema | Any) -> bool:
        return False

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        found = super().dict_schema(schema)
        if "patternProperties" in found:
            ((pattern, values),) = found.pop("patternProperties").items()
            found["propertyNames"] = {**found.get("propertyNames", {}), "pattern": pattern}
            found["additionalProperties"] = values
        return found


@cache
def _schemas() -> tuple[dict[type, dict[str, str]], dict[str, Any]]:
    """The `$ref` to each type's schema, and the components they point at (made once)."""
    adapters: list[tuple[type, JsonSchemaMode, TypeAdapter[Any]]] = [
        *((t, "validation", TypeAdapter(t)) for t in _REQUESTS),
        *((t, "serialization", TypeAdapter(t)) for t in _ANSWERS),
    ]
    refs, found = TypeAdapter.json_schemas(
        adapters,
        ref_template="#/components/schemas/{model}",
        union_format="primitive_type_array",  # {"type": ["string", "null"]}, not anyOf
        schema_generator=_DocumentSchemas,
    )
    components: dict[str, Any] = found["$defs"]
    for schema in components.values():
        schema.pop("title", None)  # the component's name
    return {t: ref for (t, _), ref in refs.items()}, components


def _ref(kind: type) -> dict[str, str]:
    return dict(_schemas()[0][kind])


def _inline(kind: Any) -> dict[str, Any]:
    """The schema of a path parameter's type (`Topic`, `ScheduleName`), in place."""
    return TypeAdapter(kind).json_schema(schema_generator=_DocumentSchemas)


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(kind: type) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": _ref(kind)}}}


def _listing(field: str, item: type) -> dict[str, Any]:
    """`{field: [item, ...]}`, as the list routes answer."""
    return {
        "type": "object",
        "required": [field],
        "additionalProperties": False,
        "properties": {field: {"type": "array", "items": _ref(item)}},
    }


def _errors(*statuses: int) -> dict[str, Any]:
    names = {
        400: "invalid field (named in the message)",
        401: "no or unknown token",
        403: "the token lacks the scope, or is limited to topics and this is not one of them",
        404: "not found, or of a topic outside the token's topics",
        409: "not cancellable, a schedule declared in code, a lane no longer stuck, or a "
        "redriven dead letter whose key a newer unfinished message holds",
        413: "too large",
        415: "not JSON",
        429: "backlog cap reached",
        503: "the database is unavailable (a restart, a failover): retry after Retry-After",
    }
    return {str(s): _json(_ref(ErrorJson), names[s]) for s in (*statuses, 503)}


_TOKENS = (
    "A token from `delaysvc create-token NAME [--scope send|admin] [--topic T ...]`. `send` "
    "sends, reads and cancels; `admin` also lists and redrives dead letters. A token made "
    "with --topic does so only for those topics: sending to another is 403, and a message, "
    "dead letter or periodic schedule of another topic is 404, as if it did not exist (a PUT "
    "of a schedule name another topic holds too); /topics lists only its topics."
)


def _path_parameter(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema}


def _cap_path(what: str, parameter: dict[str, Any]) -> dict[str, Any]:
    return {
        "parameters": [parameter],
        "put": {
            "summary": f"Cap the waiting messages of {what} for every producer; max_waiting "
            "left out or null lifts it, policy reject by default (admin)",
            "requestBody": _body(CapChangeJson),
            "responses": {
                "200": _json(_ref(CapJson), "the cap (max_waiting null: lifted)"),
                **_errors(400, 401, 403, 404, 413, 415),
            },
        },
    }


def document() -> dict[str, Any]:
    secured: list[dict[str, list[str]]] = [{"bearer": []}]
    message_id = [_path_parameter("message_id", {"type": "integer"})]
    topic = _path_parameter("topic", _inline(Topic))
    name = [_path_parameter("name", _inline(ScheduleName))]
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
            },
            "schemas": copy.deepcopy(_schemas()[1]),
        },
        "security": secured,
        "paths": {
            "/messages": {
                "post": {
                    "summary": "Schedule a message",
                    "requestBody": _body(NewMessageJson),
                    "responses": {
                        "201": _json(_ref(SentMessageJson), "stored"),
                        "200": _json(_ref(SentMessageJson), "the unfinished message with this key"),
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
                    "responses": {
                        "200": _json(_ref(MessageJson), "the message"),
                        **_errors(400, 401, 404),
                    },
                },
            },
            "/messages/batch": {
                "post": {
                    "summary": f"Schedule up to {MAX_BATCH:,} messages, all or nothing",
                    "requestBody": _body(NewBatchJson),
                    "responses": {
                        "201": _json(_listing("messages", SentInBatchJson), "stored"),
                        **_errors(400, 401, 403, 413, 415, 429),
                    },
                }
            },
            "/messages/{message_id}": {
                "parameters": message_id,
                "get": {
                    "summary": "A message and its timeline",
                    "responses": {
                        "200": _json(_ref(MessageJson), "the message"),
                        **_errors(401, 404),
                    },
                },
                "delete": {
                    "summary": "Cancel a message that is not running or finished",
                    "responses": {
                        "200": _json(_ref(MessageJson), "cancelled"),
                        **_errors(401, 404, 409),
                    },
                },
            },
            "/levels": {
                "get": {
                    "summary": "Delay levels and the timer lane",
                    "responses": {
                        "200": _json(_listing("levels", LaneJson), "per lane"),
                        **_errors(401),
                    },
                }
            },
            "/topics": {
                "get": {
                    "summary": "Topics with ready, running and dead jobs",
                    "responses": {
                        "200": _json(_listing("topics", TopicJson), "per topic"),
                        **_errors(401),
                    },
                }
            },
            "/dead": {
                "get": {
                    "summary": "Dead letters (admin)",
                    "parameters": [
                        {"name": "topic", "in": "query", "schema": {"type": "string"}},
                        {
                            "name": "after",
                            "in": "query",
                            "description": "the id of the last one seen: the next page",
                            "schema": {"type": "integer", "minimum": 0},
                        },
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_DEAD_PAGE},
                        },
                    ],
                    "responses": {
                        "200": _json(
                            _listing("dead", DeadLetterJson), "dead letters, newest first"
                        ),
                        **_errors(400, 401, 403),
                    },
                }
            },
            "/dead/{message_id}/redrive": {
                "parameters": message_id,
                "post": {
                    "summary": "Run a dead letter again (admin)",
                    "responses": {
                        "200": _json(_ref(MessageJson), "ready again"),
                        **_errors(401, 403, 404, 409),
                    },
                },
            },
            "/limits": {
                "get": {
                    "summary": "Topics with limits (admin)",
                    "responses": {
                        "200": _json(
                            _listing("limits", LimitsJson), "the limits of the token's topics"
                        ),
                        **_errors(401, 403),
                    },
                }
            },
            "/topics/{topic}/limits": {
                "parameters": [topic],
                "put": {
                    "summary": "Set a topic's limits; a field left out or null lifts it (admin)",
                    "requestBody": _body(LimitsChangeJson),
                    "responses": {
                        "200": _json(_ref(LimitsJson), "the topic's limits"),
                        **_errors(400, 401, 403, 413, 415),
                    },
                },
            },
            "/caps": {
                "get": {
                    "summary": "Levels and topics with backlog caps (admin)",
                    "responses": {
                        "200": _json(
                            _listing("caps", CapJson),
                            "the caps of the token's topics (every cap for a token of all)",
                        ),
                        **_errors(401, 403),
                    },
                }
            },
            "/topics/{topic}/cap": _cap_path("a topic", topic),
            "/levels/{level}/cap": _cap_path(
                "a level (not for a token limited to topics)",
                _path_parameter("level", {"type": "integer"}),
            ),
            "/schedules": {
                "get": {
                    "summary": "Periodic schedules (admin)",
                    "responses": {
                        "200": _json(
                            _listing("schedules", ScheduleJson),
                            "every schedule of the token's topics",
                        ),
                        **_errors(401, 403),
                    },
                }
            },
            "/schedules/{name}": {
                "parameters": name,
                "get": {
                    "summary": "A periodic schedule (admin)",
                    "responses": {
                        "200": _json(_ref(ScheduleJson), "the schedule"),
                        **_errors(401, 403, 404),
                    },
                },
                "put": {
                    "summary": "Create or replace a periodic schedule (admin)",
                    "requestBody": _body(NewScheduleJson),
                    "responses": {
                        "201": _json(_ref(ScheduleJson), "created"),
                        "200": _json(_ref(ScheduleJson), "replaced"),
                        **_errors(400, 401, 403, 404, 409, 413, 415),
                    },
                },
                "delete": {
                    "summary": (
                        "Delete a periodic schedule (admin; one declared in code only once "
                        "no running worker declares it)"
                    ),
                    "responses": {
                        "200": _json(_ref(DeletedJson), "deleted (its name)"),
                        **_errors(401, 403, 404, 409),
                    },
                },
            },
            "/schedules/{name}/pause": {
                "parameters": name,
                "post": {
                    "summary": "Pause a periodic schedule (admin)",
                    "responses": {
                        "200": _json(_ref(ScheduleJson), "paused"),
                        **_errors(401, 403, 404),
                    },
                },
            },
            "/schedules/{name}/resume": {
                "parameters": name,
                "post": {
                    "summary": "Resume a periodic schedule from its next tick (admin)",
                    "responses": {
                        "200": _json(_ref(ScheduleJson), "resumed"),
                        **_errors(401, 403, 404),
                    },
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
