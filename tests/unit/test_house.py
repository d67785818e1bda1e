"""The house rules that `lint-imports` does not check (docs/architecture.md): no import cycle
between delaysvc's modules (imports inside functions and type-only ones included), no module
over 800 lines, a package root that loads nothing until a name is used, and the module paths
from before the packages still working."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from delaysvc import _moved

PACKAGE = Path(__file__).resolve().parents[2] / "delaysvc"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    edges = {
        m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in graph.modules)
        for m in graph.modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            for nxt in edges[node]:
                if nxt in on_stack:
                    low[node] = min(low[node], low[nxt])
            if low[node] == index[node]:
                group = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    group.append(top)
                    if top == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_module_imports_itself_in_a_circle() -> None:
    graph = grimp.build_graph("delaysvc")
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_module_is_over_800_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 800
    }
    assert long == {}


def _loaded_after(code: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(done.stdout.split())


def test_the_package_root_loads_nothing_until_a_name_is_used() -> None:
    loaded = _loaded_after("import delaysvc")
    assert {m for m in loaded if m.startswith("delaysvc.")} <= {"delaysvc._moved"}
    assert "sqlalchemy" not in loaded


def test_a_send_loads_neither_the_worker_nor_celery_nor_flask() -> None:
    loaded = _loaded_after("from delaysvc import send, configure")
    assert "delaysvc.producer.default" in loaded
    assert not {"celery", "flask", "delaysvc.worker.consumer", "delaysvc.runtime.tasks"} & loaded


def test_the_cli_loads_alembic_only_for_the_commands_that_migrate() -> None:
    """Every `delaysvc` command imports the CLI; Alembic (and Mako and Pygments under it, a
    fifth of a second here) is for `migrate`, `up` and `bench`'s databases."""
    loaded = _loaded_after("import delaysvc.cli")
    assert not {"alembic", "mako", "pygments", "celery", "flask"} & loaded


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_a_module_path_from_before_the_packages_is_the_module_it_became(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(_moved.MOVED[old])


@pytest.mark.parametrize(
    ("package", "name"),
    [
        ("delaysvc.db", "make_engine"),
        ("delaysvc.schema", "metadata"),
        ("delaysvc.producer", "Producer"),
    ],
)
def test_a_module_that_became_a_package_answers_its_old_names(package: str, name: str) -> None:
    assert getattr(importlib.import_module(package), name) is not None
