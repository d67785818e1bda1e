"""Traces across the delay (`delaysvc.config.tracing`), in one process with the SDK's in-memory
exporter: a send is a PRODUCER span whose context its message stores; each run of its handler
is a CONSUMER span linked to it, one per attempt, with its outcome; a lane run is a span with
what it moved. With no TracerProvider set, nothing is added to a message; with OpenTelemetry
not imported by the application, delaysvc imports none of it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once

from delaysvc.config import tracing
from delaysvc.config.settings import Settings
from delaysvc.config.validation import MAX_PROPERTIES
from delaysvc.errors import DeadLetter, RetryLater, ValidationError
from delaysvc.maintenance import delivery
from delaysvc.producer.sending import Producer
from delaysvc.worker.consumer import Consumer, handler

pytestmark = pytest.mark.usefixtures("own_handlers")


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The spans this test ends: an SDK TracerProvider is the global one for this test only
    (the API sets one once a process; its flag and provider are put back after, as
    opentelemetry-test-utils' `reset_trace_globals` does)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    trace.set_tracer_provider(provider)
    yield exporter
    provider.shutdown()


@pytest.fixture
def consumer(settings: Settings, engine: Any) -> Consumer:
    return Consumer(settings, engine)


def traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def named_prefix(exporter: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


def linked_to(span: ReadableSpan) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


def ids(span: ReadableSpan) -> tuple[int, int]:
    return (span.get_span_context().trace_id, span.get_span_context().span_id)


def make_due(engine: Any, producer: Producer, message_id: int) -> datetime:
    """Move a waiting message into its topic's queue by the lane's own delivery, with the
    clock at its due time (no sleeping); -> that due time."""
    waiting = producer.get(message_id)
    row_lane = _lane_of(engine, message_id)
    with engine.connect() as conn:
        assert delivery.run_once(conn, row_lane, 100, waiting.deliver_at).moved == 1
    return waiting.deliver_at


def _lane_of(engine: Any, message_id: int) -> int:
    from sqlalchemy import text

    with engine.connect() as conn:
        return conn.execute(
            text("SELECT lane FROM commit_log WHERE id = :id"), {"id": message_id}
        ).scalar_one()


def test_a_send_is_a_producer_span_whose_context_the_message_carries(
    producer: Producer, spans: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("the application")
    with tracer.start_as_current_span("POST /orders") as request:
        sent = producer.send(
            "order.cancel",
            {"order": 42},
            delay="30m",
            # the propagator's names are delaysvc's while tracing is on: these are replaced
            properties={"traceparent": "00-given", "tracestate": "given=1", "tenant": "acme"},
        )
    (send,) = named(spans, "send order.cancel")
    assert send.kind == SpanKind.PRODUCER
    assert send.parent is not None and send.parent.span_id == request.get_span_context().span_id
    assert send.context.trace_id == request.get_span_context().trace_id
    assert dict(send.attributes or {}) == {
        "messaging.system": "delaysvc",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "order.cancel",
        "messaging.message.id": str(sent.id),
        "delaysvc.created": True,
        "delaysvc.deliver_at": sent.deliver_at.isoformat(),
    }
    stored = producer.get(sent.id).properties
    assert stored == {"tenant": "acme", "traceparent": traceparent(send)}


def test_a_send_whose_key_is_held_keeps_the_holders_context(
    producer: Producer, spans: InMemorySpanExporter
) -> None:
    first = producer.send("order.cancel", {}, delay="30m", key="order-1")
    again = producer.send("order.cancel", {}, delay="30m", key="order-1")
    assert (again.id, again.created) == (first.id, False)
    first_send, second_send = named(spans, "send order.cancel")
    assert (first_send.attributes or {})["delaysvc.created"] is True
    assert (second_send.attributes or {})["delaysvc.created"] is False
    assert (second_send.attributes or {})["messaging.message.id"] == str(first.id)
    assert producer.get(first.id).properties == {"traceparent": traceparent(first_send)}


@pytest.mark.parametrize(
    ("topics", "name"),
    [(["order.cancel"] * 3, "send order.cancel"), (["order.cancel", "sms.send"] * 2, "send")],
)
def test_a_batch_is_one_producer_span_whose_context_every_message_carries(
    producer: Producer,
    consumer: Consumer,
    spans: InMemorySpanExporter,
    topics: list[str],
    name: str,
) -> None:
    runs: list[int] = []
    for topic in set(topics):
        handler(topic)(lambda message: runs.append(message.id))
    with trace.get_tracer("the application").start_as_current_span("POST /batch") as request:
        sent = producer.send_batch(
            [
                {"topic": topic, "body": {"n": n}, "properties": {"traceparent": "00-given"}}
                for n, topic in enumerate(topics)
            ]
        )
    (send,) = named(spans, name)
    assert send.kind == SpanKind.PRODUCER
    assert send.parent is not None and send.parent.span_id == request.get_span_context().span_id
    attributes = dict(send.attributes or {})
    assert attributes["messaging.batch.message_count"] == len(topics)
    assert attributes.get("messaging.destination.name") == (
        topics[0] if len(set(topics)) == 1 else None
    )
    assert [producer.get(m.id).properties for m in sent] == [
        {"traceparent": traceparent(send)}
    ] * len(topics)
    for topic in set(topics):
        consumer.run_once(topic)
    assert sorted(runs) == sorted(m.id for m in sent)
    assert [linked_to(run) for run in named_prefix(spans, "process ")] == [[ids(send)]] * len(
        topics
    )


def test_each_run_is_a_consumer_span_linked_to_the_send_one_per_attempt(
    producer: Producer, consumer: Consumer, engine: Any, spans: InMemorySpanExporter
) -> None:
    inside: list[Any] = []

    @handler("order.cancel")
    def cancel(message: Any) -> None:
        with trace.get_tracer("the application").start_as_current_span("UPDATE orders") as own:
            inside.append(own)
        if message.attempts == 1:
            raise ConnectionError("the shop is down")

    sent = producer.send("order.cancel", {"order": 42})  # due now
    consumer.run_once("order.cancel")
    retry_due = make_due(engine, producer, sent.id)
    consumer.run_once("order.cancel")
    assert producer.get(sent.id).status == "succeeded"

    (send,) = named(spans, "send order.cancel")
    first, second = runs = named(spans, "process order.cancel")
    for run in runs:
        assert run.kind == SpanKind.CONSUMER
        assert linked_to(run) == [ids(send)]
        assert run.parent is None  # a link, not a parent: the run is a trace of its own
        assert run.context.trace_id != send.context.trace_id
    # the handler's own spans are children of its run
    assert [s.parent.span_id for s in inside] == [r.context.span_id for r in runs]
    assert {k: v for k, v in (first.attributes or {}).items() if k != "delaysvc.wait_ms"} == {
        "messaging.system": "delaysvc",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "order.cancel",
        "messaging.message.id": str(sent.id),
        "delaysvc.attempt": 1,
        "delaysvc.outcome": "retried",
        "error.type": "builtins.ConnectionError",
    }
    assert first.status.status_code == StatusCode.ERROR
    assert first.status.description == "ConnectionError: the shop is down"
    assert [e.name for e in first.events] == ["exception"]
    assert (first.events[0].attributes or {})["exception.message"] == "the shop is down"
    assert (second.attributes or {})["delaysvc.attempt"] == 2
    assert (second.attributes or {})["delaysvc.outcome"] == "succeeded"
    assert "error.type" not in (second.attributes or {})
    assert second.status.status_code == StatusCode.UNSET
    assert second.events == ()
    # the wait is from the run's own due time (the send's, then the retry's) to its start
    for run, due in ((first, sent.deliver_at), (second, retry_due)):
        assert run.start_time is not None
        expected_ms = (run.start_time / 1e9 - due.timestamp()) * 1000
        assert (run.attributes or {})["delaysvc.wait_ms"] == pytest.approx(expected_ms, abs=20)


@pytest.mark.parametrize(
    ("max_retries", "raised", "outcome", "error_type"),
    [
        (2, RetryLater(delay="5m"), "retried", "delaysvc.errors.RetryLater"),
        (2, DeadLetter("no such order"), "dead", "delaysvc.errors.DeadLetter"),
        (0, ValueError("bad body"), "dead", "builtins.ValueError"),
        (2, ValueError("bad body"), "retried", "builtins.ValueError"),
    ],
)
def test_a_runs_outcome_is_what_its_failure_comes_to(
    producer: Producer,
    consumer: Consumer,
    spans: InMemorySpanExporter,
    max_retries: int,
    raised: Exception,
    outcome: str,
    error_type: str,
) -> None:
    @handler("order.cancel", max_retries=max_retries)
    def fails(message: Any) -> None:
        raise raised

    sent = producer.send("order.cancel", {})
    consumer.run_once("order.cancel")
    assert producer.get(sent.id).status == {"retried": "retrying", "dead": "dead"}[outcome]
    (run,) = named(spans, "process order.cancel")
    assert (run.attributes or {})["delaysvc.outcome"] == outcome
    assert (run.attributes or {})["error.type"] == error_type
    assert run.status.status_code == StatusCode.ERROR


def test_a_transactional_handler_runs_in_its_span(
    producer: Producer, consumer: Consumer, spans: InMemorySpanExporter
) -> None:
    seen: list[int] = []

    @handler("order.cancel", transaction=True)
    def cancel(message: Any, conn: Any) -> None:
        seen.append(trace.get_current_span().get_span_context().span_id)

    producer.send("order.cancel", {})
    consumer.run_once("order.cancel")
    (run,) = named(spans, "process order.cancel")
    assert seen == [run.context.span_id]
    assert (run.attributes or {})["delaysvc.outcome"] == "succeeded"


def test_a_durable_celery_task_is_traced_from_apply_async_to_its_publish(
    producer: Producer, consumer: Consumer, engine: Any, spans: InMemorySpanExporter, monkeypatch
) -> None:
    """`apply_async(countdown=...)` of an app made durable is a send: its span is a child of
    the caller's, and the run that publishes the task when due links to it; the publish
    happens inside that run's span, where Celery's own instrumentation takes the trace on."""
    from celery import Celery
    from celery.signals import before_task_publish

    from delaysvc.contrib import celery as durable_celery

    monkeypatch.setattr(durable_celery, "_apps", {})
    app = Celery("traced", broker="memory://", set_as_current=False)
    durable_celery.durable(app, producer=producer)
    published_in: list[Any] = []

    def during_publish(**_: object) -> None:
        published_in.append(trace.get_current_span().get_span_context().span_id)

    before_task_publish.connect(during_publish, weak=False)
    try:
        with trace.get_tracer("the application").start_as_current_span("POST /orders") as request:
            task_id = app.send_task("shop.remind", (1,), countdown=30).id
        message = producer.find(durable_celery.topic_for("shop.remind"), task_id)
        make_due(engine, producer, message.id)
        assert consumer.run_once(message.topic).succeeded == 1
    finally:
        before_task_publish.disconnect(during_publish)
        app.close()
    (send,) = named(spans, "send celery.shop.remind")
    assert send.parent is not None and send.parent.span_id == request.get_span_context().span_id
    (run,) = named(spans, "process celery.shop.remind")
    assert linked_to(run) == [ids(send)]
    assert published_in == [run.get_span_context().span_id]


def test_a_message_sent_untraced_runs_in_a_span_with_no_link(
    producer: Producer, consumer: Consumer, request: pytest.FixtureRequest
) -> None:
    handler("order.cancel")(lambda message: None)
    sent = producer.send("order.cancel", {}, properties={"tenant": "acme"})  # tracing is off
    spans: InMemorySpanExporter = request.getfixturevalue("spans")  # and now on
    consumer.run_once("order.cancel")
    (run,) = named(spans, "process order.cancel")
    assert run.links == ()
    assert (run.attributes or {})["messaging.message.id"] == str(sent.id)


async def _asend(producer: Producer) -> Any:
    return await producer.asend("order.cancel", {}, delay="30m")


def test_an_asend_in_a_span_carries_the_context_across_its_thread(
    producer: Producer, spans: InMemorySpanExporter
) -> None:
    import asyncio

    with trace.get_tracer("the application").start_as_current_span("handler") as caller:
        sent = asyncio.run(_asend(producer))
    (send,) = named(spans, "send order.cancel")
    assert send.parent is not None and send.parent.span_id == caller.get_span_context().span_id
    assert producer.get(sent.id).properties == {"traceparent": traceparent(send)}


def test_a_lane_run_is_a_span_with_the_messages_moved_and_their_lateness(
    producer: Producer, engine: Any, spans: InMemorySpanExporter
) -> None:
    sent = [producer.send("order.cancel", {"n": n}, delay_level=1) for n in range(3)]  # 1 s
    runner = delivery.LaneRunner(engine, 1, 100, idle_poll_seconds=0.05)
    budget = (max(m.deliver_at for m in sent) - sent[0].stored_at).total_seconds() + 0.5
    running = threading.Thread(target=runner.run, args=(budget,))
    running.start()
    try:
        while not runner.held_lane and running.is_alive():
            running.join(0.01)
        # a second runner finds the lane held: it returns at once, and is no span
        second = delivery.LaneRunner(engine, 1, 100, idle_poll_seconds=0.05)
        assert (second.run(0.1), second.held_lane) == (0, False)
    finally:
        running.join()
    assert runner.moved_total == 3
    (run,) = named(spans, "deliver lane")
    attributes = dict(run.attributes or {})
    largest = attributes.pop("delaysvc.lateness_max_ms")
    mean = attributes.pop("delaysvc.lateness_mean_ms")
    assert attributes == {
        "messaging.system": "delaysvc",
        "delaysvc.lane": 1,
        "delaysvc.messages_moved": 3,
    }
    # the head's due time is exact: moved within ms of it (the largest is taken at the move's
    # statement time, the sum at the clock's: a mean may pass the largest by a fraction of a ms)
    assert 0 <= largest < 500
    assert 0 <= mean < 500


def test_the_context_is_carried_besides_the_most_properties_a_caller_may_give(
    producer: Producer, spans: InMemorySpanExporter
) -> None:
    """The limit (`MAX_PROPERTIES`) is on the caller's own properties: the context comes on
    top, so tracing never makes a valid send invalid. A property named for the context is
    delaysvc's while tracing is on: replaced by the send's own, and not counted, so a
    message's properties, context included, can be sent again (a handler passing them on)."""
    own = {f"p{n}": str(n) for n in range(MAX_PROPERTIES)}
    given = {**own, "traceparent": "00-given", "tracestate": "given=1"}
    one = producer.send("t.props", 1, properties=own)
    again = producer.send("t.props", 2, properties=given)
    (batch,) = producer.send_batch([{"topic": "t.props", "body": 3, "properties": given}])
    first, second, batch_send = named(spans, "send t.props")
    assert producer.get(one.id).properties == {**own, "traceparent": traceparent(first)}
    assert producer.get(again.id).properties == {**own, "traceparent": traceparent(second)}
    assert producer.get(batch.id).properties == {**own, "traceparent": traceparent(batch_send)}
    assert len(one.properties) == MAX_PROPERTIES + 1  # what the send answers is what is stored
    resent = producer.send("t.props", 4, properties=producer.get(one.id).properties)
    assert set(resent.properties) == {*own, "traceparent"}
    # more of one's own is refused, traced or not, and a context field's value is checked
    for refused in ({**given, "one": "more"}, {**own, "traceparent": "a\x00b"}):
        with pytest.raises(ValidationError, match="properties"):
            producer.send("t.props", 5, properties=refused)
        with pytest.raises(ValidationError, match=r"messages\[0\]\.properties"):
            producer.send_batch([{"topic": "t.props", "body": 5, "properties": refused}])


