"""A body is stored as `json.dumps(body, ensure_ascii=False, allow_nan=False,
separators=(",", ":"))` gives it (a float perhaps spelled otherwise, the same number), through
orjson where it writes that and an encoder built once where it does not (`encode_body`)."""

from __future__ import annotations

import dataclasses
import enum
import json
import platform
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from delaysvc.config import validation
from delaysvc.config.validation import encode_body
from delaysvc.errors import TooLarge, ValidationError

BODIES: list[Any] = [
    {"n": 1, "pad": "x" * 40},
    "plain text",
    'ünïcödé ✓ \u2028 "quoted" \\ \n',
    [1, 2.5, -0.0, 1e300, True, False, None],
    {1: "int key", 2.5: "float key", None: "null key", False: "bool key"},
    (1, (2, 3)),
    10**40,
    {"nested": [{"deep": {"er": [[]]}}], "empty": {}},
    0,
    None,
]


def _json_dumps(body: Any) -> str:
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_a_body_is_encoded_as_json_dumps_encodes_it(body: Any) -> None:
    assert encode_body(body, 1 << 20) == (_json_dumps(body).encode(), True)


def test_a_body_orjson_can_write_is_written_by_orjson() -> None:
    """The quick way is really taken (its import did not fail on CPython), and gives json's
    bytes; a float is spelled as orjson spells it, the same number as json's spelling."""
    assert validation.orjson is not None or platform.python_implementation() != "CPython"
    body = {"order_id": 42, "items": [{"sku": "ä-1", "qty": 2}], "ok": True, "note": "\n\t\x01"}
    assert encode_body(body, 1 << 20) == (orjson.dumps(body), True)
    assert orjson.dumps(body) == _json_dumps(body).encode()
    data, _ = encode_body({"big": 1e16, "small": 1.5e-7}, 1 << 20)
    assert data == b'{"big":1e+16,"small":1.5e-7}'  # json: 1.5e-07
    assert json.loads(data) == {"big": 1e16, "small": 1.5e-7}


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text() | st.integers() | st.booleans() | st.none(), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(_JSON_VALUES)
def test_any_body_is_stored_as_json_reads_it_or_refused_as_json_refuses_it(body: Any) -> None:
    try:
        expected = _json_dumps(body).encode("utf-8")
    except (ValueError, UnicodeEncodeError):  # NaN or Infinity; a lone surrogate
        with pytest.raises(ValidationError) as refused:
            encode_body(body, 1 << 30)
        assert refused.value.field == "body"
        return
    data, is_json = encode_body(body, 1 << 30)
    assert is_json
    assert json.loads(data) == json.loads(expected)
    assert data == expected or _has_float(body)  # a float may be spelled otherwise


def _has_float(body: Any) -> bool:
    if isinstance(body, float):
        return True
    if isinstance(body, dict):
        return any(_has_float(value) for value in body.values())
    if isinstance(body, (list, tuple)):
        return any(_has_float(value) for value in body)
    return False


class Colour(enum.Enum):
    RED = "red"
    DEEP = {"id": 7}


class Size(enum.IntEnum):
    LARGE = 3


def test_uuids_and_enum_members_are_stored_as_their_text_and_value_with_a_null_or_without() -> None:
    order = uuid.UUID("12345678-1234-5678-1234-567812345678")
    body = {"order": order, "colour": Colour.RED, "deep": Colour.DEEP, "size": Size.LARGE}
    written = (
        b'{"order":"12345678-1234-5678-1234-567812345678","colour":"red","deep":{"id":7},"size":3}'
    )
    assert encode_body(body, 1 << 20) == (written, True)  # orjson's way
    with_null = {**body, "coupon": None}  # json's way (a null in it)
    assert encode_body(with_null, 1 << 20) == (written[:-1] + b',"coupon":null}', True)


def test_bytes_are_kept_and_a_size_over_the_limit_is_refused() -> None:
    assert encode_body(b"\x00raw", 10) == (b"\x00raw", False)
    assert encode_body(memoryview(b"ab"), 10) == (b"ab", False)
    with pytest.raises(TooLarge, match="11 bytes, the limit is 10"):
        encode_body("x" * 9, 10)


@dataclasses.dataclass
class Point:
    x: int
    y: int


def test_bodies_json_cannot_hold_are_refused_naming_the_body() -> None:
    circular: list[Any] = []
    circular.append(circular)
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    cases: list[tuple[Any, str | None]] = [
        ({1, 2}, "not JSON serializable"),
        ({"at": datetime(2026, 12, 1, tzinfo=UTC)}, "type datetime is not JSON serializable"),
        ({"at": datetime(2026, 12, 1, tzinfo=UTC), "x": None}, "type datetime is not JSON"),
        ([Point(1, 2)], "type Point is not JSON serializable"),
        ({"id": 2**64}, None),  # not refused: orjson's limit, json writes it
        ({uuid.uuid4(): "a UUID key"}, "keys must be"),
        (float("nan"), "Out of range float"),
        ({"at": float("inf")}, "Out of range float"),
        ({(1, 2): "tuple key"}, "keys must be"),
        (circular, "contains itself"),
        (deep, "nested more than 254 levels deep"),
        (_nested(255), "nested more than 254 levels deep"),
        # orjson stops at the big integer before the deep part: json writes it, the depth is
        # checked all the same
        ({"id": 2**64, "deep": _nested(254)}, "nested more than 254 levels deep"),
        ({"id": 2**64, "deep": _nested(253)}, None),
        (_nested(254), None),
        ("\udc80", "not valid Unicode"),
    ]
    for body, says in cases:
        if says is None:
            assert encode_body(body, 1 << 20) == (_json_dumps(body).encode(), True)
            continue
        with pytest.raises(ValidationError, match=says) as refused:
            encode_body(body, 1 << 20)
        assert refused.value.field == "body"
    assert encode_body({"after": "errors"}, 100) == (b'{"after":"errors"}', True)


def test_one_body_encoded_by_many_threads_at_once_is_never_taken_for_a_circular_one() -> None:
    body = {"rows": [{"n": n, "tags": ["a", "b"]} for n in range(200)]}
    expected = encode_body(body, 1 << 20)
    failures: list[BaseException] = []

    def encode() -> None:
        try:
            for _ in range(200):
                assert encode_body(body, 1 << 20) == expected
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=encode) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.parametrize(
    "value",
    [
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "t": "ä ✓"},
        ["vip", "eu-west"],
        [{"ord": 0, "body": "e30=", "deliver_at": None, "tags": ["a"], "properties": {}}],
        {"lone": "\udc80"},  # orjson refuses it: json's text, which the database refuses
    ],
    ids=["properties", "tags", "staged rows", "lone surrogate"],
)
def test_json_text_is_the_same_value_as_json_dumps_writes(value: Any) -> None:
    text = validation.json_text(value)
    assert isinstance(text, str)
    assert json.loads(text) == json.loads(json.dumps(value))
    if value == {"lone": "\udc80"}:
        assert text == json.dumps(value)
    else:
        assert text == orjson.dumps(value).decode()


def _nested(depth: int) -> Any:
    """Arrays `depth` deep: `[[...]]`."""
    body: Any = []
    for _ in range(depth - 1):
        body = [body]
    return body
