"""The dashboard's blueprint and its guards: login, roles, CSRF, error pages.

Every page needs a logged-in user (users come from `delaysvc create-user`); `viewer` reads,
`admin` also acts. Every POST carries the session's CSRF token (a form field, or the
`X-CSRF-Token` header for fetch calls) and is refused with 400 without it. Pages redirect to
/login when nobody is logged in; the JSON endpoints under /ui/ answer 401 instead. Bad input (a
NUL in any parameter included) gets the dashboard's 400 page naming it, or JSON under /ui/.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from functools import wraps
from typing import Any
from urllib.parse import urlsplit

from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    flash,
    g,
    jsonify,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from sqlalchemy.exc import DataError, OperationalError
from werkzeug.exceptions import HTTPException

from delaysvc import auth, store
from delaysvc.config.settings import Settings
from delaysvc.errors import DelaysvcError, ValidationError
from delaysvc.web.api import services
from delaysvc.web.errors import STATUS

log = logging.getLogger(__name__)

ui = Blueprint("ui", __name__)
PUBLIC_ENDPOINTS = {"login", "static"}
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"
SESSION_GENERATION = "generation"
"""The session's key for the user's session generation at login (see `current_user`)."""
LOGGED_IN_AT = "since"
"""The session's key for its login time (Unix time): it lasts PERMANENT_SESSION_LIFETIME from
there (see `current_user`)."""


def session_secret(settings: Settings) -> str | None:
    """The key that signs session cookies: DELAYSVC_SECRET_KEY, else a random key made once
    and kept in `var_dir/secret_key` (mode 0600), so that every web worker started from the
    same folder accepts the others' cookies (a random key per process would log users out
    whenever gunicorn routes a request to another worker). None if that file cannot be
    written: the app then keeps its per-process key."""
    if settings.secret_key:
        return settings.secret_key
    path = settings.var_dir / "secret_key"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            draft = path.with_name(f".secret_key.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32))
            try:
                os.link(draft, path)  # atomic; the first worker to get here wins
            except FileExistsError:
                pass
            finally:
                draft.unlink()
        return path.read_text().strip() or None
    except OSError as exc:
        log.warning("dashboard.no_shared_secret", extra={"path": str(path), "error": str(exc)})
        return None


def timeout_ms() -> int:
    return int(services()["settings"].statement_timeout_ms)


# ---------------------------------------------------------------- CSRF


def csrf_token() -> str:
    """The session's CSRF token (made on first use; rotated at login and logout)."""
    token = session.get("csrf")
    if not token:
        token = session["csrf"] = secrets.token_urlsafe(32)
    return str(token)


def csrf_ok() -> bool:
    sent = request.form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER) or ""
    expected = session.get("csrf") or ""
    return bool(expected) and hmac.compare_digest(str(sent), str(expected))


# ---------------------------------------------------------------- the logged-in user


def current_user() -> Any:
    """The dashboard_user row of the session, read again on every request so that a deleted
    user or a changed role takes effect at once. None when nobody is logged in, and when the
    session's generation is not the user's (the user logged out, or got a new password, since
    this session's login: every copy of its cookie is then no session)."""
    if "user" not in g:
        name = session.get("user")
        user = None
        # a session lasts from its login, however often it is used: the cookie's own expiry
        # moves on with each answer (the overview's polls kept a session, or a copy of it, alive
        # for good); an ended one is no session, nothing read for it
        lasts = current_app.permanent_session_lifetime.total_seconds()
        if name and time.time() - float(session.get(LOGGED_IN_AT, 0)) <= lasts:
            with services()["engine"].connect() as conn:
                user = store.find_user(conn, name)
            if user is not None and session.get(SESSION_GENERATION) != user.session_generation:
                user = None
        g.user = user
    return g.user


def is_admin() -> bool:
    user = current_user()
    return user is not None and user.role == "admin"


def admin_required(view: Callable[..., Any]) -> Callable[..., Any]:
    """Viewers get 403 (their pages have no action buttons either)."""

    @wraps(view)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not is_admin():
            abort(403, "this action needs the admin role")
        return view(*args, **kwargs)

    return guarded


def wants_json() -> bool:
    return request.path.startswith("/ui/")


NUL_ALLOWED = {"password"}
"""Form fields that may hold a NUL (a password is only hashed, never stored or sought)."""


def refuse_nul() -> None:
    """A NUL in a query parameter, a form field or the path: a ValidationError naming it (the
    dashboard's 400 page), before a statement would send it to PostgreSQL, whose text cannot
    hold one (that DataError is the JSON API's answer, not a page)."""
    fields = [
        *request.args.items(multi=True),
        *((name, value) for name, value in request.form.items(multi=True)),
        *(request.view_args or {}).items(),
    ]
    for name, value in fields:
        if isinstance(value, str) and "\x00" in value and name not in NUL_ALLOWED:
            raise ValidationError(name, "must not contain a NUL character (%00)")


@ui.before_request
def guard() -> Any:
    refuse_nul()
    if request.endpoint and request.endpoint.rsplit(".", 1)[-1] in PUBLIC_ENDPOINTS:
        if request.method == "POST" and not csrf_ok():
            abort(400, "the form has expired; reload the page and try again")
        return None
    if current_user() is None:
        if wants_json():
            return jsonify({"error": {"code": "unauthorized", "message": "log in"}}), 401
        return redirect(url_for("dashboard.ui.login", next=request.full_path.rstrip("?")))
    if request.method == "POST" and not csrf_ok():
        abort(400, "the form has expired; reload the page and try again")
    return None


