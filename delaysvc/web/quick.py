"""`POST /api/v1/messages`, the API's most frequent request, answered without Flask's request
machinery.

A single send's request spent more of a web worker's CPU in Flask's and Werkzeug's request,
context and response objects than in the send itself: under gunicorn -w 4, 689 us a request
with the thinnest Flask view calling the producer against 487 us for a WSGI callable doing the
same (docs/benchmarks/2026-11-29-http-send-floor). `QuickSends` wraps the app's WSGI callable
and takes such a request when it is the plain case: a JSON body (`Content-Type:
application/json`) whose length is given and within the app's limit, a live API token, an
object in the body. That request is sent by the API's own `api.send_one`, and its answer
written straight, as Flask's `jsonify` writes it. Everything else goes to the Flask app whole
(a body already read is put back), which answers it as it always did; an error the send raises
is answered by the app's own error handlers, in a request context made for it. Both ways give
the same answers: the API's tests run through this wrapper.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from io import BytesIO
from typing import Any

from flask import (
    Flask,
    appcontext_popped,
    appcontext_pushed,
    appcontext_tearing_down,
    got_request_exception,
    request_finished,
    request_started,
    request_tearing_down,
)
from sqlalchemy import Engine

from delaysvc.auth import ApiToken, authenticate_token
from delaysvc.config.validation import ascii_digits
from delaysvc.producer.sending import Producer
from delaysvc.web.api import bearer_token, send_one

_STATUS = {201: "201 CREATED", 200: "200 OK"}  # as Werkzeug's responses spell them

_SIGNALS = (
    request_started,
    request_finished,
    got_request_exception,
    request_tearing_down,
    appcontext_pushed,
    appcontext_popped,
    appcontext_tearing_down,
)

StartResponse = Callable[..., Any]


class QuickSends:
    """The Flask `app`'s WSGI callable, with single sends taken the quick way."""

    def __init__(self, app: Flask, path: str, producer: Producer, engine: Engine):
        self.app = app
        self.path = path  # the API's single sends: `/api/v1/messages`
        self.flask = app.wsgi_app  # the callable this one stands in front of
        self.producer = producer
        self.engine = engine

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if (
            environ.get("PATH_INFO") != self.path
            or environ.get("REQUEST_METHOD") != "POST"
            or requests_hooked(self.app)
        ):
            return self.flask(environ, start_response)
        try:
            sender = self._sender(environ)
        except Exception as exc:  # the database down, say: the app's 503
            return self._error(environ, start_response, exc)
        size = content_length(environ.get("CONTENT_LENGTH", ""))
        limit = self.app.config["MAX_CONTENT_LENGTH"]  # as Flask reads it: at each request
        if sender is None or size is None or (limit is not None and size > limit):
            return self.flask(environ, start_response)
        body = environ["wsgi.input"].read(size)
        environ["wsgi.input"] = BytesIO(body)  # for Flask, if it answers after all
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # Flask's own answer names the problem
            data = None
        if type(data) is not dict or len(body) != size:
            return self.flask(environ, start_response)
        try:
            answer, status = send_one(self.producer, sender, data)
        except Exception as exc:  # every error is the app's handlers' to answer
            environ["wsgi.input"].seek(0)
            return self._error(environ, start_response, exc)
        payload = self.app.json.response(answer).get_data()  # type: ignore[attr-defined]
        start_response(
            _STATUS[status],
            [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))],
        )
        return [payload]

    def _sender(self, environ: dict[str, Any]) -> ApiToken | None:
        """The request's live token, if it is a JSON request with one (else Flask answers)."""
        kind = environ.get("CONTENT_TYPE", "").partition(";")[0].strip().lower()
        given = bearer_token(environ.get("HTTP_AUTHORIZATION", ""))
        if kind != "application/json" or given is None:
            return None
        return authenticate_token(self.engine, given)

    def _error(
        self, environ: dict[str, Any], start_response: StartResponse, exc: Exception
    ) -> Iterable[bytes]:
        """`exc` answered as Flask answers an error its view raised: the app's handlers."""
        with self.app.request_context(environ):
            response = self.app.finalize_request(
                self.app.handle_user_exception(exc), from_error_handler=True
            )
        return response(environ, start_response)


def requests_hooked(app: Flask) -> bool:
    """Whether an application that made this app hooked code into its requests (a
    `before_request`, `after_request`, `teardown_request` or URL value preprocessor of the
    app or the API, a `teardown_appcontext`, a receiver of Flask's request or app context
    signals): then every request is Flask's, so it runs."""
    hooks = (
        app.before_request_funcs,
        app.after_request_funcs,
        app.teardown_request_funcs,
        app.url_value_preprocessors,
    )
    return (
        any(hook.get(None) or hook.get("api") for hook in hooks)
        or bool(app.teardown_appcontext_funcs)
        or any(
            signal.receivers and next(signal.receivers_for(app), None) is not None
            for signal in _SIGNALS
        )
    )


def content_length(given: str) -> int | None:
    """A request's body length as its Content-Length gives it (None: not given, or not a
    length)."""
    return int(given) if ascii_digits(given) else None
