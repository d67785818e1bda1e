"""Connections a producer keeps for its single sends, each in autocommit.

A single send is one statement committing by itself (`engines.autocommit_cursor`). Taking a
connection from SQLAlchemy's pool for it, switching it to autocommit and back, and giving it
back cost more than a send's own Python: four sending processes sent 1.2-1.3x as many a second
on connections they kept (docs/benchmarks/2026-11-29-held-connections). So a producer keeps
up to `most` connections of its engine for them, taken from the pool once and detached from it
(beside the pool's size, not out of it), in autocommit for good; the last given back is the
next taken, while the process's caches still hold it. A send finding none free while `most`
are in use takes one from the pool as before.

A kept connection is looked at before each use: one the server closed while it sat (a
restart, an idle timeout) is replaced before anything is sent on it, so a send on it is never
in doubt. One whose statement was interrupted or whose connection was lost is closed, never
used again. A forked child never uses its parent's (they would share a socket). The free ones
are closed with the engine's pool (`Engine.dispose`) and when the producer is gone.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from psycopg.pq import TransactionStatus
from sqlalchemy import Engine, event

from delaysvc.db.engines import (
    autocommit_cursor,
    pooled_connection,
    server_closed,
    sqlalchemy_error,
)

MOST = 2
"""Connections a producer keeps for single sends, at most."""


class HeldConnections:
    """`cursor()`: a cursor of a kept connection of `engine` (psycopg 3) in autocommit."""

    def __init__(self, engine: Engine, most: int = MOST):
        self.engine = engine
        self.most = most
        self._free: deque[tuple[Any, Any]] = deque()  # (psycopg connection, its cursor)
        self._lock = threading.Lock()
        self._kept = 0  # free and in use
        weakref.finalize(self, _close_all, self._free)
        reference = weakref.ref(self)
        event.listen(engine, "engine_disposed", lambda _: _call(reference, "close_free"))
        os.register_at_fork(after_in_child=lambda: _call(reference, "_forked"))

    @contextmanager
    def cursor(self) -> Iterator[Any]:
        """A cursor whose statements each commit by themselves, with `autocommit_cursor`'s
        errors: a failure to connect is an OperationalError raised before anything is yielded;
        a lost connection is reported as `connection_invalidated`."""
        held = self._take()
        if held is None:
            with autocommit_cursor(self.engine) as cursor:
                yield cursor
            return
        driver, cursor = held
        dialect = self.engine.dialect
        lost = False
        try:
            yield cursor
        except dialect.loaded_dbapi.Error as error:
            lost = dialect.is_disconnect(error, driver, cursor)
            raise sqlalchemy_error(error, dialect, lost=lost) from error
        finally:
            if not lost and driver.info.transaction_status == TransactionStatus.IDLE:
                self._free.append(held)
            else:  # lost, or stopped mid-statement: never used again
                self._drop(driver)

    def _take(self) -> tuple[Any, Any] | None:
        """A free connection, or a new one while fewer than `most` are kept; else None."""
        while self._free:
            try:
                driver, cursor = self._free.pop()
            except IndexError:  # another thread took the last one
                break
            if not server_closed(driver):
                return driver, cursor
            self._drop(driver)
        with self._lock:
            if self._kept >= self.most:
                return None
            self._kept += 1
        try:
            return self._open()
        except BaseException:
            with self._lock:
                self._kept -= 1
            raise

    def _open(self) -> tuple[Any, Any]:
        pooled = pooled_connection(self.engine)
        driver = pooled.driver_connection
        assert driver is not None
        pooled.detach()  # ours now, out of the pool's count
        driver.autocommit = True
        return driver, driver.cursor()

    def _drop(self, driver: Any) -> None:
        with self._lock:
            self._kept -= 1
        with suppress(Exception):  # a lost connection may fail to close; it is gone either way
            driver.close()

    def _forked(self) -> None:
        """In a forked child, as it starts (one thread, and a lock another thread of the parent
        may have held when it forked): forget the parent's connections, never closing them,
        which would end the parent's sessions on the sockets both share (psycopg closes nothing
        of another process's when its objects are dropped)."""
        self._lock = threading.Lock()
        self._free.clear()
        self._kept = 0

    def close_free(self) -> None:
        """Close the connections no send is using."""
        while self._free:
            try:
                driver, _ = self._free.pop()
            except IndexError:
                return
            self._drop(driver)


def _call(reference: weakref.ref[HeldConnections], method: str) -> None:
    """`method` of the kept connections, if the producer holding them is still there."""
    held = reference()
    if held is not None:
        getattr(held, method)()


def _close_all(free: deque[tuple[Any, Any]]) -> None:
    """The producer is gone (or the process is ending): close the connections it kept (in a
    forked child, its own only: the parent's were forgotten as it started)."""
    while free:
        driver, _ = free.pop()
        with suppress(Exception):
            driver.close()
