"""gunicorn's server hooks for `delaysvc web` (and `up`'s web): its workers die with their
master however the master dies. A sync worker notices a new parent on its own; uvicorn's
workers (the default server's) never look, and after a master killed with SIGKILL they kept
serving its port, so every restart of the web failed with "address in use" until the
supervisor gave up, and they ran on after it."""

from __future__ import annotations

import os
from typing import Any

from delaysvc.runtime.supervisor import die_with_parent


def post_fork(server: Any, worker: Any) -> None:
    """In each worker, just forked: SIGTERM from the kernel when its master dies."""
    set_parent_death_signal = die_with_parent(os.getppid())
    if set_parent_death_signal is not None:
        set_parent_death_signal()
