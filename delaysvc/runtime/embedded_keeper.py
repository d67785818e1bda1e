"""`delaysvc up`'s keeper of its embedded PostgreSQL: a child of `up` like the others, so it
dies with `up` however `up` dies (SIGKILL too: `supervisor.die_with_parent`), and a user of
the server the wheel counts: the wheel stops the server when the last process counted exits.
`up` is counted as well, but a killed `up` runs no exit handler, and its other children take
the server's URL without being counted: before this keeper a killed `up` left the server
running for good. While `up` runs, the keeper also starts the server again if it stops (killed,
crashed), with a line saying so, where the rest would wait on a server nobody starts.

Run as `python -m delaysvc.runtime.embedded_keeper VAR_DIR` (`supervisor.keeper_command`)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from delaysvc.db.engines import (
    embedded_server,
    ignore_stop_signals,
    process_gone,
    restart_if_stopped,
)

POLL_SECONDS = 1.0
UP = os.getppid()  # the `delaysvc up` this keeper serves
UP_GONE_SECONDS = 5.0


def _leave(signum: int, frame: FrameType | None) -> None:
    # once: the kernel sends the parent-death signal again as up's threads die, and one
    # more cut the exit handlers short (the server ran on, the wheel's list half written)
    ignore_stop_signals()
    if os.getppid() != UP or process_gone(UP):
        # up died (the kernel's SIGTERM, sent while up is still exiting): the wheel counts a
        # process as a user until it is gone, and would leave the server running for it
        _wait_until_gone(UP, UP_GONE_SECONDS)
    sys.exit(0)  # a normal exit: the exit handlers stop the server if no one else uses it


def _wait_until_gone(pid: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def main(var_dir: Path) -> None:
    signal.signal(signal.SIGTERM, _leave)
    signal.signal(signal.SIGINT, _leave)
    server = embedded_server(var_dir)
    failing = False
    while True:
        time.sleep(POLL_SECONDS)
        try:
            restarted = restart_if_stopped(server)
        except Exception as exc:  # said once, and tried again at every poll
            if not failing:
                print(f"the embedded PostgreSQL stopped and does not start again: {exc}",
                      flush=True)  # fmt: skip
            failing = True
            continue
        if restarted or failing:
            print(f"the embedded PostgreSQL under {server.pgdata} had stopped: started it again",
                  flush=True)  # fmt: skip
        failing = False


if __name__ == "__main__":
    main(Path(sys.argv[1]))
