"""Property-based tests (hypothesis) of everything a producer hands in: level strings, delays,
topic names, keys, bodies, properties. Each input is either accepted and stored exactly, or
refused with a DelaysvcError that names the field; never another exception, never half-stored.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from delaysvc.config.levels import DelayLevels, parse_duration_ms
from delaysvc.errors import ConfigError, DelaysvcError, ValidationError
from delaysvc.producer.sending import Producer

RUNS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
level_tokens = st.one_of(
    st.builds(lambda n, u: f"{n}{u}", st.integers(-5, 500), st.sampled_from("smhdxy")),
    st.text(alphabet="0123456789smhd. -", max_size=5),
)


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM commit_log")).scalar_one()


@given(st.lists(level_tokens, min_size=0, max_size=6).map(" ".join))
@settings(max_examples=300, deadline=None)
def test_a_level_string_parses_to_increasing_levels_or_is_refused_naming_a_token(
    spec: str,
) -> None:
    try:
        levels = DelayLevels.parse(spec)
    except ConfigError as error:
        assert "DELAYSVC" in str(error) or any(
            part in str(error) for part in [*spec.split(" "), "empty"]
        )
        return
    delays = [levels.delay_ms(n) for n in range(1, levels.max_level + 1)]
    assert delays == sorted(set(delays)) and delays[0] > 0
    assert len(delays) == len(spec.strip().split(" "))  # surrounding blanks are ignored


@given(st.text(max_size=12))
@settings(max_examples=300, deadline=None)
def test_a_duration_parses_to_whole_milliseconds_or_is_refused(value: str) -> None:
    try:
        ms = parse_duration_ms(value)
    except ValidationError as error:
        assert error.field in ("delay", "duration")
        return
    assert isinstance(ms, int) and ms >= 0


@RUNS
@given(
    topic=st.text(max_size=140),
    key=st.none() | st.text(max_size=300),
    body=json_values,
    properties=st.none() | st.dictionaries(st.text(max_size=20), st.text(max_size=20), max_size=3),
    delay_ms=st.none() | st.integers(min_value=-10, max_value=10**11),
)
def test_a_message_is_stored_exactly_or_refused_naming_the_field(
    producer: Producer,
    engine: Engine,
    topic: str,
    key: str | None,
    body: Any,
    properties: dict[str, str] | None,
    delay_ms: int | None,
) -> None:
    before = _count(engine)
    try:
        message = producer.send(topic, body, key=key, properties=properties, delay_ms=delay_ms)
    except DelaysvcError as error:
        assert isinstance(error, ValidationError)
        assert error.field in ("topic", "key", "body", "properties", "delay_ms")
        assert _count(engine) == before  # nothing half-stored
        return
    stored = producer.get(message.id)
    assert stored.topic == topic
    if message.created:
        assert stored.key == key
        assert stored.properties == (properties or {})
        assert json.dumps(stored.body, sort_keys=True) == json.dumps(
            json.loads(json.dumps(body)), sort_keys=True
        )


@RUNS
@given(body=st.binary(max_size=200))
def test_bytes_bodies_come_back_byte_for_byte(producer: Producer, body: bytes) -> None:
    message = producer.send("t.bytes", body)
    assert producer.get(message.id).body == body


@pytest.mark.parametrize("bad", [math.nan, math.inf, {"x": -math.inf}])
def test_nan_and_infinity_are_refused(producer: Producer, engine: Engine, bad: Any) -> None:
    with pytest.raises(ValidationError) as error:
        producer.send("t.nan", bad)
    assert error.value.field == "body"
    assert _count(engine) == 0


@pytest.mark.parametrize(
    "hostile",
    [
        "'; DROP TABLE commit_log; --",
        '" OR 1=1 --',
        "$$; SELECT pg_sleep(10); $$",
        "😀 unicode ✓ and \\ backslash",
    ],
)
def test_sql_in_keys_bodies_and_properties_is_stored_verbatim(
    producer: Producer, hostile: str
) -> None:
    message = producer.send("t.hostile", {"text": hostile}, key=hostile, properties={"p": hostile})
    stored = producer.get(message.id)
    assert (stored.key, stored.body, stored.properties) == (
        hostile,
        {"text": hostile},
        {"p": hostile},
    )


def test_nul_bytes_are_refused_in_keys_and_properties(producer: Producer) -> None:
    with pytest.raises(ValidationError) as error:
        producer.send("t.nul", {}, key="a\x00b")
    assert error.value.field == "key"
    with pytest.raises(ValidationError) as error:
        producer.send("t.nul", {}, properties={"a": "b\x00"})
    assert error.value.field == "properties"
