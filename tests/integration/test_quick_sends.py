"""`POST /api/v1/messages` the quick way (`delaysvc.web.quick`): a plain single send is answered
without Flask's request machinery, and with the same answer; every other request, and every
error, is answered by the Flask app as before. The API's own tests (test_api.py and the rest)
run through the same wrapper."""

from __future__ import annotations

from io import BytesIO
from typing import Any

import pytest
from flask import Flask, jsonify, request_started
from flask.testing import FlaskClient
from sqlalchemy import Engine

from delaysvc import auth
from delaysvc.producer.caps import set_cap

URL = "/api/v1/messages"
ORDER = {"topic": "order.cancel", "body": {"id": 42}, "delay": "30m", "key": "order-42"}


@pytest.fixture
def token(engine: Engine) -> dict[str, str]:
    return {"Authorization": f"Bearer {auth.create_token(engine, 'shop', 'send')}"}


@pytest.fixture
def flask_requests(app: Flask) -> list[str]:
    """The paths of the requests the Flask app itself answered: its own WSGI callable, behind
    the quick way, counting them."""
    seen: list[str] = []
    flask = app.wsgi_app.flask  # type: ignore[attr-defined]

    def counted(environ: dict[str, Any], start_response: Any) -> Any:
        seen.append(environ["PATH_INFO"])
        return flask(environ, start_response)

    app.wsgi_app.flask = counted  # type: ignore[attr-defined]
    return seen


def _as_flask_writes_it(app: Flask, answer: Any) -> bytes:
    with app.app_context():
        return jsonify(answer).get_data()


def test_a_plain_send_is_answered_the_quick_way_as_flask_would_answer_it(
    app: Flask, client: FlaskClient, token: dict[str, str], flask_requests: list[str]
) -> None:
    first = client.post(URL, json=ORDER, headers=token)
    again = client.post(URL, json=ORDER, headers=token)  # the key held: its holder, 200
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.content_type == again.content_type == "application/json"
    assert first.data == _as_flask_writes_it(app, first.get_json())
    assert again.get_json() == first.get_json()
    assert first.headers["Content-Length"] == str(len(first.data))
    assert flask_requests == []  # neither reached Flask
    # and a message was stored, once
    asked = {"topic": "order.cancel", "key": "order-42"}
    found = client.get(URL, query_string=asked, headers=token)
    assert found.status_code == 200 and found.get_json()["id"] == first.get_json()["id"]
    assert flask_requests == [URL]  # a GET is Flask's


@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ({}, ORDER, 401, "unauthorized"),
        ({"Authorization": "Bearer dsv_unknown"}, ORDER, 401, "unauthorized"),
        ({"Content-Type": "text/plain"}, b'{"topic": "t"}', 415, "unsupported_media_type"),
        ({"Content-Type": "application/json"}, b'{"topic": "t", "body": ', 400, "invalid"),
        ({"Content-Type": "application/json"}, b"[1, 2]", 400, "invalid"),
        ({"Content-Type": "application/json"}, "over the limit", 413, "request_entity_too_large"),
    ],
    ids=["no token", "unknown token", "not JSON", "malformed JSON", "not an object", "too large"],
)  # fmt: skip
def test_requests_the_quick_way_does_not_take_are_answered_by_flask(
    app: Flask,
    client: FlaskClient,
    token: dict[str, str],
    flask_requests: list[str],
    headers: dict[str, str],
    body: Any,
    status: int,
    code: str,
) -> None:
    given = {**token, **headers} if "Authorization" not in headers and headers else headers
    if body == "over the limit":  # a JSON object a byte longer than the app takes
        body = b"{" + b" " * (app.config["MAX_CONTENT_LENGTH"] - 1) + b"}"
    if isinstance(body, dict):
        response = client.post(URL, json=body, headers=given)
    else:
        response = client.post(URL, data=body, headers=given)
    assert response.status_code == status, response.get_json()
    assert response.get_json()["error"]["code"] == code
    assert flask_requests == [URL]


