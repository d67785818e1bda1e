"""Handlers the end-to-end tests run in real Celery workers. Each run is recorded in the test's
own database (table `e2e_run`, made by the test), so the test can count executions exactly."""

from __future__ import annotations

import os
import time

import psycopg
from celery import shared_task

from delaysvc import DeadLetter, handler
from delaysvc.db.engines import libpq_url

_connection: psycopg.Connection | None = None


def _record(message_id: int, attempt: int, note: str = "") -> None:
    global _connection
    if _connection is None or _connection.closed:
        url = libpq_url(os.environ["DELAYSVC_DATABASE_URL"])
        # no statement prepared on the server: the tests run the workers behind PgBouncer too
        _connection = psycopg.connect(url, autocommit=True, prepare_threshold=None)
    _connection.execute(
        "INSERT INTO e2e_run (message_id, attempt, pid, note) VALUES (%s, %s, %s, %s)",
        (message_id, attempt, os.getpid(), note),
    )


@handler("e2e.record")
def record(message):  # type: ignore[no-untyped-def]
    _record(message.id, message.attempts)


@handler("e2e.in_transaction", transaction=True)
def in_transaction(message, conn):  # type: ignore[no-untyped-def]
    """Its row and the job's success commit together: killed before the commit, neither."""
    from sqlalchemy import text

    conn.execute(
        text("INSERT INTO public.e2e_run (message_id, attempt, pid) VALUES (:id, :attempt, :pid)"),
        {"id": message.id, "attempt": message.attempts, "pid": os.getpid()},
    )
    time.sleep(message.body.get("sleep", 0))


@handler("e2e.flaky")
def fails_twice(message):  # type: ignore[no-untyped-def]
    _record(message.id, message.attempts)
    if message.attempts < 3:
        raise ConnectionError(f"flaky failure {message.attempts}")


@handler("e2e.broken", max_retries=2)
def always_fails(message):  # type: ignore[no-untyped-def]
    _record(message.id, message.attempts)
    if message.body.get("dead_now"):
        raise DeadLetter("asked to give up")
    raise ValueError("always broken")


@handler("e2e.slow_first")
def slow_first_attempt(message):  # type: ignore[no-untyped-def]
    """The first attempt hangs (the test kills the worker meanwhile); later ones finish."""
    _record(message.id, message.attempts, "start")
    if message.attempts == 1:
        time.sleep(message.body.get("sleep", 60))
    _record(message.id, message.attempts, "done")


@handler("e2e.slow")
def takes_its_time(message):  # type: ignore[no-untyped-def]
    _record(message.id, message.attempts, "start")
    time.sleep(message.body["sleep"])


def _header(name: str):  # type: ignore[no-untyped-def]
    request = celery_task.request
    return getattr(request, name, None) or (request.headers or {}).get(name)


@handler("e2e.exits")
def exits_the_process(message):  # type: ignore[no-untyped-def]
    """The first attempt kills its own worker process, as a segfaulting library would."""
    _record(message.id, message.attempts, "start")
    if message.attempts == 1:
        os._exit(3)
    _record(message.id, message.attempts, "done")


_leaked: list[bytes] = []


@handler("e2e.leaks")
def leaks_memory(message):  # type: ignore[no-untyped-def]
    """Keeps 40 MB per run for ever, as a leaking handler would."""
    _leaked.append(os.urandom(40 * 1024 * 1024))
    _record(message.id, message.attempts, "leak")


@shared_task(name="e2e.celery_task")
def celery_task(body):  # type: ignore[no-untyped-def]
    """A plain Celery task bound to topic e2e.task by DELAYSVC_TOPIC_TASKS."""
    message_id, attempt = _header("delaysvc_message_id"), _header("delaysvc_attempt")
    _record(message_id, attempt, "task")
    if body.get("fail_first") and attempt == 1:
        raise RuntimeError("task failed on its first attempt")
    return body


@handler("e2e.noop")
def does_nothing(message):  # type: ignore[no-untyped-def]
    """For the lateness of a handler's start, nothing else."""


@handler("e2e.limited")
def limited(message):  # type: ignore[no-untyped-def]
    """200 ms of work between a start and an end record (the limits test overlaps them)."""
    _record(message.id, message.attempts, "start")
    time.sleep(0.2)
    _record(message.id, message.attempts, "end")
