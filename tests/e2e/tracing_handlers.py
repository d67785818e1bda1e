"""An application that traces, for tests/e2e/test_tracing_e2e.py: importing it sets up the
OpenTelemetry SDK as an application would (a TracerProvider, its spans written as JSON lines,
one per span as it ends, to the file `E2E_TRACES` names), and registers a handler for
`e2e.traced`. The Celery worker imports it as a handler module (DELAYSVC_HANDLERS); run as
`python -m tests.e2e.tracing_handlers`, it is the producer: inside one request span it sends
one message of each kind and prints their ids as JSON."""

from __future__ import annotations

import json
import os
import sys

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from delaysvc import DeadLetter, handler, send


def _trace_to_file(service: str) -> None:
    """Each span, as it ends, appended to the file `E2E_TRACES` names as one JSON line (the
    SDK's own span format, `ReadableSpan.to_json`); the exporter flushes every span."""
    out = open(os.environ["E2E_TRACES"], "a")  # noqa: SIM115  (open while the process lives)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(
        SimpleSpanProcessor(
            ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
        )
    )
    trace.set_tracer_provider(provider)


@handler("e2e.traced", max_retries=3)
def traced(message):  # type: ignore[no-untyped-def]
    """Fails the first attempt when asked (a retry), or goes to the dead letters at once."""
    if message.body.get("dead"):
        raise DeadLetter("asked to give up")
    if message.body.get("fail_first") and message.attempts == 1:
        raise ConnectionError("the first attempt fails")


def send_in_a_request() -> dict[str, int]:
    """One message that succeeds, one that fails once then succeeds, one that dies: each due in
    1 s, sent inside the span of a request."""
    tracer = trace.get_tracer("e2e.producer")
    with tracer.start_as_current_span("POST /orders"):
        return {
            name: send("e2e.traced", body, delay="1s").id
            for name, body in (
                ("ok", {}),
                ("flaky", {"fail_first": True}),
                ("dead", {"dead": True}),
            )
        }


if __name__ == "__main__":
    _trace_to_file("e2e-producer")
    json.dump(send_in_a_request(), sys.stdout)
else:
    _trace_to_file("e2e-worker")
