"""The dashboard's timeline of a message shows its events in time order, also where one
statement stamped two of them a moment apart in the other order."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from delaysvc.producer.message import Message
from delaysvc.web.ui_format import timeline


def test_a_death_stamped_before_its_last_error_is_shown_after_it() -> None:
    """A handler's last failure and its death are one statement: `finished_at` and the error
    entry's `at` are two clock readings in it, the death's sometimes the earlier (3 ms apart
    on a loaded machine: CI's dashboard test saw the times out of order). The death was sorted
    after the error but shown at its own, earlier time."""
    stored = datetime(2026, 12, 7, 1, 0, tzinfo=UTC)
    failed = stored + timedelta(milliseconds=20)
    message = Message(
        id=1,
        topic="t",
        key=None,
        status="dead",
        delay_level=None,
        deliver_at=stored,
        stored_at=stored,
        delivered_at=stored,
        started_at=stored + timedelta(milliseconds=5),
        finished_at=failed - timedelta(milliseconds=3),
        attempts=1,
        duration_ms=12,
        errors=[{"attempt": 1, "at": failed.isoformat(), "error": "ValueError: no stock"}],
    )
    events = timeline(message)
    assert [e["label"] for e in events][-2:] == ["attempt 1 failed", "dead"]
    times = [e["at"] for e in events]
    assert times == sorted(times)
