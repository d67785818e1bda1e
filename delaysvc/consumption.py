"""Handlers and the consumer: claim ready jobs, run their handlers, record the outcome.

A handler is a plain function registered for a topic with `@handler`. Workers import the modules
in `DELAYSVC_HANDLERS` so the decorators run.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

HandlerFunc = Callable[[Any], Any]


@dataclass(frozen=True)
class Handler:
    topic: str
    func: HandlerFunc
    max_retries: int | None


_registry: dict[str, Handler] = {}


def handler(topic: str, *, max_retries: int | None = None) -> Callable[[HandlerFunc], HandlerFunc]:
    """Register `func(message)` for `topic`. Returning is success; raising is a failure that
    is retried at level 3, 4, ... (10s, 30s, 1m ...) until `max_retries` (default 16) is spent,
    then the message is dead-lettered. Raise `RetryLater(delay=...)` or `DeadLetter(reason)`
    to decide yourself."""
    from delaysvc.validation import validate_topic

    validate_topic(topic)
    if max_retries is not None and (not isinstance(max_retries, int) or max_retries < 0):
        raise ValueError(f"max_retries must be a whole number >= 0, got {max_retries!r}")

    def register(func: HandlerFunc) -> HandlerFunc:
        _registry[topic] = Handler(topic, func, max_retries)
        return func

    return register


def registered(topic: str) -> Handler | None:
    return _registry.get(topic)


def registered_topics() -> list[str]:
    return sorted(_registry)


def load_handler_modules(modules: tuple[str, ...]) -> None:
    for module in modules:
        importlib.import_module(module)
        log.info("handlers.loaded", extra={"module": module})
