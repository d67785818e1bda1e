"""Importing a module does nothing but define things: no file or folder appears in the folder
that imports it (`import delaysvc.tasks` used to make `./var/broker`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import outside_env

IMPORT_EVERY_MODULE = """
import importlib, pkgutil, delaysvc
for found in pkgutil.walk_packages(delaysvc.__path__, "delaysvc."):
    if found.name.endswith("__main__") or found.name == "delaysvc.migrations.env":
        continue  # the CLI runs; Alembic's env runs only under Alembic
    importlib.import_module(found.name)
print("imported")
"""


def test_importing_every_module_writes_nothing_where_it_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_MODULE],
        cwd=tmp_path,
        env=outside_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout.strip()) == (0, "imported"), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
