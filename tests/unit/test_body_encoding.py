"""A body is stored as `json.dumps(body, ensure_ascii=False, allow_nan=False,
separators=(",", ":"))` gives it, through an encoder built once (`encode_body`)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

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


@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_a_body_is_encoded_as_json_dumps_encodes_it(body: Any) -> None:
    expected = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    assert encode_body(body, 1 << 20) == (expected.encode(), True)


def test_bytes_are_kept_and_a_size_over_the_limit_is_refused() -> None:
    assert encode_body(b"\x00raw", 10) == (b"\x00raw", False)
    assert encode_body(memoryview(b"ab"), 10) == (b"ab", False)
    with pytest.raises(TooLarge, match="11 bytes, the limit is 10"):
        encode_body("x" * 9, 10)


def test_bodies_json_cannot_hold_are_refused_naming_the_body() -> None:
    circular: list[Any] = []
    circular.append(circular)
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    cases = [
        ({1, 2}, "not JSON serializable"),
        (float("nan"), "Out of range float"),
        ({"at": float("inf")}, "Out of range float"),
        ({(1, 2): "tuple key"}, "keys must be"),
        (circular, "contains itself"),
        (deep, "nested too deeply"),
        ("\udc80", "not valid Unicode"),
    ]
    for body, says in cases:
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
