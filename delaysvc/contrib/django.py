"""Django: schedule jobs in the transaction of Django's own connection.

    from django.db import transaction
    from delaysvc.contrib.django import send

    with transaction.atomic():
        order = Order.objects.create(total=120)
        send("order.cancel", {"order_id": order.id}, delay="30m", key=f"order-{order.id}")

The message commits with the order, or neither does: `send` runs its statement on
`django.db.connections[using]` (Django's cursor, so its query logging and execute wrappers see
it), inside whatever `atomic()` block is open; a rollback, of the block or of a savepoint
around the send, leaves no trace of it. Outside `atomic()` Django autocommits: a send commits by
itself, and a batch, a capped send or a cancel commits as one transaction of its own.
`send_batch`, `cancel` and `get` take `using=` the same way. `handler` registers a handler whose
ORM work and the job's success commit together in one `atomic()` block. Errors are delaysvc's
(`ValidationError`, `BacklogFull`, `DatabaseUnavailable`...); one raised before anything was
written (a bad argument, a full backlog with the `reject` policy) leaves the `atomic()` block
usable. Django's psycopg 3 and psycopg2 backends both work. A `Message`'s times are aware, in
UTC, whatever `USE_TZ` says (with `USE_TZ=False` Django's connection gives naive local times;
delaysvc's statements read them aware: `delaysvc.db.connections`); a `deliver_at` must be
aware here too, a naive one is refused as everywhere.

The tables are delaysvc's, not Django's: apply them with `delaysvc migrate` (with
`DELAYSVC_DATABASE_URL` naming the same database) in your deployment, beside Django's own
`migrate`; Django's migrations never see them. The workers (`delaysvc worker`, beat) and the
handlers run outside Django's request cycle, as with any delaysvc setup.

delaysvc's settings (delay levels, caps, topic delays) are read from the `DELAYSVC_*`
environment on first use, or given with `configure(Settings(...))` (in `AppConfig.ready`, say).
The database is always Django's: the producer's engine, built from `DATABASES[using]`, is not
used by these calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import wraps
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from sqlalchemy import Engine
from sqlalchemy.engine import URL

from delaysvc.config.settings import Settings
from delaysvc.db.connections import Joined, joined
from delaysvc.db.engines import make_engine
from delaysvc.producer.sending import Message, Producer, SentBatch
from delaysvc.worker.handlers import HandlerFunc, register_handler

__all__ = [
    "TransactionRolledBack",
    "cancel",
    "configure",
    "get",
    "handler",
    "producer",
    "send",
    "send_batch",
]

_settings: Settings | None = None
_producers: dict[str, Producer] = {}


def configure(settings: Settings | None = None) -> None:
    """delaysvc's settings for these calls; None: read them from the environment again."""
    global _settings
    _settings = settings
    _producers.clear()


def producer(using: str = DEFAULT_DB_ALIAS) -> Producer:
    """The producer for Django's database `using`."""
    found = _producers.get(using)
    if found is None:
        settings = _settings or Settings.from_env()
        found = _producers[using] = Producer(settings, make_engine(settings, _url(using)))
    return found


def send(topic: str, body: Any, *, using: str = DEFAULT_DB_ALIAS, **options: Any) -> Message:
    """`delaysvc.send` in Django's transaction on `connections[using]`."""
    return producer(using).send(topic, body, connection=connections[using], **options)


def send_batch(
    messages: Sequence[Mapping[str, Any]], *, using: str = DEFAULT_DB_ALIAS
) -> SentBatch:
    return producer(using).send_batch(messages, connection=connections[using])


def cancel(
    message_id: int | None = None, *, using: str = DEFAULT_DB_ALIAS, **options: Any
) -> Message:
    return producer(using).cancel(message_id, connection=connections[using], **options)


def get(message_id: int, *, using: str = DEFAULT_DB_ALIAS) -> Message:
    return producer(using).get(message_id, connection=connections[using])


def handler(
    topic: str, *, max_retries: int | None = None, using: str = DEFAULT_DB_ALIAS
) -> Callable[[HandlerFunc], HandlerFunc]:
    """A transactional handler in Django: `func(message)` runs inside
    `transaction.atomic(using=using)`, and the job's success is written through Django's
    connection in the same transaction. The ORM calls of the handler and `succeeded` commit
    together, or neither does (`delaysvc.handler(..., transaction=True)` for the service's own
    connection). The worker must be a Django process: `django.setup()` in the handler module,
    and `DATABASES[using]` the database delaysvc's tables are in. A handler that leaves the
    block marked for rollback (`transaction.set_rollback(True)`, or a database error it caught
    outside a savepoint) has its work undone and the job retried, failed with
    `TransactionRolledBack` (it was Django's "An error occurred in the current transaction",
    from the success delaysvc then wrote, though no query had failed). The block is nested
    in the handler's: `atomic(durable=True)` cannot be used in one."""

    @contextmanager
    def atomic(_engine: Engine) -> Iterator[tuple[Joined, tuple[()]]]:
        # a connection Django would not keep (past CONN_MAX_AGE, or one that failed: cut by a
        # server restart) is closed first, as Celery's Django fixup does before each task: the
        # job runs on a new one instead of failing once on it
        connections[using].close_if_unusable_or_obsolete()
        with transaction.atomic(using=using), joined(connections[using]) as statements:
            yield statements, ()

    register = register_handler(topic, max_retries, atomic)

    def decorate(func: HandlerFunc) -> HandlerFunc:
        @wraps(func)
        def checked(message: Any, *more: Any) -> Any:
            done = func(message, *more)
            if connections[using].needs_rollback:
                raise TransactionRolledBack(
                    "the handler left its transaction marked for rollback "
                    "(transaction.set_rollback(True), or a database error caught outside a "
                    "savepoint): its work is undone and the job is retried"
                )
            return done

        register(checked)
        return func

    return decorate


class TransactionRolledBack(Exception):
    """A Django handler's transaction was marked for rollback, though it raised nothing."""


def _url(using: str) -> str:
    """Django's `DATABASES[using]` as a SQLAlchemy URL (psycopg 3)."""
    database = connections.settings[using]
    port = database.get("PORT")
    return URL.create(
        "postgresql+psycopg",
        username=database.get("USER") or None,
        password=database.get("PASSWORD") or None,
        host=database.get("HOST") or None,
        port=int(port) if port else None,
        database=database.get("NAME") or None,
    ).render_as_string(hide_password=False)
