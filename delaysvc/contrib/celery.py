"""Celery: every countdown and ETA made durable, with one line and no other change.

    app = Celery("proj", broker="redis://...")
    durable(app)  # from delaysvc.contrib.celery import durable

From then on a task published with a countdown or an ETA more than `threshold` seconds (1 s)
away, by `apply_async`, `send_task` or a task's own `self.retry(countdown=...)`, is not given
to the broker, where a worker would hold it in memory until it is due (lost to a kill with
late acks off, back only after Redis's visibility timeout with them on). It is stored in
delaysvc instead, as a message of topic `celery.<task name>` whose key is the task id, and when
it is due delaysvc's worker publishes it to Celery as it was, without the ETA: the same task id
(`AsyncResult(id)` works), name, args, kwargs, headers, priority, link/link_error callbacks
and retry count, and the same routing: a kombu `Queue` or `Exchange` among the publish options
is stored whole (its exchange, the exchange's type, routing key, arguments and bindings; a
`Broadcast` stays one) and rebuilt, so Celery publishes to the exchange, with the routing key,
and declares the queue it would have. `revoke(id)` (or `AsyncResult(id).revoke()`, or Celery's
CLI) cancels it in delaysvc as well, before it is due, and is remembered there: a retry the
task stores while it still runs, after its revoke, is dropped when due, not published (Celery's
workers remember a revoke for 3 h and forget it when restarted); so is a revoke by stamped
headers, for every stored task carrying the stamp. Celery's publish signals (`before_task_publish`,
`after_task_publish`) and its task-sent event come with that publish, in delaysvc's worker,
not from `apply_async`: the publish runs in the `process` span, a trace of its own linked to
the caller's `send` span.

Where it runs: call `durable(app)` in the module that creates the app, so that every process
that imports the app publishes this way (the web application, and Celery's workers, whose
retries go through it), and name that module in delaysvc's `DELAYSVC_HANDLERS`: `durable`
also registers the handler of the topics `celery.*`, which publishes with the app's broker and
settings. The delaysvc database is the default producer's (`DELAYSVC_DATABASE_URL`), or pass
`producer=`.

What holds: `apply_async` returns once the message is committed in delaysvc; a database that
cannot be reached is an error there, as a broker that cannot be reached is. Publishing when due
is at least once: a delaysvc worker killed between publishing and recording it publishes again,
with the same task id. A countdown at or under the threshold, a message with no ETA, and one
that RabbitMQ delays itself (Celery's native delayed delivery for quorum queues) go to the
broker as before.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from collections.abc import Callable
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from celery import Celery
from celery.app.amqp import AMQP, task_message
from celery.app.control import Control
from celery.utils.time import maybe_make_aware
from kombu import Exchange, Queue, binding
from kombu import serialization as kombu_serialization
from kombu.common import Broadcast
from kombu.exceptions import ContentDisallowed
from kombu.utils import json as kombu_json
from kombu.utils.functional import maybe_list
from kombu.utils.imports import symbol_by_name

from delaysvc import store
from delaysvc.config.validation import json_text
from delaysvc.errors import DeadLetter, NotCancellable, NotFound
from delaysvc.producer.default import default_producer
from delaysvc.producer.sending import Producer
from delaysvc.worker.consumer import Job
from delaysvc.worker.handlers import register_handler

__all__ = ["TOPIC_PREFIX", "durable", "key_for", "topic_for"]

log = logging.getLogger(__name__)

TOPIC_PREFIX = "celery."
"""The topics of stored Celery tasks: `celery.<task name>`, one per task, so the dashboard and
`delaysvc topics list` show them under their task names."""
THRESHOLD_SECONDS = 1.0
NATIVE_DELAY_EXCHANGE = "celery_delayed_27"
"""The exchange Celery publishes to when RabbitMQ delays a message itself (quorum queues)."""
RETRIES_FOUND = 100
"""How many retries of a task `revoke` looks for in delaysvc to cancel (Celery's default
max_retries is 3); one it does not find, or one the task stores after its revoke, is dropped
when due (`celery_revoked`)."""
REVOKES_KEPT_MS = 86_400_000
"""How long a revoke is remembered beyond the longest delay (DELAYSVC_MAX_DELAY): a retry
stored by a task still running a day after its revoke could come due after it is forgotten."""
_NOT_PORTABLE = {"declare", "producer", "connection"}
"""Publish options that are live objects of the sending process; Celery derives them again."""
_DECLARED = ("queue", "exchange")
"""Publish options stored as a kombu entity's declaration when they hold one (a name stays a
name): Celery takes the exchange, its type, the routing key and what it declares from them."""
_KOMBU = "kombu"
"""The key of a stored declaration that names its kombu class: "Queue", "Broadcast" or
"Exchange"."""
_TOPIC_CHARACTER = re.compile(r"[^A-Za-z0-9._-]")


class _Durability:
    """An app's `durable` arguments."""

    def __init__(self, threshold: float, producer: Producer | None):
        self.threshold = threshold
        self._producer = producer

    @property
    def producer(self) -> Producer:
        return self._producer or default_producer()


