"""`delaysvc.contrib.celery.durable`: a Celery app's countdowns stored in delaysvc, published to
its broker when due as they were, revoked by id; topic patterns (`celery.*`) in the registry and
in the "handled" health. The app's broker here is kombu's in-memory transport (a real kombu
transport, in this process); tests/e2e/test_celery_durable_e2e.py runs Redis and RabbitMQ with
real workers."""

from __future__ import annotations

import logging
import pickle
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from kombu import Exchange, Queue, binding
from kombu.common import Broadcast
from kombu.utils import json as kombu_json

from delaysvc import store
from delaysvc.contrib import celery as durable_celery
from delaysvc.contrib.celery import durable, key_for, topic_for
from delaysvc.db.names import sql
from delaysvc.errors import NotFound, ValidationError
from delaysvc.store.health import HANDLED
from delaysvc.worker import consumer as consumption
from delaysvc.worker.consumer import Consumer, handler, registered


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    saved = dict(consumption._registry)
    apps = dict(durable_celery._apps)
    yield
    consumption._registry.clear()
    consumption._registry.update(saved)
    durable_celery._apps.clear()
    durable_celery._apps.update(apps)


@pytest.fixture
def celery_app(producer) -> Iterator[Celery]:
    name = f"shop{uuid.uuid4().hex[:8]}"  # the memory transport is per process: a queue each
    app = Celery(name, broker="memory://", set_as_current=False)
    durable(app, producer=producer)
    app.conf.update(  # configured after `durable`: it must take this configuration
        task_default_queue=f"{name}-default",
        task_routes={"shop.invoice": {"queue": f"{name}-invoices"}},
        accept_content=["json", "pickle"],
    )

    @app.task(name="shop.cancel_order", shared=False)
    def cancel_order(order_id: int) -> int:
        return order_id

    @app.task(name="shop.invoice", shared=False)
    def invoice(order_id: int) -> int:
        return order_id

    yield app
    app.close()


def broker_messages(app: Celery, queue: str) -> list:
    """Every message waiting in `queue` of the app's broker, taken out."""
    taken = []
    with app.connection_for_read() as conn:
        simple = conn.SimpleQueue(Queue(queue, routing_key=queue))
        while True:
            try:
                message = simple.get(block=False)
            except simple.Empty:
                return taken
            message.ack()
            taken.append(message)


def stored(producer, task_id: str, task: str = "shop.cancel_order", retries: int = 0):
    return producer.find(topic_for(task), key_for(task_id, retries))


def run_due(producer, engine, message) -> None:
    """Make the stored message due now and run the `celery.*` handler on it."""
    with engine.begin() as conn:
        assert store.deliver_now(conn, [message.id]) == 1
    result = Consumer(producer.settings, engine).run_once(message.topic)
    assert result.succeeded == 1, producer.get(message.id).last_error


def test_a_countdown_beyond_the_threshold_is_stored_not_published(celery_app, producer):
    default = celery_app.conf.task_default_queue
    before = datetime.now(UTC)
    result = celery_app.tasks["shop.cancel_order"].apply_async((42,), countdown=60)
    message = stored(producer, result.id)
    assert message.topic == "celery.shop.cancel_order"
    assert message.status == "scheduled"
    assert before + timedelta(seconds=59) < message.deliver_at < before + timedelta(seconds=61)
    assert message.body["task"] == "shop.cancel_order"
    assert message.body["id"] == result.id
    assert message.body["args"] == "(42,)"
    assert broker_messages(celery_app, default) == []


