"""The checker of a `chaos` history: one small function per property, each returning the
violations it found (message id, what). `check` runs them all.

The properties, as defined here (DESIGN.md's "Invariants" and "Consumption"):

- `no_lost_send`: every send acknowledged as a new message (ok, created) ends, after the run
  has drained, succeeded (with a successful run recorded), dead (with a dead letter giving a
  reason), or cancelled by something acknowledged or possibly done: a cancel of it (ok or
  info), a send that replaced or debounced it (ok, naming it in `replaced_id`), or a send of
  unknown outcome whose message (naming it in `last_error`, same topic and key) was never
  acknowledged. Every message stored (acknowledged or not) is finished at the end.
- `not_early`: no run starts (database clock) before the due time its claim gave it, the
  first run of an acknowledged message not before the due time acknowledged to the producer,
  and a retry not due before its failure's end plus the least its retry level waits under any
  of the run's level configurations (the one it started with and each a level change left),
  unless a fault explains a run taken again at once (a lost outcome). The due time a claim
  gives is the engine's own: without this, retries due at half their delay passed.
- `not_after_cancel`: no run of a message starts after its acknowledged cancel (or the
  acknowledged send that replaced it) finished it, by the database's finished_at.
- `one_holder_per_key`: the times two messages of one topic and key were surely unfinished
  never overlap. Surely unfinished: from stored_at to its end, where the end is the end record
  of the run that finished it (succeeded, or dying), or the cancel's finished_at; a death
  followed by a redrive reopens it at the redrive's due time. And at the end, no key is held
  by two unfinished messages.
- `reruns_explained`: a run following another run of the same message is expected when the
  previous one ended in a failure or a death and this one was due after that (a retry, a
  redrive). Any other is a rerun and needs a fault between the first run's start and its own
  start: a kill (or a warm stop escalated to a kill) of the first run's process group, or a
  PostgreSQL restart (its lease expired meanwhile, or its outcome was lost).
- `level_order`: for one client, sends at one level with the same acknowledged delay, one
  acknowledged before the next was asked, with no level change in between, are moved into
  their topic queues in send order (delivered_at, the move's clock, never decreasing). Only
  messages moved once and never retried or redriven count (a retry's move rewrites
  delivered_at); start order is not checked: two consumers claim with SKIP LOCKED, and the
  second may start a later message first.
- `delaysvc_check`: `delaysvc check` finds nothing at the end.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from delaysvc.bench.chaos_faults import BASE_LEVELS
from delaysvc.bench.chaos_history import Fault, Final, History, Op, Run, Violation
from delaysvc.config.levels import DelayLevels

_REPLACED_BY = re.compile(r"replaced by message (\d+)")
_LEVELS_LEFT = re.compile(r"-> '([^']*)'$")  # a level change's detail: 'before' -> 'after'


@dataclass(frozen=True)
class Pair:
    """An op's invoke with its completion (None: the client never completed it: info)."""

    invoke: Op
    done: Op | None

    @property
    def phase(self) -> str:
        return self.done.phase if self.done is not None else "info"

    @property
    def result(self) -> dict[str, Any]:
        return self.done.result if self.done is not None else {}

    @property
    def end(self) -> float:
        return self.done.at if self.done is not None else float("inf")


