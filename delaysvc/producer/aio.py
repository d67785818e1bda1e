"""Single sends from an event loop, written together: `AsyncSends`, the HTTP API's quick way
under an asyncio server (`delaysvc.web.asgi`).

A send is checked as `Producer.send_item` checks it, then written on a psycopg
AsyncConnection of the process's own small pool, in one autocommitted statement. While
`writers` writes are under way, the sends that come wait, and when one ends, all that waited
(up to `MOST`) are written by one statement (`store.insert_group_async`): one round trip and
one commit for them all, each message still placed, capped and keyed as if sent alone. The
loop serves other requests while a write waits on the database, so one worker process keeps
many sends under way without a thread each. Measured on 2 cores against gunicorn's sync
workers (docs/benchmarks/2026-12-06-http-asgi-floor): the thinnest ASGI callable sending this
way reaches several times their single sends a second.

Only the plain send goes this way; `send_item` returns None for the rest, which the caller
sends the producer's way: a producer with backlog caps of its own (DELAYSVC_BACKLOG_CAPS), an
application that traces, a key policy other than "keep", a driver other than psycopg 3, a
message a cap covers or whose key an unfinished message holds (the statement stores nothing of
it), and a database not reached before the statement was sent (nothing was stored).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from delaysvc import store
from delaysvc.config import tracing
from delaysvc.db.engines import (
    behind_transaction_pooler,
    database_url,
    libpq_url,
    psycopg_prepare_options,
    require_kept_prepared_statements_async,
    server_closed,
)
from delaysvc.producer.grouping import MOST
from delaysvc.producer.message import Message
from delaysvc.producer.sending import Producer, unavailable

log = logging.getLogger(__name__)

WRITERS = 2
"""Writes under way at once in a process; sends that come meanwhile wait and are written
together when one ends."""

CONNECTIONS = 4
"""The process's connections for these sends (a write takes one; the rest are spare)."""

CONNECT_SECONDS = 2.0
"""How long a write waits for a connection (more than `writers` are kept, so only while the
database cannot be reached) before its sends are left to the producer's way, which answers
for the outage as a single send does (503: nothing stored)."""

_Waiting = tuple[store.NewMessage, "asyncio.Future[store.Stored | None]"]


class AsyncSends:
    """`send_item` from an event loop, its writes grouped; `open` before the first send (in
    the loop that sends), `close` after the last."""

    def __init__(self, producer: Producer, writers: int = WRITERS):
        self.producer = producer
        self.writers = writers
        settings = producer.settings
        url = database_url(settings)
        options: dict[str, Any] = {"autocommit": True, "application_name": "delaysvc"}
        options.update(psycopg_prepare_options(settings, url))  # as the producer's engine
        kept = settings.database_pooling == "transaction-prepared"
        self.pool = AsyncConnectionPool(
            libpq_url(url),
            min_size=1,
            max_size=CONNECTIONS,
            kwargs=options,
            open=False,
            timeout=CONNECT_SECONDS,
            check=_not_closed_by_server,
            # as the producer's engine asks (`engines.make_engine`)
            configure=require_kept_prepared_statements_async
            if kept and behind_transaction_pooler(settings, url)
            else None,
        )
        self._takes = producer.sends_autocommitted() and not settings.caps
        self._waiting: list[_Waiting] = []
        self._writing = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.groups = 0
        """Statements written so far (each one message or a group): what grouping saved."""

    async def open(self) -> None:
        await self.pool.open()

    async def close(self) -> None:
        await self.pool.close()

    async def send_item(self, item: Mapping[str, Any]) -> Message | None:
        """`Producer.send_item(item)`: the Message stored, or None when this way does not store
        it (see the module's docstring): send it the producer's way. Bad input raises as
        `send_item` does, before anything is written."""
        if not self._takes or tracing.tracer() is not None:
            return None
        new, policy = self.producer.prepare_item(item)
        if policy != "keep":  # a key's policy: the producer's own transaction
            return None
        done: asyncio.Future[store.Stored | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((new, done))
        if self._writing < self.writers:
            self._writing += 1
            task = asyncio.create_task(self._write())
            self._tasks.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(self._tasks.discard)
        stored = await done
        return None if stored is None else self.producer.message_sent(new, stored, True)

    async def _write(self) -> None:
        """Write what waits, group after group, until nothing does."""
        try:
            while self._waiting:
                group, self._waiting = self._waiting[:MOST], self._waiting[MOST:]
                try:
                    stored = await self._written([new for new, _ in group])
                except BaseException as exc:
                    for _, done in group:
                        if not done.done():
                            done.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for (_, done), one in zip(group, stored, strict=True):
                    if not done.done():  # its request may have been cancelled meanwhile
                        done.set_result(one)
        finally:
            self._writing -= 1

    async def _written(self, messages: Sequence[store.NewMessage]) -> list[store.Stored | None]:
        """`messages` written in one statement; None each where nothing was stored (the
        database not reached, or the statement refused whole: each sent alone says why). A
        connection lost once the statement was sent may have stored them: DatabaseUnavailable
        (maybe_stored=True), as a single send says it."""
        sent = False
        try:
            async with self.pool.connection() as conn:
                sent = True
                self.groups += 1
                return await store.insert_group_async(conn, messages)
        except psycopg.Error as exc:
            if not store.rolled_back(exc) and isinstance(exc, psycopg.OperationalError):
                # PoolTimeout too: no connection to be had
                if sent:
                    raise unavailable(exc, "send", maybe_stored=True) from exc
                log.warning("producer.async_unreachable", extra={"error": str(exc)})
            # else refused, or rolled back by a deadlock (nothing stored): each sent alone
        return [None] * len(messages)


async def _not_closed_by_server(conn: psycopg.AsyncConnection[Any]) -> None:
    """A pooled connection the server ended while it sat idle (a restart, an idle timeout) is
    replaced before a send is written on it, seen without a round trip (`server_closed`, as
    the producer's engine does): a statement sent is never in doubt for that."""
    if server_closed(conn):
        await conn.close()  # closed, the pool replaces it (else it would hand it out again)
        raise psycopg.OperationalError("the server closed this pooled connection")
