"""The chaos checker (`delaysvc.bench.chaos_check`) finds what it is there to find: each
property on a small made-up history, once holding and once broken, naming the message. (The
history-checked run itself is tests/faults/test_history_checked.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from delaysvc.bench import chaos_check
from delaysvc.bench.chaos_history import Fault, Final, History, Op, Run

T = 1_000_000.0  # the history's epoch seconds start here


def _send(index: int, message_id: int, at: float, **args: object) -> list[Op]:
    asked = {"topic": "chaos.ok", **args}
    result = {"id": message_id, "created": True, "stored_at": at, "deliver_at": at + 1.0}
    if "replaced_id" in args:
        result["replaced_id"] = asked.pop("replaced_id")
    return [
        Op(0, index, "send", "invoke", at, asked),
        Op(0, index, "send", "ok", at + 0.01, asked, result),
    ]


def _final(message_id: int, at: float, **fields: object) -> Final:
    base = Final(
        message_id, "chaos.ok", None, "succeeded", at, at + 1.0, at + 1.0, at + 3.0, 1, None, None
    )
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def _run(message_id: int, start: float, **fields: object) -> Run:
    base = Run(message_id, 1, start - 0.5, start, 100, 100, start + 0.1, "ok")
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def _good() -> History:
    """Two messages at level 1 from one client, run once each, in order."""
    return History(
        ops=_send(1, 1, T, delay_level=1) + _send(2, 2, T + 1, delay_level=1),
        faults=[],
        runs=[_run(1, T + 1.2), _run(2, T + 2.2)],
        finals={1: _final(1, T), 2: _final(2, T + 1)},
        check_summary="delaysvc check: ok",
    )


def _violated(history: History) -> dict[str, list[int | None]]:
    return {
        name: [v.message_id for v in found]
        for name, found in chaos_check.check(history).items()
        if found
    }


def test_a_clean_history_holds_and_was_looked_at() -> None:
    history = _good()
    assert _violated(history) == {}
    ix = chaos_check.Index(history)
    assert {name: count(ix) for name, count in chaos_check.COVERAGE.items()} == {
        "no_lost_send": 2,
        "not_early": 2,
        "not_after_cancel": 0,
        "one_holder_per_key": 0,
        "reruns_explained": 0,
        "level_order": 1,
        "delaysvc_check": 1,
    }


@pytest.mark.parametrize(
    ("breaking", "expected"),
    [
        ("lost", {"no_lost_send": [2]}),
        ("unfinished", {"no_lost_send": [2]}),
        ("cancelled_unexplained", {"no_lost_send": [2]}),
        ("early", {"not_early": [2, 2]}),
        ("rerun", {"reruns_explained": [2]}),
        ("out_of_order", {"level_order": [2]}),
        ("check", {"delaysvc_check": [2]}),
    ],
)
def test_each_property_names_the_message_that_broke_it(
    breaking: str, expected: dict[str, list[int]]
) -> None:
    h = _good()
    if breaking == "lost":
        del h.finals[2]
        h.runs = h.runs[:1]
    elif breaking == "unfinished":
        h.finals[2] = _final(2, T + 1, status="ready", finished_at=None)
    elif breaking == "cancelled_unexplained":
        h.finals[2] = _final(2, T + 1, status="cancelled")
        h.runs = h.runs[:1]
    elif breaking == "early":
        h.runs[1] = _run(2, T + 1.5, deliver_ts=T + 2.0)
    elif breaking == "rerun":
        h.runs.append(_run(2, T + 5))
    elif breaking == "out_of_order":
        h.finals[2] = _final(2, T + 1, delivered_at=T + 0.5)
    elif breaking == "check":
        h.check_lines = ["message 2: in two places"]
    assert _violated(h) == expected


def test_a_rerun_after_its_worker_was_killed_is_explained_and_one_without_is_not() -> None:
    h = _good()
    h.runs.append(_run(2, T + 5, pgid=200))
    h.faults = [Fault("kill_consume", T + 3, T + 3.1, pgids=(200,))]
    assert _violated(h) == {"reruns_explained": [2]}  # another process group was killed
    h.faults = [Fault("kill_consume", T + 3, T + 3.1, pgids=(100,))]
    assert _violated(h) == {}


def test_a_run_after_the_acknowledged_cancel_is_found() -> None:
    h = _good()
    h.ops += [
        Op(0, 3, "cancel", "invoke", T + 1.1, {"id": 2}),
        Op(0, 3, "cancel", "ok", T + 1.2, {"id": 2}, {"id": 2, "finished_at": T + 1.15}),
    ]
    h.finals[2] = _final(2, T + 1, status="cancelled", finished_at=T + 1.15, delivered_at=None)
    h.runs = h.runs[:1]
    assert _violated(h) == {}
    h.runs.append(_run(2, T + 2.2))
    assert _violated(h) == {"not_after_cancel": [2]}


def test_two_unfinished_holders_of_a_key_at_once_are_found() -> None:
    h = _good()
    h.finals[1] = _final(1, T, key="k")
    h.finals[2] = _final(2, T + 1, key="k")  # stored at T + 1, while 1 ran until T + 1.3
    assert _violated(h) == {"one_holder_per_key": [2]}
    h.runs[0] = _run(1, T + 0.8)  # 1 ended at T + 0.9: the key was free
    h.finals[1] = _final(1, T, key="k", deliver_ts=T + 0.3)
    assert "one_holder_per_key" not in _violated(h)


def test_a_retried_message_is_not_compared_for_level_order() -> None:
    """Found by the 30-minute run: a message whose handler failed (its own write cut off by a
    PostgreSQL restart) was retried, and its delivered_at became the retry's, minutes after the
    message sent behind it: not a move out of order. Only messages moved once are compared."""
    h = _good()
    h.finals[1] = _final(1, T, delivered_at=T + 300.0, attempts=2)
    assert _violated(h) == {}
    assert chaos_check.COVERAGE["level_order"](chaos_check.Index(h)) == 0


def test_a_retry_due_before_its_levels_delay_after_the_failure_is_found() -> None:
    """`not_early` compared a run with the due time its claim gave, the engine's own: retries
    due at half their delay passed (the mutation review). A retry is due no sooner than its
    failure's end plus the least its retry level waits (level 3: 3 s in the base levels)."""
    h = _good()
    failed = _run(2, T + 2.2, outcome="fail")  # ends at T + 2.3
    h.runs[1] = failed
    h.runs.append(_run(2, T + 5.4, attempt=2, deliver_ts=T + 5.3))
    assert _violated(h) == {}
    h.runs[2] = _run(2, T + 3.9, attempt=2, deliver_ts=T + 3.8)  # 1.5 s after the failure
    assert _violated(h) == {"not_early": [2]}
    # a level change to longer delays leaves the base levels' 3 s the least wait
    h.faults = [
        Fault("level_change", T, T + 0.1, detail="'1s 2s 3s 5s 8s' -> '1s 2s 4s 5s 8s 10s'")
    ]
    assert _violated(h) == {"not_early": [2]}
    # its outcome lost to a restart, the run is taken again after its lease, at once
    h.faults = [Fault("pg_restart", T + 2.25, T + 2.5)]
    assert _violated(h) == {}
