"""`delaysvc.contrib.celery.durable`: a stored task is published when due to the exchange, with
the routing key and the queue declaration Celery gives it: a kombu `Queue` of a topic exchange
given to `send_task` or by `task_routes`, a `Broadcast` (fanout) queue. On the machine's
RabbitMQ, each compared with the same task sent without a countdown (Celery's own publish).
The app that publishes when due is another instance of the app, as in delaysvc's worker
process (a `Broadcast` has another queue name in each)."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from amqp.exceptions import NotFound as AmqpNotFound
from celery import Celery
from kombu import Connection, Exchange, Queue
from kombu.common import Broadcast

from delaysvc.contrib.celery import durable
from tests.integration.test_celery_durable import (  # noqa: F401  (an autouse fixture)
    clean_registry,
    run_due,
    stored,
)


def _rabbitmq_wanted() -> bool:
    """A RabbitMQ answers, or CI says one must (then these tests cannot skip)."""
    if os.environ.get("DELAYSVC_TEST_REQUIRE_RABBITMQ"):
        return True
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _rabbitmq_wanted(), reason="no RabbitMQ at 127.0.0.1:5672")

TASK = "shop.notify"


class Broker:
    """The test's queues and exchanges on RabbitMQ, each named for this test alone."""

    def __init__(self, url: str):
        self.url = url
        self.uid = uuid.uuid4().hex[:8]
        self.conn = Connection(url)
        self.queues: set[str] = set()
        self.exchanges: set[str] = set()

    def name(self, part: str) -> str:
        return f"delaysvc-test-{self.uid}-{part}"

    def listen(self, part: str, exchange: Exchange, binding_key: str = "") -> str:
        """A queue bound to `exchange`, as a consumer of it declares one; -> its name."""
        queue = Queue(self.name(part), exchange, routing_key=binding_key)
        self.owns(queue)
        queue(self.conn.default_channel).declare()
        return queue.name

    def owns(self, queue: Queue) -> None:
        """`queue` and its exchange are deleted after the test (a queue Celery declares)."""
        self.queues.add(queue.name)
        self.exchanges.add(queue.name)  # a missing queue Celery creates has one of its name
        if queue.exchange is not None and queue.exchange.name:
            self.exchanges.add(queue.exchange.name)

    def taken(self, queue: str) -> list[tuple[str, str, str]]:
        """Every message waiting in `queue`, taken out: (exchange, routing key, task id)."""
        taken = []
        channel = self.conn.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            info = message.delivery_info
            taken.append((info["exchange"], info["routing_key"], message.headers["id"]))
        return taken

    def delete_all(self) -> None:
        for kind, names in (("queue", self.queues), ("exchange", self.exchanges)):
            for name in names:
                with self.conn.channel() as channel, contextlib.suppress(AmqpNotFound):
                    getattr(channel, f"{kind}_delete")(name)
        self.conn.release()


@pytest.fixture
def broker(rabbitmq: str) -> Iterator[Broker]:
    broker = Broker(rabbitmq)
    try:
        yield broker
    finally:
        broker.delete_all()


@pytest.fixture
def make_app(broker: Broker, producer) -> Iterator[Any]:
    """`make_app(**conf)`: an instance of the test's app; the last one made publishes what is
    due (delaysvc's worker imports the app's module as another process does). Each has its
    own connections, so its own cache of the queues it declared, as another process has."""
    made: list[Celery] = []
    name = f"routes{broker.uid}"

    def make(**conf: Any) -> Celery:
        app = Celery(name, broker=broker.url, set_as_current=False)
        durable(app, producer=producer)
        app.conf.update(
            task_default_queue=broker.name("default"),
            broker_transport_options={
                "confirm_publish": True,  # routed when publish returns
                "client_properties": {"connection_name": f"{name} #{len(made)}"},
            },
            **conf,
        )
        made.append(app)
        return app

    yield make
    for app in made:
        app.close()


def deliveries(broker, queues, sender, producer, engine, **options):
    """The task sent at once, then sent with a countdown and published when due: -> what each
    of `queues` got of each, as (exchange, routing key)."""
    at_once = sender.send_task(TASK, (1,), **options)
    got_at_once = {queue: broker.taken(queue) for queue in queues}
    later = sender.send_task(TASK, (2,), countdown=30, **options)
    assert {queue: broker.taken(queue) for queue in queues} == {queue: [] for queue in queues}
    run_due(producer, engine, stored(producer, later.id, TASK))
    got_when_due = {queue: broker.taken(queue) for queue in queues}
    for got, task_id in ((got_at_once, at_once.id), (got_when_due, later.id)):
        assert {message[2] for messages in got.values() for message in messages} == {task_id}
    return (
        {queue: [message[:2] for message in got] for queue, got in got_at_once.items()},
        {queue: [message[:2] for message in got] for queue, got in got_when_due.items()},
    )


def test_a_queue_of_a_topic_exchange_given_to_send_task(broker, make_app, producer, engine):
    exchange = Exchange(broker.name("ex"), "topic")
    target = Queue(broker.name("q2"), exchange, routing_key="k2.x")
    broker.owns(target)
    sender = make_app()
    make_app()
    watcher = broker.listen("watch", exchange, "k2.*")

    at_once, when_due = deliveries(
        broker, [target.name, watcher], sender, producer, engine, queue=target
    )
    routed = [(exchange.name, "k2.x")]
    assert at_once == {target.name: routed, watcher: routed}
    assert when_due == at_once


def test_a_queue_of_task_routes_with_its_declaration(broker, make_app, producer, engine):
    """The queue has arguments: a declaration without them, or with others, is refused by
    RabbitMQ (PRECONDITION_FAILED), so the one Celery declares is the one it had."""
    exchange = Exchange(broker.name("ex"), "topic", durable=False)
    target = Queue(
        broker.name("q3"), exchange, routing_key="k3.y", queue_arguments={"x-max-priority": 5}
    )
    broker.owns(target)
    conf = {"task_routes": {TASK: {"queue": target}}}
    sender = make_app(**conf)
    make_app(**conf)
    watcher = broker.listen("watch", exchange, "k3.#")

    at_once, when_due = deliveries(broker, [target.name, watcher], sender, producer, engine)
    routed = [(exchange.name, "k3.y")]
    assert at_once == {target.name: routed, watcher: routed}
    assert when_due == at_once


def test_a_broadcast_queue_reaches_every_consumer(broker, make_app, producer, engine):
    """As Celery's documentation routes a task to every worker: a `Broadcast` in
    `task_queues`, the task routed to it by name; each worker consumes a queue of its own."""
    fanout = broker.name("bcast")
    apps = []
    for _ in range(2):
        queues = [Broadcast(fanout), Queue(broker.name("default"))]
        for queue in queues:
            broker.owns(queue)
        apps.append(
            make_app(task_queues=queues, task_routes={TASK: {"queue": fanout, "exchange": fanout}})
        )
    sender = apps[0]
    exchange = Exchange(fanout, "fanout")  # as `Broadcast` declares it
    workers = [broker.listen(f"worker{n}", exchange) for n in range(2)]

    at_once, when_due = deliveries(broker, workers, sender, producer, engine)
    assert [exchanges for exchanges, _key in at_once[workers[0]]] == [fanout]
    assert at_once[workers[1]] == at_once[workers[0]]
    assert when_due == at_once
