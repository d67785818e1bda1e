"""Bad input to the dashboard gets the dashboard's answer, not the JSON API's: a NUL byte (which
PostgreSQL's text cannot hold) in the login name, a page's filters, a form or the path is
refused with the 400 page naming the field, before any statement; the JSON under /ui/ answers
the dashboard's JSON; the API keeps its own."""

from __future__ import annotations

import re

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, text
from werkzeug.test import TestResponse

from delaysvc import auth
from delaysvc.web import ui
from tests.support.dashboard import ADMIN, csrf

NUL_MESSAGE = "must not contain a NUL character (%00)"


def _error_page(response: TestResponse) -> str:
    """The message of the dashboard's HTML error page (asserting it is one, with 400)."""
    assert response.status_code == 400, response.text
    assert response.content_type == "text/html; charset=utf-8"
    found = re.search(r'<p class="error" id="error-message">(.*?)</p>', response.text)
    assert found is not None, response.text
    return found.group(1)


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/messages?topic=a%00b", "topic"),
        ("/messages?key=a%00b", "key"),
        ("/messages?status=ready&key=%00", "key"),
        ("/dead?topic=a%00b", "topic"),
        ("/dead?error=a%00b", "error"),
        ("/history?topic=a%00b", "topic"),
        ("/topics?x=%00", "x"),
    ],
)
def test_a_nul_in_a_pages_filters_gets_the_dashboards_400_page_naming_it(
    admin: FlaskClient, path: str, field: str
) -> None:
    assert _error_page(admin.get(path)) == f"{field}: {NUL_MESSAGE}"


def test_a_nul_in_an_actions_form_or_path_gets_the_dashboards_400_page(
    admin: FlaskClient, engine: Engine
) -> None:
    token = csrf(admin)
    redrive = admin.post(
        "/dead/redrive", data={"scope": "group", "topic": "a\x00", "csrf_token": token}
    )
    assert _error_page(redrive) == f"topic: {NUL_MESSAGE}"
    pause = admin.post("/schedules/a%00b/pause", data={"csrf_token": token})
    assert _error_page(pause) == f"name: {NUL_MESSAGE}"
    limits = admin.post("/topics/limits", data={"topic": "t\x00", "csrf_token": token})
    assert _error_page(limits) == f"topic: {NUL_MESSAGE}"
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM topic_state")).scalar_one() == 0


def test_a_nul_in_the_login_name_gets_the_dashboards_400_page_and_counts_no_attempt(
    app: Flask, engine: Engine
) -> None:
    client = app.test_client()
    client.get("/login")
    form = {"name": "ada\x00", "password": ADMIN[1], "csrf_token": csrf(client)}
    assert _error_page(client.post("/login", data=form)) == f"name: {NUL_MESSAGE}"
    assert client.get("/").status_code == 302
    # a password is only hashed: a NUL in it is a wrong password, not bad input
    form = {"name": ADMIN[0], "password": "x\x00", "csrf_token": csrf(client)}
    assert client.post("/login", data=form).status_code == 401
    with engine.connect() as conn:
        failed = conn.execute(text("SELECT failed_logins FROM dashboard_user WHERE name = 'ada'"))
        assert failed.scalar_one() == 1


def test_json_under_ui_answers_the_dashboards_json_and_the_api_keeps_its_own(
    app: Flask, admin: FlaskClient, engine: Engine
) -> None:
    polled = admin.get("/ui/history.json?topic=a%00")
    assert polled.status_code == 400
    assert polled.get_json() == {"error": {"code": "error", "message": f"topic: {NUL_MESSAGE}"}}
    token = auth.create_token(engine, "nul", scope="admin")
    api = app.test_client().get(
        "/api/v1/dead?topic=a%00", headers={"Authorization": f"Bearer {token}"}
    )
    assert api.status_code == 400
    assert api.get_json()["error"]["code"] == "invalid"


def test_input_the_database_refuses_gets_the_dashboards_400_page(
    admin: FlaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Input no check anticipated, refused by PostgreSQL (here a NUL, with the check before the
    database taken away): the dashboard's page saying what was refused, not the API's JSON."""
    monkeypatch.setattr(ui, "refuse_nul", lambda: None)
    message = _error_page(admin.get("/messages?key=a%00b"))
    assert message == "a value was refused: PostgreSQL text fields cannot contain NUL (0x00) bytes"


@pytest.mark.parametrize("page", ["/messages", "/dead", "/history"])
def test_a_topic_filter_that_is_no_topic_name_is_refused_naming_it(
    admin: FlaskClient, page: str
) -> None:
    """/history refused one; /messages and /dead answered an empty page (found by a
    reviewer), where the documentation promises the 400 page naming the field."""
    response = admin.get(page + "?topic=%3Cscript%3E")
    assert response.status_code == 400
    assert "topic: " in response.text and "&lt;script&gt;" in response.text