def test_with_no_tracer_provider_nothing_is_added_to_a_message(
    producer: Producer, consumer: Consumer
) -> None:
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert tracing.tracer() is None
    ran: list[Any] = []
    handler("order.cancel")(lambda message: ran.append(message.properties))
    # off, the names are the caller's like any other
    sent = producer.send("order.cancel", {}, properties={"traceparent": "mine"})
    consumer.run_once("order.cancel")
    assert ran == [{"traceparent": "mine"}]
    assert producer.get(sent.id).properties == {"traceparent": "mine"}


def test_without_opentelemetry_imported_delaysvc_imports_none_of_it(
    settings: Settings, database_url: str
) -> None:
    """A process that never imported OpenTelemetry sends, delivers and runs a message, and
    still has none of it loaded (OpenTelemetry is installed here: only the import is spared)."""
    script = f"""
import json, sys
from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.maintenance import delivery
from delaysvc.producer.sending import Producer
from delaysvc.worker.consumer import Consumer, handler

settings = Settings(database_url={database_url!r}, delay_levels={settings.delay_levels!r})
engine = make_engine(settings)
ran = []
handler("order.cancel")(lambda message: ran.append(message.id))
sent = Producer(settings, engine).send("order.cancel", {{}}, delay_level=1)
delivery.LaneRunner(engine, 1, 100, 0.05).run(1.5)
Consumer(settings, engine).run_once("order.cancel")
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
print(json.dumps({{"ran": ran == [sent.id], "properties": sent.properties, "loaded": loaded}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(done.stdout) == {"ran": True, "properties": {}, "loaded": []}


def test_the_propagators_default_fields_are_the_documented_ones() -> None:
    from opentelemetry import propagate

    assert sorted(propagate.get_global_textmap().fields) == sorted(tracing.PROPAGATED)
