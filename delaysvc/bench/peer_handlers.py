"""delaysvc's own entry in the peers suite: a handler module (`DELAYSVC_HANDLERS`) for the
workers the bench starts, recording each job like the other peers' handlers do."""

from __future__ import annotations

from delaysvc import handler
from delaysvc.bench.record import record
from delaysvc.worker.consumer import Job

TOPIC = "bench.peer"


@handler(TOPIC)
def received(message: Job) -> None:
    record(int(message.body["i"]), float(message.body["due"]))


SOAK_TOPIC = "bench.soak"


@handler(SOAK_TOPIC)
def soaked(message: Job) -> None:
    """The soak suite's no-op: it counts jobs from the database, not from a file."""
    return None
