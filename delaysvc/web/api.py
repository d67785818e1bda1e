"""The HTTP API: JSON in, JSON out, `Authorization: Bearer <token>`."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from functools import wraps
from typing import Any, Literal

from flask import Blueprint, current_app, g, jsonify, request
from werkzeug.exceptions import Forbidden, RequestEntityTooLarge

from delaysvc import store
from delaysvc.auth import ApiToken, authenticate_token
from delaysvc.config.validation import validate_topic
from delaysvc.errors import NotFound, ValidationError
from delaysvc.maintenance.periodic import Schedules, schedule
from delaysvc.producer.caps import all_caps, check_target, set_cap
from delaysvc.producer.dead_letters import DeadLetters
from delaysvc.producer.sending import MAX_BATCH, Producer
from delaysvc.serialize import (
    cap_json,
    dead_letter_json,
    lane_json,
    lifted_cap_json,
    limits_json,
    message_json,
    schedule_json,
    sent_batch_json,
    sent_message_json,
    topic_json,
)
from delaysvc.web import params
from delaysvc.web.errors import error_response
from delaysvc.web.models import MAX_DEAD_PAGE, DeletedJson
from delaysvc.worker.limits import all_limits, set_limits

api = Blueprint("api", __name__)


def services() -> dict[str, Any]:
    return current_app.extensions["delaysvc"]


def requires(scope: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`send` tokens may enqueue, read and cancel; `admin` tokens may do everything. A token
    limited to topics does so only for messages of those: others are 404 (see `token()`)."""

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(view)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            given = bearer_token(request.headers.get("Authorization", ""))
            if given is None:
                return error_response(401, "unauthorized", "send Authorization: Bearer <token>")
            token = authenticate_token(services()["engine"], given)
            if token is None:
                return error_response(401, "unauthorized", "unknown, revoked or expired token")
            if scope == "admin" and token.scope != "admin":
                return error_response(403, "forbidden", "this needs a token with scope admin")
            g.token = token
            return view(*args, **kwargs)

        guarded.required_scope = scope  # type: ignore[attr-defined]
        return guarded

    return decorate


def bearer_token(header: str) -> str | None:
    """The token an `Authorization: Bearer <token>` header carries (the scheme's name in any
    case, as RFC 7235 has it); None for any other."""
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return given.strip()


def token() -> ApiToken:
    """The request's token. Views pass its `topics` to the core, which answers NotFound for a
    message of any other topic, exactly as for one that does not exist."""
    found: ApiToken = g.token
    return found


def require_topic(item: dict[str, Any], sender: ApiToken | None = None) -> None:
    """A token (the request's, or `sender`) limited to topics may send only to those: 403
    naming the topic and them."""
    allowed = (sender or token()).topics
    if allowed is not None:
        topic = validate_topic(item.get("topic"))
        if topic not in allowed:
            raise Forbidden(
                f"topic {topic!r} is not one of this token's topics: {', '.join(allowed)}"
            )


