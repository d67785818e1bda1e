"""Sending: scheduling, cancelling and reading messages (`sending`), the module-level
`delaysvc.send` and friends (`default`), backlog caps (`caps`), redriving dead letters
(`dead_letters`).

`from delaysvc.producer import Producer`, the path from before the package, still works: names
not found here are looked up in `sending` on first use."""

import importlib
from typing import Any

_SUBMODULES = {"sending", "default", "caps", "dead_letters"}


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULES:  # those are imported as submodules, not looked up
        try:
            return getattr(importlib.import_module("delaysvc.producer.sending"), name)
        except AttributeError:
            pass
    raise AttributeError(f"module 'delaysvc.producer' has no attribute {name!r}")