@dataclass
class Index:
    """The history looked up the ways the properties need it."""

    history: History
    pairs: list[Pair] = field(default_factory=list)
    created: dict[int, Pair] = field(default_factory=dict)  # acked new message id -> its send
    runs: dict[int, list[Run]] = field(default_factory=dict)  # by message, by start
    cancel_ids: set[int] = field(default_factory=set)  # named by a cancel, ok or info
    key_cancels_unknown: dict[tuple[str, str], list[Pair]] = field(default_factory=dict)
    replaced_ids: set[int] = field(default_factory=set)  # named by an ok send's replaced_id
    redriven_at: dict[int, list[float]] = field(default_factory=dict)  # ok redrives' due times
    level_configs: list[DelayLevels] = field(default_factory=list)  # the first, each change's

    def __post_init__(self) -> None:
        invokes: dict[tuple[int, int], Op] = {}
        completions: dict[tuple[int, int], Op] = {}
        for op in self.history.ops:
            (invokes if op.phase == "invoke" else completions)[(op.process, op.index)] = op
        self.pairs = [Pair(op, completions.get(k)) for k, op in sorted(invokes.items())]
        for pair in self.pairs:
            if pair.invoke.kind == "send" and pair.phase == "ok" and pair.result.get("created"):
                self.created[pair.result["id"]] = pair
        runs: dict[int, list[Run]] = defaultdict(list)
        for run in self.history.runs:
            runs[run.message_id].append(run)
        self.runs = {m: sorted(rs, key=lambda r: r.start) for m, rs in runs.items()}
        key_cancels: dict[tuple[str, str], list[Pair]] = defaultdict(list)
        for pair in self.of("cancel", "ok", "info"):
            named = pair.result.get("id", pair.invoke.args.get("id"))
            if named is not None:
                self.cancel_ids.add(named)
            elif pair.phase == "info":
                key_cancels[(pair.invoke.args["topic"], pair.invoke.args["key"])].append(pair)
        self.key_cancels_unknown = dict(key_cancels)
        self.replaced_ids = {
            p.result["replaced_id"]
            for p in self.of("send", "ok")
            if p.result.get("replaced_id") is not None
        }
        redriven: dict[int, list[float]] = defaultdict(list)
        for pair in self.of("redrive", "ok"):
            redriven[pair.result["id"]].append(pair.result["deliver_at"])
        self.redriven_at = dict(redriven)
        configs = [BASE_LEVELS]
        for fault in self.history.faults:
            left = _LEVELS_LEFT.search(fault.detail)
            if fault.kind in ("level_change", "level_removal") and left:
                configs.append(left.group(1))
        self.level_configs = [DelayLevels.parse(config) for config in configs]

    def of(self, kind: str, *phases: str) -> list[Pair]:
        return [p for p in self.pairs if p.invoke.kind == kind and p.phase in phases]

    def least_retry_wait(self, failed_attempts: int) -> float:
        """The shortest a retry after `failed_attempts` failures waits (seconds), under any
        level configuration of the run: a worker's may lag the database's."""
        return min(
            levels.delay_ms(levels.retry_level(failed_attempts)) / 1000
            for levels in self.level_configs
        )


# ---------------------------------------------------------------- the properties


def no_lost_send(ix: Index) -> list[Violation]:
    name, found = "no_lost_send", []
    finals = ix.history.finals
    for message_id in sorted(ix.created):
        final = finals.get(message_id)
        if final is None:
            found.append(Violation(name, message_id, "acknowledged, not in the database"))
        elif final.status == "succeeded" and not any(
            r.outcome == "ok" for r in ix.runs.get(message_id, [])
        ):
            found.append(Violation(name, message_id, "succeeded without a successful run"))
        elif final.status == "dead" and not final.dead_reason:
            found.append(Violation(name, message_id, "dead without a dead letter's reason"))
        elif final.status == "cancelled" and not _cancel_explained(ix, final):
            found.append(
                Violation(name, message_id, f"cancelled, explained by no op ({final.last_error})")
            )
    for final in finals.values():
        if final.finished_at is None:
            found.append(Violation(name, final.id, f"still {final.status} at the end"))
    return found


def _cancel_explained(ix: Index, final: Final) -> bool:
    if final.id in ix.cancel_ids or final.id in ix.replaced_ids:
        return True
    for pair in ix.key_cancels_unknown.get((final.topic, final.key or ""), []):
        if final.finished_at is not None and pair.invoke.at <= final.finished_at <= pair.end:
            return True
    replaced = _REPLACED_BY.fullmatch(final.last_error or "")
    if replaced:
        by = ix.history.finals.get(int(replaced.group(1)))
        return (
            by is not None
            and by.id not in ix.created
            and (by.topic, by.key) == (final.topic, final.key)
        )
    return False


CLOCK_SLACK = 0.001  # both times are the database clock's; this is float rounding


def not_early(ix: Index) -> list[Violation]:
    name, found = "not_early", []
    for message_id, runs in ix.runs.items():
        for run in runs:
            if run.start < run.deliver_ts:
                found.append(
                    Violation(
                        name,
                        message_id,
                        f"attempt {run.attempt} started {run.deliver_ts - run.start:.3f}s "
                        "before the due time it was claimed with",
                    )
                )
        for failed, retry in itertools.pairwise(runs):
            if failed.outcome != "fail" or failed.end is None:
                continue
            if _fault_between(ix.history.faults, failed, retry) is not None:
                continue  # the failure's outcome may be lost: taken again after its lease
            least = failed.end + ix.least_retry_wait(failed.attempt)
            if retry.deliver_ts < least - CLOCK_SLACK:
                found.append(
                    Violation(
                        name,
                        message_id,
                        f"attempt {retry.attempt} was due {least - retry.deliver_ts:.3f}s before "
                        f"attempt {failed.attempt}'s failure plus its retry level's delay",
                    )
                )
        send = ix.created.get(message_id)
        if send is not None and runs and runs[0].start < send.result["deliver_at"]:
            found.append(
                Violation(
                    name,
                    message_id,
                    f"first run {send.result['deliver_at'] - runs[0].start:.3f}s before the "
                    "due time acknowledged to the producer",
                )
            )
    return found


