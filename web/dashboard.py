"""The operator dashboard (server-rendered, no CDN), health and metrics."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, render_template
from prometheus_client import CONTENT_TYPE_LATEST

from delaysvc import store
from web.api import database_ok, lane_json, services

dashboard = Blueprint("dashboard", __name__)


@dashboard.get("/")
def overview():
    with services()["engine"].connect() as conn:
        lanes = [lane_json(row) for row in store.lane_stats(conn)]
    return render_template("overview.html", lanes=lanes)


@dashboard.get("/healthz")
def healthz():
    ok = database_ok()
    return jsonify({"status": "ok" if ok else "degraded", "database": ok}), 200 if ok else 503


@dashboard.get("/metrics")
def metrics():
    from web.metrics import render

    settings = services()["settings"]
    body = render(services()["engine"], settings.statement_timeout_ms)
    return Response(body, content_type=CONTENT_TYPE_LATEST)
