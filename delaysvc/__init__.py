"""delaysvc: durable delayed jobs on PostgreSQL.

from delaysvc import handler, send, DeadLetter, RetryLater

send("order.cancel", {"order_id": 42}, delay="30m", key="order-42", connection=conn)
await asend("order.cancel", {"order_id": 42}, delay="30m", connection=async_conn)

@handler("order.cancel", max_retries=16)
def cancel_order(message): ...

The package root only re-exports, and loads each name on first use: `from delaysvc import
send` loads the producer, not the worker or Celery. docs/architecture.md maps the packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from delaysvc import _moved

_moved.install()  # old module paths (delaysvc.tasks, delaysvc.consumption, ...) keep working

if TYPE_CHECKING:
    from delaysvc.errors import (
        BacklogFull,
        ConfigError,
        DeadLetter,
        DelaysvcError,
        DuplicateKey,
        NotCancellable,
        NotFound,
        RetryLater,
        ValidationError,
    )
    from delaysvc.maintenance.periodic import periodic
    from delaysvc.producer.default import (
        acancel,
        aget,
        asend,
        asend_batch,
        cancel,
        configure,
        default_producer,
        get,
        send,
        send_batch,
    )
    from delaysvc.producer.sending import Message, SentBatch
    from delaysvc.worker.consumer import Job, handler

_HOMES = (
    "delaysvc.errors",
    "delaysvc.producer.default",
    "delaysvc.producer.sending",
    "delaysvc.worker.consumer",
    "delaysvc.maintenance.periodic",
)
"""Where the public names live, looked in in this order (so `send` loads no worker)."""

__all__ = [
    "BacklogFull",
    "ConfigError",
    "DeadLetter",
    "DelaysvcError",
    "DuplicateKey",
    "Job",
    "Message",
    "NotCancellable",
    "NotFound",
    "RetryLater",
    "SentBatch",
    "ValidationError",
    "acancel",
    "aget",
    "asend",
    "asend_batch",
    "cancel",
    "configure",
    "default_producer",
    "get",
    "handler",
    "periodic",
    "send",
    "send_batch",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        for home in _HOMES:
            module = importlib.import_module(home)
            if hasattr(module, name):
                value = getattr(module, name)
                globals()[name] = value
                return value
    # not public: `from delaysvc import store` then imports the subpackage
    raise AttributeError(f"module 'delaysvc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
