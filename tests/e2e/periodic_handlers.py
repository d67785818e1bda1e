"""A schedule declared in code for the periodic end-to-end test (a handler module of its own:
the other end-to-end tests count every message they see)."""

from delaysvc import handler, periodic
from tests.e2e.handlers import _record


@periodic("every 1s", topic="e2e.tick", body={"from": "code"})
@handler("e2e.tick")
def tick(message):  # type: ignore[no-untyped-def]
    _record(message.id, message.attempts, message.properties["tick"])
