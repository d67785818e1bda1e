"""Another team's handler module for the periodic end-to-end tests: a schedule of its own,
declared by workers that do not import `tests.e2e.periodic_handlers`."""

from delaysvc import handler, periodic
from tests.e2e.handlers import _record


@periodic("every 1s", topic="e2e.tock", body={"from": "team b"})
@handler("e2e.tock")
def tock(message):  # type: ignore[no-untyped-def]
    _record(message.id, message.attempts, message.properties["tick"])
