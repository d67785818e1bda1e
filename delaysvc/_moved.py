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
from types import ModuleType

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
