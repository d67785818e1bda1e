"""What a click user expects of `delaysvc`: every command and option has help, `--help` always
works (a bad setting is the error of a command that reads the settings, never of `--help`),
and the groups share one grammar, `<noun> <verb>`, with `list` in each."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import click
import pytest

from delaysvc.cli import cli
from tests.conftest import outside_env
from tests.support.passes import first_pass_only


def _commands(group: click.Group, path: str = "delaysvc") -> Iterator[tuple[str, click.Command]]:
    for name, command in group.commands.items():
        if command.hidden:
            continue  # the spellings from before the groups
        yield f"{path} {name}", command
        if isinstance(command, click.Group):
            yield from _commands(command, f"{path} {name}")


COMMANDS = dict(_commands(cli))


def test_every_command_and_every_option_has_help() -> None:
    missing = [path for path, command in COMMANDS.items() if not command.help]
    missing += [
        f"{path} {param.opts[0]}"
        for path, command in COMMANDS.items()
        for param in command.params
        if isinstance(param, click.Option) and not param.hidden and not param.help
    ]
    assert missing == []


def test_every_group_lists_with_list() -> None:
    groups = [p for p, c in COMMANDS.items() if isinstance(c, click.Group) and "bench" not in p]
    assert sorted(groups) == [
        "delaysvc caps",
        "delaysvc dead",
        "delaysvc limits",
        "delaysvc pipeline",
        "delaysvc schedules",
        "delaysvc topics",
    ]
    no_list = [g for g in groups if "list" not in COMMANDS[g].commands]  # type: ignore[attr-defined]
    assert no_list == ["delaysvc pipeline"]  # jobs, not things kept


@first_pass_only("~6 s of commands started, no database")
@pytest.mark.parametrize("command", ["send", "dead list", "pipeline archive", "up", "topics"])
def test_help_works_with_a_bad_setting(command: str) -> None:
    env = outside_env() | {"DELAYSVC_DELAY_LEVELS": "bogus", "DELAYSVC_LOG_FORMAT": "xml"}
    result = subprocess.run(
        [sys.executable, "-m", "delaysvc", *command.split(), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith(f"Usage: delaysvc {command} ")
    refused = subprocess.run(
        [sys.executable, "-m", "delaysvc", "levels", "--no-db"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: DELAYSVC_")
