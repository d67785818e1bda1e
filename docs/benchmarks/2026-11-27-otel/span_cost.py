"""The client CPU of delaysvc's tracing hooks alone, no database (issue 37):

    python docs/benchmarks/2026-11-27-otel/span_cost.py

each hook 20,000 times: with OpenTelemetry never imported (`absent`), then with its API
imported and no TracerProvider set (the proxy: `off`), then with the SDK's TracerProvider, a
BatchSpanProcessor and an exporter that drops what it is given (`on`), beside a bare SDK span
for scale."""

from __future__ import annotations

import sys
import timeit
from datetime import UTC, datetime
from typing import Any

from delaysvc.config import tracing

N = 20_000
DUE = datetime.now(UTC)
CARRIED = {"traceparent": "00-3286597013e01acc74596afd34953df4-561b132acdc92495-01"}


def send() -> None:
    """What `Producer._send_traced` adds around a single send."""
    with tracing.sending("order.cancel") as span:
        if span is not None:
            context = tracing.context_properties()
            tracing.carried({"tenant": "acme"}, context)
            tracing.sent(span, 1, True, DUE)


def run() -> None:
    """What `Consumer._run` adds around a handler's run."""
    with tracing.processing("order.cancel", 1, 1, CARRIED, DUE) as span:
        if span is not None:
            tracing.finished(span, "succeeded", None)


def micros(call: Any) -> float:
    call()
    return timeit.timeit(call, number=N) / N * 1e6


assert "opentelemetry" not in sys.modules
print(f"absent: send hook {micros(send):.2f} us, run hook {micros(run):.2f} us")

from opentelemetry import trace  # noqa: E402  (the application imports the API now)
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

print(f"off: send hook {micros(send):.2f} us, run hook {micros(run):.2f} us")


class Dropped(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def bare() -> None:
    with trace.get_tracer("bare").start_as_current_span("send order.cancel"):
        pass


provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(Dropped()))
trace.set_tracer_provider(provider)
print(
    f"on: send hook {micros(send):.1f} us, run hook {micros(run):.1f} us, "
    f"a bare SDK span {micros(bare):.1f} us"
)
