"""The web app as an ASGI callable, for an asyncio server (`delaysvc web`'s default server:
gunicorn's master with uvicorn's workers): `POST /api/v1/messages` sent on the event loop,
everything else answered by the Flask app.

A single send in the plain case (a JSON body of a given length within the app's limit, a live
API token, an object whose send `AsyncSends` takes) is checked as the API checks it and
written by `delaysvc.producer.aio.AsyncSends`: the worker keeps many sends under way without a
thread each, and those that meet are written together. Every other request, and every single
send that way does not store or refuses (bad input, a topic the token may not send to, a held
key, a cap), goes to the Flask app whole, its body put back, through a2wsgi's WSGI adapter (a
pool of threads): the app answers it as it always does, and its answer is the one the client
gets. The one error answered here is a connection lost after a send's statement was sent
(it may be stored: the app's 503 for it, by the app's own error handler), since the app
would send the message again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from a2wsgi import WSGIMiddleware
from flask import Flask
from sqlalchemy import Engine

from delaysvc.auth import ApiToken, authenticate_token, remembered_token
from delaysvc.config.settings import Settings
from delaysvc.errors import DatabaseUnavailable
from delaysvc.producer.aio import AsyncSends
from delaysvc.producer.message import Message
from delaysvc.serialize import sent_message_json
from delaysvc.web import API_PREFIX, create_app
from delaysvc.web.api import bearer_token, message_options, require_topic
from delaysvc.web.quick import content_length, requests_hooked

Scope = MutableMapping[str, Any]
Event = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Event]]
Send = Callable[[Event], Awaitable[None]]

FLASK_THREADS = 16
"""Requests the Flask app answers at once in a worker (a2wsgi's thread pool)."""


def create_asgi_app(settings: Settings | None = None) -> AsgiApp:
    """The Flask app of `create_app(settings)` with single sends taken on the event loop."""
    app = create_app(settings)
    services = app.extensions["delaysvc"]
    return AsgiApp(app, AsyncSends(services["producer"]), services["engine"])


class AsgiApp:
    """An ASGI callable: single sends by `sends`, the rest by the Flask `app`."""

    def __init__(self, app: Flask, sends: AsyncSends, engine: Engine):
        self.app = app
        self.sends = sends
        self.engine = engine
        self.path = API_PREFIX + "/messages"
        self.flask = WSGIMiddleware(_input_terminated(app), workers=FLASK_THREADS)  # type: ignore[arg-type]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif (
            scope["type"] != "http"
            or scope["path"] != self.path
            or scope["method"] != "POST"
            or requests_hooked(self.app)
        ):
            await self.flask(scope, receive, send)  # type: ignore[arg-type]
        else:
            await self._single_send(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            event = await receive()
            if event["type"] == "lifespan.startup":
                await self.sends.open()
                await send({"type": "lifespan.startup.complete"})
            elif event["type"] == "lifespan.shutdown":
                await self.sends.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _single_send(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        size = content_length(headers.get(b"content-length", b"").decode("latin-1"))
        limit = self.app.config["MAX_CONTENT_LENGTH"]
        kind = headers.get(b"content-type", b"").partition(b";")[0].strip().lower()
        given = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
        if size is None or (limit is not None and size > limit) or kind != b"application/json":
            await self.flask(scope, receive, send)  # type: ignore[arg-type]
            return
        body = await _body(receive, size)
        answer = None
        if given is not None and len(body) == size:
            answer = await self._sent(body, given)
        if answer is None:  # the app's to answer, as it always has
            await self.flask(scope, _replaying(body, receive), send)  # type: ignore[arg-type]
            return
        status, payload, extra = answer
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    *extra,
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _sent(self, body: bytes, given: str) -> tuple[int, bytes, list[Any]] | None:
        """(status, body, more headers) of a single send stored here; None: the app answers."""
        try:
            sender = remembered_token(self.engine, given)
            if sender is None:  # a lookup in the database: not on the loop
                sender = await asyncio.to_thread(authenticate_token, self.engine, given)
            data = json.loads(body)
            if sender is None or type(data) is not dict:
                return None
            message = await self._checked_send(sender, data)
        except DatabaseUnavailable as exc:  # may be stored: not to be sent again by the app
            return self._error(exc)
        except Exception:  # bad input, a topic not the token's, ...: the app says which
            return None
        if message is None:
            return None
        payload = self.app.json.response(sent_message_json(message)).get_data()  # type: ignore[attr-defined]
        return 201, payload, []

    async def _checked_send(self, sender: ApiToken, data: dict[str, Any]) -> Message | None:
        options = message_options(data)
        require_topic(options, sender)
        return await self.sends.send_item(options)

    def _error(self, exc: Exception) -> tuple[int, bytes, list[Any]]:
        """`exc` as the app's error handlers answer it."""
        with self.app.test_request_context(self.path, method="POST"):
            response = self.app.make_response(self.app.handle_user_exception(exc))
        extra = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in response.headers.items()
            if name.lower() not in ("content-type", "content-length")
        ]
        return response.status_code, response.get_data(), extra


def _input_terminated(app: Flask) -> Callable[[dict[str, Any], Any], Any]:
    """The Flask app, told that the body a2wsgi gives it ends where the request's does (it
    reads the ASGI body events to the last): without it, Werkzeug reads a body of no
    Content-Length (`Transfer-Encoding: chunked`) as empty, and applies the app's
    MAX_CONTENT_LENGTH (a 413) only to a length given."""

    def wsgi(environ: dict[str, Any], start_response: Any) -> Any:
        environ["wsgi.input_terminated"] = True
        return app(environ, start_response)

    return wsgi


async def _body(receive: Receive, size: int) -> bytes:
    """The request's body: what comes, until its end or past `size` bytes."""
    parts, read = [], 0
    while True:
        event = await receive()
        part = event.get("body", b"")
        parts.append(part)
        read += len(part)
        if not event.get("more_body", False) or read > size:
            return b"".join(parts)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` with the body already read given again first."""
    given = False

    async def replay() -> Event:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
