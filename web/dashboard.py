"""The operator dashboard (server-rendered, no CDN: its CSS and script are in web/static),
health and metrics.

`/healthz` and `/metrics` are open (probes and Prometheus). Everything else is the `ui`
blueprint (web/ui.py), nested here: login required, roles, CSRF. Pages:
overview (`/`), topics, messages, message, dead letters; see docs/dashboard.md.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from flask import Blueprint, Response, jsonify
from flask.blueprints import BlueprintSetupState
from prometheus_client import CONTENT_TYPE_LATEST

from web import ui_dead, ui_messages, ui_views  # noqa: F401  (they attach their routes to `ui`)
from web.api import database_ok, services
from web.ui import session_secret, ui

dashboard = Blueprint("dashboard", __name__)
dashboard.register_blueprint(ui)
SESSION_HOURS = 12


@dashboard.record_once
def _session_cookie(state: BlueprintSetupState) -> None:
    """HttpOnly and SameSite=Lax always; Secure when DELAYSVC_SECURE_COOKIES is set (https);
    one signing key for every worker (see `session_secret`)."""
    settings = state.app.extensions["delaysvc"]["settings"]
    secret = session_secret(settings)
    if secret:
        state.app.config["SECRET_KEY"] = secret
    state.app.config.update(
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_SECURE=bool(settings.secure_cookies),
        SESSION_COOKIE_NAME="delaysvc_session",
        PERMANENT_SESSION_LIFETIME=timedelta(hours=SESSION_HOURS),
    )


@dashboard.get("/healthz")
def healthz() -> Any:
    ok = database_ok()
    return jsonify({"status": "ok" if ok else "degraded", "database": ok}), 200 if ok else 503


@dashboard.get("/metrics")
def metrics() -> Any:
    from web.metrics import render

    settings = services()["settings"]
    body = render(services()["engine"], settings.statement_timeout_ms)
    return Response(body, content_type=CONTENT_TYPE_LATEST)
