"""The http bench suite at a toy size: wrk against a real gunicorn on the test database. Its
full size (50 clients for 5 minutes) is `delaysvc bench http`; figures in docs/reliability.md."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import Engine

from delaysvc.bench import BenchContext, require_parts
from delaysvc.bench.http import http_suite
from delaysvc.config.settings import Settings
from delaysvc.db.names import sql


@pytest.fixture(autouse=True)
def wrk() -> None:
    """The suite needs wrk: MissingPart without it (skipped, or failed where required)."""
    require_parts(["http"])


def test_http_suite_sends_through_gunicorn_with_no_error_and_loses_nothing(
    settings: Settings, engine: Engine, database_url: str
) -> None:
    sizes = {"http_clients": 4, "http_seconds": 2, "http_workers": 2, "http_threads": 4}
    results = http_suite(BenchContext(settings, engine, database_url, sizes)).results
    result = results["http"]
    assert result["errors"] == {"connect": 0, "read": 0, "write": 0, "status": 0, "timeout": 0}
    assert result["requests"] > 20
    assert result["acknowledged"] == result["requests"]
    assert result["stored"] >= result["acknowledged"] and result["lost"] == 0
    assert 0 < result["latency_ms"]["p50"] <= result["latency_ms"]["p99"]
    assert result["raw_insert_per_s"] > 0
    # the batch endpoint beside send_batch in Python: every call stored its 1,000
    batch = results["http_batch"]
    assert batch["errors"] == 0
    assert batch["http_msgs_per_s"] > 0 and batch["python_batch_msgs_per_s"] > 0
    with engine.connect() as conn:
        stored = conn.execute(
            sql("SELECT count(*) FROM delaysvc.message WHERE topic = 'bench.http.batch'")
        ).scalar_one()
    assert stored % 1000 == 0 and stored >= 2000


def test_http_suite_stops_at_once_with_gunicorn_s_own_words_when_the_app_cannot_start(
    settings: Settings, engine: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the bench's own process never reads it; the web app refuses it at start
    monkeypatch.setenv("DELAYSVC_LOG_FORMAT", "bogus")
    sizes = {"http_clients": 2, "http_seconds": 1, "http_workers": 1, "http_threads": 1}
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        http_suite(BenchContext(settings, engine, database_url, sizes))
    assert time.monotonic() - started < 40  # not the 60 s wait for an answer
    assert "gunicorn exited" in str(raised.value)
    assert "DELAYSVC_LOG_FORMAT: 'bogus' is not a log format" in str(raised.value)
