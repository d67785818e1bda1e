"""Traces across the delay (OpenTelemetry): a send's trace context stored in its message, and
each run of its handler, however much later and in whichever process, linked back to it.

A delayed job breaks a trace: the request that scheduled it is gone when it runs. With the
`otel` extra (`opentelemetry-api` only: the SDK, its exporters and the TracerProvider are the
application's), once the application has set a TracerProvider:

- a single send is a PRODUCER span `send <topic>`, and its context is stored in the message's
  properties as the application's propagator writes it (by default W3C `traceparent`,
  `tracestate` and `baggage`; `PROPAGATED`): those names are delaysvc's while tracing is on, a
  value the caller gives for one is replaced (`carried`), and not counted against the
  caller's limit, `MAX_PROPERTIES`, which the context comes on top of (`validated_properties`):
  tracing never makes a valid send invalid, and a message's properties, its context included,
  can be sent again; a batch is one `send` span, its context in every message of it;
- each run of a handler is a CONSUMER span `process <topic>` linked to that context (a link,
  not a parent: the run is a trace of its own, or a child of whatever traces the worker), with
  OpenTelemetry's messaging attributes and delaysvc's: the attempt, the wait from due to start,
  the outcome (`OUTCOMES`); a handler's error is recorded on it;
- each run of a delivery lane is a span `deliver lane` with the messages moved and their
  lateness.

Nothing is paid without it: delaysvc never imports OpenTelemetry itself. An application that
traces has imported the API; while it has not (`opentelemetry.trace` not in `sys.modules`,
whether installed or not), or has set no TracerProvider (the API's default proxy, or the no-op
one), every hook here returns at once, and nothing is added to a message.

It lives in `config`, beside the log formatting, because the producer, the worker and the
maintenance services all use it, and it needs nothing of delaysvc but the property limits.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from typing import Any

from delaysvc.config.validation import MAX_PROPERTY_VALUE, validate_properties

SYSTEM = "delaysvc"
"""`messaging.system` of every span delaysvc starts, and the name of its tracer."""

PROPAGATED = ("traceparent", "tracestate", "baggage")
"""The properties the default propagator writes (an application's own propagator may write
others: `opentelemetry.propagate.get_global_textmap().fields`)."""

OUTCOMES = ("succeeded", "retried", "dead", "lost")
"""`delaysvc.outcome` of a handler's run: it returned; it raised and the job will run again; it
raised and the job is a dead letter; its claim was lost (the job is another run's)."""

_OFF: AbstractContextManager[None] = nullcontext()
_cached: tuple[Any, Any] | None = None  # (the provider, delaysvc's tracer from it)


def tracer() -> Any | None:
    """delaysvc's tracer, or None while no span would be recorded: the application has not
    imported OpenTelemetry, or has set no TracerProvider."""
    global _cached
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    if _cached is None or _cached[0] is not provider:
        _cached = (provider, provider.get_tracer(SYSTEM))
    return _cached[1]


# ---------------------------------------------------------------- the send


def sending(topic: str | None, batch: int | None = None) -> AbstractContextManager[Any]:
    """The PRODUCER span of a send to `topic`, or of a batch of `batch` messages (its topic set
    by `sent_to` when they share one), current while the messages are stored; None to the
    `with` when tracing is off. Its context is what `carried` writes into their properties."""
    found = tracer()
    if found is None:
        return _OFF
    from opentelemetry.trace import SpanKind

    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
    }
    if topic is not None:
        attributes["messaging.destination.name"] = topic
    if batch is not None:
        attributes["messaging.batch.message_count"] = batch
    return found.start_as_current_span(
        f"send {topic}" if topic is not None else "send",
        kind=SpanKind.PRODUCER,
        attributes=attributes,
    )


def sent_to(span: Any, topic: str) -> None:
    """A batch's `send` span named for the one topic all its messages go to."""
    span.update_name(f"send {topic}")
    span.set_attribute("messaging.destination.name", topic)


def context_properties() -> dict[str, str]:
    """The current trace context as message properties, as the global propagator writes it
    (a field longer than a property may be, a big `baggage`, is left out)."""
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {name: value for name, value in carrier.items() if len(value) <= MAX_PROPERTY_VALUE}