@ui.after_request
def no_store(response: Response) -> Response:
    """Pages show live state: never serve them from a cache (or show them after logout)."""
    if request.endpoint and not request.endpoint.endswith("static"):
        response.headers["Cache-Control"] = "no-store"
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault(
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "frame-ancestors 'none'; form-action 'self'",
    )
    return response


@ui.app_context_processor
def template_globals() -> dict[str, Any]:
    return {"csrf_token": csrf_token, "current_user": current_user, "is_admin": is_admin}


# ---------------------------------------------------------------- login and logout


def safe_next(target: str | None) -> str:
    """Only a path on this site (no scheme, no host, no `//`): no open redirect. Nor a control
    character (urlsplit skips a line break, which then failed the redirect's header: a 500
    after the login) or a backslash (browsers read `/\\host` as `//host`)."""
    if not target or any(c < " " or c in "\x7f\\" for c in target):
        return url_for("dashboard.ui.overview")
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return url_for("dashboard.ui.overview")
    return target


@ui.route("/login", methods=["GET", "POST"])
def login() -> Any:
    error, status, headers = None, 200, {}
    if request.method == "POST":
        name = request.form.get("name", "")
        password = request.form.get("password", "")
        client = auth.client_of(request.remote_addr)
        _say_if_behind_a_proxy()
        try:
            user = auth.check_login(services()["engine"], name, password, client) if name else None
        except auth.TooManyLogins as exc:
            log.warning("dashboard.login_throttled", extra={"client": client})
            minutes = -(-exc.seconds_left // 60)
            error = f"too many failed logins from your address; try again in {minutes} min"
            status, headers = 429, {"Retry-After": str(exc.seconds_left)}
        else:
            if user is not None:
                session.clear()
                session.permanent = True  # expires after PERMANENT_SESSION_LIFETIME
                session["user"] = user.name
                session[SESSION_GENERATION] = user.session_generation
                session[LOGGED_IN_AT] = time.time()
                session["csrf"] = secrets.token_urlsafe(32)
                log.info("dashboard.login", extra={"user": user.name})
                return redirect(safe_next(request.form.get("next")))
            log.warning("dashboard.login_failed", extra={"user": name})
            error = "wrong name or password (or the account is locked for a few minutes)"
            status = 401
    next_url = request.form.get("next") or request.args.get("next", "")
    page = render_template("login.html", error=error, next=next_url)
    return page, status, headers


def _say_if_behind_a_proxy() -> None:
    """A login that came through a proxy while DELAYSVC_PROXY_HOPS is 0: every client counts as
    the proxy (one count of failed logins for all of them). Said once an app."""
    app = services()
    forwarded = "X-Forwarded-For" in request.headers and not app["settings"].proxy_hops
    if forwarded and not app.get("proxy_said"):
        app["proxy_said"] = True
        log.warning(
            "dashboard.forwarded_not_believed",
            extra={
                "client": request.remote_addr,
                "hint": "logins carry X-Forwarded-For but DELAYSVC_PROXY_HOPS is 0: every "
                "client counts as the proxy; set it to the number of proxies in front",
            },
        )


@ui.post("/logout")
def logout() -> Any:
    """End the session: every session of the user, on every browser and every copy of the
    cookie (a copied cookie would otherwise work on until its 12 hours end)."""
    user = current_user()
    log.info("dashboard.logout", extra={"user": user.name})
    auth.end_sessions(services()["engine"], user)
    session.clear()
    flash("logged out")
    return redirect(url_for("dashboard.ui.login"))


# ---------------------------------------------------------------- errors


def _error_page(status: int, message: str) -> Any:
    if wants_json():
        code = "timeout" if status == 503 else "error"
        return jsonify({"error": {"code": code, "message": message}}), status
    return render_template("error.html", status=status, message=message), status


@ui.errorhandler(DelaysvcError)
def domain_error(exc: DelaysvcError) -> Any:
    return _error_page(STATUS.get(exc.code, 400), str(exc))


@ui.errorhandler(HTTPException)
def http_error(exc: HTTPException) -> Any:
    return _error_page(exc.code or 500, exc.description or exc.name)


@ui.errorhandler(DataError)
def refused_by_database(exc: DataError) -> Any:
    """Input no check anticipated, refused by PostgreSQL (a number out of range): the user's
    mistake, answered with the dashboard's page (the API's handler answers JSON)."""
    log.warning("dashboard.data_error", extra={"error": str(exc.orig)})
    return _error_page(400, f"a value was refused: {exc.orig}")


@ui.errorhandler(OperationalError)
def database_error(exc: OperationalError) -> Any:
    """Mostly the statement timeout: say so, rather than a bare 500."""
    log.warning("dashboard.query_failed", extra={"error": str(exc.orig)})
    if "statement timeout" in str(exc.orig):
        return _error_page(503, "the query took too long; narrow the search and try again")
    return _error_page(503, "the database is not answering; try again shortly")


def done(message: str) -> None:
    """Tell the user, on the next page, what an action did."""
    flash(message)
