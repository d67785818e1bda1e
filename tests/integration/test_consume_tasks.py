"""The consume worker's Celery tasks run in this process (no broker in between), on the test
database: what they report."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import text

from delaysvc.tasks.app import create_celery_app

tasks_app = importlib.import_module("delaysvc.tasks.app")  # the package's `app` is the Celery app
consume_tasks = importlib.import_module("delaysvc.tasks.consume")


@pytest.fixture
def celery_app(settings, monkeypatch) -> Iterator[Celery]:
    """delaysvc's Celery app on the test database, current, with a runtime of its own."""
    monkeypatch.setattr(tasks_app, "_runtime", None)
    monkeypatch.setattr(consume_tasks, "_reported_at", None)
    app = create_celery_app(settings.model_copy(update={"broker_url": "memory://"}))
    app.set_current()
    yield app
    tasks_app.runtime().engine.dispose()
    app.close()


def consumer_seen(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM heartbeat WHERE component = 'consumer'")
        ).scalar_one()


def test_a_consume_task_reports_the_consumers_in(celery_app, engine, producer) -> None:
    """Only the sweep (fired by beat every second, expiring after a second) reported the
    consumers in, from the consume queue: behind a backlog of consume tasks (5,105 after a
    PostgreSQL restart) every sweep expired unrun, and /healthz said `"consumer": false`,
    degraded, for minutes while the consumers ran 110 jobs a second."""
    assert consumer_seen(engine) == 0
    consume_tasks.consume.run("no.such.topic")
    assert consumer_seen(engine) == 1
