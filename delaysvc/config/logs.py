"""Logging for every process delaysvc starts: the CLI, Celery's worker and beat (through
Celery's `setup_logging` signal, `delaysvc.tasks.app`) and the web app
(`delaysvc.web.create_app`, under gunicorn).

`DELAYSVC_LOG_FORMAT=text` (the default) writes `time level logger event key=value ...` lines,
one `key=value` per field the code passed in `extra=` (ids, counts, lanes; logfmt's quoting);
`DELAYSVC_LOG_FORMAT=json` writes one JSON object per line: `timestamp` (UTC, ISO 8601),
`level`, `logger`, `event` (the message, a stable event name in delaysvc's own records) and
every `extra=` field, plus `exc_info` when there is a traceback. The JSON formatter is
python-json-logger's. In either format an extra never shadows a standard field: one named like
it (`level`, say) comes out as `extra_level`.

Like `logging.basicConfig`, `configure` leaves alone a root logger that the host application
(or a test runner) has already given handlers: delaysvc is a guest in other people's processes.
Calling it again replaces only the handler it installed itself.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

if TYPE_CHECKING:
    from delaysvc.config.settings import LogFormat, Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
JSON_FIELDS = {"levelname": "level", "name": "logger", "message": "event"}
STANDARD = {*RESERVED_ATTRS, "taskName", "timestamp", "exc_info", *JSON_FIELDS.values()}
"""A record's own attributes and the names the formats give them: no extra may take these."""
HANDLER_NAME = "delaysvc"


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The fields the code passed in `extra=`, an `extra_` before any that would shadow a
    standard field (Python refuses only a record's own attributes; `level` it lets through)."""
    found = {}
    for key, value in record.__dict__.items():
        if key in RESERVED_ATTRS or key == "taskName" or key.startswith("_"):
            continue
        found[f"extra_{key}" if key in STANDARD else key] = value
    return found


def _logfmt(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text and not any(c in text for c in ' "=\\\n'):
        return text
    return json.dumps(text)


class TextFormatter(logging.Formatter):
    """`time level logger event`, then the extras as `key=value` pairs."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = extras(record)
        if not fields:
            return line
        return line + " " + " ".join(f"{key}={_logfmt(v)}" for key, v in fields.items())


class JsonLineFormatter(JsonFormatter):
    """python-json-logger's, with the extras renamed as `extras` says."""

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        own = {k: v for k, v in vars(record).items() if k in RESERVED_ATTRS or k == "taskName"}
        super().add_fields(log_data, logging.makeLogRecord(own), message_dict)
        log_data.update(extras(record))


def formatter(log_format: LogFormat) -> logging.Formatter:
    if log_format == "json":
        return JsonLineFormatter(
            [*JSON_FIELDS],
            rename_fields=JSON_FIELDS,
            timestamp=True,
            # Python 3.12 gives every record a `taskName` (asyncio), None outside a task
            reserved_attrs=[*RESERVED_ATTRS, "taskName"],
        )
    return TextFormatter()


def configure(
    settings: Settings, level: int | str = logging.WARNING, logfile: str | None = None
) -> None:
    """Log records of `level` and above from every logger to stderr (or `logfile`), in the
    format of DELAYSVC_LOG_FORMAT."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if h.get_name() == HANDLER_NAME]
    if len(ours) < len(root.handlers):
        return  # configured by someone else
    handler: logging.Handler = (
        logging.FileHandler(logfile) if logfile else logging.StreamHandler(sys.stderr)
    )
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(formatter(settings.log_format))
    for old in ours:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # a library's warning is a record too, in the same format


class Unconfigured(logging.Handler):
    """delaysvc's warnings in a process that set up no logging (a script that sends messages):
    Python's last resort writes only a record's message, delaysvc's bare event name
    (`producer.reconnecting`), without the fields that say what happened. On the `delaysvc`
    logger, this writes them to stderr as the text format does while the root logger has no
    handler; once the application (or `configure`) gives it one, this writes nothing and the
    records go there alone."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.set_name("delaysvc-unconfigured")
        self.setFormatter(TextFormatter())

    def handle(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers:
            return False
        return bool(super().handle(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def guard_unconfigured() -> None:
    """Put `Unconfigured` on the `delaysvc` logger, once a process."""
    package = logging.getLogger("delaysvc")
    if not any(isinstance(handler, Unconfigured) for handler in package.handlers):
        package.addHandler(Unconfigured())


class Sparingly:
    """A warning said at most once every `seconds` (the monotonic clock), not once an event:
    `if said.now(): log.warning(...)`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at: float | None = None

    def now(self) -> bool:
        at = time.monotonic()
        if self._at is not None and at - self._at < self.seconds:
            return False
        self._at = at
        return True
