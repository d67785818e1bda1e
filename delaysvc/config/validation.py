"""What the producer accepts, checked before anything is written.

Rules (docs/how-to/producing.md lists them for users):
- topic: 1-127 characters of `A-Z a-z 0-9 . _ -`, starting with a letter or digit
  (RocketMQ's `[%|a-zA-Z0-9_-]` less its internal `%`/`|`, plus `.` for `order.cancel`);
- key: 1-256 characters, no NUL, no control characters;
- tags: at most 16, each 1-64 characters of `A-Z a-z 0-9 . _ - :`;
- properties: at most 64 string -> string pairs, names 1-128 characters, values up to 4096,
  no NUL;
- body: bytes, or anything `json.dumps` takes (no NaN/Infinity), UUIDs (as their text) and
  enum members (as their value) too; encoded size at most `max_body_bytes`.
"""

from __future__ import annotations

import json
import json.encoder
import re
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any
from uuid import UUID

try:
    import orjson
except ImportError:  # no wheel for this Python (PyPy): json's encoder alone
    orjson = None  # type: ignore[assignment]

from delaysvc.errors import ConfigError, TooLarge, ValidationError, shown

TOPIC_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,126}")
TAG_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,64}")
MESSAGE_FIELDS = (
    "topic",
    "body",
    "delay",
    "delay_ms",
    "delay_level",
    "deliver_at",
    "key",
    "tags",
    "properties",
)
"""What a message is sent with (`send`'s arguments; an HTTP item, a bulk-schedule row)."""
WHOLE_FIELDS = ("delay_level", "delay_ms")
"""Those of whole numbers. bulk-schedule takes a whole float for one (pandas writes an integer
column with a missing value as floats) below MAX_WHOLE_FLOAT, where floats still hold every
whole number."""
MAX_WHOLE_FLOAT = 2.0**53

MAX_PRIORITY = 1000


def validate_priority(priority: object) -> int:
    """A whole number from -1000 to 1000 (higher is claimed first); None (not given): 0."""
    if priority is None:
        return 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValidationError("priority", f"must be a whole number, got {shown(priority)}")
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValidationError(
            "priority", f"{priority} is out of range: use -{MAX_PRIORITY} to {MAX_PRIORITY}"
        )
    return priority


MAX_KEY_CHARS = 256
MAX_TAGS = 16
MAX_PROPERTIES = 64
MAX_PROPERTY_NAME = 128
MAX_PROPERTY_VALUE = 4096
MAX_BODY_DEPTH = 254
"""The deepest a JSON body may nest (arrays and objects within each other): orjson's own limit,
well within what every reader of a stored body decodes (`json.loads` in a worker's handler or
an API answer, Spark). A body nested deeper was stored, and then could not be read back."""
CONTROL_CHARS = r"\x00-\x1f\x7f"
"""What a key must not hold: NUL and the other control characters (a regex class's body)."""
# text a key or a property must not hold: the control characters, and the halves of a UTF-16
# pair (surrogates), which no UTF-8 text holds, so PostgreSQL cannot store them
_REFUSED = re.compile(f"[{CONTROL_CHARS}\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")
NOT_UNICODE = "contains text that is not valid Unicode (a lone UTF-16 surrogate)"


def ascii_digits(text: str) -> bool:
    """Whether `text` is a whole number in the digits 0-9: `str.isdigit()` also takes `²`
    (on which `int()` raises) and other scripts' digits (which `int()` reads as a number
    nobody typed)."""
    return text.isascii() and text.isdigit()


def validate_topic(topic: object) -> str:
    if not isinstance(topic, str) or not TOPIC_PATTERN.fullmatch(topic):
        raise ValidationError(
            "topic",
            f"{shown(topic)} is not a topic name; use 1-127 characters of letters, digits, "
            "'.', '_' and '-', starting with a letter or digit",
        )
    return topic


def validate_key(key: object) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS:
        raise ValidationError("key", f"must be a string of 1-{MAX_KEY_CHARS} characters")
    if refused := _REFUSED.search(key):
        if _SURROGATE.match(refused.group()):
            raise ValidationError("key", NOT_UNICODE)
        raise ValidationError("key", "must not contain NUL or other control characters")
    return key


