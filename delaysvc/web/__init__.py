"""The Flask app: HTTP API (`/api/v1`), dashboard (`/`), health and metrics."""

from __future__ import annotations

import secrets
from datetime import timedelta

from flask import Flask, Request
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface
from werkzeug.middleware.proxy_fix import ProxyFix
from werkzeug.routing import IntegerConverter

from delaysvc.config import logs
from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.producer.sending import Producer

SESSION_HOURS = 12
WEB_GROUP_WRITERS = 2
"""Single sends a web worker writes at once before the next ones wait and go together."""
API_PREFIX = "/api/v1"


class AsciiIntegerConverter(IntegerConverter):
    r"""`<int:...>` in a path: the digits 0-9 only. Werkzeug's matches `\d+`, every script's
    digits, and int() reads them (`/messages/\u0661`, an Arabic-Indic one, was message 1);
    here they match no route: 404. At most 19 digits, a bigint's: int() of more than 4,300
    raised, a 500."""

    regex = r"[0-9]{1,19}"


class _DashboardSessions(SecureCookieSessionInterface):
    """The dashboard's signed-cookie sessions, and none for the JSON API: its requests carry a
    token, and opening a session builds a signing serializer each time (a tenth of a single
    send's request). An API request gets Flask's null session: nothing read, no cookie set."""

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        if request.path.startswith(API_PREFIX + "/"):
            return None
        return super().open_session(app, request)


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    logs.configure(settings)  # DELAYSVC_LOG_FORMAT; a host that set up logging keeps its own
    app = Flask(__name__)
    from delaysvc.web.answers import Answers
    from delaysvc.web.ui import session_secret

    app.config.update(
        # one signing key for every web worker (see session_secret)
        SECRET_KEY=session_secret(settings) or secrets.token_hex(32),
        MAX_CONTENT_LENGTH=settings.max_body_bytes * 2 + 64 * 1024,
        SESSION_COOKIE_NAME="delaysvc_session",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_SECURE=settings.secure_cookies,  # DELAYSVC_SECURE_COOKIES, for https
        PERMANENT_SESSION_LIFETIME=timedelta(hours=SESSION_HOURS),
    )
    app.session_interface = _DashboardSessions()
    app.json = Answers(app)
    app.json.sort_keys = False  # answers keep the order built
    app.url_map.converters["int"] = AsciiIntegerConverter
    engine = make_engine(settings)
    # requests served at once by a worker's threads: their single sends are written together
    # (group commit, `delaysvc.producer.grouping`)
    producer = Producer(settings, engine, group_writers=WEB_GROUP_WRITERS)
    app.extensions["delaysvc"] = {"settings": settings, "engine": engine, "producer": producer}
    from delaysvc.web.api import api
    from delaysvc.web.dashboard import dashboard
    from delaysvc.web.errors import register_error_handlers
    from delaysvc.web.quick import QuickSends

    app.register_blueprint(api, url_prefix=API_PREFIX)
    app.register_blueprint(dashboard)
    register_error_handlers(app)
    app.wsgi_app = QuickSends(app, API_PREFIX + "/messages", producer, engine)  # type: ignore[method-assign]
    if settings.proxy_hops:  # the client's address as the proxies in front saw it
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=settings.proxy_hops)  # type: ignore[method-assign]
    return app
