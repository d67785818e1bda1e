"""Bounded backlogs: RabbitMQ's x-max-length recipe, done without loss.

A cap limits the waiting messages of one delay level (`level:16=100000:reject`) or of one topic
(`topic:sms.send=5000:deliver-early`). Caps live in the database (`backlog_cap`), set by the
CLI (`delaysvc caps set`), the API and the dashboard, so every producer keeps to them whatever
its own settings: a single send (`send_one`, `store.producing.SEND_ONE`) stores nothing when a
cap covers its topic or level (one probe of the caps' primary key), and the producer stores it
again here, under the cap. `DELAYSVC_BACKLOG_CAPS` sets caps at start-up (`apply_configured`: by
`delaysvc migrate` and each delivery worker's start); a producer that has it keeps to those
at once too, where the database has no cap for the same level or topic.

Sends to a capped level or topic are serialised by an advisory lock held until their
transaction ends; then

- `reject`: a send that would take the backlog over the cap fails with `BacklogFull` (HTTP 429)
  before anything is written, so the caller's transaction stays clean;
- `deliver-early`: the send is stored, and the oldest waiting messages beyond the cap are
  delivered now (moved to their topic queues, counted in `schedule_offset.early_total`), as
  RabbitMQ dead-letters a full queue's head — but nothing is dropped.

A cap counts only what a send adds to its backlog: a send whose key an unfinished message
holds stores nothing (it returns that message), a key repeated in a batch is stored once, and
a replace or debounce takes its holder out as it puts the new message in. Such a send is never
refused and delivers nothing early while its holder waits in the same backlog (`_net`); a
holder already due, or in another level, leaves no room, and the send counts as a new one.

Counts are exact: a level cap reads the level's `lane_count` deltas (a few thousand rows at
most between two folds), a topic cap scans at most the cap's worth of the capped topics' index
on every send to that topic (`delaysvc.maintenance.caps_index`, which builds it when the caps
change; until then the same count scans the commit log).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from sqlalchemy import Connection, Engine

from delaysvc import store
from delaysvc.config.levels import MAX_LEVELS
from delaysvc.config.settings import BacklogCap, CapPolicy
from delaysvc.config.validation import MAX_WAITING, ascii_digits, validate_topic
from delaysvc.errors import BacklogFull, ValidationError, shown
from delaysvc.schema.tables import WAITING

log = logging.getLogger(__name__)


class Adding(Protocol):
    """What a cap reads of a message a write adds (a `store.NewMessage`, a batch's item)."""

    @property
    def topic(self) -> str: ...

    @property
    def lane(self) -> int: ...

    @property
    def key(self) -> str | None: ...


def _counts(cap: BacklogCap, topic: str, lane: int) -> bool:
    """A message of `topic` waiting in `lane` is one of the cap's backlog."""
    if cap.scope == "level":
        return lane == int(cap.target)
    return topic == cap.target and lane >= 0


def covers(cap: BacklogCap, message: Adding) -> bool:
    """The message, once stored, is one of the cap's backlog."""
    return _counts(cap, message.topic, message.lane)


def _net(cap: BacklogCap, adding: Sequence[Adding], leaving: Sequence[Any]) -> int:
    """What a write adds to the cap's backlog: the messages it stores, less the waiting ones it
    takes out (a replaced message)."""
    added = sum(1 for m in adding if _counts(cap, m.topic, m.lane))
    return added - sum(1 for r in leaving if r.status in WAITING and _counts(cap, r.topic, r.lane))


def covering(
    conn: store.Statements,
    configured: Sequence[BacklogCap],
    messages: Sequence[Adding],
) -> list[BacklogCap]:
    """The caps these messages' topics and levels have: the database's (one statement), and
    those `configured` (a producer's DELAYSVC_BACKLOG_CAPS) for targets the database has no
    cap of. In a fixed order, so two transactions never wait on each other's cap locks."""
    waiting = [m for m in messages if m.lane >= 0]
    if not waiting:
        return []
    rows = store.caps_covering(
        conn, [m.topic for m in waiting], [m.lane for m in waiting if m.lane > 0]
    )
    found = {(row.scope, row.target): _cap(row) for row in rows}
    for cap in configured:
        target = str(int(cap.target)) if cap.scope == "level" else cap.target
        found.setdefault((cap.scope, target), cap)
    touched = (cap for cap in found.values() if any(_counts(cap, m.topic, m.lane) for m in waiting))
    return sorted(touched, key=lambda cap: (cap.scope, cap.target))


def _cap(row: Any) -> BacklogCap:
    return BacklogCap(row.scope, row.target, row.max_waiting, row.policy)


def _adding(
    conn: store.Statements, messages: Sequence[Adding], leaving: Sequence[Any]
) -> list[Adding]:
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
    capped: Sequence[BacklogCap],
    messages: Sequence[Adding],
    leaving: Sequence[Any] = (),
) -> None:
    """Lock the caps `covering` found for these messages; refuse them if a `reject` cap would
    overflow. Only what adds to a backlog counts: a message whose key is held already stores
    nothing, and `leaving` (rows as `store.MESSAGE_STATE` reads them: a message about to be
    replaced) takes its place."""
    for cap in capped:
        store.lock_cap(conn, f"{cap.scope}:{cap.target}")
    rejecting = [cap for cap in capped if cap.policy == "reject"]
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
                f"{cap.limit}; {incoming} more refused, retry later"
            )