def not_after_cancel(ix: Index) -> list[Violation]:
    name, found = "not_after_cancel", []
    cancelled: dict[int, str] = {}
    for pair in ix.of("cancel", "ok"):
        cancelled[pair.result["id"]] = f"cancel op {pair.invoke.process}/{pair.invoke.index}"
    for pair in ix.of("send", "ok"):
        if pair.result.get("replaced_id") is not None:
            by = f"replacing send {pair.invoke.process}/{pair.invoke.index}"
            cancelled[pair.result["replaced_id"]] = by
    for message_id, by in sorted(cancelled.items()):
        final = ix.history.finals.get(message_id)
        if final is None or final.finished_at is None:
            found.append(Violation(name, message_id, f"{by} acknowledged; not cancelled"))
            continue
        for run in ix.runs.get(message_id, []):
            if run.start > final.finished_at:
                found.append(
                    Violation(
                        name,
                        message_id,
                        f"attempt {run.attempt} started {run.start - final.finished_at:.3f}s "
                        f"after {by} finished it",
                    )
                )
    return found


def _held(ix: Index, final: Final) -> list[tuple[float, float]]:
    """The times `final` was surely unfinished (see the module's `one_holder_per_key`)."""
    runs = ix.runs.get(final.id, [])
    redrives = sorted(ix.redriven_at.get(final.id, []))
    spans: list[tuple[float, float]] = []
    opened: float | None = final.stored_at
    closed = final.stored_at
    for run in runs:
        if opened is None:  # dead: reopened by a redrive before this run, if any
            reopened = [t for t in redrives if closed < t <= run.start]
            if run.deliver_ts > closed:
                reopened.append(run.deliver_ts)
            opened = min(reopened, default=None)
        if opened is not None and run.outcome == "dead" and run.end is not None:
            spans.append((opened, run.end))
            opened, closed = None, run.end
    if opened is None:
        opened = min((t for t in redrives if t > closed), default=None)
    end = _end_of(final, runs)
    if opened is not None and end is not None and end > opened:
        spans.append((opened, end))
    return spans


def _end_of(final: Final, runs: list[Run]) -> float | None:
    if final.status == "cancelled":
        return final.finished_at
    ends = [r.end for r in runs if r.end is not None and r.outcome in ("ok", "dead")]
    return max(ends) if ends else None


def one_holder_per_key(ix: Index) -> list[Violation]:
    name, found = "one_holder_per_key", []
    by_key: dict[tuple[str, str], list[Final]] = defaultdict(list)
    for final in ix.history.finals.values():
        if final.key is not None:
            by_key[(final.topic, final.key)].append(final)
    for (topic, key), finals in sorted(by_key.items()):
        spans = sorted((s, e, f.id) for f in finals for s, e in _held(ix, f))
        for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
            if a != b and start_b < end_a:
                found.append(
                    Violation(
                        name,
                        b,
                        f"stored {end_a - start_b:.3f}s before message {a} (key {topic}/{key}) "
                        "surely finished",
                    )
                )
        unfinished = [f.id for f in finals if f.finished_at is None]
        if len(unfinished) > 1:
            found.append(
                Violation(name, unfinished[0], f"key {topic}/{key} held by {unfinished} at the end")
            )
    return found


def reruns_explained(ix: Index) -> list[Violation]:
    name, found = "reruns_explained", []
    for message_id, runs in sorted(ix.runs.items()):
        for first, again in itertools.pairwise(runs):
            if _due_again(first, again):
                continue  # a retry or a redrive
            if _fault_between(ix.history.faults, first, again) is None:
                ended = f"ended {first.outcome}" if first.outcome else "cut off"
                found.append(
                    Violation(
                        name,
                        message_id,
                        f"attempt {first.attempt} (pid {first.pid}, {ended}) ran again as "
                        f"attempt {again.attempt} {again.start - first.start:.3f}s later "
                        "with no crash in between",
                    )
                )
    return found


def _due_again(first: Run, again: Run) -> bool:
    """`again` is a retry or a redrive of `first`: it failed or died, and `again` was due
    after it ended."""
    return (
        first.outcome in ("fail", "dead") and first.end is not None and again.deliver_ts > first.end
    )


