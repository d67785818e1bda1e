"""Group commit: the single sends of one process's threads, written together while they wait.

A producer made with `group_writers=N` (the web app's: `delaysvc.web.create_app`) writes a
single send at once while fewer than N writes are under way in the process, as always. A send
that comes while N are waits, and when one of them ends, every send that waited meanwhile (up
to `MOST`) is written in one statement (`store.insert_group`): one round trip and one commit
for all of them, where each alone would pay both. Each message is still its own send, placed,
capped and keyed as if sent alone, and each caller returns only once its group has committed.
A group is one transaction: if its write fails, nothing of it is stored and every send in it
raises the error (each its own copy), but for PostgreSQL rolling it back (a deadlock on a key
another writer holds): then each is written alone, as it would have been. A group writes its
keys in one order (`store.insert_group`), so two groups never deadlock each other.

It pays where many threads of one process send at once: 16 threads, N = 2, 1.42x the sends a
second of each written alone; with 4 threads it is even (N = 1 costs a third there: PostgreSQL
already commits concurrent transactions together), so a producer groups nothing unless asked
(docs/benchmarks/2026-11-28-group-commit). Nothing is shared across processes: a forked child
starts with no group.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, cast

MOST = 64
"""Sends written in one statement at most; more waiting go in the next group."""

_ALONE = object()
"""A waiting send's result when its group did not store it: it is written alone."""

M = TypeVar("M")  # a message to write
R = TypeVar("R")  # what writing it gives


class _Waiting(Generic[M, R]):
    """A send waiting for its group: the thread sleeps on `_done` until the group's writer
    wakes it, or a write ending hands it a `group` (itself first) to write."""

    __slots__ = ("_done", "error", "group", "message", "result")

    def __init__(self, message: M):
        self.message = message
        self.result: object = None  # R, or _ALONE
        self.error: BaseException | None = None
        self.group: list[_Waiting[M, R]] | None = None  # set when this thread writes them
        self._done = threading.Lock()
        self._done.acquire()

    def wait(self) -> None:
        self._done.acquire()

    def wake(self) -> None:
        self._done.release()


class Grouped(Generic[M, R]):
    """Writes each message by `write_one` (fewer than `writers` writes under way) or, with
    those that came while `writers` were, by `write_group` (-> one result per message, in
    order; None for one it did not store, which is then written by `write_one` in its own
    thread). A group of one is written by `write_one`."""

    def __init__(
        self,
        write_one: Callable[[M], R],
        write_group: Callable[[Sequence[M]], Sequence[R]],
        writers: int,
    ):
        self.writers = writers
        self._write_one = write_one
        self._write_group = write_group
        self._reset()
        reference = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reset_in_child(reference))

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._waiting: deque[_Waiting[M, R]] = deque()
        self._writing = 0  # writes under way

    def write(self, message: M) -> R:
        with self._lock:
            alone = self._writing < self.writers
            if alone:
                self._writing += 1
            else:
                waiting: _Waiting[M, R] = _Waiting(message)
                self._waiting.append(waiting)
        if alone:
            try:
                return self._write_one(message)
            finally:
                self._pass_on()
        waiting.wait()
        if waiting.group is not None:
            self._write_group_of(waiting.group)
        if waiting.error is not None:
            raise _own_copy(waiting.error) from waiting.error
        if waiting.result is _ALONE:  # the group did not store it
            return self._write_one(message)
        return cast(R, waiting.result)

    def _write_group_of(self, group: list[_Waiting[M, R]]) -> None:
        """Write `group` (this thread's send first) as one, wake each of the others with its
        result or the error, and pass the writing on."""
        try:
            messages = [waiting.message for waiting in group]
            if len(group) == 1:
                results: Sequence[object] = [self._write_one(messages[0])]
            else:
                results = [_ALONE if r is None else r for r in self._write_group(messages)]
            for waiting, result in zip(group, results, strict=True):
                waiting.result = result
        except BaseException as error:
            for waiting in group:
                waiting.error = error
        finally:
            for waiting in group[1:]:
                waiting.wake()
            self._pass_on()

    def _pass_on(self) -> None:
        """After a write: the sends waiting (up to MOST) go to the first of them to write as
        a group; none waiting, this writer is done."""
        with self._lock:
            if not self._waiting:
                self._writing -= 1
                return
            group = [self._waiting.popleft() for _ in range(min(MOST, len(self._waiting)))]
        group[0].group = group
        group[0].wake()


def _own_copy(error: BaseException) -> BaseException:
    """An error of a group for one of its sends to raise: a twin of the same class, arguments
    and attributes (made without `__init__`, whose arguments an exception need not keep), so
    that no two threads raise, and set the traceback of, the same exception object."""
    twin = type(error).__new__(type(error), *error.args)
    twin.__dict__.update(error.__dict__)
    return twin


def _reset_in_child(reference: weakref.ref[Grouped]) -> None:
    grouped = reference()
    if grouped is not None:
        grouped._reset()
