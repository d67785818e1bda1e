"""delaysvc's own entry in the peers suite: a handler module (`DELAYSVC_HANDLERS`) for the
workers the bench starts, recording each job like the other peers' handlers do."""

from __future__ import annotations

from delaysvc import handler
from delaysvc.bench.record import record
from delaysvc.consumption import Job

TOPIC = "bench.peer"


@handler(TOPIC)
def received(message: Job) -> None:
    record(int(message.body["i"]), float(message.body["due"]))
