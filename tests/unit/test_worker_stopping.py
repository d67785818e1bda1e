"""A worker's stop, asked from inside its SIGTERM handler (`delaysvc.tasks.app.Stopping`): a
second SIGTERM runs the handler again in the same thread while the first is inside
`Event.set`; it must return, not wait on the lock its own thread holds."""

from __future__ import annotations

import threading

import pytest

from delaysvc.tasks import delivery, periodic
from delaysvc.tasks.app import Stopping


class _InterruptedEvent:
    """An Event whose `set` holds a lock, as `threading.Event.set` holds its Condition's, and
    is interrupted there by the next signal's handler (`interrupt`), in the same thread."""

    def __init__(self, interrupt: list[object]) -> None:
        self.lock = threading.Lock()
        self.interrupt = interrupt
        self.sets = 0

    def set(self) -> None:
        if not self.lock.acquire(timeout=2):
            raise AssertionError("the handler waited on the lock its own thread holds")
        try:
            self.sets += 1
            if self.sets == 1:
                for handler in self.interrupt:  # the next SIGTERMs arrive here
                    handler()  # type: ignore[operator]
        finally:
            self.lock.release()


@pytest.mark.parametrize(
    ("module", "receiver"),
    [(delivery, "_stop_lanes"), (periodic, "_stop_declaring")],
    ids=["delivery", "periodic"],
)
def test_a_second_sigterm_inside_the_first_ones_stop_returns_and_the_stop_holds(
    monkeypatch: pytest.MonkeyPatch, module: object, receiver: str
) -> None:
    stopping = Stopping()
    interrupted = _InterruptedEvent([])
    stopping.event = interrupted  # type: ignore[assignment]
    monkeypatch.setattr(module, "_stopping", stopping)
    handler = getattr(module, receiver)
    interrupted.interrupt.extend([handler, handler])
    handler()
    assert interrupted.sets == 1


def test_a_stop_sets_its_event_once_asked() -> None:
    stopping = Stopping()
    assert not stopping.event.is_set()
    stopping.ask()
    stopping.ask()
    assert stopping.event.is_set()
