"""The handler registry: `@handler` and its kin register a function for a topic, or for every
topic that starts with a prefix (`@handler("webhook.*")`; an exact topic wins, then the longest
prefix). Workers import the modules in `DELAYSVC_HANDLERS` so the decorators run; the consumer
(`delaysvc.worker.consumer`) finds each job's handler here.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine

from delaysvc.config.validation import validate_topic
from delaysvc.errors import ConfigError, ValidationError

log = logging.getLogger("delaysvc.worker.consumer")  # the workers' logger, as before the split

HandlerFunc = Callable[..., Any]  # (message), or (message, conn) with transaction=True


TransactionOpener = Callable[[Engine], AbstractContextManager[tuple[Any, tuple[Any, ...]]]]
"""Opens a transactional handler's transaction: -> (what the job's own statements run on, the
arguments the handler gets after the message). The service's: `in_service_transaction`;
Django's: `delaysvc.contrib.django.handler`."""


@contextmanager
def in_service_transaction(engine: Engine) -> Iterator[tuple[Connection, tuple[Connection]]]:
    """A transaction on the service's database; the handler gets its `Connection`."""
    with engine.begin() as conn:
        yield conn, (conn,)


@dataclass(frozen=True)
class Handler:
    topic: str
    func: HandlerFunc
    max_retries: int | None
    transaction: TransactionOpener | None = None

    def run(self, *arguments: Any) -> None:
        """Call the handler with `arguments` (the message, then the transaction's); an `async
        def` handler's coroutine is run to its end on this thread's event loop."""
        result = self.func(*arguments)
        if inspect.isawaitable(result):
            _run_to_its_end(result)
        elif inspect.isgenerator(result) or inspect.isasyncgen(result):
            raise TypeError(f"{_name(self.func)} gave a generator, which runs nothing: {_RETURN}")


_RETURN = "a handler returns (or raises) when its work is done; write it without yield"

_loops = threading.local()


def _event_loop() -> asyncio.Runner:
    """This thread's event loop for `async def` handlers, kept from job to job (a loop of each
    job's own would be set up and torn down each time)."""
    runner: asyncio.Runner | None = getattr(_loops, "runner", None)
    if runner is None:
        runner = _loops.runner = asyncio.Runner()
    return runner


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _run_to_its_end(awaitable: Any) -> None:
    """Run an `async def` handler's coroutine on this thread's loop; the tasks it leaves
    running are cancelled then, as `asyncio.run` cancels them (else they would run on inside
    the next job's handler, or never)."""
    runner = _event_loop()
    try:
        runner.run(_awaited(awaitable))
    finally:
        loop = runner.get_loop()
        left = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))


_registry: dict[str, Handler] = {}
"""Handlers by topic, and by pattern (`prefix*`) for a family of topics."""


def handler(
    topic: str, *, max_retries: int | None = None, transaction: bool = False
) -> Callable[[HandlerFunc], HandlerFunc]:
    """Register `func(message)` for `topic`. Returning is success; raising is a failure that
    is retried at level 3, 4, ... (10s, 30s, 1m ...) until `max_retries` (default 16) is spent,
    then the message is dead-lettered. Raise `RetryLater(delay=...)` or `DeadLetter(reason)`
    to decide yourself.

    `func` may be an `async def` function: its coroutine is run to its end, on an event loop
    the worker's thread keeps from job to job, before the job's outcome is written.

    `transaction=True`: `func(message, conn)` gets a SQLAlchemy `Connection` on the service's
    database in an open transaction, and the job's success is written in that transaction:
    the handler's rows and `succeeded` commit together or not at all (effectively once for
    work in the same database). Raising rolls both back, then the usual retry or dead letter;
    a process killed mid-handler leaves neither, and the job runs again after its lease. While
    the transaction is open the job's row is locked, so no other consumer can take it."""
    return register_handler(topic, max_retries, in_service_transaction if transaction else None)


