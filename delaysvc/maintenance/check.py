"""`delaysvc check`: a read-only check of a live database's invariants (what `pg_amcheck` is to
PostgreSQL), safe under load.

Every check is one set-based statement of `delaysvc.store.check`; all of them run in one READ
ONLY transaction at REPEATABLE READ, so they see one snapshot (a message moving between tables
meanwhile is seen in one place), under a statement and a lock timeout. They take ACCESS SHARE
locks only, which no writer's lock conflicts with (DDL alone does: a partition drop or a level
change waits for the check, at most its own lock timeout, as it would for any reader), on every
table they read before the snapshot is taken, so DDL committed meanwhile is wholly in it or not
at all.

What is checked (DESIGN.md's invariants, and the columns they rest on):

- every unfinished message is in exactly one place: a level's queue, the timer queue, its topic
  queue, or running under a lease; a lane's row agrees with its message (lane, offset, due time);
- no queue row (consume_queue, timer_queue, topic_queue, dead_letter) without its message, or
  of another topic; a dead letter's message is dead;
- a message is in commit_log or in the history, never both, and in the history once; the
  history holds finished messages only, each in the partition of the UTC day it finished;
  finished_at is set exactly for finished messages;
- a level's schedule offset (the highest offset moved) passed only rows that were due, and
  never the last offset its sequence gave out;
- each lane's exact count (`lane_count`) equals its queue's rows;
- a key is held by at most one unfinished message of its topic;
- no lease expired longer ago than a tolerance and not rescued, and none ends further ahead
  than the longest lease a worker takes;
- every level's queue rows have their lane (a schedule_offset row: else nothing delivers them);
- no cancelled message started after its cancel;
- no running periodic schedule's next tick further in the past than a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine

from delaysvc.config.settings import MAX_TASK_LEASE_SECONDS
from delaysvc.store import check as store_check

DEFAULT_LIMIT = 100
DEFAULT_LEASE_TOLERANCE_S = 60.0
DEFAULT_SCHEDULE_TOLERANCE_S = 60.0  # periodic_schedules.GRACE: later than that, a tick is missed
DEFAULT_TIMEOUT_S = 300.0
LOCK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Violation:
    check: str  # the store_check statement that found it
    subject: str  # "message 42", "lane 3", "schedule 'nightly'"
    problem: str
    message_id: int | None = None

    def __str__(self) -> str:
        return f"{self.subject}: {self.problem}"


@dataclass(frozen=True)
class Summary:
    unfinished: int
    running: int
    ready: int
    lanes: int
    topic_queues: int
    checked_at: datetime


@dataclass(frozen=True)
class CheckResult:
    summary: Summary
    violations: list[Violation] = field(default_factory=list)
    """The first `limit` violations found (at most `limit` per check, then cut to `limit`)."""
    total: int = 0
    """All violations found, listed or not."""

    @property
    def ok(self) -> bool:
        return self.total == 0

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def by_check(self, check: str) -> list[Violation]:
        return [v for v in self.violations if v.check == check]

    def summary_line(self) -> str:
        s = self.summary
        state = "ok" if self.ok else "FAILED"
        return (
            f"delaysvc check: {state} — {s.unfinished:,} unfinished messages in {s.lanes:,} "
            f"lanes, {s.topic_queues:,} topic queues, {s.running:,} running; "
            f"{self.total:,} violation{'' if self.total == 1 else 's'}"
        )

    def lines(self) -> list[str]:
        """One line per listed violation, `and N more` when some were not listed, then the
        summary line."""
        out = [str(v) for v in self.violations]
        if self.total > len(self.violations):
            out.append(f"and {self.total - len(self.violations):,} more")
        return [*out, self.summary_line()]


@dataclass(frozen=True)
class CheckOptions:
    lease_tolerance_s: float = DEFAULT_LEASE_TOLERANCE_S
    schedule_tolerance_s: float = DEFAULT_SCHEDULE_TOLERANCE_S
    limit: int = DEFAULT_LIMIT
    timeout_s: float = DEFAULT_TIMEOUT_S


def run_check(
    target: Engine | Connection,
    *,
    lease_tolerance_s: float = DEFAULT_LEASE_TOLERANCE_S,
    schedule_tolerance_s: float = DEFAULT_SCHEDULE_TOLERANCE_S,
    limit: int = DEFAULT_LIMIT,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CheckResult:
    """Check every invariant on one snapshot of the database. `target` is an engine, or a
    connection with no transaction open (the check opens its own, read only, and rolls it
    back). A `DBAPIError` (a timeout, a missing table) propagates."""
    options = CheckOptions(lease_tolerance_s, schedule_tolerance_s, limit, timeout_s)
    if isinstance(target, Engine):
        with target.connect() as conn:
            return run_check_on(conn, options)
    return run_check_on(target, options)


def run_check_on(conn: Connection, options: CheckOptions) -> CheckResult:
    with snapshot(conn, options.timeout_s):
        return check_snapshot(conn, options)


@contextmanager
def snapshot(conn: Connection, timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[Connection]:
    """A READ ONLY, REPEATABLE READ transaction on `conn` for the checks, rolled back after."""
    if conn.in_transaction():
        raise ValueError("run_check needs a connection with no transaction open")
    transaction = conn.begin()
    try:
        store_check.begin_snapshot(conn, int(timeout_s * 1000), int(LOCK_TIMEOUT_S * 1000))
        yield conn
    finally:
        transaction.rollback()


def check_snapshot(conn: Connection, options: CheckOptions) -> CheckResult:
    """Every check, in the snapshot `conn`'s transaction holds (see `snapshot`)."""
    violations: list[Violation] = []
    total = 0
    for name, run in CHECKS:
        rows = run(conn, options)
        if rows:
            total += int(rows[0].total)
        violations += [Violation(name, r.subject, r.problem, r.message_id) for r in rows]
    offsets = _schedule_offsets_beyond_their_sequence(conn)
    total += len(offsets)
    violations += offsets
    row = store_check.summary(conn)
    summary = Summary(
        int(row.unfinished),
        int(row.running),
        int(row.ready),
        int(row.lanes),
        int(row.topic_queues),
        row.checked_at,
    )
    return CheckResult(summary, violations[: options.limit], total)


