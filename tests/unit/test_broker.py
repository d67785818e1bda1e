"""The embedded mode's filesystem broker (delaysvc.tasks.broker): messages get through whole,
and a worker's wait for them is short enough to see a stop request soon."""

from __future__ import annotations

import socket
import time

import pytest
from kombu import Connection, Queue

from delaysvc.tasks import broker


def _connection(folder: str) -> Connection:
    return Connection(
        f"{broker.SCHEME}://localhost//",
        transport_options={
            "data_folder_in": folder,
            "data_folder_out": folder,
            "control_folder": f"{folder}/control",
            "store_processed": False,
            "polling_interval": 0.02,
        },
    )


def test_a_message_put_is_taken_whole(tmp_path):
    with _connection(str(tmp_path)) as conn:
        queue = conn.SimpleQueue("q")
        queue.put({"n": 1, "body": "x" * 100_000})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 1, "body": "x" * 100_000}
        message.ack()
        queue.close()
    assert not [p for p in tmp_path.iterdir() if p.is_file()]  # consumed files are deleted


def test_a_workers_wait_ends_within_a_quarter_second(tmp_path):
    """Celery's loop waits `drain_events(timeout=2.0)` and checks for a stop only between
    waits: each wait here ends after DRAIN_SECONDS (failed before: 2 s)."""
    conn = _connection(str(tmp_path))
    with conn, conn.Consumer(Queue("q"), callbacks=[lambda body, message: None]):
        started = time.monotonic()
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=2.0)
        assert time.monotonic() - started < 1.0
