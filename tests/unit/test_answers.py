"""The web app's JSON answers (`delaysvc.web.answers.Answers`): orjson's text, the JSON
Flask's own provider writes."""

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from flask import Flask
from flask.json.provider import DefaultJSONProvider

from delaysvc.web.answers import Answers, orjson


def _apps() -> tuple[Flask, Flask]:
    ours, flasks = Flask("ours"), Flask("flasks")
    ours.json = Answers(ours)
    for app in (ours, flasks):
        app.json.sort_keys = False  # type: ignore[attr-defined]  # as create_app sets it
    return ours, flasks


@dataclass
class _Point:
    x: int


VALUES = [
    {"messages": [{"id": 7, "topic": "t", "key": None, "created": True, "delay_level": 3}]},
    {"z": 1, "a": [1.5, -0.0, 10**18, "ünïcode ✓", "\u2028"], "m": {}},
    {"at": datetime(2026, 12, 7, 9, 30, tzinfo=UTC), "point": _Point(3), "amount": Decimal("1.10")},
    {"huge": 10**30},  # beyond 64 bits: orjson refuses, Flask's writes it
    {"lone": "\ud800"},  # a lone surrogate: the same
    {1: "a key that is not a string"},
]


@pytest.mark.parametrize("value", VALUES)
def test_an_answer_reads_as_flasks_own(value: object) -> None:
    ours, flasks = _apps()
    with ours.app_context():
        written = ours.json.response(value).get_data()
    with flasks.app_context():
        expected = flasks.json.response(value).get_data()
    assert json.loads(written) == json.loads(expected)


def test_orjson_writes_the_compact_answers_in_the_order_built_and_beyond_ascii_as_utf8() -> None:
    assert orjson is not None  # a dependency on CPython
    ours, _ = _apps()
    with ours.app_context():
        text = ours.json.response({"b": "✓", "a": 1}).get_data()
    assert text == '{"b":"✓","a":1}\n'.encode()


def test_in_debug_the_answers_are_flasks_indented_ones() -> None:
    ours, _ = _apps()
    ours.debug = True
    with ours.app_context():
        text = ours.json.response({"a": [1]}).get_data(as_text=True)
    assert text == DefaultJSONProvider(ours).dumps({"a": [1]}, indent=2) + "\n"
