"""`DELAYSVC_LOG_FORMAT`: every process delaysvc starts, run for real (the CLI, a Celery worker
and beat), writes one JSON object per line with the records' structured fields."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from delaysvc.runtime.supervisor import die_with_parent
from tests.conftest import ROOT, TEST_LEVELS, outside_env
from tests.support.passes import first_pass_only

Record = dict[str, Any]


def _env(**variables: str) -> dict[str, str]:
    env = outside_env()
    env.update(variables)
    return env


def _records(output: str) -> list[Record]:
    """Every line parsed as one JSON object (a line that is not one fails here)."""
    records = [json.loads(line) for line in output.splitlines() if line.strip()]
    for record in records:
        assert isinstance(record, dict), record
        assert {"timestamp", "level", "logger", "event"} <= set(record), record
        assert datetime.fromisoformat(record["timestamp"]).utcoffset() is not None
    return records


def test_the_cli_logs_one_json_object_per_line_keeping_the_extra_fields(
    database_url: str,
) -> None:
    env = _env(
        DELAYSVC_DATABASE_URL=database_url,
        DELAYSVC_DELAY_LEVELS=TEST_LEVELS,
        DELAYSVC_LOG_FORMAT="json",
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "delaysvc",
            "-v",
            "send",
            "order.cancel",
            '{"id": 7}',
            "--level",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    message_id = int(result.stdout.split("id=")[1].split()[0])
    records = _records(result.stderr)
    sent = [record for record in records if record["event"] == "message.sent"]
    assert len(sent) == 1, records
    (record,) = sent
    assert (record["level"], record["logger"]) == ("INFO", "delaysvc.producer")
    assert (record["message_id"], record["topic"]) == (message_id, "order.cancel")
    assert record["lane"] == 2


def test_the_text_format_keeps_the_extra_fields_as_key_value_pairs(database_url: str) -> None:
    env = _env(DELAYSVC_DATABASE_URL=database_url, DELAYSVC_DELAY_LEVELS=TEST_LEVELS)
    result = subprocess.run(
        [sys.executable, "-m", "delaysvc", "-v", "send", "order.cancel", "{}", "--level", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    message_id = int(result.stdout.split("id=")[1].split()[0])
    (line,) = [line for line in result.stderr.splitlines() if " message.sent " in line]
    assert line.split(" message.sent ")[0].endswith("INFO delaysvc.producer")
    assert f"message_id={message_id} " in line
    assert "topic=order.cancel " in line and "lane=2" in line.split()


def test_a_log_format_other_than_text_or_json_is_one_clear_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "delaysvc", "levels", "--no-db"],
        env=_env(DELAYSVC_LOG_FORMAT="xml"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: DELAYSVC_LOG_FORMAT: 'xml' is not a log format; use text or json"
    ]


class Process:
    """A child whose output lines are read as they come."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path):
        self.popen = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=die_with_parent(),  # gone with the test process, however it ends
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert self.popen.stdout is not None
        stream = self.popen.stdout
        threading.Thread(
            target=lambda: [self.lines.put(line) for line in stream], daemon=True
        ).start()

    def wait_for(self, found: Callable[[Record], bool], timeout: float = 60.0) -> Record:
        """The first record `found` accepts; every line up to it must be a JSON record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                assert self.popen.poll() is None, "".join(self.seen)
                continue
            self.seen.append(line)
            (record,) = _records(line)
            if found(record):
                return record
        raise AssertionError(f"not logged within {timeout} s:\n{''.join(self.seen)}")

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@contextmanager
def running(argv: list[str], env: dict[str, str], cwd: Path) -> Iterator[Process]:
    process = Process(argv, env, cwd)
    try:
        yield process
    finally:
        process.stop()


CELERY = [sys.executable, "-m", "celery", "-A", "delaysvc.tasks", "--quiet"]


@first_pass_only(
    "~7 s; Celery's records as JSON, on the filesystem broker in either pass, the same on "
    "either server"
)
@pytest.mark.timeout(180)
def test_celery_worker_and_beat_log_their_own_records_as_json(
    database_url: str, tmp_path: Path
) -> None:
    env = _env(
        DELAYSVC_DATABASE_URL=database_url,
        DELAYSVC_DELAY_LEVELS=TEST_LEVELS,
        DELAYSVC_VAR_DIR=str(tmp_path / "var"),  # the filesystem broker both share
        DELAYSVC_LOG_FORMAT="json",
        # as root, Celery warns about it on stderr before any logging exists
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    worker = [*CELERY, "worker", "-P", "solo", "-Q", "delaysvc.consume", "-n", "logs@%h"]
    worker += ["--without-mingle", "--without-gossip", "-l", "INFO"]
    beat = [*CELERY, "beat", "-s", str(tmp_path / "schedule"), "-l", "INFO"]
    with running(worker, env, tmp_path) as consumer:
        ready = consumer.wait_for(lambda r: r["event"].endswith(" ready."))
        assert (ready["level"], ready["logger"]) == ("INFO", "celery.apps.worker")
        with running(beat, env, tmp_path) as scheduler:
            started = scheduler.wait_for(lambda r: r["event"] == "beat: Starting...")
            assert started["logger"] == "celery.beat"
            # the sweep beat sends every second, run by the worker: Celery's record of it keeps
            # its structured `data`
            done = consumer.wait_for(lambda r: "succeeded" in r["event"])
    assert done["logger"] == "celery.app.trace"
    assert done["data"]["name"] == "delaysvc.consume_sweep"
    assert done["data"]["id"] in done["event"]


@pytest.mark.parametrize(
    ("web_server", "access_logger"), [("asgi", "uvicorn.access"), ("sync", "gunicorn.access")]
)
def test_the_web_server_logs_gunicorns_own_lines_and_the_access_log_as_json(
    database_url: str, tmp_path: Path, web_server: str, access_logger: str
) -> None:
    import urllib.request

    from delaysvc.runtime.supervisor import free_port

    port = free_port()
    env = _env(
        DELAYSVC_DATABASE_URL=database_url,
        DELAYSVC_DELAY_LEVELS=TEST_LEVELS,
        DELAYSVC_LOG_FORMAT="json",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    web = [sys.executable, "-m", "delaysvc", "web", "--port", str(port), "--workers", "1"]
    web += ["--server", web_server]
    with running(web, env, tmp_path) as server:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "".join(server.seen)
                time.sleep(0.2)
        access = server.wait_for(lambda r: "GET /healthz" in r["event"])
    assert access["logger"] == access_logger


SEND_TO_NOWHERE = """
import sys
from delaysvc import send
from delaysvc.errors import DatabaseUnavailable
{setup}
try:
    send("t", 1)
except DatabaseUnavailable:
    sys.exit(3)
"""


@pytest.mark.parametrize(
    "setup", ["", "import logging; logging.basicConfig()"], ids=["unset", "its_own"]
)
def test_a_producers_warning_in_a_program_without_logging_says_its_fields(setup: str) -> None:
    """A program that sends messages and set up no logging saw the bare event name of the
    producer's warnings (`producer.reconnecting`: Python's last resort writes a record's message
    alone), not what happened. They come with their fields, as the text format writes them;
    a program with logging of its own gets them there, once."""
    done = subprocess.run(
        [sys.executable, "-c", SEND_TO_NOWHERE.format(setup=setup)],
        env=_env(DELAYSVC_DATABASE_URL="postgresql://nobody@127.0.0.1:9/none"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    said = [line for line in done.stderr.splitlines() if "producer.reconnecting" in line]
    if setup:
        assert said == ["WARNING:delaysvc.producer:producer.reconnecting"]
    else:
        [line] = said
        assert " WARNING delaysvc.producer producer.reconnecting error=" in line
        assert "127.0.0.1" in line and "port 9" in line
