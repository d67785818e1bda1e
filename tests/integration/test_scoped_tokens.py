"""Admin tokens limited to topics, on every write route of the HTTP API: an object of another
topic is 404 with exactly the words a GET gives (never 403, never a body that tells it
exists), and nothing about it changes. Against a real PostgreSQL, through the Flask client."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, text

from delaysvc import auth
from delaysvc.maintenance.periodic import schedule
from delaysvc.store import schedules as store_schedules

BILLING = {"schedule": "0 2 * * *", "topic": "billing.jobs", "body": {"run": "nightly"}}


@pytest.fixture
def admin(engine: Engine) -> dict[str, str]:
    return {"Authorization": f"Bearer {auth.create_token(engine, 'ops', 'admin')}"}


@pytest.fixture
def a_jobs(engine: Engine) -> dict[str, str]:
    """An admin token for the topic `a.jobs` only."""
    token = auth.create_token(engine, "a-ops", "admin", topics=["a.jobs"])
    return {"Authorization": f"Bearer {token}"}


def _not_found(response: Any) -> dict[str, Any]:
    assert response.status_code == 404, response.get_json()
    body: dict[str, Any] = response.get_json()
    assert body["error"]["code"] == "not_found"
    return body


def _stored(engine: Engine, name: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT topic, cron, every_ms, body, paused, updated_at FROM periodic_schedule "
                "WHERE name = :name"
            ),
            {"name": name},
        ).one()


def test_a_put_of_another_topics_schedule_is_404_as_a_get_and_changes_nothing(
    client: FlaskClient, admin: dict[str, str], a_jobs: dict[str, str], engine: Engine
) -> None:
    created = client.put("/api/v1/schedules/nightly-billing", json=BILLING, headers=admin)
    assert created.status_code == 201
    before = _stored(engine, "nightly-billing")
    got = _not_found(client.get("/api/v1/schedules/nightly-billing", headers=a_jobs))
    retarget = {"schedule": "every 1m", "topic": "a.jobs", "body": "mine now"}
    put = client.put("/api/v1/schedules/nightly-billing", json=retarget, headers=a_jobs)
    assert _not_found(put) == got  # the same answer: the name's existence is not told
    documented = client.get("/api/v1/openapi.json").get_json()["paths"]["/schedules/{name}"]
    assert "404" in documented["put"]["responses"]
    assert _stored(engine, "nightly-billing") == before  # not re-targeted, not touched
    # the token's own names: created (201) and replaced (200) as before
    created = client.put("/api/v1/schedules/a-hourly", json=retarget, headers=a_jobs)
    assert (created.status_code, created.get_json()["topic"]) == (201, "a.jobs")
    replaced = client.put(
        "/api/v1/schedules/a-hourly", json=retarget | {"schedule": "every 2m"}, headers=a_jobs
    )
    assert (replaced.status_code, replaced.get_json()["schedule"]) == (200, "every 2m")
    # a body naming a topic outside the token is 403 whether the name exists or not
    for name in ("nightly-billing", "no-such-name"):
        refused = client.put(f"/api/v1/schedules/{name}", json=BILLING, headers=a_jobs)
        assert refused.status_code == 403, refused.get_json()
    assert _stored(engine, "nightly-billing") == before


def test_pause_resume_and_delete_of_another_topics_schedule_are_404_as_a_get(
    client: FlaskClient, admin: dict[str, str], a_jobs: dict[str, str], engine: Engine
) -> None:
    client.put("/api/v1/schedules/nightly-billing", json=BILLING, headers=admin)
    client.post("/api/v1/schedules/nightly-billing/pause", headers=admin)
    before = _stored(engine, "nightly-billing")
    got = _not_found(client.get("/api/v1/schedules/nightly-billing", headers=a_jobs))
    for method, path in (
        ("POST", "/api/v1/schedules/nightly-billing/pause"),
        ("POST", "/api/v1/schedules/nightly-billing/resume"),
        ("DELETE", "/api/v1/schedules/nightly-billing"),
    ):
        assert _not_found(client.open(path, method=method, headers=a_jobs)) == got, path
    assert _stored(engine, "nightly-billing") == before


def _wait_for_lock_waiter(engine: Engine) -> None:
    """Until another session waits on a lock of periodic_schedule (a condition, not a nap)."""
    deadline = time.monotonic() + 10
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%periodic_schedule%' AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
            if waiting:
                return
            conn.rollback()
            time.sleep(0.01)
    raise AssertionError("the PUT never waited on the row being created")


def test_a_put_racing_the_creation_of_the_name_under_another_topic_cannot_retarget_it(
    client: FlaskClient, a_jobs: dict[str, str], engine: Engine
) -> None:
    """The check and the write are one: a scoped PUT that found no such name, while another
    transaction creates it for another topic, answers 404 and leaves that schedule alone."""
    theirs = schedule("nightly-billing", "0 2 * * *", topic="billing.jobs", body={"x": 1})
    answers: list[Any] = []
    with engine.connect() as creator:
        creating = creator.begin()
        now = store_schedules.statement_now(creator)
        store_schedules.put(creator, theirs, "api", theirs.next_tick(now))  # not committed
        mine = {"schedule": "every 1m", "topic": "a.jobs"}

        def put() -> None:
            answers.append(
                client.put("/api/v1/schedules/nightly-billing", json=mine, headers=a_jobs)
            )

        racer = threading.Thread(target=put)
        racer.start()
        try:
            _wait_for_lock_waiter(engine)  # the PUT saw no row, and waits on the insert
        finally:
            creating.commit()
            racer.join(30)
    assert not racer.is_alive()
    _not_found(answers[0])
    stored = _stored(engine, "nightly-billing")
    assert (stored.topic, stored.cron, stored.every_ms) == ("billing.jobs", "0 2 * * *", None)


def test_every_write_route_of_the_api_is_scoped_or_named_here(app: Flask) -> None:
    """The write routes this file and test_api.py check for another topic's objects: a new
    write route fails here until it is checked too."""
    checked = {
        ("/api/v1/messages", "POST"),  # 403: test_api, sends only to the token's topics
        ("/api/v1/messages/batch", "POST"),  # 403, the batch whole: test_api
        ("/api/v1/messages/<int:message_id>", "DELETE"),  # 404: test_api
        ("/api/v1/dead/<int:message_id>/redrive", "POST"),  # 404: test_api
        ("/api/v1/topics/<topic>/limits", "PUT"),  # 403 below
        ("/api/v1/schedules/<name>", "PUT"),
        ("/api/v1/schedules/<name>", "DELETE"),
        ("/api/v1/schedules/<name>/pause", "POST"),
        ("/api/v1/schedules/<name>/resume", "POST"),
        ("/api/v1/topics/<topic>/cap", "PUT"),  # 404 outside the token's topics: test_caps
        ("/api/v1/levels/<level>/cap", "PUT"),  # 404 for any token limited to topics
    }
    writes = {
        (rule.rule, method)
        for rule in app.url_map.iter_rules()
        if rule.rule.startswith("/api/v1/")
        for method in rule.methods - {"GET", "HEAD", "OPTIONS"}
    }
    assert writes <= checked, writes - checked


def test_limits_of_another_topic_are_refused_and_not_set(
    client: FlaskClient, a_jobs: dict[str, str], engine: Engine
) -> None:
    refused = client.put(
        "/api/v1/topics/billing.jobs/limits", json={"max_running": 1}, headers=a_jobs
    )
    assert refused.status_code == 403, refused.get_json()
    with engine.connect() as conn:
        limited = conn.execute(
            text("SELECT count(*) FROM topic_state WHERE max_running IS NOT NULL")
        ).scalar_one()
    assert limited == 0
    own = client.put("/api/v1/topics/a.jobs/limits", json={"max_running": 2}, headers=a_jobs)
    assert own.get_json() == {"topic": "a.jobs", "max_running": 2, "rate_per_s": None}
