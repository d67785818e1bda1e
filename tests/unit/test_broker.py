"""The embedded mode's filesystem broker (delaysvc.tasks.broker): messages get through whole,
and a worker's wait for them is short enough to see a stop request soon."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from kombu import Connection, Queue

from delaysvc.config.settings import Settings
from delaysvc.tasks import broker
from delaysvc.tasks.app import broker_options


def _connection(var_dir: Path) -> Connection:
    """A connection with the options a worker of the embedded mode gets (`broker_options`)."""
    url, options = broker_options(Settings.from_env({}, var_dir=var_dir))
    assert url.startswith(broker.SCHEME)
    return Connection(url, transport_options=options)


def test_a_message_put_is_taken_whole(tmp_path):
    with _connection(tmp_path) as conn:
        queue = conn.SimpleQueue("q")
        queue.put({"n": 1, "body": "x" * 100_000})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 1, "body": "x" * 100_000}
        message.ack()
        queue.close()
    # consumed files are deleted
    assert not [p for p in (tmp_path / "broker").iterdir() if p.is_file()]


def test_a_workers_wait_ends_within_a_quarter_second(tmp_path):
    """Celery's loop waits `drain_events(timeout=2.0)` and checks for a stop only between
    waits: each wait here ends after DRAIN_SECONDS (failed before: 2 s)."""
    conn = _connection(tmp_path)
    with conn, conn.Consumer(Queue("q"), callbacks=[lambda body, message: None]):
        started = time.monotonic()
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=2.0)
        assert time.monotonic() - started < 1.0
