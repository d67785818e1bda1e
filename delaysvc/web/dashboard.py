"""The operator dashboard (server-rendered, no CDN: its CSS and script are in web/static),
health and metrics.

`/healthz` is open (probes); `/metrics` too (Prometheus), unless DELAYSVC_METRICS_TOKEN is set:
then it needs `Authorization: Bearer <that token>`. Everything else is the `ui`
blueprint (web/ui.py), nested here: login required, roles, CSRF. Pages:
overview (`/`), topics, messages, message, dead letters; see docs/dashboard.md.
"""

from __future__ import annotations

import hmac
from typing import Any

from flask import Blueprint, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST

from delaysvc.web import ui_dead, ui_messages, ui_views  # noqa: F401  (they attach their routes to `ui`)
from delaysvc.web.api import bearer_token, services
from delaysvc.web.errors import error_response
from delaysvc.web.ui import ui

dashboard = Blueprint("dashboard", __name__)
dashboard.register_blueprint(ui)


@dashboard.get("/healthz")
def healthz() -> Any:
    """200 while the database answers (this process can serve); the body also says whether
    beat and the consumers are alive (`status` "degraded" when one is not)."""
    from delaysvc.maintenance.heartbeats import read_health

    health = read_health(services()["engine"])
    body = {
        "status": health.status,
        "database": health.database,
        **health.components,
        "seconds_since": health.seconds_since,
    }
    return jsonify(body), 200 if health.database else 503


@dashboard.get("/metrics")
def metrics() -> Any:
    from delaysvc.web.metrics import render

    settings = services()["settings"]
    if settings.metrics_token is not None and not _bearer_is(settings.metrics_token):
        return error_response(
            401, "unauthorized", "send Authorization: Bearer <the DELAYSVC_METRICS_TOKEN>"
        )
    body = render(services()["engine"], settings.statement_timeout_ms, settings.metrics_max_topics)
    return Response(body, content_type=CONTENT_TYPE_LATEST)


def _bearer_is(expected: str) -> bool:
    """Whether the request carries `Authorization: Bearer <expected>`, compared in constant
    time (as bytes: compare_digest refuses non-ASCII strings)."""
    sent = bearer_token(request.headers.get("Authorization", ""))  # `bearer` in any case too
    return sent is not None and hmac.compare_digest(sent.encode(), expected.encode())