Check = Callable[[Connection, CheckOptions], list[Any]]
CHECKS: list[tuple[str, Check]] = [
    ("unfinished_out_of_place", lambda c, o: store_check.unfinished_out_of_place(c, o.limit)),
    (
        "queue_rows_without_their_message",
        lambda c, o: store_check.queue_rows_without_their_message(c, o.limit),
    ),
    (
        "dead_letters_without_a_dead_message",
        lambda c, o: store_check.dead_letters_without_a_dead_message(c, o.limit),
    ),
    (
        "messages_in_log_and_history",
        lambda c, o: store_check.messages_in_log_and_history(c, o.limit),
    ),
    ("messages_twice_in_history", lambda c, o: store_check.messages_twice_in_history(c, o.limit)),
    (
        "unfinished_or_misfiled_history",
        lambda c, o: store_check.unfinished_or_misfiled_history(c, o.limit),
    ),
    (
        "finished_at_disagrees_with_status",
        lambda c, o: store_check.finished_at_disagrees_with_status(c, o.limit),
    ),
    ("keys_held_twice", lambda c, o: store_check.keys_held_twice(c, o.limit)),
    ("lane_counts_off", lambda c, o: store_check.lane_counts_off(c, o.limit)),
    (
        "rows_behind_the_schedule_offset_not_due",
        lambda c, o: store_check.rows_behind_the_schedule_offset_not_due(c, o.limit),
    ),
    (
        "leases_expired_long_ago",
        lambda c, o: store_check.leases_expired_long_ago(c, o.lease_tolerance_s, o.limit),
    ),
    ("messages_no_lane_serves", lambda c, o: store_check.messages_no_lane_serves(c, o.limit)),
    (
        "leases_beyond_the_longest",
        lambda c, o: store_check.leases_beyond_the_longest(
            c, MAX_TASK_LEASE_SECONDS, o.lease_tolerance_s, o.limit
        ),
    ),
    ("runs_after_their_cancel", lambda c, o: store_check.runs_after_their_cancel(c, o.limit)),
    (
        "schedules_overdue",
        lambda c, o: store_check.schedules_overdue(c, o.schedule_tolerance_s, o.limit),
    ),
]
"""(name, check): each names the store_check statement it runs."""


def _schedule_offsets_beyond_their_sequence(conn: Connection) -> list[Violation]:
    """A level's schedule offset is at most the last offset its sequence gave out (one small
    statement per level: a sequence is read as a relation of its own)."""
    name = "schedule_offset_beyond_its_sequence"
    found = []
    for level in store_check.level_offsets(conn):
        if not level.has_sequence:
            found.append(Violation(name, f"lane {level.lane}", "has no offset sequence"))
            continue
        given = store_check.last_offset_given(conn, level.lane)
        if level.schedule_offset > given:
            problem = (
                f"schedule offset {level.schedule_offset} is beyond the last offset its "
                f"sequence gave out ({given})"
            )
            found.append(Violation(name, f"lane {level.lane}", problem))
    return found
