"""The producer's rules as Spark column expressions: bulk-schedule's fast path.

`prepare(frame, settings, key_from_row)` adds to every input row

- `_fast`: true when the JVM has checked every rule but the body's and knows the row is valid
  with exactly the values the producer would store;
- `_head`: for those rows, the COPY text of every stored column but the body (topic, key,
  tags, properties, delay_level, lane, delay_ms, deliver_at), escaped for COPY;
- `_line`: for those rows whose body the JVM can encode exactly as the producer would (a JSON
  scalar, or a flat object or array of strings without escapes, whole numbers, true, false
  and null, with no repeated name, within the size limit: `_body_bytes`), the whole COPY text
  line, so the row needs no Python work at all;
- `_body`: for the other fast rows, the body cell as text (the Python side encodes it with
  the producer's own `encode_body`, which decides its JSON-ness, canonical bytes and size);
- `_orig`: for every other row, the original cells, which the Python side runs through the
  producer's own code (`bulk.to_options` + `Producer.prepare`) for the exact decision and
  reason.

So the JVM only ever *accepts*, and only where its answer is provably the producer's: rows it
is not sure of (a bad row of any kind, or an unusual but valid spelling such as a JSON escape
in `tags`, an ISO time without a colon in its offset, a level like ` 3`) fall back to the
producer's code. The rules mirrored here, with the producer's name for each:

- topic: `validation.TOPIC_PATTERN`; key: 1-`MAX_KEY_CHARS` characters, no control character;
- tags: a JSON array of at most `MAX_TAGS` strings matching `TAG_PATTERN` (no escapes);
- properties: a flat JSON object of string -> string (no escapes, no control characters,
  no repeated name), at most `MAX_PROPERTIES`, names 1-`MAX_PROPERTY_NAME` characters;
- at most one of delay_level / delay / delay_ms / deliver_at, else the topic's default delay
  (`DELAYSVC_TOPIC_DELAYS`), else due now (`producer.resolve_schedule`): a level is clamped
  (0 or below: due now), a delay or delay_ms (`levels.parse_duration_ms`) of 0 is due now, one
  equal to a level's delay goes to that level's FIFO lane, others to the timer lane; a delay
  over `max_delay`, or a deliver_at without an offset or more than `max_delay` ahead, is left
  to the producer's path (which refuses it);
- every other column must be empty.

JSON Lines rows always take the producer's path: Spark's JSON reader re-spells nested values
(`2.50` -> `2.5`, big integers) and cannot tell `"key": 42` from `"key": "42"`.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ByteType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    TimestampNTZType,
    TimestampType,
)

from delaysvc.config.levels import format_ms
from delaysvc.config.settings import Settings
from delaysvc.config.validation import (
    MAX_KEY_CHARS,
    MAX_PROPERTIES,
    MAX_PROPERTY_NAME,
    MAX_TAGS,
    MAX_WHOLE_FLOAT,
    WHOLE_FIELDS,
)
from delaysvc.config.validation import MESSAGE_FIELDS as FIELDS
from delaysvc.schema.tables import NO_LANE, TIMER_LANE

_WS = r"[ \t\n\r]*"  # JSON's whitespace, as Python's json reads it
_TOPIC = r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,126}\z"  # validation.TOPIC_PATTERN, whole string
_TAG = r"[A-Za-z0-9._:-]{1,64}"  # validation.TAG_PATTERN
_TAGS = rf"\A{_WS}\[{_WS}(?:\"{_TAG}\"{_WS}(?:,{_WS}\"{_TAG}\"{_WS}){{0,{MAX_TAGS - 1}}})?\]{_WS}\z"
_STR = r'"[^"\\\x00-\x1f]*+"'  # a JSON string without escapes or control characters
_STR_CAPTURE = r'"([^"\\\x00-\x1f]*+)"'
# a body whose canonical JSON (`validation.encode_body`: compact separators, key order kept,
# ensure_ascii off) is its text without whitespace: a scalar or a flat object or array of
# strings without escapes, whole numbers as Python prints them (no -0, no leading zero, at
# most 18 digits), true, false and null
_SCALAR = rf"(?:{_STR}|(?:0|-?[1-9][0-9]{{0,17}})(?![0-9.eE])|true|false|null)"
_MEMBERS = rf"(?:{_STR}{_WS}:{_WS}{_SCALAR}{_WS}(?:,{_WS}{_STR}{_WS}:{_WS}{_SCALAR}{_WS})*+)?"
_ITEMS = rf"(?:{_SCALAR}{_WS}(?:,{_WS}{_SCALAR}{_WS})*+)?"
_BODY = rf"\A{_WS}(?:{_SCALAR}|\{{{_WS}{_MEMBERS}\}}|\[{_WS}{_ITEMS}\]){_WS}\z"
_PAIR = rf"{_STR}{_WS}:{_WS}{_STR}"
_PROPERTIES = rf"\A{_WS}\{{{_WS}(?:{_PAIR}{_WS}(?:,{_WS}{_PAIR}{_WS})*+)?\}}{_WS}\z"
_PROPERTIES_MAX_CHARS = 4096  # longer ones (legal up to 64 x 4 KiB) take the producer's path
_CONTROL = r"[\x00-\x1f\x7f]"
_WHOLE = r"\A-?[0-9]{1,9}\z"
_DELAY_MS = r"\A[0-9]{1,15}\z"
_DURATION = r"\A(?:[0-9]{1,9}(?:ms|s|m|h|d)){1,16}\z"  # levels.DURATION_PATTERN, bounded
_ONE_DURATION = r"\A([0-9]{1,9})(ms|s|m|h|d)\z"
_INSTANT = (
    r"\A([0-9]{4})-([0-9]{2})-([0-9]{2})[T ]([0-9]{2}):([0-9]{2})"
    r"(?::([0-9]{2})(?:\.([0-9]{1,6}))?)?(Z|[+-][0-9]{2}:[0-9]{2})\z"
)
_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)
NULL = r"\N"  # COPY text's NULL
RID = "_rid"  # the row id bulk.run gives every input row
REPLACED = "\ufffd"  # put by Spark's text readers where the input's bytes are not UTF-8


def prepare(frame: DataFrame, settings: Settings, key_from_row: bool) -> DataFrame:
    """The frame with `_fast`, `_head`, `_body` and `_orig` (see the module's docstring).

    Built in steps (`_step`): a value used by several expressions is computed once as a
    column of its own (Spark does not merge projections that would repeat a costly one)."""
    source = [c for c in frame.columns if c != RID]
    plain: list[Column] = []  # conditions that the cells are usable as text
    cells: dict[str, Column] = {}
    for name in FIELDS:
        text, usable = _cell(frame, name)
        cells[f"__{name}"] = text
        plain.append(usable)
    for name in (c for c in source if c not in FIELDS):  # must be empty
        column = F.col(f"`{name}`")
        if isinstance(frame.schema[name].dataType, StringType):
            plain.append(column.isNull() | (column == ""))
        else:
            plain.append(column.isNull())
    if "deliver_at" in source and isinstance(frame.schema["deliver_at"].dataType, TimestampType):
        cells["__at_ts"] = F.col("deliver_at")
    original = F.struct(*(_original(frame, c) for c in source))
    frame = frame.select(
        RID,
        original.alias("__orig"),
        _all(plain).alias("__plain"),
        *(c.alias(n) for n, c in cells.items()),
    )
    frame = _schedule(frame, settings)

    topic, body, key = F.col("__topic"), F.col("__body"), F.col("__key")
    ok_topic = topic.isNotNull() & topic.rlike(_TOPIC)
    ok_body = body.isNotNull()
    # a keyless row's derived key (--key-from-row) is the producer path's
    ok_key = key.isNotNull() if key_from_row else F.lit(True)
    ok_key = ok_key & (
        key.isNull() | (F.length(key).between(1, MAX_KEY_CHARS) & ~key.rlike(_CONTROL))
    )
    tags, ok_tags = _tags(F.col("__tags"))
    properties, ok_properties = _properties(F.col("__properties"))
    fast = F.coalesce(
        _all([F.col("__plain"), ok_topic, ok_body, ok_key, ok_tags, ok_properties]),
        F.lit(False),
    ) & F.coalesce(F.col("__schedule_ok"), F.lit(False))
    frame = _step(frame, _fast=fast)
    head = F.concat_ws(
        "\t",
        topic,
        F.coalesce(_copy_escape(key), F.lit(NULL)),
        F.coalesce(tags, F.lit(NULL)),
        F.coalesce(_copy_escape(properties), F.lit(NULL)),
        *(
            F.coalesce(F.col(part), F.lit(NULL))
            for part in ("__out_delay_level", "__out_lane", "__out_delay_ms", "__out_deliver_at")
        ),
    )
    fast = F.col("_fast")
    frame = _body_bytes(frame, settings.max_body_bytes)
    encoded = F.col("__body_bytes")
    line = F.concat(head, F.lit("\tt\t\\\\x"), F.lower(F.hex(encoded)), F.lit("\n"))
    return frame.select(
        RID,
        fast,
        F.when(fast & encoded.isNotNull(), line).alias("_line"),
        F.when(fast & encoded.isNull(), head).alias("_head"),
        F.when(fast & encoded.isNull(), body).alias("_body"),
        F.when(~fast, F.col("__orig")).alias("_orig"),
        # the row's topic and key as one value, if it has a key (`bulk.store_fast`)
        F.when(key.isNotNull(), F.concat_ws("\t", topic, key)).alias("_topic_key"),
    )


def _body_bytes(frame: DataFrame, max_bytes: int) -> DataFrame:
    """Adds `__body_bytes`: the bytes `encode_body(body_value(body))` stores, for the bodies
    whose canonical form is the text without the whitespace between tokens (a JSON scalar, or
    a flat object or array of strings without escapes, whole numbers, true, false and null, no
    repeated name, and within `max_bytes`); null for every other body, which Python encodes."""
    text = F.col("__body")
    compact = F.regexp_replace(text, F.lit(f"({_STR})|[ \\t\\n\\r]+"), F.lit("$1"))
    frame = _step(frame, __compact=F.when(text.rlike(_BODY), compact))
    compact = F.col("__compact")
    # in a flat object without escapes every `":` ends a name: with two or more, look for a
    # repeated one (JSON keeps the last, the text would keep both)
    names = (F.length(compact) - F.length(F.replace(compact, F.lit('":'), F.lit("")))) / 2
    spelled = F.regexp_extract_all(compact, F.lit(f"{_STR_CAPTURE}:"), F.lit(1))
    distinct = (names <= 1) | (F.size(F.array_distinct(spelled)) == names)
    data = F.encode(compact, "UTF-8")
    return _step(frame, __body_bytes=F.when(distinct & (F.octet_length(data) <= max_bytes), data))


def _step(frame: DataFrame, **columns: Column) -> DataFrame:
    return frame.select("*", *(c.alias(name) for name, c in columns.items()))


def _all(conditions: list[Column]) -> Column:
    result = F.lit(True)
    for condition in conditions:
        result = result & condition
    return result


def _cell(frame: DataFrame, name: str) -> tuple[Column, Column]:
    """A field as text (empty -> null) and whether the JVM can use that text: strings and
    whole numbers can; other types (and a timestamp deliver_at, used as is) are the producer
    path's unless empty."""
    if name not in frame.columns:
        return F.lit(None).cast("string"), F.lit(True)
    column = F.col(f"`{name}`")
    data_type = frame.schema[name].dataType
    if isinstance(data_type, StringType):
        # U+FFFD: where Spark read bytes that are not UTF-8, the producer path's to refuse
        return F.nullif(column, F.lit("")), ~F.coalesce(column.contains(REPLACED), F.lit(False))
    if isinstance(data_type, _INTEGRAL):
        return column.cast("string"), F.lit(True)
    if name in WHOLE_FIELDS and isinstance(data_type, (DoubleType, FloatType)):
        # pandas writes an integer column with a missing value as floats: a whole one is its
        # number (as `bulk.to_options` takes it), any other the producer path's to refuse
        whole = ~F.isnan(column) & (F.abs(column) < MAX_WHOLE_FLOAT) & (column == F.floor(column))
        return F.when(whole, column.cast("long").cast("string")), column.isNull() | whole
    if name == "deliver_at" and isinstance(data_type, TimestampType):
        return F.date_format(column, "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX"), F.lit(True)
    return F.lit(None).cast("string"), column.isNull()


def _original(frame: DataFrame, name: str) -> Column:
    """A cell as the producer's path reads it. A deliver_at of times without a zone
    (TIMESTAMP_NTZ, as pandas and pyarrow write a naive datetime) as ISO text without an
    offset, which the producer refuses as it refuses the same text in a CSV: Spark would hand
    it to Python as a naive datetime, as it does an instant (TIMESTAMP) in the local time of
    the process, and `bulk._instant` reads a naive datetime as such an instant."""
    column = F.col(f"`{name}`")
    data_type = frame.schema[name].dataType
    if name == "deliver_at" and isinstance(data_type, TimestampNTZType):
        return column.cast("string").alias(name)
    if name in ("topic", "key") and isinstance(data_type, _INTEGRAL):
        # as `_cell` gives it the JVM: a column of whole numbers (order ids) is their text on
        # both paths (the producer's refused it, "must be a string", where the JVM stored it)
        return column.cast("string").alias(name)
    return column


def _copy_escape(text: Column) -> Column:
    """COPY text format: a backslash is doubled (the fast path's values hold no tab, newline
    or carriage return: keys refuse control characters, JSON is re-written compactly)."""
    return F.replace(text, F.lit("\\"), F.lit("\\\\"))


def _tags(text: Column) -> tuple[Column, Column]:
    """-> (the text[] literal, usable). Every element quoted, so a tag `NULL` stays text."""
    elements = F.regexp_extract_all(text, F.lit(f'"({_TAG})"'), F.lit(1))
    literal = F.concat(
        F.lit("{"),
        F.array_join(F.transform(elements, lambda e: F.concat(F.lit('"'), e, F.lit('"'))), ","),
        F.lit("}"),
    )
    ok = text.isNull() | text.rlike(_TAGS)
    return F.when(text.isNotNull(), literal), ok


def _properties(text: Column) -> tuple[Column, Column]:
    """-> (compact JSON for the jsonb column, usable)."""
    parsed = F.from_json(text, "map<string,string>")
    names = F.map_keys(parsed)
    ok = text.isNull() | (
        (F.length(text) <= _PROPERTIES_MAX_CHARS)
        & text.rlike(_PROPERTIES)
        & (F.size(parsed) <= MAX_PROPERTIES)
        & (F.size(F.array_distinct(names)) == F.size(parsed))
        & F.forall(names, lambda n: F.length(n).between(1, MAX_PROPERTY_NAME))
    )
    return F.when(text.isNotNull(), F.to_json(parsed)), ok


def _schedule(frame: DataFrame, settings: Settings) -> DataFrame:
    """Adds `__out_delay_level`, `__out_lane`, `__out_delay_ms`, `__out_deliver_at` (text) and
    `__schedule_ok`: the producer's `resolve_schedule` for the rows whose timing the JVM can
    decide."""
    levels = settings.levels
    level_text, delay_text = F.col("__delay_level"), F.col("__delay")
    ms_text, at_text = F.col("__delay_ms"), F.col("__deliver_at")
    given = sum(
        (c.isNotNull().cast("int") for c in (level_text, delay_text, ms_text, at_text)),
        F.lit(0),
    )

    # delay / delay_ms / the topic's default: a number of ms
    pieces = F.regexp_extract_all(delay_text, F.lit("[0-9]+(?:ms|s|m|h|d)"), F.lit(0))
    duration_ms = F.aggregate(
        pieces,
        F.lit(0).cast("long"),
        lambda total, p: F.try_add(
            total, F.try_multiply(F.regexp_extract(p, "^[0-9]+", 0).try_cast("long"), _unit_ms(p))
        ),
    )
    defaults = settings.default_delays_ms
    if defaults:
        default_ms = F.create_map(*(F.lit(x) for kv in defaults.items() for x in kv))[
            F.col("__topic")
        ]
    else:
        default_ms = F.lit(None).cast("long")
    # one number and unit, the usual spelling, without the higher-order function
    single = F.regexp_extract(delay_text, _ONE_DURATION, 1).try_cast("long") * _unit_ms(
        F.regexp_extract(delay_text, _ONE_DURATION, 2)
    )
    # a level's own spelling (`30m`), the most usual delay of all, is looked up
    spelled = F.create_map(*(F.lit(x) for d in levels.delays_ms for x in (format_ms(d), d)))
    ms = F.coalesce(
        spelled[delay_text].cast("long"),
        F.when(delay_text.rlike(_ONE_DURATION), single)
        .when(delay_text.isNotNull(), F.when(delay_text.rlike(_DURATION), duration_ms))
        .when(ms_text.isNotNull(), F.when(ms_text.rlike(_DELAY_MS), ms_text.try_cast("long")))
        .otherwise(default_ms),
    )
    instant, instant_ok = _instant(frame, at_text)
    frame = _step(
        frame,
        __given=given,
        __level=F.least(
            F.greatest(level_text.try_cast("long"), F.lit(0)), F.lit(levels.max_level)
        ).cast("int"),
        __ms=ms,
        __instant=instant,
        __instant_ok=instant_ok,
    )
    level, ms, instant = F.col("__level"), F.col("__ms"), F.col("__instant")
    ms_ok = ms.isNotNull() | (delay_text.isNull() & ms_text.isNull())
    ms_ok = ms_ok & (F.coalesce(ms, F.lit(0)) <= settings.max_delay_ms)
    exact = F.array_position(F.array(*(F.lit(d) for d in levels.delays_ms)), ms).cast("int")
    ahead_ms = (F.unix_micros(instant) - F.unix_micros(F.current_timestamp())) / 1000
    at_ok = F.col("__instant_ok") & (ahead_ms <= settings.max_delay_ms)
    by_level = level_text.isNotNull()
    by_time = at_text.isNotNull()
    frame = _step(
        frame,
        __exact=exact,
        __due_now=F.when(by_level, level == 0).otherwise(F.coalesce(ms, F.lit(0)) == 0),
        __schedule_ok=(F.col("__given") <= 1)
        & F.when(by_level, level_text.rlike(_WHOLE)).when(by_time, at_ok).otherwise(ms_ok),
    )
    exact, due_now = F.col("__exact"), F.col("__due_now")
    level_delays = F.array(*(F.lit(ms) for ms in (0, *levels.delays_ms)))
    lane = (
        F.when(by_time, F.lit(TIMER_LANE))
        .when(due_now, F.lit(NO_LANE))
        .when(by_level, level)
        .when(exact > 0, exact)
        .otherwise(F.lit(TIMER_LANE))
    )
    delay_level = (
        F.when(by_time, F.lit(None))
        .when(due_now, F.lit(0))
        .when(by_level, level)
        .when(exact > 0, exact)
    )
    delay_ms = (
        F.when(by_time, F.lit(None))
        .when(due_now, F.lit(0))
        .when(by_level, F.element_at(level_delays, level + 1))
        .otherwise(ms)
    )
    deliver_at = F.when(by_time, F.date_format(instant, "yyyy-MM-dd HH:mm:ss.SSSSSSXXX"))
    return _step(
        frame,
        __out_delay_level=delay_level.cast("string"),
        __out_lane=lane.cast("string"),
        __out_delay_ms=delay_ms.cast("string"),
        __out_deliver_at=deliver_at,
    )


def _unit_ms(piece: Column) -> Column:
    unit = F.regexp_extract(piece, "[a-z]+$", 0)
    result = F.lit(86_400_000).cast("long")
    for name, ms in (("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)):
        result = F.when(unit == name, F.lit(ms).cast("long")).otherwise(result)
    return result


def _instant(frame: DataFrame, text: Column) -> tuple[Column, Column]:
    """deliver_at -> (the instant, usable): a timestamp column as it is; text in the ISO 8601
    form `YYYY-MM-DD[T ]HH:MM[:SS[.ffffff]](Z|+HH:MM)`, years 1970-2999, which Python's
    `datetime.fromisoformat` reads as the same instant."""
    if "__at_ts" in frame.columns:
        column = F.col("__at_ts")
        return column, F.year(column).between(1970, 2999)
    part = [F.regexp_extract(text, _INSTANT, i) for i in range(9)]
    matched = text.rlike(_INSTANT)
    second = F.when(part[6] == "", F.lit("0")).otherwise(part[6])
    fraction = F.when(part[7] == "", F.lit("0")).otherwise(part[7])
    local = F.try_make_timestamp(
        part[1].try_cast("int"),
        part[2].try_cast("int"),
        part[3].try_cast("int"),
        part[4].try_cast("int"),
        part[5].try_cast("int"),
        F.concat(second, F.lit("."), fraction).try_cast("decimal(8,6)"),
        F.lit("UTC"),
    )
    zone = part[8]
    sign = F.when(F.substring(zone, 1, 1) == "-", F.lit(-1)).otherwise(F.lit(1))
    offset_h = F.when(zone == "Z", F.lit(0)).otherwise(F.substring(zone, 2, 2).try_cast("int"))
    offset_m = F.when(zone == "Z", F.lit(0)).otherwise(F.substring(zone, 5, 2).try_cast("int"))
    offset_us = sign * (offset_h * 3600 + offset_m * 60) * F.lit(1_000_000).cast("long")
    instant = F.timestamp_micros(F.unix_micros(local) - offset_us)
    ok = (
        matched
        & local.isNotNull()
        & part[1].try_cast("int").between(1970, 2999)
        & (second.try_cast("int") <= 59)
        & (offset_h <= 23)
        & (offset_m <= 59)
    )
    return F.when(matched, instant), ok
