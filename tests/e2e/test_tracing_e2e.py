"""Traces across real processes: a producer process sends inside a request span, a Celery
worker (with delivery and beat, as deployed) runs the handler; both set up the OpenTelemetry
SDK as an application does (tests/e2e/tracing_handlers.py) and write their spans to files.
Each run of the handler is a span of its own linked to its message's send span, one per
attempt, with the attempt and its outcome."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.e2e.conftest import Service, wait_for
from tests.support.passes import second_pass_only

pytestmark = pytest.mark.e2e

TOPIC = "e2e.traced"


def _spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _ids(context: dict[str, str]) -> tuple[str, str]:
    return context["trace_id"], context["span_id"]


@second_pass_only("real processes, ~7 s; the trace's links, the same on either server")
def test_each_run_in_the_worker_links_to_the_send_in_the_producer_one_span_per_attempt(
    service: Service, tmp_path: Path
) -> None:
    producer_spans, worker_spans = tmp_path / "producer.jsonl", tmp_path / "worker.jsonl"
    service.env["DELAYSVC_HANDLERS"] = "tests.e2e.tracing_handlers"
    service.env["E2E_TRACES"] = str(worker_spans)
    service.start()
    sent = subprocess.run(
        [sys.executable, "-m", "tests.e2e.tracing_handlers"],
        env=service.env | {"E2E_TRACES": str(producer_spans)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    ids: dict[str, int] = json.loads(sent.stdout)
    wait_for(
        lambda: (
            (service.count_status("succeeded", TOPIC), service.count_status("dead", TOPIC))
            == (2, 1)
        ),
        60,
        "two messages to succeed and one to die",
    )

    produced = _spans(producer_spans)
    (request,) = [s for s in produced if s["name"] == "POST /orders"]
    sends = {
        int(s["attributes"]["messaging.message.id"]): s
        for s in produced
        if s["name"] == f"send {TOPIC}"
    }
    assert sorted(sends) == sorted(ids.values())
    for send in sends.values():
        assert send["kind"] == "SpanKind.PRODUCER"
        assert send["parent_id"] == request["context"]["span_id"]
        assert send["resource"]["attributes"]["service.name"] == "e2e-producer"

    runs: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for span in _spans(worker_spans):
        if span["name"] == f"process {TOPIC}":
            runs[int(span["attributes"]["messaging.message.id"])].append(span)
    attempts = {
        row.id: row.attempts
        for row in service.rows("SELECT id, attempts FROM message WHERE topic = :t", t=TOPIC)
    }
    expected = {
        ids["ok"]: [(1, "succeeded", "UNSET")],
        ids["flaky"]: [(1, "retried", "ERROR"), (2, "succeeded", "UNSET")],
        ids["dead"]: [(1, "dead", "ERROR")],
    }
    assert {
        message_id: [
            (
                s["attributes"]["delaysvc.attempt"],
                s["attributes"]["delaysvc.outcome"],
                s["status"]["status_code"],
            )
            for s in sorted(spans, key=lambda s: s["start_time"])
        ]
        for message_id, spans in runs.items()
    } == expected
    assert {message_id: len(spans) for message_id, spans in runs.items()} == attempts
    for message_id, spans in runs.items():
        send = sends[message_id]
        for span in spans:
            assert span["kind"] == "SpanKind.CONSUMER"
            assert span["resource"]["attributes"]["service.name"] == "e2e-worker"
            assert [_ids(link["context"]) for link in span["links"]] == [_ids(send["context"])]
            assert span["context"]["trace_id"] != send["context"]["trace_id"]
            assert span["parent_id"] is None
            assert span["attributes"]["delaysvc.wait_ms"] >= 0  # none ran before it was due
    (flaky_first, _) = sorted(runs[ids["flaky"]], key=lambda s: s["start_time"])
    assert [e["attributes"]["exception.message"] for e in flaky_first["events"]] == [
        "the first attempt fails"
    ]
