"""Connections: engines and the embedded PostgreSQL (`engines`), the caller's own connections
(`connections`), and the schema names SQL is written with (`names`).

`from delaysvc.db import make_engine`, the path from before the package, still works: names
not found here are looked up in `engines` on first use (nothing is imported at load, so
`config` may use `names` without a cycle)."""

import importlib
from typing import Any

_SUBMODULES = {"engines", "connections", "names"}


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULES:  # those are imported as submodules, not looked up
        try:
            return getattr(importlib.import_module("delaysvc.db.engines"), name)
        except AttributeError:
            pass
    raise AttributeError(f"module 'delaysvc.db' has no attribute {name!r}")
