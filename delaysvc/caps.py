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
from typing import Any

from delaysvc import store
from delaysvc.errors import BacklogFull
from delaysvc.schema import WAITING
from delaysvc.settings import BacklogCap

log = logging.getLogger(__name__)


def _counts(cap: BacklogCap, topic: str, lane: int) -> bool:
    """A message of `topic` waiting in `lane` is one of the cap's backlog."""
    if cap.scope == "level":
        return lane == int(cap.target)
    return topic == cap.target and lane >= 0


def _net(cap: BacklogCap, adding: Sequence[store.NewMessage], leaving: Sequence[Any]) -> int:
    """What a write adds to the cap's backlog: the messages it stores, less the waiting ones it
    takes out (a replaced message)."""
    added = sum(1 for m in adding if _counts(cap, m.topic, m.lane))
    return added - sum(1 for r in leaving if r.status in WAITING and _counts(cap, r.topic, r.lane))


def _covering(caps: Sequence[BacklogCap], messages: Sequence[store.NewMessage]) -> list[BacklogCap]:
    found = {cap for cap in caps for m in messages if _counts(cap, m.topic, m.lane)}
    # a fixed order, so two transactions never wait on each other's cap locks
    return sorted(found, key=lambda cap: (cap.scope, cap.target))


def _adding(
    conn: store.Statements, messages: Sequence[store.NewMessage], leaving: Sequence[Any]
) -> list[store.NewMessage]:
    """The messages an insert will store: not those whose key an unfinished message holds
    (locked until the transaction ends, so it keeps holding it) unless that message is leaving,
    nor a key's repeats in the batch."""
    held = store.lock_key_holders(conn, [(m.topic, m.key) for m in messages])
    gone = {row.id for row in leaving}
    taken = {pair for pair, row in held.items() if row.id not in gone}
    adding = []
    for m in messages:
        if m.key is not None:
            if (m.topic, m.key) in taken:
                continue
            taken.add((m.topic, m.key))
        adding.append(m)
    return adding


def _pending(conn: store.Statements, cap: BacklogCap, up_to: int) -> int:
    """Waiting messages under the cap: exact for a level, counted up to `up_to` for a topic."""
    if cap.scope == "level":
        return store.lane_pending(conn, int(cap.target))
    return store.topic_pending(conn, cap.target, up_to)


def before_insert(
    conn: store.Statements,
    caps: Sequence[BacklogCap],
    messages: Sequence[store.NewMessage],
    leaving: Sequence[Any] = (),
) -> None:
    """Lock every cap these messages touch; refuse them if a `reject` cap would overflow.
    Only what adds to a backlog counts: a message whose key is held already stores nothing,
    and `leaving` (rows as `store.MESSAGE_STATE` reads them: a message about to be replaced)
    takes its place."""
    covering = _covering(caps, messages)
    for cap in covering:
        store.lock_cap(conn, f"{cap.scope}:{cap.target}")
    rejecting = [cap for cap in covering if cap.policy == "reject"]
    if not rejecting:
        return
    adding = _adding(conn, messages, leaving)
    for cap in rejecting:
        incoming = _net(cap, adding, leaving)
        if incoming <= 0:
            continue
        pending = _pending(conn, cap, cap.limit + 1)
        if pending + incoming > cap.limit:
            raise BacklogFull(
                f"{cap.scope} {cap.target} holds {pending} waiting messages and its cap is "
                f"{cap.limit} (DELAYSVC_BACKLOG_CAPS); {incoming} more refused, retry later"
            )


def after_insert(
    conn: store.Statements,
    caps: Sequence[BacklogCap],
    created: Sequence[store.NewMessage],
    leaving: Sequence[Any] = (),
) -> int:
    """Deliver the oldest waiting messages beyond each `deliver-early` cap the `created`
    messages (those the insert stored) added to, net of `leaving`. -> how many."""
    early: Counter[str] = Counter()
    for cap in _covering(caps, created):
        incoming = _net(cap, created, leaving)
        if cap.policy != "deliver-early" or incoming <= 0:
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
