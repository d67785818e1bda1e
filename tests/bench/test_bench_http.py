"""The http bench suite at a toy size: wrk against a real gunicorn on the test database. Its
full size (50 clients for 5 minutes) is `delaysvc bench http`; figures in docs/reliability.md."""

from __future__ import annotations

from sqlalchemy import Engine

from delaysvc.bench import BenchContext
from delaysvc.bench.http import http_suite
from delaysvc.config.settings import Settings


def test_http_suite_sends_through_gunicorn_with_no_error_and_loses_nothing(
    settings: Settings, engine: Engine, database_url: str
) -> None:
    sizes = {"http_clients": 4, "http_seconds": 2, "http_workers": 2}
    result = http_suite(BenchContext(settings, engine, database_url, sizes)).results["http"]
    assert result["errors"] == {"connect": 0, "read": 0, "write": 0, "status": 0, "timeout": 0}
    assert result["requests"] > 20
    assert result["acknowledged"] == result["requests"]
    assert result["stored"] >= result["acknowledged"] and result["lost"] == 0
    assert 0 < result["latency_ms"]["p50"] <= result["latency_ms"]["p99"]
    assert result["raw_insert_per_s"] > 0
