"""gunicorn's own records (its master's lines, the access log) in DELAYSVC_LOG_FORMAT=json:
gunicorn formats them with handlers of its own, which `delaysvc.config.logs.configure` leaves alone;
`web_command` names this class with `--logger-class` when the format is json."""

from __future__ import annotations

from typing import Any

from gunicorn import glogging

from delaysvc.config.logs import formatter


class JsonLogger(glogging.Logger):
    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        for log in (self.error_log, self.access_log):
            for handler in log.handlers:
                handler.setFormatter(formatter("json"))
