"""Both log formats show every `extra=` field, and no extra shadows a standard one."""

from __future__ import annotations

import io
import json
import logging

import pytest

from delaysvc.config import logs


def _logged(log_format: str, **extra: object) -> str:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.formatter(log_format))  # type: ignore[arg-type]
    logger = logging.getLogger(f"tests.log_formats.{log_format}")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("schema.level_changed", extra=extra)
    finally:
        logger.removeHandler(handler)
    return out.getvalue().strip()


def test_a_json_extra_named_like_a_standard_field_never_replaces_it() -> None:
    record = json.loads(_logged("json", level=3, logger="x", event="y", message_id=5))
    assert (record["level"], record["event"]) == ("WARNING", "schema.level_changed")
    assert record["logger"] == "tests.log_formats.json"
    assert (record["extra_level"], record["extra_logger"], record["extra_event"]) == (3, "x", "y")
    assert record["message_id"] == 5


def test_the_text_format_ends_with_every_extra_quoted_where_needed() -> None:
    line = _logged("text", level=3, message_id=5, hint='a "b"', rows=[1, 2])
    head, fields = line.split(" schema.level_changed ")
    assert head.endswith("WARNING tests.log_formats.text")
    assert fields == 'extra_level=3 message_id=5 hint="a \\"b\\"" rows="[1, 2]"'


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_record_without_extras_is_the_plain_line(log_format: str) -> None:
    line = _logged(log_format)
    if log_format == "text":
        assert line.endswith("WARNING tests.log_formats.text schema.level_changed")
    else:
        assert set(json.loads(line)) == {"timestamp", "level", "logger", "event"}
