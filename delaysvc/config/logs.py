"""Logging for every process delaysvc starts: the CLI, Celery's worker and beat (through
Celery's `setup_logging` signal, `delaysvc.tasks.app`) and the web app
(`delaysvc.web.create_app`, under gunicorn).

`DELAYSVC_LOG_FORMAT=text` (the default) writes `time level logger event` lines;
`DELAYSVC_LOG_FORMAT=json` writes one JSON object per line: `timestamp` (UTC, ISO 8601),
`level`, `logger`, `event` (the message, a stable event name in delaysvc's own records) and
every field the code passed in `extra=` (ids, counts, lanes), plus `exc_info` when there is a
traceback. The formatter is python-json-logger's.

Like `logging.basicConfig`, `configure` leaves alone a root logger that the host application
(or a test runner) has already given handlers: delaysvc is a guest in other people's processes.
Calling it again replaces only the handler it installed itself.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

if TYPE_CHECKING:
    from delaysvc.config.settings import LogFormat, Settings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
JSON_FIELDS = {"levelname": "level", "name": "logger", "message": "event"}
HANDLER_NAME = "delaysvc"


def formatter(log_format: LogFormat) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(
            [*JSON_FIELDS],
            rename_fields=JSON_FIELDS,
            timestamp=True,
            # Python 3.12 gives every record a `taskName` (asyncio), None outside a task
            reserved_attrs=[*RESERVED_ATTRS, "taskName"],
        )
    return logging.Formatter(TEXT_FORMAT)


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
