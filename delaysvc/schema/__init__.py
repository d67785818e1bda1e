"""The tables (`tables`), and the migrations that make and change them (`migrate`, with the
Alembic revisions in `migrations/`).

`from delaysvc.schema import metadata`, the path from before the package, still works: names
not found here are looked up in `tables` on first use."""

import importlib
from typing import Any

_SUBMODULES = {"tables", "migrate", "migrations"}


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULES:  # those are imported as submodules, not looked up
        try:
            return getattr(importlib.import_module("delaysvc.schema.tables"), name)
        except AttributeError:
            pass
    raise AttributeError(f"module 'delaysvc.schema' has no attribute {name!r}")