def validate_tags(tags: object) -> list[str] | None:
    if tags is None:
        return None
    if isinstance(tags, str) or not isinstance(tags, list | tuple):
        raise ValidationError("tags", "must be a list of strings")
    if len(tags) > MAX_TAGS:
        raise ValidationError("tags", f"{len(tags)} tags given, at most {MAX_TAGS}")
    for tag in tags:
        if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
            raise ValidationError(
                "tags", f"{shown(tag)} is not a tag; use 1-64 characters of letters, digits, '._:-'"
            )
    return list(tags)


def validate_properties(properties: object) -> dict[str, str] | None:
    if properties is None:
        return None
    if not isinstance(properties, dict):
        raise ValidationError("properties", "must be an object of string -> string")
    if len(properties) > MAX_PROPERTIES:
        raise ValidationError(
            "properties", f"{len(properties)} properties given, at most {MAX_PROPERTIES}"
        )
    for name, value in properties.items():
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_PROPERTY_NAME:
            raise ValidationError(
                "properties",
                f"name {shown(name)} must be a string of 1-{MAX_PROPERTY_NAME} characters",
            )
        if not isinstance(value, str) or len(value) > MAX_PROPERTY_VALUE:
            raise ValidationError(
                "properties",
                f"value of {shown(name)} must be a string of at most {MAX_PROPERTY_VALUE} "
                "characters",
            )
        if "\x00" in name or "\x00" in value:
            raise ValidationError("properties", f"{shown(name)} contains a NUL character")
        if _SURROGATE.search(name) or _SURROGATE.search(value):
            raise ValidationError("properties", f"{shown(name)}: its name or value {NOT_UNICODE}")
    return dict(properties)


def _beyond_json(value: object) -> object:
    """What a body may hold beyond JSON's own types, as orjson writes it: a UUID as its text,
    an enum member as its value. Anything else is refused, in json's words."""
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _json_encoder() -> Callable[[Any], str]:
    """`json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
    default=_beyond_json)` with its encoder built once: `json.dumps` builds one per call, which
    costs twice what encoding a small body does (1.5 of 2.3 us; a batch encodes every body).
    Without a circular check (its one dict would be shared by every thread): a body that
    contains itself is refused as nested too deeply, as a deep one is. Python without json's C
    encoder (PyPy) uses `json`'s own."""
    python = json.JSONEncoder(
        ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_beyond_json
    )
    make: Callable[..., Callable[[Any, int], Sequence[str]]] | None
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return python.encode
    try:  # markers, default, encoder, indent, separators, sort_keys, skipkeys, allow_nan
        encoder = make(None, _beyond_json, json.encoder.encode_basestring, None, ":", ",",
                       False, False, False)  # fmt: skip
    except TypeError:  # another Python's signature
        return python.encode
    return lambda body: "".join(encoder(body, 0))


_to_json = _json_encoder()

# orjson writes the same JSON (compact, key order kept, UTF-8 unescaped; a small float may be
# spelled otherwise, `1.5e-7` for `1.5e-07`, `0.00001` for `1e-05`: the same number) 5-10x
# faster than json's C encoder (0.14 against 0.69 us a two-field body, 1.1 against 11.6 a body
# of ten items). What it takes
# and json does not is handed back to json: times and dataclasses (passed to `_beyond_json`,
# which refuses them), integers beyond 64 bits, keys that are not strings, nesting past 254.
# It writes NaN and Infinity as null, which json refuses: a body whose JSON has `null` in it
# is encoded by json again, which refuses those or writes the same null.
_ORJSON_OPTIONS = (
    0 if orjson is None else orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
)


def _json_bytes(body: Any) -> bytes:
    """`body` as JSON in UTF-8; raises as `_to_json` does, or UnicodeEncodeError. (orjson's
    options given by position and `find` rather than `in`: 0.4 us of 1.0 a body, ad hoc.)"""
    depth_checked = False
    if orjson is not None:
        try:
            data = orjson.dumps(body, _beyond_json, _ORJSON_OPTIONS)
        except TypeError as exc:  # orjson.JSONEncodeError: json decides
            if str(exc) == "Recursion limit reached":  # nested past MAX_BODY_DEPTH
                raise RecursionError from None
        else:
            if data.find(b"null") < 0:
                return data
            depth_checked = True  # orjson wrote it: within its depth, MAX_BODY_DEPTH
    text = _to_json(body)  # raises RecursionError for a body that contains itself
    if not depth_checked and _nested_deeper(body, MAX_BODY_DEPTH):
        raise RecursionError
    return text.encode("utf-8")


