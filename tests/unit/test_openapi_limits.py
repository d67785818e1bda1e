"""The OpenAPI document's request schemas and the checks the API runs give one verdict at each
limit: the schemas are generated from the constants the checks use (delaysvc.web.models), and
this holds them to it, value by value, on each side of every limit. Also: each schema is valid
JSON Schema 2020-12, the dialect of OpenAPI 3.1. No database is needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from delaysvc.config.levels import parse_duration_ms
from delaysvc.config.validation import (
    MAX_KEY_CHARS,
    MAX_PRIORITY,
    MAX_PROPERTIES,
    MAX_PROPERTY_NAME,
    MAX_PROPERTY_VALUE,
    MAX_RATE_PER_S,
    MAX_RUNNING,
    MAX_TAGS,
    MIN_RATE_PER_S,
    check_max_running,
    parse_rate,
    validate_key,
    validate_priority,
    validate_properties,
    validate_tags,
    validate_topic,
)
from delaysvc.errors import ValidationError
from delaysvc.maintenance.periodic import schedule
from delaysvc.producer.caps import MAX_WAITING, check_max_waiting, check_policy
from delaysvc.producer.sending import validate_on_duplicate
from delaysvc.web.openapi import document

DOCUMENT = document()
SCHEMAS = DOCUMENT["components"]["schemas"]


def _schedule_named(name: object) -> object:
    return schedule(name, "5m", topic="t")  # type: ignore[arg-type]


def _missing(value: object) -> object:
    return schedule("n", "5m", topic="t", on_missed=value)  # type: ignore[arg-type]


FIELD = {
    ("NewMessage", "topic"): validate_topic,
    ("NewMessage", "key"): validate_key,
    ("NewMessage", "tags"): validate_tags,
    ("NewMessage", "properties"): validate_properties,
    ("NewMessage", "priority"): validate_priority,
    ("NewMessage", "delay"): parse_duration_ms,
    ("NewMessage", "on_duplicate"): validate_on_duplicate,
    ("LimitsChange", "max_running"): check_max_running,
    ("LimitsChange", "rate"): parse_rate,
    ("CapChange", "max_waiting"): check_max_waiting,
    ("CapChange", "policy"): check_policy,
    ("NewSchedule", "topic"): validate_topic,
    ("NewSchedule", "on_missed"): _missing,
}
# (component, field, value, allowed). Not here: a trailing newline ("a\n"), which Python's
# `re` lets `$` match before (jsonschema's search) and ECMA-262, OpenAPI's dialect, does not.
CASES: list[tuple[str, str, Any, bool]] = [
    ("NewMessage", "topic", "order.cancel", True),
    ("NewMessage", "topic", "a" * 127, True),
    ("NewMessage", "topic", "a" * 128, False),
    ("NewMessage", "topic", ".hidden", False),
    ("NewMessage", "topic", "a b", False),
    ("NewMessage", "topic", "", False),
    ("NewMessage", "key", None, True),
    ("NewMessage", "key", "k" * MAX_KEY_CHARS, True),
    ("NewMessage", "key", "k" * (MAX_KEY_CHARS + 1), False),
    ("NewMessage", "key", "", False),
    ("NewMessage", "key", "a\tb", False),
    ("NewMessage", "key", "a\x7f", False),
    ("NewMessage", "key", "clé-ü", True),
    ("NewMessage", "tags", None, True),
    ("NewMessage", "tags", ["a:b.c_d-e"] * MAX_TAGS, True),
    ("NewMessage", "tags", ["a"] * (MAX_TAGS + 1), False),
    ("NewMessage", "tags", ["x" * 64], True),
    ("NewMessage", "tags", ["x" * 65], False),
    ("NewMessage", "tags", ["a b"], False),
    ("NewMessage", "tags", [""], False),
    ("NewMessage", "tags", "a", False),
    ("NewMessage", "properties", None, True),
    ("NewMessage", "properties", {f"p{n}": "v" for n in range(MAX_PROPERTIES)}, True),
    ("NewMessage", "properties", {f"p{n}": "v" for n in range(MAX_PROPERTIES + 1)}, False),
    ("NewMessage", "properties", {"n" * MAX_PROPERTY_NAME: ""}, True),
    ("NewMessage", "properties", {"n" * (MAX_PROPERTY_NAME + 1): ""}, False),
    ("NewMessage", "properties", {"": "v"}, False),
    ("NewMessage", "properties", {"n": "v" * MAX_PROPERTY_VALUE}, True),
    ("NewMessage", "properties", {"n": "v" * (MAX_PROPERTY_VALUE + 1)}, False),
    ("NewMessage", "properties", {"a\x00": "v"}, False),
    ("NewMessage", "properties", {"a": "v\x00"}, False),
    ("NewMessage", "properties", {"a": 1}, False),
    ("NewMessage", "priority", MAX_PRIORITY, True),
    ("NewMessage", "priority", -MAX_PRIORITY, True),
    ("NewMessage", "priority", MAX_PRIORITY + 1, False),
    ("NewMessage", "priority", -MAX_PRIORITY - 1, False),
    ("NewMessage", "priority", None, True),  # not given
    ("NewMessage", "priority", True, False),
    ("NewMessage", "delay", "30m", True),
    ("NewMessage", "delay", "1h30m250ms", True),
    ("NewMessage", "delay", "1.5m", False),
    ("NewMessage", "delay", "5", False),
    ("NewMessage", "delay", "m", False),
    ("NewMessage", "delay", "", False),
    ("NewMessage", "on_duplicate", "debounce", True),
    ("NewMessage", "on_duplicate", "drop", False),
    ("LimitsChange", "max_running", None, True),
    ("LimitsChange", "max_running", MAX_RUNNING, True),
    ("LimitsChange", "max_running", MAX_RUNNING + 1, False),
    ("LimitsChange", "max_running", 0, False),
    ("LimitsChange", "max_running", 1.5, False),
    # the string form's maximum is past what a pattern says (the description says it)
    ("LimitsChange", "rate", "10/s", True),
    ("LimitsChange", "rate", " 1.5 / m ", True),
    ("LimitsChange", "rate", "10/d", False),
    ("LimitsChange", "rate", "ten/s", False),
    ("LimitsChange", "rate", "\u0661\u0660/s", False),  # Arabic-Indic digits
    ("LimitsChange", "rate", MAX_RATE_PER_S, True),
    ("LimitsChange", "rate", MAX_RATE_PER_S + 0.5, False),
    ("LimitsChange", "rate", 0.001, True),
    ("LimitsChange", "rate", 0, False),
    ("LimitsChange", "rate", MIN_RATE_PER_S, True),
    ("LimitsChange", "rate", 1e-12, False),  # 1/rate was past any date: a task's countdown
    ("LimitsChange", "rate", 10**400, False),
    ("CapChange", "max_waiting", MAX_WAITING, True),
    ("CapChange", "max_waiting", MAX_WAITING + 1, False),
    ("CapChange", "max_waiting", 0, False),
    ("CapChange", "policy", "deliver-early", True),
    ("CapChange", "policy", "drop", False),
    ("NewSchedule", "topic", "report.build", True),
    ("NewSchedule", "topic", "-report", False),
    ("NewSchedule", "on_missed", "latest", True),
    ("NewSchedule", "on_missed", "all", False),
]


def _checked(check: Callable[[Any], object], value: Any) -> bool:
    try:
        check(value)
    except ValidationError:
        return False
    return True


def _schema_allows(schema: dict[str, Any], value: Any) -> bool:
    return Draft202012Validator({**schema, "components": DOCUMENT["components"]}).is_valid(value)


@pytest.mark.parametrize(
    ("component", "field", "value", "allowed"),
    CASES,
    ids=[f"{c}.{f}-{n}" for n, (c, f, _, _) in enumerate(CASES)],
)
def test_the_schema_and_the_check_agree_at_each_limit(
    component: str, field: str, value: Any, allowed: bool
) -> None:
    schema = SCHEMAS[component]["properties"][field]
    assert (_schema_allows(schema, value), _checked(FIELD[component, field], value)) == (
        allowed,
        allowed,
    )


@pytest.mark.parametrize(
    ("name", "allowed"),
    [("nightly-billing:eu", True), ("a" * 200, True), ("a" * 201, False), ("-a", False)],
)
def test_the_schedule_name_parameter_and_the_check_agree(name: str, allowed: bool) -> None:
    (parameter,) = DOCUMENT["paths"]["/schedules/{name}"]["parameters"]
    assert (_schema_allows(parameter["schema"], name), _checked(_schedule_named, name)) == (
        allowed,
        allowed,
    )


def test_every_case_field_is_one_the_document_has() -> None:
    assert {(c, f) for c, f, _, _ in CASES} == set(FIELD)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_each_schema_is_valid_json_schema_2020_12(name: str) -> None:
    Draft202012Validator.check_schema(SCHEMAS[name])
