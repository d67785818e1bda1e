"""Hostile input at the HTTP edge: deep JSON, invalid UTF-8, SQL-injection strings in every
field and search box. Each is refused with a 4xx naming the problem, or stored verbatim and
found again, never interpreted and never a 5xx. And what the logs keep at INFO: never a token,
never a message body."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import Engine, text

from delaysvc import auth
from delaysvc.config.settings import Settings
from delaysvc.web import create_app

INJECTIONS = [
    "x'; DROP TABLE commit_log; --",
    "' OR '1'='1",
    "1; SELECT pg_sleep(10)",
    "$$; TRUNCATE dead_letter; $$",
    "%' AND status LIKE '%",
]


@pytest.fixture
def app(settings: Settings) -> Iterator[Flask]:
    app = create_app(settings.model_copy(update={"max_body_bytes": 10_000_000}))
    yield app
    app.extensions["delaysvc"]["engine"].dispose()


@pytest.fixture
def headers(engine: Engine) -> dict[str, str]:
    return {"Authorization": f"Bearer {auth.create_token(engine, 'hostile', scope='admin')}"}


def test_deeply_nested_json_is_refused_with_400_not_500(
    app: Flask, headers: dict[str, str]
) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    response = app.test_client().post(
        "/api/v1/messages",
        data='{"topic": "hostile.deep", "body": ' + deep + "}",
        headers={**headers, "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "invalid"
    assert "nested" in response.get_json()["error"]["message"]


def test_invalid_utf8_is_refused_with_400(app: Flask, headers: dict[str, str]) -> None:
    response = app.test_client().post(
        "/api/v1/messages",
        data=b'{"topic": "hostile.utf8", "body": "\xff\xfe caf\xe9"}',
        headers={**headers, "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] in ("bad_request", "invalid")


@pytest.mark.parametrize("evil", INJECTIONS)
def test_sql_injection_strings_are_stored_verbatim_and_found_never_run(
    app: Flask, headers: dict[str, str], engine: Engine, evil: str
) -> None:
    client = app.test_client()
    sent = client.post(
        "/api/v1/messages",
        json={
            "topic": "hostile.sql",
            "body": {"note": evil},
            "key": evil,
            "properties": {evil: evil},
            "delay": "1h",
        },
        headers=headers,
    )
    assert sent.status_code == 201, sent.text
    found = client.get(
        "/api/v1/messages", query_string={"topic": "hostile.sql", "key": evil}, headers=headers
    )
    assert found.status_code == 200 and found.get_json()["id"] == sent.get_json()["id"]
    # as a topic or a tag the string is refused by their rules, naming the field
    tagged = client.post(
        "/api/v1/messages",
        json={"topic": "hostile.sql", "body": {}, "tags": [evil]},
        headers=headers,
    )
    assert tagged.status_code == 400 and tagged.get_json()["error"]["message"].startswith("tags:")
    refused = client.post("/api/v1/messages", json={"topic": evil, "body": {}}, headers=headers)
    assert refused.status_code == 400 and "topic" in refused.get_json()["error"]["message"]
    lookup = client.get(
        "/api/v1/messages", query_string={"topic": evil, "key": evil}, headers=headers
    )
    assert lookup.status_code == 400
    with engine.connect() as conn:
        stored = conn.execute(
            text(
                "SELECT key, convert_from(body, 'UTF8') FROM commit_log WHERE topic = 'hostile.sql'"
            )
        ).one()
        tables = conn.execute(
            text("SELECT count(*) FROM pg_tables WHERE tablename IN ('commit_log', 'dead_letter')")
        ).scalar_one()
    assert stored[0] == evil and evil in stored[1]
    assert tables == 2


@pytest.mark.parametrize("evil", INJECTIONS)
def test_sql_injection_strings_in_the_dashboard_search_are_plain_filters(
    app: Flask, engine: Engine, evil: str
) -> None:
    from tests.support.dashboard import ADMIN, login

    auth.create_user(engine, *ADMIN, role="admin")
    client = app.test_client()
    login(client, ADMIN)
    for query in ({"key": evil}, {"topic": "t", "key": evil}):
        page = client.get("/messages", query_string=query)
        assert page.status_code == 200
        assert "No message matches." in page.text
    # a topic filter is checked as a topic name first, as the id is checked as a number
    assert client.get("/messages", query_string={"topic": evil}).status_code == 400
    assert client.get("/dead", query_string={"topic": evil}).status_code == 400
    assert client.get("/dead", query_string={"topic": "t", "error": evil}).status_code == 200
    assert client.get("/messages", query_string={"id": evil}).status_code == 400


def test_info_logs_carry_neither_tokens_nor_bodies(
    app: Flask, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    token = auth.create_token(engine, "logged", scope="send")
    secret_body = {"card": "4111-1111-1111-1111-SECRET"}
    client = app.test_client()
    with caplog.at_level(logging.INFO):
        sent = client.post(
            "/api/v1/messages",
            json={"topic": "hostile.logs", "body": secret_body, "key": "k1"},
            headers={"Authorization": f"Bearer {token}"},
        )
        client.post(
            "/api/v1/messages",
            json={"topic": "x", "body": {}},
            headers={"Authorization": "Bearer wrong-token-value"},
        )
    assert sent.status_code == 201
    logged = "\n".join(f"{record.getMessage()} {record.__dict__}" for record in caplog.records)
    assert caplog.records  # the send was logged ...
    assert token not in logged and "wrong-token-value" not in logged  # ... without secrets
    assert "4111-1111" not in logged


# Digits Python's int() and str.isdigit() take but a query string's number is not made of:
# superscripts (isdigit, and int() raises), Arabic-Indic and full-width (int() reads them).
UNICODE_DIGITS = ["²", "١٢", "\uff11\uff12", "7²"]


@pytest.mark.parametrize("digits", UNICODE_DIGITS)
@pytest.mark.parametrize(
    ("query", "name", "allowed"),
    [
        ("limit", "limit", "a whole number from 1 to 1000"),
        ("after", "after", "a whole number from 0"),
    ],
)
def test_api_integer_parameters_take_ascii_digits_only(
    app: Flask, headers: dict[str, str], digits: str, query: str, name: str, allowed: str
) -> None:
    response = app.test_client().get("/api/v1/dead", query_string={query: digits}, headers=headers)
    assert response.status_code == 400, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "invalid"
    assert error["message"].startswith(f"{name}: ") and allowed in error["message"]
    assert "digits 0-9" in error["message"]
    documented = app.test_client().get("/api/v1/openapi.json").get_json()
    assert "400" in documented["paths"]["/dead"]["get"]["responses"]


@pytest.fixture
def dashboard(app: Flask, engine: Engine) -> Any:
    from tests.support.dashboard import ADMIN, login

    auth.create_user(engine, *ADMIN, role="admin")
    client = app.test_client()
    login(client, ADMIN)
    return client


@pytest.mark.parametrize("digits", UNICODE_DIGITS)
@pytest.mark.parametrize(
    ("path", "name", "allowed"),
    [
        ("/messages?id={}", "id", "digits 0-9"),
        ("/messages?limit={}", "limit", "digits 0-9"),
        ("/messages?before={}", "before", "digits 0-9"),
        ("/messages?after={}", "after", "digits 0-9"),
        ("/dead?before={}", "before", "digits 0-9"),
        ("/history?days={}", "days", "1, 7, 30, 90"),
        ("/ui/history.json?days={}", "days", "1, 7, 30, 90"),
    ],
)
def test_dashboard_integer_parameters_take_ascii_digits_only(
    dashboard: Any, digits: str, path: str, name: str, allowed: str
) -> None:
    response = dashboard.get(path.format(digits))
    assert response.status_code == 400, response.text
    assert f"{name}: " in response.text and allowed in response.text


@pytest.mark.parametrize("digits", UNICODE_DIGITS)
def test_dashboard_integer_form_fields_take_ascii_digits_only(
    dashboard: Any, engine: Engine, digits: str
) -> None:
    from tests.support.dashboard import csrf, flashes

    token = csrf(dashboard)
    limits = dashboard.post(
        "/topics/limits", data={"topic": "t.limits", "max_running": digits, "csrf_token": token}
    )
    notes = flashes(dashboard, limits)
    assert any("max_running: " in note and "digits 0-9" in note for note in notes), notes
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM topic_state")).scalar_one() == 0
    purge = dashboard.post(
        "/dead/purge", data={"ids": digits, "csrf_token": token}, follow_redirects=True
    )
    assert purge.status_code == 400 and "ids: " in purge.text and "digits 0-9" in purge.text


@pytest.mark.parametrize("digits", ["\u0661", "\uff11", "\u0661\u0662"])
def test_an_id_in_a_path_takes_ascii_digits_only(
    app: Flask, headers: dict[str, str], producer: Any, digits: str
) -> None:
    """Flask's `int` converter matched any script's digits (`\\d+`) and int() read them: `/\\u0661`
    (Arabic-Indic one) answered message 1. A path of such digits names no message: 404."""
    assert producer.send("t.path", 1, delay="1h").id == 1
    client = app.test_client()
    assert client.get("/api/v1/messages/1", headers=headers).status_code == 200
    for method in ("get", "delete"):
        response = getattr(client, method)(f"/api/v1/messages/{digits}", headers=headers)
        assert response.status_code == 404, (method, response.get_json())
    assert client.post(f"/api/v1/dead/{digits}/redrive", headers=headers).status_code == 404
    assert producer.get(1).status == "scheduled"  # not cancelled by the DELETE
