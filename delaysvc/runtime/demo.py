"""The handlers `delaysvc up` runs when DELAYSVC_HANDLERS names none: the quick tour's topics
and `delaysvc load`'s, so a first send visibly runs. Each prints one line per message it runs
(`load.demo` one per thousand); none touches anything. DELAYSVC_HANDLERS=your.module replaces
them all."""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any

from delaysvc.worker.consumer import Job, handler

log = logging.getLogger(__name__)
TOPICS = ("greet", "order.cancel", "load.demo")
LOAD_REPORT_EVERY = 1000
_load_runs = itertools.count(1)


def _say(line: str) -> None:
    print(f"demo handler: {line}", flush=True)


def _body(message: Job) -> str:
    return json.dumps(message.body, separators=(", ", ": "), default=str)


@handler("greet")
def greet(message: Job) -> None:
    name = message.body.get("name") if isinstance(message.body, dict) else None
    _say(f"hello, {name or 'world'} (message {message.id}, attempt {message.attempts})")


@handler("order.cancel")
def cancel_order(message: Job) -> None:
    _say(f"order.cancel {_body(message)} (message {message.id}, attempt {message.attempts})")


@handler("load.demo")
def load(message: Any) -> None:
    runs = next(_load_runs)
    if runs % LOAD_REPORT_EVERY == 0:
        _say(f"load.demo: {runs:,} messages run by this process")