def _nested_deeper(body: Any, limit: int) -> bool:
    """Whether `body` nests arrays and objects more than `limit` deep (a body json encodes
    and orjson did not: an integer beyond 64 bits may stop orjson before a deep part)."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            inner: Any = value.values()
        elif isinstance(value, list | tuple):
            inner = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((item, depth + 1) for item in inner)
    return False


def not_json(constant: str) -> Any:
    """`json.loads`'s `parse_constant` for a strict parse: NaN, Infinity and -Infinity, which
    Python's parser takes, are not JSON."""
    raise ValueError(f"{constant} is not JSON")


def json_text(value: Any) -> str:
    """JSON text of a checked value of plain types (a property map, a tag list, a staged
    batch's rows) for a `jsonb` parameter, where PostgreSQL reads it and only its value counts:
    orjson's (2.5 against 0.7 us a property map of three, through psycopg's jsonb dumper, ad
    hoc), json's where orjson refuses it (a lone surrogate, whose error stays the database's)."""
    if orjson is not None:
        try:
            return orjson.dumps(value).decode()
        except TypeError:
            pass
    return json.dumps(value)


_BINARY = (bytes, bytearray, memoryview)  # a tuple: `bytes | ...` makes a new union each call


def encode_body(body: Any, max_bytes: int) -> tuple[bytes, bool]:
    """-> (stored bytes, is_json). Bytes are kept as they are; anything else is JSON."""
    if isinstance(body, _BINARY):
        data, is_json = bytes(body), False
    else:
        try:
            data, is_json = _json_bytes(body), True
        except UnicodeEncodeError:  # a ValueError: before the clause below
            raise ValidationError("body", "contains text that is not valid Unicode") from None
        except (TypeError, ValueError) as exc:
            raise ValidationError("body", f"must be JSON-serialisable or bytes ({exc})") from None
        except RecursionError:
            raise ValidationError(
                "body", f"is nested more than {MAX_BODY_DEPTH} levels deep, or contains itself"
            ) from None
    if len(data) > max_bytes:
        raise TooLarge("body", f"is {len(data)} bytes, the limit is {max_bytes}")
    return data, is_json


def decode_body(data: bytes, is_json: bool) -> Any:
    return json.loads(data) if is_json else data


RATE_PATTERN = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|m|h)")
"""Starts per time, `10/s` (surrounding spaces allowed); [0-9], not \\d, which takes every
script's digits."""
_PER = {"s": 1.0, "m": 60.0, "h": 3600.0}
MAX_RATE_PER_S = 1_000_000
MIN_RATE_PER_S = 1 / 86_400
"""One start a day: a topic waits 1/rate between starts, which for a rate near 0 is past any
date (a consume task's countdown overflowed)."""
MAX_RUNNING = 100_000
MAX_WAITING = 1_000_000_000
"""The largest backlog cap (messages waiting in a level or topic)."""


def parse_rate(value: object) -> float | None:
    """`10/s`, `600/m`, `100/h`, or a number of starts per second; None lifts the limit."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # clamped first: out of range stays out of range, and float() of an int of hundreds
        # of digits (JSON allows them) would raise OverflowError
        rate = float(max(-1, min(value, 2 * MAX_RATE_PER_S)))
    elif isinstance(value, str) and (found := RATE_PATTERN.fullmatch(value.strip())):
        rate = float(found.group(1)) / _PER[found.group(2)]
    else:
        raise ValidationError(
            "rate", f"{shown(value)}: use starts per time such as '10/s', '600/m'"
        )
    if not MIN_RATE_PER_S <= rate <= MAX_RATE_PER_S:
        raise ValidationError(
            "rate",
            f"{shown(value)}: must be at least one a day ({MIN_RATE_PER_S:.7f}/s, 1/24h) and at "
            f"most {MAX_RATE_PER_S}/s",
        )
    return rate


def check_max_running(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RUNNING:
        raise ValidationError(
            "max_running", f"{shown(value)}: a whole number from 1 to {MAX_RUNNING}"
        )
    return value


_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def check_schema_name(name: str) -> str:
    """`name` if it can be delaysvc's schema, else a ConfigError saying what is allowed."""
    if not _SCHEMA_NAME.fullmatch(name):
        raise ConfigError(
            f"DELAYSVC_SCHEMA={name!r} is not a schema name delaysvc can use: use lower-case "
            "letters, digits and underscores, starting with a letter or underscore, at most "
            "63 characters (default: delaysvc)"
        )
    if name.startswith("pg_") or name == "information_schema":
        raise ConfigError(f"DELAYSVC_SCHEMA={name!r} is one of PostgreSQL's own schemas")
    return name