def json_body() -> dict[str, Any]:
    if not request.is_json:
        return _raise_unsupported()
    raw = request.get_data()  # over the app's MAX_CONTENT_LENGTH given as Content-Length: 413
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    if request.content_length is None and limit is not None and len(raw) >= limit:
        raise RequestEntityTooLarge()  # a chunked body, read up to the limit and cut there
    if not raw:
        raise ValidationError("body", "the request body is empty: send a JSON object")
    try:
        data = current_app.json.loads(raw)  # UTF-8, or UTF-16/32 (told by the first bytes)
    except RecursionError:
        raise ValidationError(
            "body", "the JSON is nested too deeply to parse (keep it under ~900 levels)"
        ) from None
    except UnicodeDecodeError:
        raise ValidationError(
            "body", "the request body is not UTF-8 (nor UTF-16/32) text"
        ) from None
    except ValueError as exc:  # malformed JSON, a number of more than 4,300 digits
        raise ValidationError("body", f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValidationError("body", "the request body must be a JSON object")
    return data


def _raise_unsupported() -> dict[str, Any]:
    from werkzeug.exceptions import UnsupportedMediaType

    raise UnsupportedMediaType("send Content-Type: application/json")


def int_arg(name: str, default: int | None, low: int, high: int | None) -> Any:
    """A whole-number query parameter within [low, high] (ASCII digits), or a 400 naming it."""
    return params.int_arg(request.args, name, default, low, high)


def whole_numbers(options: dict[str, Any], *fields: str) -> dict[str, Any]:
    """`options` with the integer `fields` given as a number with a zero fraction (`1000.0`,
    what some encoders write for every number) as the integer it is: JSON Schema's `integer`,
    which the API's document states, is any number without a fraction. Other values are left
    to the checks, which name the field."""
    for field in fields:
        value = options.get(field)
        if isinstance(value, float) and value.is_integer():
            options[field] = int(value)
    return options


def message_options(item: dict[str, Any]) -> dict[str, Any]:
    """The JSON fields of one message, with deliver_at parsed from ISO 8601 and its integers
    as integers (`whole_numbers`)."""
    options = whole_numbers(dict(item), "delay_ms", "delay_level", "priority")
    at = options.get("deliver_at")
    if at is not None:
        if not isinstance(at, str):
            raise ValidationError("deliver_at", "must be an ISO 8601 string with a timezone")
        try:
            if "\x00" in at:  # Python 3.11's parser stops at a NUL and takes what came before
                raise ValueError(at)
            # RFC 3339 allows a lower-case t and z, which Python 3.11's parser does not
            options["deliver_at"] = datetime.fromisoformat(at.upper())
        except ValueError:
            raise ValidationError("deliver_at", f"{at!r} is not an ISO 8601 time") from None
    return options


@api.post("/messages")
@requires("send")
def send_message():
    answer, status = send_one(services()["producer"], token(), json_body())
    return jsonify(answer), status


def send_one(producer: Producer, sender: ApiToken, data: dict[str, Any]) -> tuple[Any, int]:
    """`POST /messages`: the request's JSON object sent for the `sender` token. -> the answer
    and its status: 201 stored, 200 the message holding its key. Flask's view and the quick
    way (`delaysvc.web.quick`) both send by this."""
    options = message_options(data)
    require_topic(options, sender)
    message = producer.send_item(options)
    return sent_message_json(message), 201 if message.created else 200


@api.post("/messages/batch")
@requires("send")
def send_messages():
    request_body = json_body()
    for name in request_body:
        if name != "messages":  # a misspelt `messages`, an `on_duplicate` beside them
            raise ValidationError(
                name,
                "unknown field; a batch's request holds only messages (each item's options "
                "go in the item; on_duplicate is for single sends)",
            )
    items = request_body.get("messages")
    if not isinstance(items, list) or not items:
        raise ValidationError("messages", "must be a non-empty list of messages")
    if len(items) > MAX_BATCH:  # send_batch itself takes more: an HTTP batch is one request
        raise ValidationError("messages", f"{len(items)} items, at most {MAX_BATCH} in one request")
    options, sender = [], token()
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValidationError(f"messages[{index}]", "must be an object")
        try:
            options.append(message_options(item))
            require_topic(item, sender)
        except ValidationError as exc:
            raise ValidationError(f"messages[{index}].{exc.field}", exc.detail) from None
        except Forbidden as exc:  # one message outside the token's topics: none is sent
            raise Forbidden(f"messages[{index}]: {exc.description}") from None
    return jsonify({"messages": sent_batch_json(services()["producer"].send_batch(options))}), 201


@api.get("/messages")
@requires("send")
def find_message():
    params.only(request.args, "topic", "key")
    topic, key = params.text_arg(request.args, "topic"), params.text_arg(request.args, "key")
    if not topic or not key:
        missing = "topic" if not topic else "key"
        raise ValidationError(missing, "look up a message with ?topic=...&key=..., both given")
    return jsonify(message_json(services()["producer"].find(topic, key, topics=token().topics)))


@api.get("/messages/<int:message_id>")
@requires("send")
def get_message(message_id: int):
    return jsonify(message_json(services()["producer"].get(message_id, topics=token().topics)))


@api.delete("/messages/<int:message_id>")
@requires("send")
def cancel_message(message_id: int):
    cancelled = services()["producer"].cancel(message_id, topics=token().topics)
    return jsonify(message_json(cancelled))


@api.get("/levels")
@requires("send")
def levels():
    with services()["engine"].connect() as conn:
        rows = store.lane_stats(conn)
    every_topic = token().topics is None
    return jsonify({"levels": [lane_json(row, every_topic=every_topic) for row in rows]})


@api.get("/topics")
@requires("send")
def topics():
    with services()["engine"].connect() as conn:
        rows = store.topic_stats(conn)
        durations = store.recent_durations(conn)
    visible = [row for row in rows if token().allows(row.topic)]
    return jsonify({"topics": [topic_json(r, durations.get(r.topic)) for r in visible]})


@api.get("/dead")
@requires("admin")
def dead_letters():
    params.only(request.args, "topic", "after", "limit")
    after = int_arg("after", None, 0, None)
    limit = int_arg("limit", 100, 1, MAX_DEAD_PAGE)
    letters = DeadLetters(services()["engine"])
    topic = params.text_arg(request.args, "topic")
    rows = letters.list(topic, after, limit, topics=token().topics)
    return jsonify({"dead": [dead_letter_json(r) for r in rows]})


@api.post("/dead/<int:message_id>/redrive")
@requires("admin")
def redrive(message_id: int):
    letters = DeadLetters(services()["engine"])
    return jsonify(message_json(letters.redrive(message_id, topics=token().topics)))


@api.get("/limits")
@requires("admin")
def list_limits():
    found = [item for item in all_limits(services()["engine"]) if token().allows(item.topic)]
    return jsonify({"limits": [limits_json(item) for item in found]})


@api.put("/topics/<topic>/limits")
@requires("admin")
def put_limits(topic: str):
    options = json_body()
    require_topic({"topic": topic})
    unknown = sorted(set(options) - {"max_running", "rate"})
    if unknown:
        raise ValidationError(unknown[0], "unknown field; allowed: max_running, rate")
    found = set_limits(
        services()["engine"],
        topic,
        max_running=whole_numbers(options, "max_running").get("max_running"),
        rate=options.get("rate"),
    )
    return jsonify(limits_json(found))


@api.get("/caps")
@requires("admin")
def list_caps():
    """A token limited to topics sees the caps of those only (no level's: levels are shared)."""
    found = [
        cap
        for cap in all_caps(services()["engine"])
        if (cap.scope == "topic" and token().allows(cap.target)) or token().topics is None
    ]
    return jsonify({"caps": [cap_json(cap) for cap in found]})


@api.put("/topics/<topic>/cap")
@requires("admin")
def put_topic_cap(topic: str):
    if not token().allows(topic):
        raise NotFound(f"no topic {topic!r} among this token's topics")
    return _put_cap("topic", topic)


@api.put("/levels/<level>/cap")
@requires("admin")
def put_level_cap(level: str):
    if token().topics is not None:  # a level holds every topic's messages
        raise NotFound(f"no level {level} for a token limited to topics")
    return _put_cap("level", level)


def _put_cap(scope: Literal["level", "topic"], target: object) -> Any:
    options = json_body()
    unknown = sorted(set(options) - {"max_waiting", "policy"})
    if unknown:
        raise ValidationError(unknown[0], "unknown field; allowed: max_waiting, policy")
    engine = services()["engine"]
    max_waiting = whole_numbers(options, "max_waiting").get("max_waiting")
    found = set_cap(engine, scope, target, max_waiting, options.get("policy"))
    if found is None:  # lifted
        _, name = check_target(scope, target)
        return jsonify(lifted_cap_json(scope, name))
    return jsonify(cap_json(found))


def _schedules() -> Schedules:
    return Schedules(services()["engine"])


@api.get("/schedules")
@requires("admin")
def list_schedules():
    rows = [row for row in _schedules().list() if token().allows(row.topic)]
    return jsonify({"schedules": [schedule_json(row) for row in rows]})


@api.get("/schedules/<name>")
@requires("admin")
def get_schedule(name: str):
    return jsonify(schedule_json(_schedules().get(name, topics=token().topics)))


@api.put("/schedules/<name>")
@requires("admin")
def put_schedule(name: str):
    options = json_body()
    allowed = ("schedule", "topic", "body", "timezone", "on_missed")
    unknown = sorted(set(options) - set(allowed))
    if unknown:  # a misspelt timezone would have been UTC
        raise ValidationError(unknown[0], f"unknown field; allowed: {', '.join(allowed)}")
    require_topic(options)
    item = schedule(
        name,
        options.get("schedule"),  # type: ignore[arg-type]  # checked by schedule()
        topic=options.get("topic"),  # type: ignore[arg-type]
        body=options.get("body"),
        timezone=options.get("timezone", "UTC"),
        on_missed=options.get("on_missed", "skip"),
    )
    # a name taken by another topic's schedule: 404 as its GET, checked as it is written
    row, created = _schedules().put(item, topics=token().topics)
    return jsonify(schedule_json(row)), 201 if created else 200


@api.post("/schedules/<name>/pause")
@requires("admin")
def pause_schedule(name: str):
    return jsonify(schedule_json(_schedules().pause(name, topics=token().topics)))


@api.post("/schedules/<name>/resume")
@requires("admin")
def resume_schedule(name: str):
    return jsonify(schedule_json(_schedules().resume(name, topics=token().topics)))


@api.delete("/schedules/<name>")
@requires("admin")
def delete_schedule(name: str):
    _schedules().delete(name, topics=token().topics)
    return jsonify(DeletedJson(deleted=name))


@api.get("/openapi.json")
def openapi():
    from delaysvc.web.openapi import document

    return jsonify(document())
