"""The RabbitMQ peer: the classic TTL + dead-letter-exchange delay recipe. One durable queue
per delay with `x-message-ttl` and `x-dead-letter-exchange`; persistent messages published with
publisher confirms; expired messages are dead-lettered into the work queue, where consumers
(`python -m delaysvc.bench.peer_rabbitmq URL FOLDER`) ack each after handling it. Every name
starts with `delaysvc_bench.`, so the bench can remove exactly what it made."""

from __future__ import annotations

import sys
from typing import Any

import pika

from delaysvc.bench.record import record

PREFIX = "delaysvc_bench"
WORK_EXCHANGE = f"{PREFIX}.work"
WORK_QUEUE = f"{PREFIX}.work"
WORK_KEY = "work"
PREFETCH = 100
PERSISTENT = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)


def delay_queue(delay_ms: int) -> str:
    return f"{PREFIX}.delay.{delay_ms}"


def declare_work(channel: Any) -> None:
    channel.exchange_declare(WORK_EXCHANGE, "direct", durable=True)
    channel.queue_declare(WORK_QUEUE, durable=True)
    channel.queue_bind(WORK_QUEUE, WORK_EXCHANGE, routing_key=WORK_KEY)


def declare_delay(channel: Any, delay_ms: int) -> str:
    name = delay_queue(delay_ms)
    channel.queue_declare(
        name,
        durable=True,
        arguments={
            "x-message-ttl": delay_ms,
            "x-dead-letter-exchange": WORK_EXCHANGE,
            "x-dead-letter-routing-key": WORK_KEY,
        },
    )
    return name


class Publisher:
    """Publishes with confirms: each `publish` returns once the broker has the message."""

    def __init__(self, url: str):
        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self.connection.channel()
        self.channel.confirm_delivery()
        declare_work(self.channel)
        self.delays: set[int] = set()
        self.bulk: Any = None
        self.published: dict[str, int] = {}

    def publish(self, i: int, due: float, delay_ms: int) -> None:
        exchange, key = self._route(self.channel, delay_ms)
        self.channel.basic_publish(
            exchange, key, f"{i} {due!r}".encode(), PERSISTENT, mandatory=True
        )

    def publish_many(self, numbers: range, due: float, delay_ms: int) -> None:
        """Publish them on a second channel without confirms (so without a round trip each),
        then wait until the queue counts every message published to it so far."""
        if self.bulk is None:
            self.bulk = self.connection.channel()
        exchange, key = self._route(self.bulk, delay_ms)
        for i in numbers:
            self.bulk.basic_publish(exchange, key, f"{i} {due!r}".encode(), PERSISTENT)
        queue = delay_queue(delay_ms) if delay_ms > 0 else WORK_QUEUE
        self.published[queue] = self.published.get(queue, 0) + len(numbers)
        while (
            self.bulk.queue_declare(queue, passive=True).method.message_count
            < (self.published[queue])
        ):
            self.connection.sleep(0.05)

    def _route(self, channel: Any, delay_ms: int) -> tuple[str, str]:
        if delay_ms <= 0:
            return WORK_EXCHANGE, WORK_KEY
        if delay_ms not in self.delays:
            declare_delay(channel, delay_ms)
            self.delays.add(delay_ms)
        return "", delay_queue(delay_ms)

    def close(self) -> None:
        if self.connection.is_open:
            self.connection.close()


def delete_everything(url: str, delays: set[int]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    for delay_ms in delays:
        channel.queue_delete(delay_queue(delay_ms))
    channel.queue_delete(WORK_QUEUE)
    channel.exchange_delete(WORK_EXCHANGE)
    connection.close()


def consume(url: str, folder: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    declare_work(channel)
    channel.basic_qos(prefetch_count=PREFETCH)

    def on_message(ch: Any, method: Any, _properties: Any, body: bytes) -> None:
        i, due = body.split()
        record(int(i), float(due), folder)
        ch.basic_ack(method.delivery_tag)

    channel.basic_consume(WORK_QUEUE, on_message)
    channel.start_consuming()


if __name__ == "__main__":
    consume(sys.argv[1], sys.argv[2])