CATCH_UP = 10_000
"""How far beyond its cap and the send's own messages a send counts a topic's backlog, to
deliver early: a level's count is exact, a topic's is bounded (it reads the waiting rows)."""


def after_insert(
    conn: store.Statements,
    capped: Sequence[BacklogCap],
    created: Sequence[Adding],
    leaving: Sequence[Any] = (),
) -> int:
    """Deliver the oldest waiting messages beyond each `deliver-early` cap the `created`
    messages (those the insert stored) added to, net of `leaving`. -> how many."""
    early: Counter[str] = Counter()
    for cap in capped:
        incoming = _net(cap, created, leaving)
        if cap.policy != "deliver-early" or incoming <= 0:
            continue
        # a topic over its cap by more than this send (the cap was lowered, retries came
        # back) is brought under it up to CATCH_UP messages at a send, not one more each time
        overflow = _pending(conn, cap, cap.limit + incoming + CATCH_UP) - cap.limit
        if overflow <= 0:
            continue
        if cap.scope == "level":
            ids = store.oldest_waiting_in_level(conn, int(cap.target), overflow)
        else:
            ids = store.oldest_waiting_of_topic(conn, cap.target, overflow)
        moved = store.deliver_now(conn, ids)
        if moved is None:
            log.warning(
                "backlog.early_delivery_failed",
                extra={
                    "cap": f"{cap.scope}:{cap.target}",
                    "hint": "its oldest waiting message cannot be moved (its lane is marked "
                    "stuck: delaysvc stats, skip-head); the send is stored over the cap",
                },
            )
            continue
        early[f"{cap.scope}:{cap.target}"] += moved
    for target, count in early.items():
        log.warning("backlog.delivered_early", extra={"cap": target, "count": count})
    return sum(early.values())


# ---------------------------------------------------------------- setting caps

POLICIES: tuple[CapPolicy, ...] = ("reject", "deliver-early")


def check_target(scope: object, target: object) -> tuple[str, str]:
    """(`level`, its number as text) or (`topic`, the topic), validated."""
    if scope == "topic":
        return "topic", validate_topic(target)
    if scope == "level":
        if isinstance(target, int) and not isinstance(target, bool):
            target = str(target)
        if (
            isinstance(target, str)
            and ascii_digits(target)
            and len(target) <= 4  # int() reads at most 4,300 digits
            and 1 <= int(target) <= MAX_LEVELS
        ):
            return "level", str(int(target))
        raise ValidationError(
            "level", f"{shown(target)}: a level number from 1 to {MAX_LEVELS}, in the digits 0-9"
        )
    raise ValidationError("scope", f"{shown(scope)}: use level or topic")


def parse_target(text: str) -> tuple[str, str]:
    """`level:16` or `topic:sms.send` -> (scope, target), validated."""
    scope, sep, target = text.partition(":")
    if not sep:
        raise ValidationError("target", f"{shown(text)}: use level:N or topic:NAME")
    return check_target(scope, target)


def check_max_waiting(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WAITING:
        raise ValidationError(
            "max_waiting", f"{shown(value)}: a whole number from 1 to {MAX_WAITING}"
        )
    return value


def check_policy(value: object) -> CapPolicy:
    if value not in POLICIES:
        raise ValidationError("policy", f"{shown(value)}: use reject or deliver-early")
    return value


def set_cap(
    engine: Engine,
    scope: str,
    target: object,
    max_waiting: object = None,
    policy: object = None,
) -> BacklogCap | None:
    """Cap a level or a topic at `max_waiting` waiting messages (`policy` reject, the
    default, or deliver-early); None lifts the cap. Every producer keeps to it from its next
    send on. -> the cap, or None (lifted)."""
    scope, target = check_target(scope, target)
    if max_waiting is None:
        if policy is not None:
            raise ValidationError("max_waiting", "is required with a policy")
        with engine.begin() as conn:
            _refuse_a_missing_level(conn, scope, target)
            store.lift_backlog_cap(conn, scope, target)
        return None
    limit = check_max_waiting(max_waiting)
    chosen = check_policy("reject" if policy is None else policy)
    with engine.begin() as conn:
        _refuse_a_missing_level(conn, scope, target)
        return _cap(store.set_backlog_cap(conn, scope, target, limit, chosen))


def _refuse_a_missing_level(conn: Connection, scope: str, target: str) -> None:
    """A level the database does not have has no cap to set or to lift."""
    if scope == "level" and int(target) not in store.stored_levels(conn):
        raise ValidationError("level", f"level {target} does not exist in the database")


def all_caps(engine: Engine) -> list[BacklogCap]:
    with engine.connect() as conn:
        return [_cap(row) for row in store.backlog_caps(conn)]


def apply_configured(engine: Engine, configured: Sequence[BacklogCap]) -> None:
    """Store the caps DELAYSVC_BACKLOG_CAPS names (`delaysvc migrate`, a delivery worker's
    start): a level or topic named there gets its cap again at every start; others keep what
    the CLI, the API or the dashboard set."""
    with engine.begin() as conn:
        for cap in configured:
            target = str(int(cap.target)) if cap.scope == "level" else cap.target
            store.set_backlog_cap(conn, cap.scope, target, cap.limit, cap.policy)