def _fault_between(faults: list[Fault], first: Run, again: Run) -> Fault | None:
    """A fault that explains `again`: PostgreSQL restarted, or `first`'s process group was
    killed, after `first` started and before `again` did."""
    for fault in faults:
        if not (first.start <= fault.end and fault.start <= again.start):
            continue
        if fault.kind == "pg_restart" or first.pgid in fault.pgids:
            return fault
    return None


def rerun_causes(ix: Index) -> dict[str, int]:
    """Reruns counted by what explains them (the report's figure)."""
    causes: dict[str, int] = defaultdict(int)
    for runs in ix.runs.values():
        for first, again in itertools.pairwise(runs):
            if _due_again(first, again):
                causes["retry or redrive"] += 1
                continue
            fault = _fault_between(ix.history.faults, first, again)
            causes[fault.kind if fault else "unexplained"] += 1
    return dict(causes)


def _level_pairs(ix: Index) -> list[tuple[Final, float, Final, float, Pair]]:
    """The pairs `level_order` compares: (earlier, when it was moved, later, when it was
    moved, the earlier's send)."""
    changes = [(f.start, f.end) for f in ix.history.faults if f.kind.startswith("level_")]
    redriven = {p.invoke.args.get("id") for p in ix.of("redrive", "ok", "info")}
    lanes: dict[tuple[int, int, float], list[Pair]] = defaultdict(list)
    for pair in sorted(ix.created.values(), key=lambda p: p.invoke.at):
        level = pair.invoke.args.get("delay_level")
        if level and pair.invoke.args.get("topic") in ("chaos.ok", "chaos.limited"):
            delay = round(pair.result["deliver_at"] - pair.result["stored_at"], 3)
            lanes[(pair.invoke.process, level, delay)].append(pair)
    compared = []
    for sends in lanes.values():
        for a, b in itertools.pairwise(sends):
            if a.end > b.invoke.at or any(s <= b.end and a.invoke.at <= e for s, e in changes):
                continue
            fa, fb = (ix.history.finals.get(p.result["id"]) for p in (a, b))
            if (
                fa is not None
                and fb is not None
                and not {fa.id, fb.id} & redriven
                and fa.attempts <= 1  # a retry's move overwrote delivered_at
                and fb.attempts <= 1
                and fa.delivered_at is not None
                and fb.delivered_at is not None
            ):
                compared.append((fa, fa.delivered_at, fb, fb.delivered_at, a))
    return compared


def level_order(ix: Index) -> list[Violation]:
    return [
        Violation(
            "level_order",
            fb.id,
            f"moved {moved_a - moved_b:.3f}s before message {fa.id}, sent before it by "
            f"client {a.invoke.process} at level {a.invoke.args['delay_level']}",
        )
        for fa, moved_a, fb, moved_b, a in _level_pairs(ix)
        if moved_b < moved_a
    ]


def delaysvc_check(ix: Index) -> list[Violation]:
    return [Violation("delaysvc_check", _id_in(line), line) for line in ix.history.check_lines]


def _id_in(line: str) -> int | None:
    found = re.search(r"message (\d+)", line)
    return int(found.group(1)) if found else None


PROPERTIES: dict[str, Callable[[Index], list[Violation]]] = {
    "no_lost_send": no_lost_send,
    "not_early": not_early,
    "not_after_cancel": not_after_cancel,
    "one_holder_per_key": one_holder_per_key,
    "reruns_explained": reruns_explained,
    "level_order": level_order,
    "delaysvc_check": delaysvc_check,
}


def _reruns(ix: Index) -> int:
    return sum(
        not _due_again(first, again)
        for runs in ix.runs.values()
        for first, again in itertools.pairwise(runs)
    )


COVERAGE: dict[str, Callable[[Index], int]] = {
    "no_lost_send": lambda ix: len(ix.created),
    "not_early": lambda ix: len(ix.history.runs),
    "not_after_cancel": lambda ix: len(ix.cancel_ids | ix.replaced_ids),
    "one_holder_per_key": lambda ix: len(
        {(f.topic, f.key) for f in ix.history.finals.values() if f.key is not None}
    ),
    "reruns_explained": _reruns,
    "level_order": lambda ix: len(_level_pairs(ix)),
    "delaysvc_check": lambda ix: int(ix.history.check_summary.startswith("delaysvc check")),
}
"""How much each property looked at (acknowledged sends, runs, cancelled messages, keys,
reruns, pairs compared, checks run): a property that checked nothing proves nothing."""


def check(history: History, only: Iterable[str] | None = None) -> dict[str, list[Violation]]:
    """Every property's violations (empty: it holds)."""
    ix = Index(history)
    return {name: PROPERTIES[name](ix) for name in (only or PROPERTIES)}
