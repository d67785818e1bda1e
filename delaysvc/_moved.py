"""Module paths from before the packages (delaysvc 0.x's flat layout), kept working: importing
an old path gives the module it became (the same module object, so its state is shared). Users
wrote some of them (`from delaysvc.consumption import Job`, `from delaysvc.settings import
Settings`); new code uses the new ones (docs/architecture.md)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

MOVED = {
    "delaysvc.settings": "delaysvc.config.settings",
    "delaysvc.levels": "delaysvc.config.levels",
    "delaysvc.validation": "delaysvc.config.validation",
    "delaysvc.extras": "delaysvc.config.extras",
    "delaysvc.sql": "delaysvc.db.names",
    "delaysvc.joining": "delaysvc.db.connections",
    "delaysvc.migrate": "delaysvc.schema.migrate",
    "delaysvc.caps": "delaysvc.producer.caps",
    "delaysvc.dead_letters": "delaysvc.producer.dead_letters",
    "delaysvc.consumption": "delaysvc.worker.consumer",
    "delaysvc.limits": "delaysvc.worker.limits",
    "delaysvc.delivery": "delaysvc.maintenance.delivery",
    "delaysvc.history": "delaysvc.maintenance.history",
    "delaysvc.periodic_schedules": "delaysvc.maintenance.periodic",
    "delaysvc.health": "delaysvc.maintenance.heartbeats",
    "delaysvc.histogram": "delaysvc.maintenance.histogram",
    "delaysvc.check": "delaysvc.maintenance.check",
    "delaysvc.up": "delaysvc.runtime.supervisor",
    "delaysvc.logs": "delaysvc.config.logs",
}
"""Old path -> new path. (`delaysvc.db`, `delaysvc.schema` and `delaysvc.producer` are packages
now; each answers the names its module had.)"""


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its new path."""


def install() -> None:
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())


def names_of(package: str, module: str, submodules: set[str]) -> Callable[[str], Any]:
    """A package's `__getattr__` answering the names of the module it was before it became a
    package (now its submodule `module`), on first use, so nothing is imported at load. The
    package's `submodules` are left to the import system."""

    def __getattr__(name: str) -> Any:
        if name not in submodules:
            try:
                return getattr(importlib.import_module(f"{package}.{module}"), name)
            except AttributeError:
                pass
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
