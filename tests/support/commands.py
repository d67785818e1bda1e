"""`delaysvc ...` run as a user runs it: a process of its own, in an environment like a user's
(`outside_env`: none of this process's delaysvc settings but the tests' schema)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import outside_env


def run_delaysvc(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, **settings: str
) -> subprocess.CompletedProcess[str]:
    """`python -m delaysvc ARGS` in `env` (default `outside_env()`) with `settings` (DELAYSVC_*
    variables) added, from `cwd`, its output captured as text; at most two minutes."""
    return subprocess.run(
        [sys.executable, "-m", "delaysvc", *args],
        env=(outside_env() if env is None else env) | settings,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
