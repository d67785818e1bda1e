"""The docs' reference pages are generated from the code (docs/gen_reference.py) and committed:
a page that no longer says what the code does, or that misses a setting, a command or a route,
fails here. The fix is `python docs/gen_reference.py`. No database is needed."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from types import ModuleType

import click
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["settings", "cli", "http-api"])
def test_the_committed_page_is_what_the_code_generates(gen: ModuleType, page: str) -> None:
    path = gen.PAGES[page]
    text = path.read_text()
    assert list(gen.blocks_in(text)) == [page], f"{path}: its generated block markers are gone"
    assert gen.render(text) == text, f"{path} is stale: run python docs/gen_reference.py"


def _generated(gen: ModuleType, page: str) -> str:
    match = gen.BLOCK.search(gen.PAGES[page].read_text())
    assert match is not None
    return str(match["body"])


def test_every_setting_is_in_the_reference_with_a_meaning(gen: ModuleType) -> None:
    from delaysvc.settings import COMMAND_VARIABLES, PROCESS_SETTINGS, Settings

    block = _generated(gen, "settings")
    documented = re.findall(r"^\| `(DELAYSVC_[A-Z_]+)` \|", block, re.MULTILINE)
    expected = [f"DELAYSVC_{name.upper()}" for name in Settings.model_fields]
    expected += [f"DELAYSVC_{name.upper()}" for name in sorted(PROCESS_SETTINGS)]
    expected += sorted(COMMAND_VARIABLES)
    assert documented == expected
    for variable, _kind, _default, meaning in gen.setting_rows():
        assert meaning, f"{variable} has no meaning: give its field a docstring in settings.py"
    for variable, meaning in gen.command_variable_rows():
        assert meaning, f"{variable} has no meaning: add it to OTHER_VARIABLES"


def _command_paths(command: click.Command, path: tuple[str, ...]) -> list[str]:
    if isinstance(command, click.Group):
        return [
            found
            for name, sub in sorted(command.commands.items())
            for found in _command_paths(sub, (*path, name))
        ]
    return [" ".join(path)]


def test_every_command_is_in_the_reference(gen: ModuleType) -> None:
    from delaysvc.cli import cli

    documented = re.findall(r"^\| \[`(delaysvc[a-z -]*)`\]", _generated(gen, "cli"), re.M)
    expected = _command_paths(cli, ("delaysvc",))
    assert documented == expected
    assert {"delaysvc up", "delaysvc send", "delaysvc pause", "delaysvc check"} <= set(expected)


def test_the_cli_page_renders_the_group_the_installed_command_runs(gen: ModuleType) -> None:
    """mkdocs-click renders `delaysvc.cli:cli` at build time: it must be the group that the
    `delaysvc` script (pyproject's [project.scripts]) runs."""
    import delaysvc.cli

    text = gen.PAGES["cli"].read_text()
    directive = re.search(r"::: mkdocs-click\n((?:    :.*\n)+)", text)
    assert directive is not None
    options = dict(re.findall(r":(\w+): (\S+)", directive.group(1)))
    assert options["module"] == "delaysvc.cli"
    assert options["prog_name"] == "delaysvc"
    group = getattr(delaysvc.cli, options["command"])
    assert isinstance(group, click.Group)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["delaysvc"].partition(":")
    assert (module, function) == ("delaysvc.cli", "main")
    assert delaysvc.cli.main.__module__ == group.callback.__module__  # type: ignore[union-attr]


def test_every_route_is_in_the_reference(gen: ModuleType) -> None:
    from delaysvc.web.openapi import document

    block = _generated(gen, "http-api")
    documented = re.findall(r"^\| ([A-Z]+) \| `/api/v1(/[^`]*)` \|", block, re.M)
    served = [(method, path) for method, path, _scope in gen.routes()]
    assert sorted(documented) == sorted(served)
    assert len(served) >= 21
    for method, path in served:
        assert f"### `{method} /api/v1{path}`" in block, f"{method} {path} has no section"
        assert method.lower() in document()["paths"][path], f"{method} {path} not in OpenAPI"


def test_admin_routes_say_so(gen: ModuleType) -> None:
    scopes = {(method, path): scope for method, path, scope in gen.routes()}
    assert scopes[("POST", "/messages")] == "send"
    assert scopes[("GET", "/dead")] == "admin"
    assert scopes[("PUT", "/schedules/{name}")] == "admin"
    assert scopes[("GET", "/openapi.json")] == "none"
    block = _generated(gen, "http-api")
    assert "| GET | `/api/v1/limits` | `admin` |" in block