def context_fields() -> frozenset[str]:
    """The property names the trace context takes while tracing is on (the global
    propagator's fields: `PROPAGATED` by default); none while it is off."""
    if tracer() is None:
        return frozenset()
    from opentelemetry import propagate

    return frozenset(propagate.get_global_textmap().fields)


def validated_properties(
    properties: object, fields: frozenset[str] = frozenset()
) -> dict[str, str] | None:
    """`validate_properties`, with a caller's value for a field of the trace context
    (`fields`: `context_fields()`) checked like any property but not counted against
    `MAX_PROPERTIES`: it is replaced by the send's own (`carried`), and the limit is on the
    caller's own properties, which the context comes on top of."""
    if not fields or not isinstance(properties, dict) or fields.isdisjoint(properties):
        return validate_properties(properties)
    validate_properties({k: v for k, v in properties.items() if k in fields})
    validate_properties({k: v for k, v in properties.items() if k not in fields})
    return dict(properties)


def carried(properties: Mapping[str, str] | None, context: Mapping[str, str]) -> dict[str, str]:
    """`properties` with the trace context `context` (`context_properties`) in place of any
    field of the propagator the caller gave."""
    from opentelemetry import propagate

    fields = propagate.get_global_textmap().fields
    kept = {k: v for k, v in (properties or {}).items() if k not in fields}
    return kept | dict(context)


def sent(span: Any, message_id: int, created: bool, deliver_at: datetime) -> None:
    """What the send stored: the message's id, whether it is new (False: its key was held, and
    the holder keeps the context of its own send) and when it is due."""
    span.set_attributes(
        {
            "messaging.message.id": str(message_id),
            "delaysvc.created": created,
            "delaysvc.deliver_at": deliver_at.isoformat(),
        }
    )


# ---------------------------------------------------------------- the run


def processing(
    topic: str, message_id: int, attempt: int, properties: Mapping[str, str], due: datetime
) -> AbstractContextManager[Any]:
    """The CONSUMER span of one run of a handler, current while it runs, linked to the span
    context its message carries (none when it was sent untraced); None to the `with` when
    tracing is off. Its outcome is the caller's to set (`finished`)."""
    found = tracer()
    if found is None:
        return _OFF
    from opentelemetry import propagate, trace

    sender = trace.get_current_span(propagate.extract(properties)).get_span_context()
    links = [trace.Link(sender)] if sender.is_valid else []
    return found.start_as_current_span(
        f"process {topic}",
        kind=trace.SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": topic,
            "messaging.message.id": str(message_id),
            "delaysvc.attempt": attempt,
            "delaysvc.wait_ms": round((time.time() - due.timestamp()) * 1000, 1),
        },
        record_exception=False,  # a handler's error is data, recorded by `finished`
        set_status_on_exception=False,
    )


def finished(span: Any, outcome: str, error: BaseException | None) -> None:
    """A run's outcome (`OUTCOMES`); a handler's error recorded, the span's status ERROR."""
    span.set_attribute("delaysvc.outcome", outcome)
    if error is None:
        return
    from opentelemetry.trace import Status, StatusCode

    kind = type(error)
    span.set_attribute("error.type", f"{kind.__module__}.{kind.__qualname__}")
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{kind.__name__}: {error}"))


# ---------------------------------------------------------------- delivery


def lane_run(lane: int) -> AbstractContextManager[Any]:
    """The span of one run of a delivery lane (`LaneRunner.run`); None to the `with` when
    tracing is off."""
    found = tracer()
    if found is None:
        return _OFF
    return found.start_as_current_span(
        "deliver lane", attributes={"messaging.system": SYSTEM, "delaysvc.lane": lane}
    )


def lane_ran(span: Any, moved: int, lateness: tuple[int, float, float]) -> None:
    """What a lane run did: messages moved into their topics' queues, and how late (from due
    to moved) they were: `lateness` is (rows measured, the largest, their sum) in ms."""
    attributes: dict[str, Any] = {"delaysvc.messages_moved": moved}
    measured, largest, total = lateness
    if measured:
        attributes["delaysvc.lateness_max_ms"] = round(largest, 1)
        attributes["delaysvc.lateness_mean_ms"] = round(total / measured, 1)
    span.set_attributes(attributes)