def durable(
    app: Celery, *, threshold: float = THRESHOLD_SECONDS, producer: Producer | None = None
) -> Celery:
    """Make `app`'s countdowns and ETAs beyond `threshold` seconds durable in delaysvc (see the
    module's text). Call it once, where the app is made; calling it again changes the
    arguments. Nothing of the app is built or configured here: the app's configuration may
    come afterwards (`config_from_object`)."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0 seconds, got {threshold!r}")
    app._delaysvc_durability = _Durability(threshold, producer)
    _extend(app, "amqp", _DurableAMQP, "send_task_message")
    _extend(app, "control", _DurableControl, None)
    _apps[app.main or ""] = app
    register_handler(TOPIC_PREFIX + "*", None, None)(publish_when_due)
    return app


def topic_for(task_name: str) -> str:
    """`celery.<task name>`: other characters than a topic's become `_`, and a name too long
    for a topic (127) ends with a hash of the whole."""
    topic = TOPIC_PREFIX + _TOPIC_CHARACTER.sub("_", task_name)
    if len(topic) > 127:
        digest = hashlib.sha1(task_name.encode()).hexdigest()[:8]
        topic = f"{topic[:118]}-{digest}"
    return topic


def key_for(task_id: str, retries: int) -> str:
    """The task id; a retry's (the same id, published again while the message that ran it may
    still be recorded as running) adds its number."""
    return task_id if not retries else f"{task_id}/retry-{retries}"


# -- publishing: store what would wait in a worker's memory ------------------------------------


class _DurableSender:
    """`app.amqp.send_task_message`: a message due beyond the threshold goes to delaysvc, any
    other to `publish`, Celery's own sender (which delaysvc calls when the message is due)."""

    def __init__(self, app: Celery, publish: Callable[..., Any]):
        self.app = app
        self.publish = publish

    def __call__(self, producer: Any, name: str, message: Any, **options: Any) -> Any:
        due = _due(self.app, message)
        durability = _durability(self.app)
        if (
            due is None
            or _natively_delayed(options)
            or (due - datetime.now(UTC)).total_seconds() <= durability.threshold
        ):
            return self.publish(producer, name, message, **options)
        headers = message.headers
        sent = durability.producer.send(
            topic_for(name),
            _stored_body(self.app, name, message, options),
            deliver_at=due,
            key=key_for(headers["id"], int(headers.get("retries") or 0)),
        )
        if not sent.created:  # the key is the task id: a task stored twice runs once
            log.warning(
                "celery.task_id_held",
                extra={"task_id": headers["id"], "task": name, "message_id": sent.id},
            )
        return None


class _DurableAMQP(AMQP):
    @cached_property
    def send_task_message(self) -> _DurableSender:
        return _DurableSender(self.app, self._create_task_sender())