def register_handler(
    topic: str, max_retries: int | None, transaction: TransactionOpener | None
) -> Callable[[HandlerFunc], HandlerFunc]:
    """`handler`, with the transaction a transactional handler runs in given."""
    if callable(topic):  # `@handler` over a function, without its topic
        raise TypeError(
            f'handler needs the topic: write @handler("order.cancel") over {_name(topic)}, '
            "not @handler"
        )
    if not isinstance(topic, str):
        raise TypeError(f"a handler's topic is a string such as 'order.cancel', got {topic!r}")
    if topic.endswith("*"):
        _validate_family(topic)
    else:
        validate_topic(topic)
    if max_retries is not None and (not isinstance(max_retries, int) or max_retries < 0):
        raise ValueError(f"max_retries must be a whole number >= 0, got {max_retries!r}")

    def register(func: HandlerFunc) -> HandlerFunc:
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(f"{_name(func)} is a generator function, which runs nothing: {_RETURN}")
        held = _registry.get(topic)
        if held is not None and _origin(held.func) != _origin(func):  # the same: a reload
            # said, not refused: a module imported under two names (a `sys.path` quirk, a
            # test runner's) registers each of its handlers twice, the last one kept
            log.warning(
                "handlers.replaced",
                extra={"topic": topic, "was": _name(held.func), "now": _name(func)},
            )
        _registry[topic] = Handler(topic, func, max_retries, transaction)
        return func

    return register


def _name(func: Callable[..., Any]) -> str:
    """`module.qualname` of a handler function, as a traceback names it: of the function a
    `functools.partial` calls, of the class of a callable object."""
    if isinstance(func, functools.partial):
        return _name(func.func)
    named = func if hasattr(func, "__qualname__") else type(func)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def _origin(func: Any, depth: int = 0) -> tuple[Any, ...]:
    """Where a handler's code comes from: its name, its code's file and line, and (for a
    function a decorator made without `functools.wraps`, or a lambda) the same of the
    functions it closes over. A module imported again gives a new function of the same
    origin; two lambdas, or two handlers wrapped by one decorator, differ."""
    if isinstance(func, functools.partial):
        return ("partial", _origin(func.func, depth))
    code = getattr(func, "__code__", None)
    if code is None:  # a callable object: its class
        return (_name(func),)
    inner = []
    for cell in getattr(func, "__closure__", None) or () if depth < 3 else ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        if callable(value):
            inner.append(_origin(value, depth + 1))
    return (_name(func), code.co_filename, code.co_firstlineno, tuple(inner))


def _validate_family(pattern: str) -> None:
    """A family of topics is a topic's beginning and `*`: `webhook.*`, `celery.*`."""
    prefix = pattern[:-1]
    if not prefix or "*" in prefix:
        raise ValidationError(
            "topic",
            f"{pattern!r} is not a topic pattern; write the topics' common beginning and one "
            "'*' at the end, as in 'webhook.*'",
        )
    validate_topic(prefix + "x")


def registered(topic: str) -> Handler | None:
    """The topic's own handler, else that of the longest pattern it matches."""
    found = _registry.get(topic)
    if found is not None:
        return found
    families = [h for p, h in _registry.items() if p.endswith("*") and topic.startswith(p[:-1])]
    return max(families, key=lambda h: len(h.topic), default=None)


def registered_topics() -> list[str]:
    """The topics and topic patterns (`webhook.*`) this process has handlers for."""
    return sorted(_registry)


def require_handler_modules(modules: tuple[str, ...]) -> None:
    """Refuse, naming DELAYSVC_HANDLERS, a handler module that cannot be found: otherwise each
    worker would fail as it imports it, and be started again, a traceback each time. Found,
    not imported (the workers import it), on this process's path and its working folder,
    where the workers (`python -m celery`) look too; a parent package is imported to look
    inside it."""
    folder = os.getcwd()
    if folder not in sys.path and "" not in sys.path:
        sys.path.insert(0, folder)
    for module in modules:
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # its package is missing, or is not a package
            found = None
        if found is None:
            raise ConfigError(
                f"DELAYSVC_HANDLERS: no module named {module!r} in {folder} or the installed "
                "packages; start from the folder that holds it, or install it"
            )


def load_handler_modules(modules: tuple[str, ...]) -> None:
    for module in modules:
        importlib.import_module(module)
        log.info("handlers.loaded", extra={"handler_module": module})
