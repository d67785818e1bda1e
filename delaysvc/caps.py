"""Bounded backlogs: RabbitMQ's x-max-length recipe, done without loss.

A cap limits the waiting messages of one delay level (`level:16=100000:reject`) or of one topic
(`topic:sms.send=5000:deliver-early`). Sends to a capped level or topic are serialised by an
advisory lock held until their transaction ends; then

- `reject`: a send that would take the backlog over the cap fails with `BacklogFull` (HTTP 429)
  before anything is written, so the caller's transaction stays clean;
- `deliver-early`: the send is stored, and the oldest waiting messages beyond the cap are
  delivered now (moved to their topic queues, counted in `schedule_offset.early_total`), as
  RabbitMQ dead-letters a full queue's head — but nothing is dropped.

Counts are exact: a level cap reads the level's `lane_count` deltas (a few thousand rows at
most between two folds), a topic cap scans at most the cap's worth of its index on every send
to that topic.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from delaysvc import store
from delaysvc.errors import BacklogFull
from delaysvc.settings import BacklogCap

log = logging.getLogger(__name__)


def _incoming(cap: BacklogCap, messages: Sequence[store.NewMessage]) -> int:
    if cap.scope == "level":
        return sum(1 for m in messages if m.lane == int(cap.target))
    return sum(1 for m in messages if m.topic == cap.target and m.lane >= 0)


def _relevant(
    caps: Sequence[BacklogCap], messages: Sequence[store.NewMessage]
) -> list[tuple[BacklogCap, int]]:
    found = [(cap, _incoming(cap, messages)) for cap in caps]
    # a fixed order, so two transactions never wait on each other's cap locks
    return sorted(((c, n) for c, n in found if n), key=lambda cn: (cn[0].scope, cn[0].target))


def _pending(conn: store.Statements, cap: BacklogCap, up_to: int) -> int:
    """Waiting messages under the cap: exact for a level, counted up to `up_to` for a topic."""
    if cap.scope == "level":
        return store.lane_pending(conn, int(cap.target))
    return store.topic_pending(conn, cap.target, up_to)


def before_insert(
    conn: store.Statements, caps: Sequence[BacklogCap], messages: Sequence[store.NewMessage]
) -> None:
    """Lock every cap these messages touch; refuse them if a `reject` cap would overflow."""
    for cap, incoming in _relevant(caps, messages):
        store.lock_cap(conn, f"{cap.scope}:{cap.target}")
        if cap.policy != "reject":
            continue
        pending = _pending(conn, cap, cap.limit + 1)
        if pending + incoming > cap.limit:
            raise BacklogFull(
                f"{cap.scope} {cap.target} holds {pending} waiting messages and its cap is "
                f"{cap.limit} (DELAYSVC_BACKLOG_CAPS); {incoming} more refused, retry later"
            )


def after_insert(
    conn: store.Statements, caps: Sequence[BacklogCap], messages: Sequence[store.NewMessage]
) -> int:
    """Deliver the oldest waiting messages beyond each `deliver-early` cap. -> how many."""
    early: Counter[str] = Counter()
    for cap, incoming in _relevant(caps, messages):
        if cap.policy != "deliver-early":
            continue
        overflow = _pending(conn, cap, cap.limit + incoming + 1) - cap.limit
        if overflow <= 0:
            continue
        if cap.scope == "level":
            ids = store.oldest_waiting_in_level(conn, int(cap.target), overflow)
        else:
            ids = store.oldest_waiting_of_topic(conn, cap.target, overflow)
        early[f"{cap.scope}:{cap.target}"] += store.deliver_now(conn, ids)
    for target, count in early.items():
        log.warning("backlog.delivered_early", extra={"cap": target, "count": count})
    return sum(early.values())
