"""The OpenAPI document (`GET /api/v1/openapi.json`) against the app it describes: it names
exactly the routes served, and the real answers of every route, errors included, match the
schemas it gives for them (generated from the types the API answers with). schemathesis
(test_api_fuzz.py) checks the same on generated input."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine

from delaysvc import auth
from delaysvc.config.settings import Settings
from delaysvc.maintenance import periodic
from delaysvc.web import create_app
from delaysvc.worker.consumer import Consumer, handler
from tests.support.openapi import Documented

TOPIC = "docs.jobs"


@pytest.fixture
def app(settings: Settings) -> Iterator[Flask]:
    app = create_app(settings.model_copy(update={"max_body_bytes": 1024}))
    yield app
    app.extensions["delaysvc"]["engine"].dispose()


@pytest.fixture
def tokens(engine: Engine) -> dict[str, dict[str, str]]:
    made = {
        "admin": auth.create_token(engine, "docs-admin", "admin"),
        "send": auth.create_token(engine, "docs-send", "send"),
        "other": auth.create_token(engine, "docs-other", "admin", topics=["other.jobs"]),
    }
    return {name: {"Authorization": f"Bearer {token}"} for name, token in made.items()}


def _served(app: Flask) -> set[tuple[str, str]]:
    served = set()
    for rule in app.url_map.iter_rules():
        if rule.rule.startswith("/api/v1/"):
            path = rule.rule[len("/api/v1") :].replace("<int:message_id>", "{message_id}")
            path = path.replace("<name>", "{name}").replace("<topic>", "{topic}")
            path = path.replace("<level>", "{level}")
            served |= {(path, m.lower()) for m in rule.methods - {"HEAD", "OPTIONS"}}
    return served


def _documented(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (path, method)
        for path, item in document["paths"].items()
        for method in item
        if method != "parameters"
    }


def test_the_document_names_exactly_the_served_routes(app: Flask, client: FlaskClient) -> None:
    document = client.get("/api/v1/openapi.json").get_json()
    assert document["openapi"] == "3.1.0"
    assert _documented(document) == _served(app)


class Checked(Documented):
    """`Documented`, remembering which routes it has checked an answer of."""

    def __init__(self, client: FlaskClient) -> None:
        super().__init__(client)
        self.routes: set[tuple[str, str]] = set()

    def answer(self, response: Any, path: str, method: str, status: int) -> Any:
        self.routes.add((path, method))
        return super().answer(response, path, method, status)


def test_every_route_answers_as_its_schemas_say(
    client: FlaskClient, tokens: dict[str, dict[str, str]], settings: Settings, engine: Engine
) -> None:
    checked = Checked(client)
    _messages(checked, client, tokens)
    _topics_and_dead_letters(checked, client, tokens, settings, engine)
    _limits_and_caps(checked, client, tokens)
    _schedules(checked, client, tokens, engine)
    checked.answer(client.get("/api/v1/levels", headers=tokens["send"]), "/levels", "get", 200)
    checked.answer(client.get("/api/v1/openapi.json"), "/openapi.json", "get", 200)
    assert checked.routes == _documented(checked.document)


def _messages(checked: Checked, client: FlaskClient, tokens: dict[str, dict[str, str]]) -> None:
    send = tokens["send"]
    message = {"topic": TOPIC, "body": {"n": 1}, "delay": "1m", "key": "k-1"}
    message |= {"tags": ["docs"], "properties": {"p": "v"}, "priority": 5}
    post = client.post("/api/v1/messages", json=message, headers=send)
    sent = checked.answer(post, "/messages", "post", 201)
    held = client.post("/api/v1/messages", json=message, headers=send)
    assert checked.answer(held, "/messages", "post", 200)["id"] == sent["id"]
    replacing = client.post(
        "/api/v1/messages", json=message | {"on_duplicate": "replace"}, headers=send
    )
    replaced = checked.answer(replacing, "/messages", "post", 201)
    assert replaced["replaced_id"] == sent["id"]
    found = client.get(f"/api/v1/messages?topic={TOPIC}&key=k-1", headers=send)
    assert checked.answer(found, "/messages", "get", 200)["id"] == replaced["id"]
    batch = {"messages": [{"topic": TOPIC, "body": n, "delay_level": 2} for n in range(2)]}
    answered = client.post("/api/v1/messages/batch", json=batch, headers=send)
    assert [
        m["created"] for m in checked.answer(answered, "/messages/batch", "post", 201)["messages"]
    ] == [True, True]

    path = f"/api/v1/messages/{replaced['id']}"
    got = checked.answer(client.get(path, headers=send), "/messages/{message_id}", "get", 200)
    assert (got["tags"], got["properties"], got["priority"]) == (["docs"], {"p": "v"}, 5)
    cancel = client.delete(path, headers=send)
    assert checked.answer(cancel, "/messages/{message_id}", "delete", 200)["status"] == "cancelled"

    # errors: each status a route documents, as the one error shape
    errors = [
        (client.post("/api/v1/messages", json={"topic": "a b", "body": 1}, headers=send), 400),
        (client.post("/api/v1/messages", json={"topic": TOPIC, "body": 1}), 401),
        (
            client.post(
                "/api/v1/messages", json={"topic": TOPIC, "body": "x" * 2000}, headers=send
            ),
            413,
        ),
        (client.post("/api/v1/messages", data="{}", headers=send), 415),
        (
            client.post(
                "/api/v1/messages", json={"topic": TOPIC, "body": 1}, headers=tokens["other"]
            ),
            403,
        ),
    ]
    for response, status in errors:
        assert set(checked.answer(response, "/messages", "post", status)) == {"error"}
    checked.answer(
        client.post("/api/v1/messages/batch", json={"messages": []}, headers=send),
        "/messages/batch",
        "post",
        400,
    )
    checked.answer(
        client.get(f"/api/v1/messages?topic={TOPIC}", headers=send), "/messages", "get", 400
    )
    checked.answer(
        client.get("/api/v1/messages/999999", headers=send), "/messages/{message_id}", "get", 404
    )
    checked.answer(client.delete(path, headers=send), "/messages/{message_id}", "delete", 409)


def _topics_and_dead_letters(
    checked: Checked,
    client: FlaskClient,
    tokens: dict[str, dict[str, str]],
    settings: Settings,
    engine: Engine,
) -> None:
    @handler("docs.fails", max_retries=0)
    def fails(message: Any) -> None:
        raise KeyError("missing")

    sent = client.post(
        "/api/v1/messages", json={"topic": "docs.fails", "body": {}}, headers=tokens["send"]
    ).get_json()
    Consumer(settings, engine).run_once("docs.fails")
    client.post("/api/v1/messages", json={"topic": TOPIC, "body": 0}, headers=tokens["send"])
    topics = checked.answer(
        client.get("/api/v1/topics", headers=tokens["send"]), "/topics", "get", 200
    )["topics"]
    by_topic = {t["topic"]: (t["ready"], t["dead"], t["duration_p50_ms"]) for t in topics}
    assert by_topic == {TOPIC: (1, 0, None), "docs.fails": (0, 1, 1.0)}  # run / none yet

    dead = checked.answer(client.get("/api/v1/dead", headers=tokens["admin"]), "/dead", "get", 200)
    assert [(d["id"], d["last_error"]) for d in dead["dead"]] == [
        (sent["id"], "KeyError: 'missing'")
    ]
    checked.answer(client.get("/api/v1/dead?limit=0", headers=tokens["admin"]), "/dead", "get", 400)
    checked.answer(client.get("/api/v1/dead", headers=tokens["send"]), "/dead", "get", 403)
    path = f"/api/v1/dead/{sent['id']}/redrive"
    redriven = checked.answer(
        client.post(path, headers=tokens["admin"]), "/dead/{message_id}/redrive", "post", 200
    )
    assert redriven["status"] == "ready"
    checked.answer(
        client.post(path, headers=tokens["admin"]), "/dead/{message_id}/redrive", "post", 404
    )


def _limits_and_caps(
    checked: Checked, client: FlaskClient, tokens: dict[str, dict[str, str]]
) -> None:
    admin = tokens["admin"]
    limits = {"max_running": 2, "rate": "10/s"}
    put = client.put(f"/api/v1/topics/{TOPIC}/limits", json=limits, headers=admin)
    assert checked.answer(put, "/topics/{topic}/limits", "put", 200)["rate_per_s"] == 10.0
    refused = client.put(f"/api/v1/topics/{TOPIC}/limits", json={"max_running": 0}, headers=admin)
    checked.answer(refused, "/topics/{topic}/limits", "put", 400)
    listed = checked.answer(client.get("/api/v1/limits", headers=admin), "/limits", "get", 200)
    assert [item["topic"] for item in listed["limits"]] == [TOPIC]

    cap = {"max_waiting": 1, "policy": "reject"}
    put = client.put(f"/api/v1/topics/{TOPIC}/cap", json=cap, headers=admin)
    assert checked.answer(put, "/topics/{topic}/cap", "put", 200)["max_waiting"] == 1
    waiting = {"topic": TOPIC, "body": 1, "delay": "1m"}  # two wait already
    full = client.post("/api/v1/messages", json=waiting, headers=admin)
    checked.answer(full, "/messages", "post", 429)
    level = client.put("/api/v1/levels/3/cap", json={"max_waiting": 5}, headers=admin)
    assert checked.answer(level, "/levels/{level}/cap", "put", 200)["policy"] == "reject"
    caps = checked.answer(client.get("/api/v1/caps", headers=admin), "/caps", "get", 200)
    assert {(c["scope"], c["target"]) for c in caps["caps"]} == {("topic", TOPIC), ("level", "3")}
    lifted = client.put(f"/api/v1/topics/{TOPIC}/cap", json={}, headers=admin)
    assert checked.answer(lifted, "/topics/{topic}/cap", "put", 200)["max_waiting"] is None
    hidden = client.put("/api/v1/levels/3/cap", json={}, headers=tokens["other"])
    checked.answer(hidden, "/levels/{level}/cap", "put", 404)


def _schedules(
    checked: Checked, client: FlaskClient, tokens: dict[str, dict[str, str]], engine: Engine
) -> None:
    admin = tokens["admin"]
    periodic._declared.clear()
    try:  # a body of bytes: answered as body_base64
        periodic.periodic("1m", topic=TOPIC, name="from-code", body=b"\x00raw")
        periodic.store_declared(engine)
    finally:
        periodic._declared.clear()
    new = {"schedule": "every 5m", "topic": TOPIC, "body": {"kind": "short"}}
    put = client.put("/api/v1/schedules/reports", json=new, headers=admin)
    assert checked.answer(put, "/schedules/{name}", "put", 201)["body"] == {"kind": "short"}
    again = client.put("/api/v1/schedules/reports", json=new, headers=admin)
    checked.answer(again, "/schedules/{name}", "put", 200)
    listed = checked.answer(
        client.get("/api/v1/schedules", headers=admin), "/schedules", "get", 200
    )
    assert [s.get("body_base64") for s in listed["schedules"]] == ["AHJhdw==", None]
    got = client.get("/api/v1/schedules/reports", headers=admin)
    assert checked.answer(got, "/schedules/{name}", "get", 200)["schedule"] == "every 5m"
    paused = client.post("/api/v1/schedules/reports/pause", headers=admin)
    assert checked.answer(paused, "/schedules/{name}/pause", "post", 200)["paused"] is True
    resumed = client.post("/api/v1/schedules/reports/resume", headers=admin)
    assert checked.answer(resumed, "/schedules/{name}/resume", "post", 200)["paused"] is False
    conflict = client.delete("/api/v1/schedules/from-code", headers=admin)
    checked.answer(conflict, "/schedules/{name}", "delete", 409)
    deleted = client.delete("/api/v1/schedules/reports", headers=admin)
    assert checked.answer(deleted, "/schedules/{name}", "delete", 200) == {"deleted": "reports"}
    gone = client.post("/api/v1/schedules/reports/pause", headers=admin)
    checked.answer(gone, "/schedules/{name}/pause", "post", 404)