class _DurableControl(Control):
    def broadcast(
        self, command: str, arguments: dict[str, Any] | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """A revoke (`revoke`, `AsyncResult.revoke`, `GroupResult.revoke`, and Celery's CLI,
        `celery control revoke`, which broadcasts it itself: it went past `revoke` alone)
        cancels the task's stored message (and its stored retries) in delaysvc and remembers
        the revoke there (a message of the task stored later is dropped when due); a revoke by
        stamped headers is remembered there (a stored task carrying one is dropped when due).
        Then the workers are told as Celery tells them (a message already published is
        theirs)."""
        given = arguments or {}
        task_id = given.get("task_id") if command == "revoke" else None
        stamps = given.get("headers") if command == "revoke_by_stamped_headers" else None
        if not task_id and not stamps:
            return super().broadcast(command, arguments, *args, **kwargs)
        producer = _durability(self.app).producer
        try:
            if task_id:
                revoke_stored(producer, [task_id] if isinstance(task_id, str) else list(task_id))
            elif stamps:
                revoke_stored_stamps(producer, stamps)
        finally:  # the database may be away: the workers are told all the same
            told = super().broadcast(command, arguments, *args, **kwargs)
        return told


def _durability(app: Celery) -> _Durability:
    return getattr(app, "_delaysvc_durability", None) or _Durability(THRESHOLD_SECONDS, None)


def _extend(app: Celery, component: str, durable_cls: type, cached: str | None) -> None:
    """Build `app.<component>` as `durable_cls` from now on; one built already becomes one."""
    base = symbol_by_name(getattr(app, f"{component}_cls"))
    if not issubclass(base, durable_cls):
        if base is not durable_cls.__mro__[1]:  # the app's own class: the durable one on top
            durable_cls = type(f"Durable{base.__name__}", (durable_cls, base), {})
        setattr(app, f"{component}_cls", durable_cls)
    built = app.__dict__.get(component)
    if built is not None and not isinstance(built, durable_cls):
        built.__class__ = type(f"Durable{type(built).__name__}", (durable_cls, type(built)), {})
        if cached:
            built.__dict__.pop(cached, None)


def _due(app: Celery, message: Any) -> datetime | None:
    """The message's ETA (task protocol 2), as an aware datetime; None without one. A message
    of task protocol 1 with an ETA is refused: its countdown would go to the broker, not
    durable, while the app believes it is."""
    headers = getattr(message, "headers", None)
    eta = headers.get("eta") if isinstance(headers, dict) else None
    if not eta:
        body = getattr(message, "body", None)
        if isinstance(body, dict) and body.get("eta"):  # protocol 1 keeps it in the body
            raise ValueError(
                "delaysvc.contrib.celery.durable() stores countdowns of Celery's task protocol "
                "2 (its default since Celery 4); this app sends protocol 1 "
                "(task_protocol=1): set task_protocol=2"
            )
        return None
    due = eta if isinstance(eta, datetime) else datetime.fromisoformat(eta)
    if due.tzinfo is not None:
        return due
    # naive (an `eta=` given so): read as Celery's worker reads it, by Celery's own function
    # (`Request.__init__`): Celery 5.7's reads a UTC time, whatever `enable_utc` says (it was
    # read as local time: `datetime.utcnow() + 8 s`, Celery's own idiom, waited 5 hours in
    # New York)
    return maybe_make_aware(due, app.conf.timezone)


def _natively_delayed(options: dict[str, Any]) -> bool:
    exchange = options.get("exchange")
    return getattr(exchange, "name", exchange) == NATIVE_DELAY_EXCHANGE


def _stored_body(app: Celery, name: str, message: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The delaysvc message: what the dashboard shows (task, id, due, args as Celery shows
    them) and the Celery message itself, serialized as the app would (`message`)."""
    serializer = options.get("serializer") or app.conf.task_serializer
    content_type, content_encoding, payload = kombu_serialization.dumps(
        message.body, serializer=serializer
    )
    binary = isinstance(payload, bytes)
    headers = message.headers
    envelope = {
        "headers": headers,
        "properties": message.properties,
        "sent_event": message.sent_event,
        "options": _portable(options),
        "serializer": serializer,
        "content_type": content_type,
        "content_encoding": content_encoding,
        "body": base64.b64encode(payload).decode() if binary else payload,
        "base64": binary,
    }
    return {
        "task": name,
        "id": headers["id"],
        "app": app.main or "",
        "eta": headers["eta"],
        "retries": headers.get("retries") or 0,
        "args": headers.get("argsrepr"),
        "kwargs": headers.get("kwargsrepr"),
        # a JSON object, not kombu's JSON text in a string: its quotes were escaped twice
        # (args of 2.8 MB of JSON took 5.2 MB); kombu's markers of its own types are kept
        "message": json.loads(kombu_json.dumps(envelope)),
    }


def envelope_of(body: dict[str, Any]) -> dict[str, Any]:
    """The Celery message a stored body holds (`_stored_body`), kombu's types revived; one
    stored before it was an object holds it as kombu's JSON text."""
    message = body["message"]
    return kombu_json.loads(message if isinstance(message, str) else json_text(message))


def _portable(options: dict[str, Any]) -> dict[str, Any]:
    """The publish options as data: a kombu queue or exchange as its whole declaration
    (`_declaration`), from which Celery takes the exchange, its type and the routing key."""
    kept: dict[str, Any] = {}
    for name, value in options.items():
        if name in _NOT_PORTABLE:
            continue
        entity = value if isinstance(value, (Queue, Exchange)) else None
        if entity is not None:
            value = _declaration(entity) if name in _DECLARED else entity.name
        try:
            kombu_json.dumps(value)
        except TypeError:
            if entity is None:
                log.warning("celery.option_dropped", extra={"option": name, "value": repr(value)})
                continue
            log.warning("celery.option_by_name", extra={"option": name, "value": repr(value)})
            value = entity.name
        kept[name] = value
    return kept


def _declaration(entity: Queue | Exchange) -> dict[str, Any]:
    """A kombu Queue, Broadcast or Exchange as data (`kombu` names which), rebuilt by
    `_entity`: all its attributes, its exchange's and its bindings'."""
    kind = "Exchange"
    if isinstance(entity, Queue):  # another subclass of Queue than Broadcast: as a Queue
        kind = "Broadcast" if isinstance(entity, Broadcast) else "Queue"
    return {_KOMBU: kind, **entity.as_dict(recurse=True)}


def _entity(declaration: dict[str, Any]) -> Queue | Exchange:
    """The kombu entity `_declaration` made data of."""
    fields = {name: value for name, value in declaration.items() if name != _KOMBU}
    if declaration[_KOMBU] == "Exchange":
        return Exchange(**fields)
    if fields.get("exchange") is not None:
        fields["exchange"] = Exchange(**fields["exchange"])
    fields["bindings"] = [
        binding(**{**bound, "exchange": bound["exchange"] and Exchange(**bound["exchange"])})
        for bound in fields.get("bindings") or ()
    ]
    if declaration[_KOMBU] == "Broadcast":  # its queue's name is `queue`, its exchange's `name`
        fields.pop("queue", None)
        return Broadcast(queue=fields.pop("name"), **fields)
    return Queue(**fields)


def _publish_options(stored: dict[str, Any]) -> dict[str, Any]:
    """The stored publish options with their queue and exchange rebuilt; a message stored
    before declarations were kept names its queue only, which Celery looks up by name."""
    options = dict(stored)
    for name in _DECLARED:
        value = options.get(name)
        if isinstance(value, dict) and _KOMBU in value:
            options[name] = _entity(value)
    return options


# -- when due: publish it to Celery --------------------------------------------------------------

_apps: dict[str, Celery] = {}
"""The apps made durable in this process, by name: the one a stored message names publishes it."""


def publish_when_due(message: Job) -> None:
    """The handler of `celery.*`: publish the stored Celery message without its ETA, with the
    sender Celery would have used; a broker error is retried as any handler's failure."""
    body = message.body
    app = _apps.get(body.get("app", ""))
    if app is None and len(_apps) == 1:
        (app,) = _apps.values()
    if app is None:
        raise DeadLetter(
            f"no Celery app named {body.get('app')!r} was made durable in this worker "
            f"(it has {sorted(_apps) or 'none'}): name its module in DELAYSVC_HANDLERS"
        )
    envelope = envelope_of(body)
    stamps = _stamps(envelope["headers"])
    with _durability(app).producer.engine.connect() as conn:
        by_stamp = store.revoked_stamp(conn, stamps) if stamps else None
        if by_stamp is not None or store.revoked(conn, body["id"]):
            # a warning: a revoke is kept for the longest delay and a day, so a task id used
            # again after its revoke (a deterministic id) is dropped all that time
            log.warning(
                "celery.revoked_not_published",
                extra={"task_id": body["id"], "stamp": by_stamp and "=".join(by_stamp)},
            )
            return
    payload = envelope["body"]
    if envelope["base64"]:
        payload = base64.b64decode(payload)
    try:
        task_body = kombu_serialization.loads(
            payload,
            envelope["content_type"],
            envelope["content_encoding"],
            accept=kombu_serialization.prepare_accept_content(app.conf.accept_content),
        )
    except ContentDisallowed as exc:  # as a Celery worker refuses it: at once, not retried
        raise DeadLetter(
            f"sent in {envelope['serializer']}, which the app's accept_content "
            f"({list(app.conf.accept_content)}) refuses: {exc}"
        ) from exc
    if isinstance(task_body, list):
        task_body = tuple(task_body)  # as Celery builds it (JSON has no tuples)
    headers = {**envelope["headers"], "eta": None}
    sent_event = envelope["sent_event"] and {**envelope["sent_event"], "eta": None}
    options = {**_publish_options(envelope["options"]), "serializer": envelope["serializer"]}
    if "expiration" in options and headers.get("expires"):
        # the broker's TTL counts from the publish: what is left of it now
        expires = maybe_make_aware(datetime.fromisoformat(headers["expires"]), app.timezone)
        options["expiration"] = max((expires - datetime.now(UTC)).total_seconds(), 0)
    with app.producer_or_acquire() as broker_producer:
        app.amqp.send_task_message.publish(
            broker_producer,
            body["task"],
            task_message(headers, envelope["properties"], task_body, sent_event),
            **options,
        )


def revoke_stored(producer: Producer, task_ids: list[str]) -> int:
    """Remember these tasks as revoked (a message of theirs that comes due is dropped), then
    cancel their waiting messages (`cancel_stored`); -> how many were cancelled."""
    with producer.engine.begin() as conn:
        keep_ms = producer.settings.max_delay_ms + REVOKES_KEPT_MS
        store.remember_revoked(conn, task_ids, keep_ms)
    return cancel_stored(producer, task_ids)


def revoke_stored_stamps(producer: Producer, headers: dict[str, Any] | list[str]) -> None:
    """Remember these stamps as revoked (`revoke_by_stamped_headers`' `headers`: a header and
    a value, or a list of values, each; or `header=value` strings, as Celery's worker takes
    them): a stored task carrying one is dropped when due."""
    if isinstance(headers, list):
        bad = [h for h in headers if "=" not in str(h)]
        if bad:
            raise ValueError(f"revoke_by_stamped_headers: {bad[0]!r} is not header=value")
        headers = dict(str(h).split("=", 1) for h in headers)
    stamps = [(h, _stamp(v)) for h, values in headers.items() for v in maybe_list(values)]
    with producer.engine.begin() as conn:
        keep_ms = producer.settings.max_delay_ms + REVOKES_KEPT_MS
        store.remember_revoked_stamps(conn, stamps, keep_ms)


def _stamps(headers: dict[str, Any]) -> list[tuple[str, str]]:
    """A Celery message's stamps, (header, value as JSON), as its worker reads them: those
    named in `stamped_headers`, their values in `stamps` (a list: each value)."""
    given = headers.get("stamps") or {}
    return [
        (header, _stamp(value))
        for header in headers.get("stamped_headers") or []
        if given.get(header) is not None
        for value in maybe_list(given[header])
    ]


def _stamp(value: Any) -> str:
    """A stamp's value as stored: JSON, so that `1` and `"1"` stay other values, as in Celery."""
    return json.dumps(value, sort_keys=True, default=str)


def cancel_stored(producer: Producer, task_ids: list[str]) -> int:
    """Cancel the waiting messages of these tasks (and of their first RETRIES_FOUND stored
    retries); -> how many. One already published or running is Celery's to revoke."""
    with producer.engine.connect() as conn:
        keys = [key_for(task_id, n) for task_id in task_ids for n in range(RETRIES_FOUND + 1)]
        held = store.unfinished_keys_in_family(conn, TOPIC_PREFIX, keys)
    cancelled = 0
    for topic, key in held:
        try:
            producer.cancel(topic=topic, key=key)
            cancelled += 1
        except (NotCancellable, NotFound):
            pass
    return cancelled
