"""The Flask app: HTTP API (`/api/v1`), dashboard (`/`), health and metrics."""

from __future__ import annotations

import secrets

from flask import Flask

from delaysvc.db import make_engine
from delaysvc.producer import Producer
from delaysvc.settings import Settings


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = Flask(__name__)
    app.config.update(
        SECRET_KEY=settings.secret_key or secrets.token_hex(32),
        MAX_CONTENT_LENGTH=settings.max_body_bytes * 2 + 64 * 1024,
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        JSON_SORT_KEYS=False,
    )
    engine = make_engine(settings)
    app.extensions["delaysvc"] = {
        "settings": settings,
        "engine": engine,
        "producer": Producer(settings, engine),
    }
    from web.api import api
    from web.dashboard import dashboard
    from web.errors import register_error_handlers

    app.register_blueprint(api, url_prefix="/api/v1")
    app.register_blueprint(dashboard)
    register_error_handlers(app)
    return app
