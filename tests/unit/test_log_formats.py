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


RECORD_FIELDS = {*vars(logging.makeLogRecord({})), "message", "asctime"}


def _extras_naming_a_record_field() -> list[str]:
    """Every `extra={...}` literal in delaysvc whose key is a LogRecord attribute."""
    import ast
    from pathlib import Path

    import delaysvc

    found = []
    for path in sorted(Path(delaysvc.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            literal = isinstance(node, ast.keyword) and isinstance(node.value, ast.Dict)
            if literal and node.arg == "extra":
                keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
                found += [f"{path.name}:{node.lineno} {k}" for k in keys if k in RECORD_FIELDS]
    return found


def test_no_extra_is_named_like_a_log_records_own_field() -> None:
    """`logging` raises KeyError for an extra named like a LogRecord attribute, but only when
    the record is made, at the level it is enabled: `handlers.loaded` gave `module=` at INFO,
    and a consume worker run with `-l info` failed every consume task (found trying two
    deployments on one broker)."""
    assert _extras_naming_a_record_field() == []


def test_handler_modules_load_with_info_enabled(caplog) -> None:
    from delaysvc.worker.handlers import load_handler_modules

    with caplog.at_level("INFO", logger="delaysvc.worker.consumer"):
        load_handler_modules(("json",))
    assert [r.message for r in caplog.records] == ["handlers.loaded"]
