"""The reaper of a supervisor's children, for a supervisor that dies without stopping them.

A supervisor killed with SIGKILL stops nothing itself: the kernel sends each child SIGTERM
(`supervisor.die_with_parent`), and a child that does not stop on it (a Celery worker whose
warm shutdown hangs) would run on unsupervised, holding the deployment's lock and taking jobs
nobody watches. The reaper is the supervisor's own child in a session of its own, which the
kernel tells nothing: the supervisor writes each child's pid and name on its stdin as it
starts it, and when that pipe ends without the line `stopped` (the supervisor died), the
reaper gives the children what a stop gives them (`grace` seconds, `Supervisor.stop_all`),
then kills each one still running. A supervisor that stops its
children itself writes `stopped`, and the reaper exits at once.

Run as `python -m delaysvc.runtime.reaper GRACE` (`supervisor.Reaper`). Linux only (pidfds:
a pid is followed, never a process that took a freed pid).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from contextlib import suppress
from typing import NamedTuple

STOPPED = b"stopped"  # the supervisor's last line when it stopped its children itself


class Watched(NamedTuple):
    pid: int
    name: str
    handle: int  # a pidfd: readable once the process has exited


def main(grace: float) -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):  # the terminal's: the supervisor's to take
        signal.signal(signum, signal.SIG_IGN)
    watched: list[Watched] = []
    for line in sys.stdin.buffer:
        if line.strip() == STOPPED:
            return
        pid, name = line.decode().rstrip("\n").split(" ", 1)
        watched = [child for child in watched if _running(child, wait=0)]  # restarted ones
        with suppress(ProcessLookupError):  # exited already: nothing to stop
            watched.append(Watched(int(pid), name, os.pidfd_open(int(pid))))
    deadline = time.monotonic() + grace
    running = [child for child in watched if _running(child, deadline - time.monotonic())]
    for child in running:
        _kill(child)
        print(
            f"delaysvc: {child.name} (pid {child.pid}) still ran {grace:g} s after its "
            "supervisor died: killed",
            file=sys.stderr,
            flush=True,
        )


def _running(child: Watched, wait: float) -> bool:
    """Whether the child still runs after at most `wait` seconds of waiting for its exit."""
    readable, _, _ = select.select([child.handle], [], [], max(0.0, wait))
    if readable:
        os.close(child.handle)
    return not readable


def _kill(child: Watched) -> None:
    """The child (still the process of that pid: its pidfd is open), as `stop_all` kills one
    past its grace; its own children die with it as they die with it there (Celery's pool and
    gunicorn's workers have the kernel's parent-death signal). Not its process group: the
    embedded database's keeper may have started the server in its own."""
    with suppress(ProcessLookupError):
        signal.pidfd_send_signal(child.handle, signal.SIGKILL)


if __name__ == "__main__":
    main(float(sys.argv[1]))
