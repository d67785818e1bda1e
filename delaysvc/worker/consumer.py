"""The consumer: claim ready jobs, run their handlers, record the outcome. Handlers are
registered in `delaysvc.worker.handlers` (`@handler`), whose names this module also gives.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, event

from delaysvc import store
from delaysvc.config import tracing
from delaysvc.config.validation import decode_body
from delaysvc.db import engines as db
from delaysvc.errors import DeadLetter, LeaseLost, RetryLater, ValidationError
from delaysvc.schema.tables import DURATION_BUCKETS_MS, NO_LANE, TIMER_LANE
from delaysvc.worker import handlers
from delaysvc.worker.handlers import Handler, _registry, registered
from delaysvc.worker.handlers import handler as handler  # `delaysvc.consumption.handler` before

if TYPE_CHECKING:
    from delaysvc.config.settings import Settings
    from delaysvc.producer.sending import Placement

log = logging.getLogger(__name__)

_REGISTRY_NAMES = frozenset(
    {
        "HandlerFunc",
        "TransactionOpener",
        "in_service_transaction",
        "load_handler_modules",
        "register_handler",
        "registered_topics",
        "require_handler_modules",
    }
)


def __getattr__(name: str) -> Any:
    """The handler registry's other names, given here as before it moved to
    `delaysvc.worker.handlers` (`from delaysvc.worker.consumer import register_handler`)."""
    if name in _REGISTRY_NAMES:
        return getattr(handlers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextmanager
def _left_open(conn: Any) -> Iterator[None]:
    """Raise DeadLetter, naming why, once a transactional handler has committed or rolled back
    the `Connection` (SQLAlchemy's) it was given: the job's success is written in that
    transaction after it. Committed, its work is kept and the job is not run again (it was
    done again at each retry, the error SQLAlchemy's "closed transaction"); rolled back, a
    retry would do the same. (Refusing the commit in its event instead leaves the pooled
    connection inside the transaction.) Django's connection refuses a commit in `atomic()`."""
    if not isinstance(conn, Connection):
        yield
        return
    ended: list[str] = []
    noted = {action: partial(_note, ended, action) for action in ("commit", "rollback")}
    for action, note in noted.items():
        event.listen(conn, action, note)
    try:
        yield
    finally:
        for action, note in noted.items():
            event.remove(conn, action, note)
    if ended:
        kept = "kept" if ended[0] == "commit" else "undone"
        raise DeadLetter(
            f"a transactional handler must not {ended[0]} the connection it is given: delaysvc "
            f"commits it with the job's success (raise to roll it back); its work was {kept}"
        )


def _note(ended: list[str], action: str, _conn: Connection) -> None:
    ended.append(action)


# ---------------------------------------------------------------- running jobs


@dataclass(frozen=True)
class Job:
    """What a handler receives."""

    id: int
    topic: str
    key: str | None
    body: Any
    attempts: int
    properties: dict[str, str]
    tags: list[str]
    deliver_at: datetime
    stored_at: datetime

    @classmethod
    def from_row(cls, row: Any) -> Job:
        return cls(
            id=row.id,
            topic=row.topic,
            key=row.key,
            body=decode_body(row.body, row.body_is_json),
            attempts=row.attempts,
            properties=row.properties or {},
            tags=row.tags or [],
            deliver_at=row.deliver_ts,
            stored_at=row.stored_at,
        )


@dataclass
class ConsumeResult:
    topic: str
    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    dispatched: int = 0
    released: int = 0  # claimed, not started within SPREAD_SECONDS: back in the queue
    limited: bool = False  # the topic has limits: the claim took what they allowed
    wait_s: float | None = None  # out of tokens: the next one comes in this long
    free_slots: int = 0  # under max_running, slots left after this claim for other consumers


def _greenlet_exit() -> tuple[type[BaseException], ...]:
    try:
        from greenlet import GreenletExit
    except ImportError:
        return ()
    return (GreenletExit,)


ENDS_THE_PROCESS: tuple[type[BaseException], ...] = (
    SystemExit,
    KeyboardInterrupt,
    *_greenlet_exit(),
)
"""What a handler may raise that fails its job and then ends the worker's process (or, for
`GreenletExit`, its greenlet: gevent's pool stopping). Anything else it raises, an exception
that is no `Exception` included (`asyncio.CancelledError`, a library's own), fails its job
alone."""

SPREAD_SECONDS = 1.0
"""A claim's jobs not started this long after it (or half a lease, if shorter) go back to
their queue, uncharged, for idle consumers, whom beat's sweep wakes within a second: a process
running slow jobs one after another held the rest for half a lease (15 s) while the others
idled (a reviewer's ten 3 s jobs ran one at a time on one of two processes). Quick jobs all
start within it: a claim of 100 taking 5 ms each runs whole, as before."""
GIVE_BACK_TICK_SECONDS = 0.25
"""How often the leases' thread looks for a claim's jobs to give back while a handler runs."""

FLUSH_SECONDS = 0.25
"""Outcomes of a batch are written at least this often, so a crash late in a batch of slow
jobs reruns only the jobs of the last quarter second, not the whole batch."""


class Leases:
    """The claims this process holds, renewed while it lives: every third of a lease, one
    statement moves the lease of every job it is running or about to run a lease ahead. A
    process that dies (kill -9, the OOM killer, a lost host) stops renewing, and its jobs are
    taken again (`rescue_once`) at most a lease later; a slow handler in a live process keeps
    its job however long it takes. A renewal that fails (the database restarting) is tried
    again every GIVE_BACK_TICK_SECONDS until it passes: leases that expired while the database
    was away are renewed as it comes back, before its rescue takes them (which waits a lease
    after the server's start for such leases: `store.rescue_expired_leases`)."""

    def __init__(self, engine: Engine, lease_seconds: int):
        self.engine = engine
        self.lease_seconds = lease_seconds
        self._held: dict[int, list[int]] = {}  # claim id -> its jobs' ids
        self._start_by: dict[int, float] = {}  # claim id -> when its jobs not started go back
        self._given_back: dict[int, int] = {}  # claim id -> how many went back (`drop` says)
        self._flushes: dict[int, Callable[[], None]] = {}  # claim id -> writes its outcomes
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def hold(self, claim_id: int, message_ids: list[int], start_by: float | None = None) -> None:
        """Renew these jobs' leases while this process lives; from `start_by` (a monotonic
        time) on, those never started go back to their queue, though a handler of the claim
        still runs (`give_back_late`)."""
        with self._lock:
            self._held[claim_id] = message_ids
            if start_by is not None:
                self._start_by[claim_id] = start_by
            if self._thread is None or not self._thread.is_alive():  # none yet, or forked
                self._thread = threading.Thread(
                    target=self._renew_while_alive, name="delaysvc-leases", daemon=True
                )
                self._thread.start()

    def flush_while_running(self, claim_id: int, flush: Callable[[], None]) -> None:
        """Call `flush` every GIVE_BACK_TICK_SECONDS while the claim is held: it writes the
        outcomes its batch has not written yet, when they are due, though a handler of the
        batch still runs (`Consumer._flush_if_due`)."""
        with self._lock:
            self._flushes[claim_id] = flush

    def drop(self, claim_id: int) -> int:
        """Renew this claim's jobs no more. -> how many of them went back while it ran."""
        with self._lock:
            self._held.pop(claim_id, None)
            self._start_by.pop(claim_id, None)
            self._flushes.pop(claim_id, None)
            return self._given_back.pop(claim_id, 0)

    def give_back_late(self) -> int:
        """The jobs never started of each claim past its `start_by` back to their queue,
        uncharged: a long handler of the claim would hold them (its batch starts its jobs one
        after another), renewed, though idle consumers could run them. A job its batch is
        starting meanwhile is either started first (and kept) or given back first (and skipped
        by the batch: `store.start_jobs` starts only its claim's). -> how many."""
        now = time.monotonic()
        with self._lock:
            late = {c: list(self._held[c]) for c, at in self._start_by.items() if now >= at}
            for claim_id in late:
                del self._start_by[claim_id]
        given = 0
        for claim_id, ids in late.items():
            with self.engine.begin() as conn:
                count = store.release_unstarted(conn, ids, claim_id, never_started=True)
            with self._lock:
                if claim_id in self._held:  # its batch still runs: it counts them
                    self._given_back[claim_id] = count
            given += count
        return given

    def renew(self) -> int:
        """Move every held job's lease a lease ahead now; -> jobs renewed."""
        with self._lock:
            held = dict(self._held)
        if not held:
            return 0
        with self.engine.begin() as conn:
            return store.renew_leases(conn, held, self.lease_seconds)

    def _renew_while_alive(self) -> None:
        renewed, failing = time.monotonic(), False
        while True:
            time.sleep(min(GIVE_BACK_TICK_SECONDS, self.lease_seconds / 3))
            try:
                # after a failure, again at each tick: the leases renewed as soon as the
                # database answers again (its rescue gives them a lease's grace after a restart)
                if failing or time.monotonic() - renewed >= self.lease_seconds / 3:
                    self.renew()
                    renewed = time.monotonic()
                given = self.give_back_late()
                failing = False
            except Exception:
                if not failing:  # said once a streak, not every tick of an outage
                    log.warning("consume.lease_renewal_failed", exc_info=True)
                failing = True
                continue
            with self._lock:
                flushes = list(self._flushes.values())
            for flush in flushes:
                try:
                    flush()
                except Exception:  # kept: its batch writes them, or tries again here
                    log.warning("consume.outcomes_write_failed", exc_info=True)
            if given:
                log.info("consume.released_behind_a_long_job", extra={"count": given})


class _Outcomes:
    """Outcomes of a batch not yet written; `lock` is held to change or write them (the
    batch's thread, and the leases' while a long handler runs: `Consumer._flush_if_due`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.clear()

    def clear(self) -> None:
        self.since = time.monotonic()
        self.succeeded: list[tuple[int, int, int]] = []  # (id, claim_id, duration_ms)
        self.failed: list[tuple[Job, int, BaseException, int]] = []
        self.durations: list[int] = []
        self.committed: set[int] = set()  # jobs whose handler's transaction wrote success

    def histogram(self) -> list[int]:
        """Handler durations per bucket of DURATION_BUCKETS_MS (the last: beyond)."""
        counts = [0] * (len(DURATION_BUCKETS_MS) + 1)
        for ms in self.durations:
            counts[bisect.bisect_right(DURATION_BUCKETS_MS, ms)] += 1
        return counts

    def add(self, job: Job, claim_id: int, error: BaseException | None, duration_ms: int) -> None:
        self.durations.append(duration_ms)
        if error is None and job.id in self.committed:
            return  # its success was written in its handler's own transaction
        if error is None:
            self.succeeded.append((job.id, claim_id, duration_ms))
        else:
            self.failed.append((job, claim_id, error, duration_ms))

    def age(self) -> float:
        return time.monotonic() - self.since


START_CHUNK_SECONDS = 0.05
"""Attempts are counted as handlers start, a chunk of jobs at a time: one job at a time while
handlers take longer than this, more at once while they are quicker (doubling up to the batch;
the claim itself counts the first chunk, as large as the last one of the topic), so fast jobs
do not pay a round trip or a second write each. A process that dies mid-chunk has charged the jobs
of the chunk that had not started (at most this long's worth); a job that was charged once runs
in a chunk of its own from then on, so no job is charged twice for runs it never had. A topic
with no retries (`max_retries=0`) starts every job alone, each charged by `start_jobs` just
before it runs (its claim charges none): there, one attempt charged without a run would be the
only one, and the job would reach the dead letters without ever running."""


class _Starts:
    """Which jobs of a batch have their attempt counted, and how many to count next."""

    def __init__(self, started_by_claim: dict[int, int], chunks: bool = True) -> None:
        self.chunks = chunks
        self.size = max(1, len(started_by_claim))
        self.chunk: list[int] = list(started_by_claim)
        self.attempts: dict[int, int] = dict(started_by_claim)
        self.chunk_ms = 0

    def covers(self, message_id: int) -> bool:
        """Whether its attempt is counted: by the claim, or by a chunk started before."""
        return message_id in self.attempts

    def next_chunk(self, upcoming: list[Job]) -> list[int]:
        """The next job, and after it while the previous chunk ran quickly, up to `size` - 1
        more that were never attempted (a rerun starts alone)."""
        if not self.chunks:
            self.size = 1
        elif self.chunk and self.chunk_ms <= START_CHUNK_SECONDS * 1000:
            self.size = min(self.size * 2, len(upcoming))
        elif self.chunk:
            self.size = 1
        chunk = [upcoming[0].id]
        for job in upcoming[1 : self.size]:
            if job.attempts > 0:
                break
            chunk.append(job.id)
        return chunk

    def started(self, chunk: list[int], attempts: dict[int, int]) -> None:
        """A chunk started: its jobs' attempts join those counted before (the claim's, which a
        rerun ahead of them, started alone, must not make forgotten)."""
        self.chunk, self.chunk_ms = chunk, 0
        self.attempts.update(attempts)

    def attempt(self, message_id: int) -> int | None:
        return self.attempts.get(message_id)

    def ran(self, duration_ms: int) -> None:
        self.chunk_ms += duration_ms


Dispatch = Callable[[str, Job, int], None]
"""Sends a job of a Celery-task topic to that task (see `delaysvc.tasks.consume`)."""


def _allowed(limits: Any, wanted: int, result: ConsumeResult) -> int:
    """How many jobs a claim of a limited topic may take (`store.lock_limits`): no more than
    free slots under `max_running`, and then one (each consumer process runs its batch one job
    at a time: a batch would hold slots without running them); no more than whole tokens
    under `rate_per_s`, and with none, say when the next one comes."""
    result.limited = True
    if limits.max_running is not None:
        free = limits.max_running - limits.running
        wanted = min(wanted, 1, free)
        result.free_slots = max(free - 1, 0)
    if limits.rate_per_s is not None:
        wanted = min(wanted, int(limits.available))
        if limits.available < 1:
            result.wait_s = (1 - limits.available) / limits.rate_per_s
    return max(wanted, 0)


class Consumer:
    """Claims ready jobs of a topic in batches, runs them, records every outcome."""

    def __init__(self, settings: Settings, engine: Engine, dispatch: Dispatch | None = None):
        self.settings = settings
        self.engine = engine
        self.dispatch = dispatch
        self.leases = Leases(engine, settings.lease_seconds)
        # per topic: how many jobs the last chunk started at once (`_Starts`); the next claim
        # counts that many attempts itself
        self._quick_jobs: dict[str, int] = {}

    def can_run(self, topic: str) -> bool:
        """A topic with no handler and no bound task is left waiting, visibly, in its queue."""
        return registered(topic) is not None or topic in self.settings.task_topics

    def task_of(self, topic: str) -> str | None:
        """The Celery task a topic's jobs are sent to (`DELAYSVC_TOPIC_TASKS`), unless the topic
        has a `@handler` of its own: a topic's own handler runs it, else its bound task, else
        the handler of the longest pattern it matches."""
        task_name = self.settings.task_topics.get(topic)
        return task_name if task_name is not None and topic not in _registry else None

    def max_retries(self, topic: str) -> int:
        found = None if self.task_of(topic) else registered(topic)
        if found is not None and found.max_retries is not None:
            return found.max_retries
        return self.settings.max_retries

    def run_once(self, topic: str, limit: int | None = None) -> ConsumeResult:
        """Claim up to `limit` jobs (one transaction), run them with no transaction open, and
        record their outcomes every FLUSH_SECONDS and at the end (one statement for all
        successes). The claim's lease is renewed while the batch runs (`Leases`). Each job's
        attempt is counted as its handler starts; jobs not started within `SPREAD_SECONDS` go
        back to the queue uncharged, for another consumer to run."""
        result = ConsumeResult(topic)
        if not self.can_run(topic):
            return result
        task_name = self.task_of(topic)
        # a Celery task runs where delaysvc cannot renew its lease: it gets a fixed one
        lease = self.settings.task_lease_seconds if task_name else self.settings.lease_seconds
        # a topic with no retries has its one attempt counted just before its handler starts,
        # never by the claim: a process dying after the claim must not spend it (`_Starts`)
        start_first = self._quick_jobs.get(topic, 1) if self.max_retries(topic) > 0 else 0
        wanted = limit or self.settings.consume_batch
        with self.engine.begin() as conn:
            limits = store.lock_limits(conn, topic)
            if limits is not None:
                wanted = _allowed(limits, wanted, result)
            rows = store.claim_ready(conn, topic, wanted, lease, start_first) if wanted else []
            if limits is not None and limits.rate_per_s is not None:
                store.spend_tokens(conn, topic, limits.available - len(rows), limits.now)
        result.claimed = len(rows)
        if not rows:
            return result
        claim_id = rows[0].claim_id
        jobs = [Job.from_row(row) for row in rows]
        if task_name is not None:
            started = {row.id: row.attempts for row in rows if row.started}
            return self._dispatch_all(task_name, jobs, claim_id, started, result)
        start_by = time.monotonic() + min(SPREAD_SECONDS, self.settings.lease_seconds / 2)
        self.leases.hold(claim_id, [job.id for job in jobs], start_by)
        try:
            started = {row.id: row.attempts for row in rows if row.started}
            self._run_batch(jobs, claim_id, started, start_by, result)
        finally:
            result.released += self.leases.drop(claim_id)
        log.info(
            "consume.batch",
            extra={
                "topic": topic,
                "claimed": result.claimed,
                "succeeded": result.succeeded,
                "retried": result.retried,
                "dead": result.dead,
                "released": result.released,
            },
        )
        return result

    def _run_batch(
        self,
        jobs: list[Job],
        claim_id: int,
        started: dict[int, int],
        start_by: float,
        result: ConsumeResult,
    ) -> None:
        """Run the claimed jobs in queue order, each started (its attempt counted) just before
        it runs; none starts after `start_by`, `SPREAD_SECONDS` from the claim (`_release`; those
        never started go back meanwhile too, while a long job runs: `Leases.give_back_late`)."""
        topic = result.topic
        pending = _Outcomes()
        self.leases.flush_while_running(claim_id, partial(self._flush_if_due, pending, result))
        starts = _Starts(started, chunks=self.max_retries(topic) > 0)
        for index, job in enumerate(jobs):
            if time.monotonic() > start_by:
                self._release(jobs[index:], claim_id, result)
                break
            if not starts.covers(job.id):
                spent = self._spent(job)
                if spent is not None:
                    with pending.lock:
                        pending.add(job, claim_id, spent, 0)
                    continue
                self._start(starts, jobs[index:], claim_id)
            attempt = starts.attempt(job.id)
            if attempt is None:
                log.warning("consume.claim_lost", extra={"message_id": job.id, "topic": topic})
                continue
            job = dataclasses.replace(job, attempts=attempt)
            error, duration_ms = self._run(job, claim_id, pending, result)
            starts.ran(duration_ms)
            self._quick_jobs[topic] = starts.size
            with pending.lock:
                pending.add(job, claim_id, error, duration_ms)
            if isinstance(error, ENDS_THE_PROCESS):
                # `sys.exit()` in a handler, or a Ctrl-C: a failure of its job like any other,
                # recorded with the batch's outcomes, the jobs not started given back; then the
                # process ends as asked
                self._record(pending, result)
                self._release(jobs[index + 1 :], claim_id, result)
                raise error
            if pending.age() >= FLUSH_SECONDS:
                self._record(pending, result)
        self._record(pending, result)

    def _flush_if_due(self, pending: _Outcomes, result: ConsumeResult) -> None:
        """Write the batch's outcomes once FLUSH_SECONDS old, from the leases' thread while a
        handler runs: quick jobs that finished before a long one were left `running` for as
        long as it ran, and run again if the process died meanwhile."""
        with pending.lock:
            if pending.age() >= FLUSH_SECONDS:
                self._record(pending, result)

    def _spent(self, job: Job) -> DeadLetter | None:
        """Why the job goes dead without running, when every attempt it may have was charged
        before this claim, by runs lost (a process that died running it, a Celery task that
        never reported back); else None."""
        if job.attempts > self.max_retries(job.topic):
            return DeadLetter(f"out of retries after {job.attempts} attempts")
        return None

    def _start(self, starts: _Starts, upcoming: list[Job], claim_id: int) -> None:
        """Count the attempts of the next jobs to start (`_Starts.next_chunk`), one commit."""
        chunk = starts.next_chunk(upcoming)
        with db.autocommit_cursor(self.engine) as cursor:
            starts.started(chunk, store.start_jobs(cursor, chunk, claim_id))

    def _release(self, jobs: list[Job], claim_id: int, result: ConsumeResult) -> None:
        with self.engine.begin() as conn:
            result.released += store.release_unstarted(conn, [job.id for job in jobs], claim_id)

    def _record(self, outcomes: _Outcomes, result: ConsumeResult) -> None:
        """Write the outcomes so far: all successes in one statement, then each failure, then
        the handlers' durations and the outcomes written (a job whose claim was lost is its
        new holder's to count) into the topic's histogram and totals, last: the topic's rows
        stay locked for the commit only."""
        with outcomes.lock:
            self._write(outcomes, result)

    def _write(self, outcomes: _Outcomes, result: ConsumeResult) -> None:
        if not outcomes.durations:  # nothing ran since the last write
            return
        with self.engine.begin() as conn:
            succeeded = store.finish_succeeded(conn, outcomes.succeeded)
            written = store.OutcomeCounts(succeeded=succeeded)
            for job, claim_id, error, duration_ms in outcomes.failed:
                written += self._record_failure(conn, job, claim_id, error, duration_ms)
            durations = outcomes.durations
            store.add_durations(
                conn, result.topic, outcomes.histogram(), max(durations), sum(durations), written
            )
        result.succeeded += written.succeeded
        result.retried += written.retried
        result.dead += written.dead
        outcomes.clear()

    def _run(
        self, job: Job, claim_id: int, pending: _Outcomes, result: ConsumeResult
    ) -> tuple[BaseException | None, int]:
        found = registered(job.topic)
        assert found is not None
        with tracing.processing(
            job.topic, job.id, job.attempts, job.properties, job.deliver_at
        ) as span:
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                if found.transaction is not None:
                    self._run_in_transaction(found, job, claim_id, started)
                    with pending.lock:
                        pending.committed.add(job.id)
                        result.succeeded += 1
                else:
                    found.run(job)
            except BaseException as exc:
                error = exc  # a handler's failure is data (`_run_batch` passes on an exit)
            duration_ms = _ms_since(started)
            if span is not None:
                tracing.finished(span, self._outcome(job, error), error)
        return error, duration_ms

    def _run_in_transaction(self, found: Handler, job: Job, claim_id: int, started: float) -> None:
        """`found`'s handler run with (job, conn) and the job's success in one transaction
        (`handler`): the job's row is locked first (rescue and lease renewal skip a locked
        row), so it stays this claim's until the commit; a job no longer this claim's runs
        nothing."""
        assert found.transaction is not None
        with found.transaction(self.engine) as (conn, arguments):
            if not store.lock_running_job(conn, job.id, claim_id):
                raise LeaseLost(job.id)
            with _left_open(conn):
                found.run(job, *arguments)
            if store.finish_one_succeeded(conn, job.id, claim_id, _ms_since(started)) is None:
                raise LeaseLost(job.id)  # never, with the row locked: the guard of the rule
            store.add_outcomes(conn, job.topic, store.OutcomeCounts(succeeded=1))

    def _dispatch_all(
        self,
        task_name: str,
        jobs: list[Job],
        claim_id: int,
        started: dict[int, int],
        result: ConsumeResult,
    ) -> ConsumeResult:
        """Send every job to its Celery task: all start now (the claim counted some), but one
        whose every attempt was charged by a run that never reported back (its lease expired:
        a name no Celery worker has, a worker killed on it), buried once they pass its
        retries, as `_run_batch` buries a handler's."""
        assert self.dispatch is not None, "Celery-task topics need a dispatcher (tasks.consume)"
        attempts = dict(started)
        rest = []
        for job in jobs:
            if job.id in started:
                continue
            spent = self._spent(job)
            if spent is not None:
                result.dead += self.record_failure_of(job, claim_id, spent, 0)
            else:
                rest.append(job.id)
        if rest:
            with db.autocommit_cursor(self.engine) as cursor:
                attempts.update(store.start_jobs(cursor, rest, claim_id))
        for job in jobs:
            if job.id in attempts:
                self.dispatch(
                    task_name, dataclasses.replace(job, attempts=attempts[job.id]), claim_id
                )
        result.dispatched = len(attempts)
        return result

    # -- outcomes -------------------------------------------------------------

    def record_success(self, message_id: int, claim_id: int, duration_ms: int) -> bool:
        """A Celery-task topic's job succeeded, counted in its topic's totals."""
        with self.engine.begin() as conn:
            topic = store.finish_one_succeeded(conn, message_id, claim_id, duration_ms)
            if topic is not None:
                store.add_outcomes(conn, topic, store.OutcomeCounts(succeeded=1))
        return topic is not None

    def record_failure_of(
        self, job: Job, claim_id: int, error: BaseException, duration_ms: int
    ) -> bool:
        """A Celery-task topic's job failed, counted in its topic's totals. -> True if the job
        is now dead."""
        with self.engine.begin() as conn:
            written = self._record_failure(conn, job, claim_id, error, duration_ms)
            store.add_outcomes(conn, job.topic, written)
        return written.dead == 1

    def _record_failure(
        self, conn: Connection, job: Job, claim_id: int, error: BaseException, duration_ms: int
    ) -> store.OutcomeCounts:
        """Retry or bury the job. -> what was written: one retried, one dead, or nothing when
        the job's claim was lost (another run holds it)."""
        failure = store.Failure(
            message_id=job.id,
            claim_id=claim_id,
            error=f"{type(error).__name__}: {_told(error)}",
            traceback="".join(traceback.format_exception(error)[-8:]),
            duration_ms=duration_ms,
        )
        schedule, refused = self._retry_schedule(job, error)
        if refused is not None:  # said where the message's last error is read
            failure = dataclasses.replace(  # first: the error is cut at 4,000 characters
                failure, error=f"{refused}: retried as a failure instead. {failure.error}"
            )
        dead_reason = self._dead_reason(job, error)
        if dead_reason is not None:
            if not store.bury(conn, failure, dead_reason):
                return _claim_lost(job)
            log.warning(
                "consume.dead",
                extra={
                    "message_id": job.id,
                    "topic": job.topic,
                    "attempts": job.attempts,
                    "reason": dead_reason,
                    "error": _first_line(failure.error),
                },
            )
            return store.OutcomeCounts(dead=1)
        retried = store.schedule_retry(
            conn,
            failure,
            lane=schedule.lane,
            delay_level=schedule.delay_level,
            delay_ms=schedule.delay_ms,
            deliver_at=schedule.deliver_at,
        )
        if not retried:
            return _claim_lost(job)
        log.warning(  # a handler failed: said where its developer looks first
            "consume.retry",
            extra={
                "message_id": job.id,
                "topic": job.topic,
                "attempts": job.attempts,
                "lane": schedule.lane,
                "error": _first_line(failure.error),
            },
        )
        return store.OutcomeCounts(retried=1)

    def _dead_reason(self, job: Job, error: BaseException) -> str | None:
        """Why a failed job is a dead letter now, or None: it is retried."""
        if isinstance(error, DeadLetter):
            return error.reason
        if job.attempts - 1 >= self.max_retries(job.topic):
            return f"out of retries: {job.attempts} attempts failed"
        return None

    def _outcome(self, job: Job, error: BaseException | None) -> str:
        """What a run of a handler comes to (`tracing.OUTCOMES`), as `_record` will write it."""
        if error is None:
            return "succeeded"
        if isinstance(error, LeaseLost):
            return "lost"
        return "retried" if self._dead_reason(job, error) is None else "dead"

    def _retry_schedule(self, job: Job, error: BaseException) -> tuple[Placement, str | None]:
        """Where the failed job goes again, and why a `RetryLater`'s own delay was not taken
        (None when it was, or when there was none): a bad one is retried as any failure, as
        is a `RetryLater` without a delay (it ran again at once, its retries spent in a
        moment)."""
        from delaysvc.producer.sending import Placement, resolve_schedule

        levels = self.settings.levels
        refused = None
        if isinstance(error, RetryLater) and (error.delay, error.delay_ms) != (None, None):
            try:
                schedule = resolve_schedule(
                    levels,
                    delay=error.delay,
                    delay_ms=error.delay_ms,
                    max_delay_ms=self.settings.max_delay_ms,
                    now=datetime.now().astimezone(),
                )
            except ValidationError as exc:
                refused = f"RetryLater's {exc}"
                log.warning(
                    "consume.bad_retry_later", extra={"message_id": job.id, "error": str(exc)}
                )
            else:
                if schedule.lane != NO_LANE:
                    return schedule, None
                return Placement(TIMER_LANE, None, 0, None), None
        level = levels.retry_level(job.attempts)
        return Placement(level, level, levels.delay_ms(level), None), refused

    # -- housekeeping ---------------------------------------------------------

    def rescue_once(self, limit: int = 1000) -> list[Any]:
        """Put jobs whose lease expired (their process stopped renewing it) back in their
        queues. -> rescued (id, topic) rows."""
        with self.engine.begin() as conn:
            # a lease that expired while the database was away: a lease's time to renew it
            rescued = store.rescue_expired_leases(conn, limit, self.settings.lease_seconds)
        if rescued:
            log.warning("consume.leases_rescued", extra={"count": len(rescued)})
        return rescued


def _told(error: BaseException) -> str:
    """An error's text; one whose `str()` raises says so."""
    try:
        return str(error)
    except BaseException as exc:  # a handler's error: whatever its str() raises, it is told
        return f"<str() failed: {type(exc).__name__}: {_told(exc)}>"


def _first_line(error: str, most: int = 300) -> str:
    """An error's first line, cut at `most` characters, for a log line (the message keeps it
    whole, with its traceback: `delaysvc show ID`)."""
    line = error.strip().partition("\n")[0]
    return line if len(line) <= most else line[: most - 3] + "..."


def _claim_lost(job: Job) -> store.OutcomeCounts:
    log.warning("consume.claim_lost", extra={"message_id": job.id, "topic": job.topic})
    return store.OutcomeCounts()


def _ms_since(started: float) -> int:
    return int((time.perf_counter() - started) * 1000)
