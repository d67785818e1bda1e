"""The operator dashboard (server-rendered, no CDN: its CSS and script are in web/static),
health and metrics.

`/healthz` and `/metrics` are open (probes and Prometheus). Everything else is the `ui`
blueprint (web/ui.py), nested here: login required, roles, CSRF. Pages:
overview (`/`), topics, messages, message, dead letters; see docs/dashboard.md.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify
from prometheus_client import CONTENT_TYPE_LATEST

from web import ui_dead, ui_messages, ui_views  # noqa: F401  (they attach their routes to `ui`)
from web.api import services
from web.ui import ui

dashboard = Blueprint("dashboard", __name__)
dashboard.register_blueprint(ui)


@dashboard.get("/healthz")
def healthz() -> Any:
    """200 while the database answers (this process can serve); the body also says whether
    beat and the consumers are alive (`status` "degraded" when one is not)."""
    from delaysvc.health import check

    health = check(services()["engine"])
    body = {
        "status": health.status,
        "database": health.database,
        **health.components,
        "seconds_since": health.seconds_since,
    }
    return jsonify(body), 200 if health.database else 503


@dashboard.get("/metrics")
def metrics() -> Any:
    from web.metrics import render

    settings = services()["settings"]
    body = render(services()["engine"], settings.statement_timeout_ms)
    return Response(body, content_type=CONTENT_TYPE_LATEST)
