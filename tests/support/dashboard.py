"""What the dashboard's tests share besides fixtures (`tests/integration/dashboard/conftest.py`):
its users, logging in, the CSRF token, the notes an action leaves, and handlers that make dead
letters."""

from __future__ import annotations

import re
from typing import Any

from flask.testing import FlaskClient
from sqlalchemy import Engine

from delaysvc.config.settings import Settings
from delaysvc.producer.sending import Producer
from delaysvc.worker.consumer import Consumer, handler

ADMIN = ("ada", "admin-password-1")
VIEWER = ("vic", "viewer-password-1")


def login(client: FlaskClient, user: tuple[str, str], next_url: str = "") -> Any:
    page = client.get("/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert token is not None
    form = {"name": user[0], "password": user[1], "csrf_token": token.group(1), "next": next_url}
    return client.post("/login", data=form)


def csrf(client: FlaskClient) -> str:
    with client.session_transaction() as session:
        return str(session["csrf"])


def flashes(client: FlaskClient, response: Any) -> list[str]:
    """Follow the redirect of an action and read the notes it left."""
    assert response.status_code == 302, response.text
    page = client.get(response.location)
    block = re.search(r'<ul class="flash" id="flash">(.*?)</ul>', page.text, re.S)
    return re.findall(r"<li>(.*?)</li>", block.group(1)) if block else []


def make_dead(
    settings: Settings, engine: Engine, producer: Producer, bodies: list[dict]
) -> list[int]:
    """Send each body to its topic and let its handler fail once (max_retries=0): dead."""
    ids = []
    for body in bodies:
        ids.append(producer.send(body["topic"], body).id)
    for topic in sorted({b["topic"] for b in bodies}):
        Consumer(settings, engine).run_once(topic)
    return ids


@handler("dash.fails", max_retries=0)
def _fails(message: Any) -> None:
    raise ValueError(message.body["error"])


@handler("dash.other", max_retries=0)
def _other(message: Any) -> None:
    raise KeyError(message.body["error"])