def test_a_json_body_sent_in_chunks_is_flasks_and_is_sent(
    client: FlaskClient, token: dict[str, str], flask_requests: list[str]
) -> None:
    response = client.post(  # no Content-Length: the server read it whole, as for chunks
        URL,
        input_stream=BytesIO(b'{"topic": "t", "body": 1}'),
        headers={**token, "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        environ_overrides={"wsgi.input_terminated": True, "CONTENT_LENGTH": ""},
    )
    assert response.status_code == 201, response.get_json()
    assert flask_requests == [URL]


def test_errors_while_sending_the_quick_way_are_the_apps_answers(
    engine: Engine, client: FlaskClient, token: dict[str, str], flask_requests: list[str]
) -> None:
    unknown = client.post(URL, json={**ORDER, "colour": "red"}, headers=token)
    assert unknown.status_code == 400
    assert unknown.get_json()["error"]["code"] == "invalid"
    assert "colour" in unknown.get_json()["error"]["message"]
    limited = {"Authorization": f"Bearer {auth.create_token(engine, 'sms', 'send', ['sms'])}"}
    elsewhere = client.post(URL, json=ORDER, headers=limited)
    assert elsewhere.status_code == 403
    assert "order.cancel" in elsewhere.get_json()["error"]["message"]
    set_cap(engine, "topic", "full", 1, "reject")
    full = {"topic": "full", "body": 1, "delay": "1h"}
    assert client.post(URL, json=full, headers=token).status_code == 201
    refused = client.post(URL, json=full, headers=token)
    assert refused.status_code == 429
    assert refused.get_json()["error"]["code"] == "backlog_full"
    assert flask_requests == []  # answered by the app's handlers, not by a second dispatch


def test_an_app_with_request_hooks_answers_every_send_through_flask(
    app: Flask, client: FlaskClient, token: dict[str, str], flask_requests: list[str]
) -> None:
    stamped: list[str] = []

    @app.after_request
    def stamp(response: Any) -> Any:  # an embedding application's hook, say
        response.headers["X-Stamped"] = "yes"
        stamped.append("after")
        return response

    sent = client.post(URL, json=ORDER, headers=token)
    assert sent.status_code == 201 and sent.headers["X-Stamped"] == "yes"
    assert flask_requests == [URL] and stamped == ["after"]


def test_an_app_context_teardown_runs_for_every_send(
    app: Flask, client: FlaskClient, token: dict[str, str], flask_requests: list[str]
) -> None:
    closed: list[str] = []
    app.teardown_appcontext(lambda error: closed.append("session"))  # Flask-SQLAlchemy's way
    assert client.post(URL, json=ORDER, headers=token).status_code == 201
    assert flask_requests == [URL] and closed == ["session"]


def test_a_receiver_of_flasks_request_signals_sees_every_send(
    app: Flask, client: FlaskClient, token: dict[str, str], flask_requests: list[str]
) -> None:
    seen: list[str] = []

    def started(sender: Flask, **_: Any) -> None:
        seen.append("started")

    request_started.connect(started, app)
    try:
        assert client.post(URL, json=ORDER, headers=token).status_code == 201
    finally:
        request_started.disconnect(started, app)
    assert seen == ["started"] and flask_requests == [URL]
    assert client.post(URL, json=ORDER, headers=token).status_code == 200
    assert flask_requests == [URL]  # the receiver gone, the quick way again


def test_a_limit_the_application_lowers_after_create_app_is_kept(
    app: Flask, client: FlaskClient, token: dict[str, str], flask_requests: list[str]
) -> None:
    app.config["MAX_CONTENT_LENGTH"] = 64  # as Flask reads it: at each request
    long = {**ORDER, "properties": {"note": "x" * 100}}
    refused = client.post(URL, json=long, headers=token)
    assert refused.status_code == 413
    assert flask_requests == [URL]
