"""Handlers the `chaos` workload runs in real Celery workers (`delaysvc.bench.chaos`). Each run
is recorded in the run's own database (`public.chaos_run`, made by `chaos.prepare`): the
message id, its attempt, the due time the worker was given, the start and end on the DATABASE
clock, and the worker's pid and process group (the group is what a fault kills), so a checker
can tell every run of every message apart, and why a second one happened."""

from __future__ import annotations

import os
import time

import psycopg

from delaysvc import DeadLetter, handler
from delaysvc.db.engines import libpq_url
from delaysvc.worker.consumer import Job

TOPICS = ("chaos.ok", "chaos.flaky", "chaos.dead", "chaos.limited")
FLAKY_RETRIES = 3
DEAD_RETRIES = 1

_connection: psycopg.Connection | None = None


def _record(message: Job, note: str) -> None:
    """One row for a run's start (note 'start') or end ('ok', 'fail', 'dead')."""
    global _connection
    if _connection is None or _connection.closed or _connection.broken:
        url = libpq_url(os.environ["DELAYSVC_DATABASE_URL"])
        _connection = psycopg.connect(url, autocommit=True, prepare_threshold=None)
    try:
        _connection.execute(
            "INSERT INTO public.chaos_run (message_id, attempt, deliver_ts, pid, pgid, note) "
            "VALUES (%s, %s, %s, %s, %s, %s)",
            (message.id, message.attempts, message.deliver_at, os.getpid(), os.getpgid(0), note),
        )
    except psycopg.OperationalError:
        _connection = None  # the database restarted: the run fails and is retried
        raise


def _was_dead(message_id: int) -> bool:
    """Did an earlier run of this message end it in the dead letters (it was redriven)?"""
    assert _connection is not None
    row = _connection.execute(
        "SELECT 1 FROM public.chaos_run WHERE message_id = %s AND note = 'dead'", (message_id,)
    ).fetchone()
    return row is not None


def _work(message: Job) -> None:
    sleep_ms = message.body.get("sleep", 0) if isinstance(message.body, dict) else 0
    if sleep_ms:
        time.sleep(sleep_ms / 1000)


@handler("chaos.ok")
def runs(message: Job) -> None:
    _record(message, "start")
    _work(message)
    _record(message, "ok")


@handler("chaos.limited")
def runs_limited(message: Job) -> None:
    _record(message, "start")
    _work(message)
    _record(message, "ok")


@handler("chaos.flaky", max_retries=FLAKY_RETRIES)
def fails_first(message: Job) -> None:
    """The first attempt fails (a retry at level 3 + 1); later ones succeed."""
    _record(message, "start")
    if message.attempts == 1:
        _record(message, "fail")
        raise ConnectionError("chaos: the first attempt fails")
    _record(message, "ok")


@handler("chaos.dead", max_retries=DEAD_RETRIES)
def dies_once(message: Job) -> None:
    """Goes to the dead letters, unless it was there before (redriven): then it succeeds."""
    _record(message, "start")
    if not _was_dead(message.id):
        _record(message, "dead")
        raise DeadLetter("chaos: asked to die")
    _record(message, "ok")