@pytest.fixture
def tokyo_clock(monkeypatch) -> Iterator[None]:
    """This process's local time zone Asia/Tokyo (UTC+9) for the test."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("enable_utc", [True, False])
def test_a_naive_eta_is_read_as_celerys_worker_reads_it(
    celery_app, producer, tokyo_clock, enable_utc
):
    """A naive `eta` was first taken as UTC, then (a first fix) as the system's local time,
    which Celery 5.7's worker does not do: it reads it as UTC, so `datetime.utcnow() + 8 s`
    (Celery's own idiom) waited 5 hours in New York (found by a reviewer with real workers).
    Checked here against Celery's worker's own `Request`, given the same message from a
    broker, in Tokyo (UTC+9), with `enable_utc` either way."""
    from celery.worker.request import Request

    celery_app.conf.update(enable_utc=enable_utc, timezone="Asia/Tokyo")
    naive = datetime.now(UTC).replace(tzinfo=None) + timedelta(minutes=30)
    result = celery_app.tasks["shop.cancel_order"].apply_async((42,), eta=naive)
    message = stored(producer, result.id)
    plain = Celery("plain", broker="memory://", set_as_current=False)
    plain.conf.update(enable_utc=enable_utc, timezone="Asia/Tokyo", task_default_queue="plain")

    @plain.task(name="shop.cancel_order", shared=False)
    def task(order_id: int) -> int:
        return order_id

    task.apply_async((42,), eta=naive)  # not durable: to the broker, as a worker gets it
    (sent,) = broker_messages(plain, "plain")
    worker_reads = Request(sent, app=plain, task=task).eta
    assert message.deliver_at == worker_reads
    plain.close()


def test_a_task_id_already_held_by_a_stored_task_is_not_stored_twice_and_says_so(
    celery_app, producer, caplog
):
    """The key is the task id: a second `apply_async(task_id=X)` while X's stored task waits
    is not stored (Celery would run both); it is logged, not silent."""
    task = celery_app.tasks["shop.cancel_order"]
    first = task.apply_async((1,), countdown=60, task_id="order-1")
    with caplog.at_level(logging.WARNING, logger="delaysvc.contrib.celery"):
        task.apply_async((2,), countdown=60, task_id="order-1")
    assert stored(producer, first.id).body["args"] == "(1,)"
    (record,) = [r for r in caplog.records if r.getMessage() == "celery.task_id_held"]
    assert (record.task_id, record.message_id) == ("order-1", stored(producer, first.id).id)


def test_a_short_countdown_and_no_countdown_go_to_the_broker(celery_app, producer):
    default = celery_app.conf.task_default_queue
    task = celery_app.tasks["shop.cancel_order"]
    short = task.apply_async((1,), countdown=0.5)
    now = task.apply_async((2,))
    sent = broker_messages(celery_app, default)
    assert [m.headers["id"] for m in sent] == [short.id, now.id]
    assert sent[0].headers["eta"] is not None  # the broker holds this one, as Celery does
    with pytest.raises(NotFound):
        stored(producer, short.id)


def test_a_countdown_of_task_protocol_1_is_refused_not_left_to_the_broker(celery_app, producer):
    """Protocol 1 keeps the ETA in the body, where durable() did not look: the countdown went
    to the broker, held in a worker's memory, while the app believed it durable."""
    celery_app.conf.task_protocol = 1
    default = celery_app.conf.task_default_queue
    task = celery_app.tasks["shop.cancel_order"]
    with pytest.raises(ValueError, match="task_protocol=1"):
        task.apply_async((1,), countdown=60)
    assert broker_messages(celery_app, default) == []
    task.apply_async((2,))  # no countdown: to the broker, as before
    assert len(broker_messages(celery_app, default)) == 1


def test_when_due_it_is_published_as_it_was_without_its_eta(celery_app, producer, engine):
    callback = celery_app.signature("shop.invoice", args=(7,))
    task_id = str(uuid.uuid4())
    celery_app.send_task(
        "shop.invoice",
        args=(42,),
        kwargs={"reason": "unpaid"},
        countdown=30,
        task_id=task_id,
        priority=3,
        headers={"tenant": "acme"},
        link=callback,
        expires=3600,
    )
    queue = f"{celery_app.main}-invoices"
    assert broker_messages(celery_app, queue) == []
    run_due(producer, engine, stored(producer, task_id, "shop.invoice"))
    (published,) = broker_messages(celery_app, queue)  # routed as the app routes it
    headers = published.headers
    assert headers["id"] == task_id and headers["task"] == "shop.invoice"
    assert headers["eta"] is None
    assert headers["tenant"] == "acme"
    assert headers["expires"] is not None
    assert published.properties["priority"] == 3
    assert published.properties["correlation_id"] == task_id
    args, kwargs, embed = published.decode()
    assert (args, kwargs) == ([42], {"reason": "unpaid"})
    assert embed["callbacks"][0]["task"] == "shop.invoice"
    assert embed["callbacks"][0]["args"] == [7]
    assert stored(producer, task_id, "shop.invoice").status == "succeeded"


def declared(queue: Queue) -> dict:
    """All of `queue`'s declaration, its bindings (a set) in order."""
    declaration = queue.as_dict(recurse=True)
    declaration["bindings"].sort(key=lambda bound: bound["routing_key"])
    return declaration


def test_a_queue_and_an_exchange_are_stored_as_declared(celery_app, producer):
    """What Celery declares and routes by comes back whole from PostgreSQL: the queue's class,
    arguments, exchange and bindings (RabbitMQ refuses a queue declared with other arguments;
    tests/integration/test_celery_routing.py publishes to it)."""
    topic = Exchange(f"{celery_app.main}-ex", "topic", durable=False, delivery_mode="transient")
    sent = [
        Queue("q", topic, "k.#", queue_arguments={"x-queue-type": "quorum"}, max_priority=9),
        Queue("bound", bindings=[binding(topic, "a.*"), binding(Exchange("f", "fanout"))]),
        Broadcast("everyone"),
        Broadcast("named", queue="mine", exchange=Exchange("x", "fanout", auto_delete=True)),
    ]
    for queue in sent:
        result = celery_app.send_task("shop.cancel_order", (1,), countdown=30, queue=queue)
        result_exchange = celery_app.send_task(
            "shop.cancel_order", (1,), countdown=30, queue=queue, exchange=topic
        )
        for task_id in (result.id, result_exchange.id):
            envelope = durable_celery.envelope_of(stored(producer, task_id).body)
            options = durable_celery._publish_options(envelope["options"])
            assert type(options["queue"]) is type(queue)
            assert declared(options["queue"]) == declared(queue)
        assert options["exchange"].as_dict() == topic.as_dict()


def test_a_task_stored_with_its_queue_by_name_is_published_to_it(celery_app, producer, engine):
    """A task stored before the queue's declaration was kept names its queue only: Celery
    finds that queue by name when it is due, as it did then."""
    task_id = str(uuid.uuid4())
    celery_app.send_task("shop.invoice", (42,), countdown=30, task_id=task_id)
    message = stored(producer, task_id, "shop.invoice")
    envelope = durable_celery.envelope_of(message.body)
    queue = f"{celery_app.main}-invoices"
    assert envelope["options"]["queue"]["name"] == queue  # stored now: the whole declaration
    envelope["options"]["queue"] = queue
    as_before = {**message.body, "message": kombu_json.dumps(envelope)}
    message = producer.send(
        message.topic,
        as_before,
        deliver_at=message.deliver_at,
        key=message.key,
        on_duplicate="replace",
    )
    run_due(producer, engine, message)
    (published,) = broker_messages(celery_app, queue)
    assert published.headers["id"] == task_id
    assert published.delivery_info["routing_key"] == queue


def test_a_binary_serializer_round_trips(celery_app, producer, engine):
    moment = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    result = celery_app.tasks["shop.cancel_order"].apply_async(
        ({"at": moment, "raw": b"\x00\xff"},), countdown=30, serializer="pickle"
    )
    message = stored(producer, result.id)
    run_due(producer, engine, message)
    (published,) = broker_messages(celery_app, celery_app.conf.task_default_queue)
    assert published.content_type == "application/x-python-serialize"
    args, _kwargs, _embed = pickle.loads(published.body)
    assert args == ({"at": moment, "raw": b"\x00\xff"},)


def test_a_task_in_a_serializer_the_app_does_not_accept_is_a_dead_letter_at_once(
    celery_app, producer, engine
):
    """Sent in pickle by an app that accepts JSON only: a Celery worker refuses it at once;
    stored, it was retried (ContentDisallowed) for hours, up to its retries."""
    celery_app.conf.accept_content = ["json"]
    result = celery_app.tasks["shop.cancel_order"].apply_async(
        (1,), countdown=30, serializer="pickle"
    )
    message = stored(producer, result.id)
    with engine.begin() as conn:
        assert store.deliver_now(conn, [message.id]) == 1
    assert Consumer(producer.settings, engine).run_once(message.topic).dead == 1
    dead = producer.get(message.id)
    assert dead.status == "dead"
    assert "pickle" in dead.last_error and "accept_content" in dead.last_error
    assert broker_messages(celery_app, celery_app.conf.task_default_queue) == []


def test_revoke_cancels_the_stored_task_and_its_stored_retries(celery_app, producer):
    first = str(uuid.uuid4())
    celery_app.send_task("shop.cancel_order", (1,), countdown=60, task_id=first)
    retried = str(uuid.uuid4())
    celery_app.send_task("shop.cancel_order", (2,), countdown=60, task_id=retried, retries=2)
    kept = celery_app.send_task("shop.cancel_order", (3,), countdown=60)
    assert stored(producer, retried, retries=2).key == f"{retried}/retry-2"

    celery_app.control.revoke([first, retried])
    assert stored(producer, first).status == "cancelled"
    assert stored(producer, retried, retries=2).status == "cancelled"
    assert stored(producer, kept.id).status == "scheduled"
    celery_app.AsyncResult(kept.id).revoke()
    assert stored(producer, kept.id).status == "cancelled"


def test_a_revoke_from_celerys_own_cli_cancels_the_stored_task_too(celery_app, producer):
    """Found by a reviewer: `celery -A proj control revoke ID` broadcasts the revoke itself,
    past `app.control.revoke`: the stored task stayed scheduled, nothing was remembered, and
    it ran after a worker restart. The CLI's own call (celery/bin/control.py), as it makes it."""
    task = str(uuid.uuid4())
    celery_app.send_task("shop.cancel_order", (1,), countdown=60, task_id=task)
    other = celery_app.send_task("shop.cancel_order", (2,), countdown=60)
    celery_app.control.broadcast(
        "revoke", timeout=0.1, destination=None, reply=False, arguments={"task_id": [task]}
    )
    assert stored(producer, task).status == "cancelled"
    assert stored(producer, other.id).status == "scheduled"
    with producer.engine.connect() as conn:
        assert store.revoked(conn, task) and not store.revoked(conn, other.id)


def test_a_revoke_by_stamped_headers_drops_the_stored_tasks_carrying_a_stamp_when_due(
    celery_app, producer, engine
):
    """`revoke_by_stamped_headers` reached Celery's workers only: a stored task with the stamp
    was published when due, and ran wherever no worker remembered the stamps (after a restart).
    The stamps are now remembered in delaysvc; as in Celery, a value matches one of a list and
    `1` is not `"1"`."""
    from celery.canvas import StampingVisitor

    class Batch(StampingVisitor):
        def on_signature(self, sig, **headers):  # type: ignore[no-untyped-def]
            return {"batch": "b-1"}

    default = celery_app.conf.task_default_queue
    task = celery_app.tasks["shop.cancel_order"]
    visited = task.si(1).set(countdown=60)
    visited.stamp(Batch())
    stamped = visited.apply_async()
    listed = task.apply_async((2,), countdown=60, stamped_headers=["batch"], batch=["x", 3])
    number = task.apply_async((3,), countdown=60, stamped_headers=["batch"], batch="3")
    kept = task.apply_async((4,), countdown=60)
    celery_app.control.revoke_by_stamped_headers({"batch": ["b-1", 3]})
    for result in (stamped, listed, number, kept):
        run_due(producer, engine, stored(producer, result.id))
    published = [m.headers["id"] for m in broker_messages(celery_app, default)]
    assert published == [number.id, kept.id]
    celery_app.control.broadcast(  # as Celery's CLI sends it: `header=value` strings
        "revoke_by_stamped_headers", arguments={"headers": ["batch=later"]}, reply=False
    )
    later = task.apply_async((5,), countdown=60, stamped_headers=["batch"], batch="later")
    run_due(producer, engine, stored(producer, later.id))
    assert broker_messages(celery_app, default) == []
    with pytest.raises(ValueError, match="'nonsense' is not header=value"):
        celery_app.control.broadcast(
            "revoke_by_stamped_headers", arguments={"headers": ["nonsense"]}, reply=False
        )


def test_a_revoked_tasks_messages_are_not_published_whenever_they_were_stored(
    celery_app, producer, engine
):
    """Revoked while it ran, a task stored its retry after the revoke: the retry was published
    when due, and ran again wherever no worker remembered the revoke (after a restart; Celery
    remembers one 3 h). A stored retry past the 100th was not even cancelled. Either is now
    dropped when due, the revoke stored in delaysvc."""
    default = celery_app.conf.task_default_queue
    running = str(uuid.uuid4())
    celery_app.control.revoke(running)  # nothing stored yet: the task runs
    celery_app.send_task("shop.cancel_order", (1,), countdown=60, task_id=running, retries=1)
    polled = str(uuid.uuid4())
    celery_app.send_task("shop.cancel_order", (2,), countdown=60, task_id=polled, retries=150)
    celery_app.AsyncResult(polled).revoke()
    kept = celery_app.send_task("shop.cancel_order", (3,), countdown=60)
    for message in (stored(producer, running, retries=1), stored(producer, polled, retries=150)):
        run_due(producer, engine, message)
    assert broker_messages(celery_app, default) == []
    run_due(producer, engine, stored(producer, kept.id))  # not revoked: published
    assert [m.headers["id"] for m in broker_messages(celery_app, default)] == [kept.id]


def test_a_task_of_a_few_mb_is_stored_with_its_message_escaped_once(celery_app, producer, engine):
    """The Celery message was stored as a JSON string inside the body, its quotes escaped
    twice: args of 2.8 MB of JSON took 5.2 MB, over the 4 MiB limit, and `apply_async` with a
    countdown raised TooLarge where the broker takes them. A task stored as a string before is
    still published."""
    default = celery_app.conf.task_default_queue
    args = ([["ab", "cd"]] * 200_000,)  # 2.8 MB of JSON, quotes everywhere
    big = celery_app.tasks["shop.cancel_order"].apply_async(args, countdown=30)
    message = stored(producer, big.id)
    run_due(producer, engine, message)
    (published,) = broker_messages(celery_app, default)
    assert published.headers["id"] == big.id
    assert published.decode()[0] == [[["ab", "cd"]] * 200_000]  # the args, whole

    small = celery_app.send_task("shop.cancel_order", (7,), countdown=30)
    message = stored(producer, small.id)
    as_before = {**message.body, "message": kombu_json.dumps(message.body["message"])}
    message = producer.send(
        message.topic, as_before, deliver_at=message.deliver_at, key=message.key,
        on_duplicate="replace",
    )  # fmt: skip
    run_due(producer, engine, message)
    (published,) = broker_messages(celery_app, default)
    assert (published.headers["id"], published.decode()[0]) == (small.id, [7])


def test_a_retry_is_stored_beside_the_message_that_ran_it(celery_app, producer, engine):
    """A task's retry reuses its id while the message that published it may still be
    recorded as running: the retry's key is its own, so it is stored, not deduplicated."""
    task_id = str(uuid.uuid4())
    celery_app.send_task("shop.cancel_order", (1,), countdown=30, task_id=task_id)
    first = stored(producer, task_id)
    celery_app.send_task("shop.cancel_order", (1,), countdown=30, task_id=task_id, retries=1)
    retry = stored(producer, task_id, retries=1)
    assert retry.id != first.id and retry.status == "scheduled"
    celery_app.send_task("shop.cancel_order", (1,), countdown=30, task_id=task_id)
    assert stored(producer, task_id).id == first.id  # the same publish again: kept once


def test_durable_on_an_app_already_in_use_and_twice(producer):
    app = Celery(f"used{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.task_default_queue = "used"
    app.send_task("x.y", countdown=30)  # builds amqp and its sender: not durable yet
    assert len(broker_messages(app, "used")) == 1
    durable(app, producer=producer)
    durable(app, producer=producer, threshold=100)
    result = app.send_task("x.y", countdown=30)  # under the new threshold
    assert len(broker_messages(app, "used")) == 1
    durable(app, producer=producer)
    result = app.send_task("x.y", countdown=30)
    assert broker_messages(app, "used") == []
    assert stored(producer, result.id, "x.y").status == "scheduled"
    with pytest.raises(ValueError, match="threshold"):
        durable(app, threshold=-1)
    app.close()


def test_a_task_name_becomes_a_topic():
    assert topic_for("proj.tasks.add") == "celery.proj.tasks.add"
    assert topic_for("proj:add now") == "celery.proj_add_now"
    long = topic_for("x" * 300)
    assert len(long) == 127 and long != topic_for("x" * 301)


def test_a_topic_pattern_handles_its_family(engine):
    @handler("webhook.*")
    def family(message):
        return None

    @handler("webhook.stripe.*")
    def narrower(message):
        return None

    @handler("webhook.stripe.refund")
    def own(message):
        return None

    assert registered("webhook.github").func is family
    assert registered("webhook.stripe.charge").func is narrower
    assert registered("webhook.stripe.refund").func is own
    assert registered("webhooks") is None
    for bad in ("*", "web*hook.*", "-x.*"):
        with pytest.raises(ValidationError, match="topic"):
            handler(bad)

    with engine.begin() as conn:
        store.record_handlers(conn, ["webhook.*", "orders"], "host-a")
    with engine.connect() as conn:
        topics = ("webhook.github", "orders", "webhooks", "order")
        handled = ", ".join(HANDLED.format(topic=f"'{topic}'") for topic in topics)
        assert conn.execute(sql(f"SELECT {handled}")).one() == (True, True, False, False)
