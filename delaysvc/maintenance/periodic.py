"""Periodic schedules: a message for a topic at every tick of a cron expression or a fixed
interval, in a time zone.

A schedule is a row of `periodic_schedule`, declared in code next to the handlers
(`@periodic("*/5 * * * *", topic="report.build")`, stored when a worker starts) or created at
run time through the API or the CLI. Workers with different handler modules share a database,
so no worker removes the schedules it does not declare: each delivery worker declares its own
again every DECLARE_EVERY (the row notes when, and by whom), and after two rounds in a row that
reached the database removes the code-declared ones no worker has declared for
UNDECLARED_GRACE. `Schedules.delete` removes one at once when no worker has declared it for
STILL_DECLARED. Beat fires `delaysvc.fire_schedules` every second;
`fire_due` locks each due schedule (`FOR UPDATE SKIP LOCKED`), stores the tick's message and
advances `next_tick` in the same transaction. A second beat, or a second worker running the
same task, skips the locked row and then finds its next tick in the future: one message per
tick, however many run. The message's key is `periodic:<name>:<tick>`, and its properties name
the schedule and the tick.

Each tick at most `GRACE` (a minute) late is fired, each as its own message: a beat that ran a
little late fires every tick it passed. After downtime (no beat running) older ticks are
missed: `on_missed="skip"` (the default, as Oban's and River's cron) fires none of them;
`"latest"` fires the most recent one once, if no tick was on time. A paused schedule resumes
from its next tick after now: a pause is never caught up.
A fixed interval is counted from the Unix epoch in UTC, so `every 5m` ticks at :00, :05, ...
Cron expressions are read by cronsim, in the schedule's time zone (daylight-saving changes as
cron does them: a time that does not exist that day runs at the next one that does).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any, Literal, TypeVar
from zoneinfo import ZoneInfo, available_timezones

from cronsim import CronSim, CronSimError
from sqlalchemy import Connection, Engine

from delaysvc.config.levels import format_ms, parse_duration_ms
from delaysvc.config.validation import encode_body, validate_topic
from delaysvc.errors import ConfigError, DeclaredInCode, NotFound, ValidationError, shown
from delaysvc.schema.tables import NO_LANE
from delaysvc.store import NewMessage, insert_message_on
from delaysvc.store import schedules as store_schedules

OnMissed = Literal["skip", "latest"]
ON_MISSED: tuple[OnMissed, ...] = ("skip", "latest")
FIRE_SECONDS = 1.0  # beat fires `delaysvc.fire_schedules` this often
GRACE = timedelta(seconds=60)
"""A tick fired at most this late is on time; a later one was missed (see the module's text)."""
DECLARE_EVERY = timedelta(minutes=1)
"""A delivery worker declares its schedules again this often (`Declarer`)."""
UNDECLARED_GRACE = timedelta(minutes=10)
"""A code-declared schedule no worker has declared for longer is removed (`Declarer`): long
enough for a rolling deploy or a worker's restart, short enough that a schedule taken out of
the code stops soon after."""
STILL_DECLARED = 2 * DECLARE_EVERY
"""A code-declared schedule declared this recently is declared by a running worker: deleting it
is refused (it would be back at the worker's next round)."""
MIN_EVERY_MS = 1000
MAX_EVERY_MS = 3650 * 86_400_000
"""The longest interval, ten years: counted from 1970, its ticks stay well within the years a
datetime holds (to 9999)."""
SHORTHANDS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
"""cron's shorthands, stored as the five fields they stand for (cronsim reads none of them)."""
MAX_TICKS_PER_RUN = 100
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
MAX_BODY_BYTES = 64 * 1024


@cache
def _iana_zones() -> frozenset[str]:
    """The IANA time zones a schedule may tick in: zoneinfo's names, less the files a host may
    hold beside them (`localtime`, each host's own zone: ticks would differ by host). Read
    from the disk at the first schedule checked, not when the module is imported."""
    return frozenset(available_timezones()) - {"localtime", "posixrules"}


@dataclass(frozen=True)
class Schedule:
    """A validated schedule (see `schedule()`): what fires, and when."""

    name: str
    topic: str
    body: bytes
    body_is_json: bool
    cron: str | None
    every_ms: int | None
    timezone: str
    on_missed: OnMissed

    @property
    def spec(self) -> str:
        """As a person writes it: the cron expression, or `every 5m`."""
        return self.cron if self.cron is not None else f"every {format_ms(self.every_ms or 0)}"

    def next_tick(self, after: datetime) -> datetime:
        """The first tick strictly after `after` (UTC)."""
        if self.every_ms is not None:
            step = timedelta(milliseconds=self.every_ms)
            return _EPOCH + ((after - _EPOCH) // step + 1) * step
        assert self.cron is not None
        # cronsim walks the wall clock: from the second pass of an hour the clocks repeat, its
        # next time can be one the first pass had (02:30 after 02:10 the second time), a tick
        # already past; a time that happens twice runs once, so the next one after it counts
        for tick in CronSim(self.cron, after.astimezone(self.zone)):
            if tick.astimezone(UTC) > after:
                return tick.astimezone(UTC)
        raise AssertionError("a cron expression has ticks without end")

    def latest_tick(self, at: datetime) -> datetime:
        """The last tick at or before `at` (UTC): of the ticks `next_tick` walks through, which
        are the ones the beat fires."""
        if self.every_ms is not None:
            step = timedelta(milliseconds=self.every_ms)
            return _EPOCH + ((at - _EPOCH) // step) * step
        # walked forward from a tick found walking back from three hours before: around a
        # change of the clocks the two walks differ (from Lord Howe's second 01:30, whose clocks
        # go back half an hour, the walk back found it; the walk forward never fires it)
        tick = self._walked_back(at - _CLOCKS_SETTLED)
        while (following := self.next_tick(tick)) <= at:
            tick = following
        return tick

    def _walked_back(self, at: datetime) -> datetime:
        """A tick at or before `at`, the latest the cron's walk back finds (UTC)."""
        assert self.cron is not None
        # walked back from an hour later on the wall clock: in the second pass of an hour the
        # clocks repeat, the latest tick can be at a later wall time (its first pass)
        start = (at + timedelta(hours=1, microseconds=1)).astimezone(self.zone)
        for tick in CronSim(self.cron, start, reverse=True):
            if tick.astimezone(UTC) <= at:
                return tick.astimezone(UTC)
        raise AssertionError("a cron expression has ticks without end")

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    @classmethod
    def from_row(cls, row: Any) -> Schedule:
        return cls(
            row.name,
            row.topic,
            bytes(row.body),
            row.body_is_json,
            row.cron,
            row.every_ms,
            row.timezone,
            row.on_missed,
        )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_CLOCKS_SETTLED = timedelta(hours=3)  # longer than any change of the clocks lasts


def schedule(
    name: str,
    when: str | timedelta,
    *,
    topic: str,
    body: Any = None,
    timezone: str = "UTC",
    on_missed: str = "skip",
) -> Schedule:
    """Validate a schedule. `when` is a cron expression of five fields (`*/5 * * * *`; `@daily`
    and the other shorthands too) or an interval: a duration (`30s`, `1h30m`, a timedelta) or
    `every <duration>`, at least 1 s. Errors name the field and what is allowed."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValidationError(
            "name",
            f"{shown(name)} is not a schedule name: 1-200 letters, digits and . _ : -, "
            "starting with a letter or digit",
        )
    topic = validate_topic(topic)
    data, is_json = encode_body(body, MAX_BODY_BYTES)
    cron, every_ms = _when(when)
    if not isinstance(timezone, str) or timezone not in _iana_zones():  # not `localtime`
        raise ValidationError(
            "timezone",
            f"{shown(timezone)} is not an IANA time zone (such as 'Europe/Berlin', 'UTC')",
        )
    if on_missed not in ON_MISSED:
        raise ValidationError("on_missed", f"{shown(on_missed)}: use 'skip' or 'latest'")
    return Schedule(name, topic, data, is_json, cron, every_ms, timezone, on_missed)


def _when(when: str | timedelta) -> tuple[str | None, int | None]:
    if isinstance(when, timedelta):
        every_ms = int(when / timedelta(milliseconds=1))
    elif not isinstance(when, str) or not when.strip():
        raise ValidationError("schedule", "give a cron expression or an interval such as '5m'")
    elif _looks_like_interval(when):
        text = when.strip().removeprefix("every").strip()
        every_ms = parse_duration_ms(text, field="schedule")
    else:
        cron = " ".join(when.split())
        cron = SHORTHANDS.get(cron.lower(), cron)
        if len(cron.split()) != 5:
            raise ValidationError(
                "schedule",
                f"{shown(when)} is not a cron expression: it has {len(cron.split())} fields, "
                "not five "
                "(minute hour day month weekday); for seconds use an interval such as '30s'",
            )
        try:
            CronSim(cron, datetime.now(UTC))
        except (CronSimError, ValueError) as exc:  # ValueError: a number int() cannot read
            raise ValidationError(
                "schedule",
                f"{shown(when)} is not a cron expression ({exc}); use five fields such as "
                "'*/5 * * * *', or an interval such as '5m'",
            ) from None
        return cron, None
    if every_ms < MIN_EVERY_MS:
        raise ValidationError("schedule", f"an interval must be at least 1s, got {shown(when)}")
    if every_ms > MAX_EVERY_MS:
        raise ValidationError(
            "schedule", f"an interval must be at most {format_ms(MAX_EVERY_MS)}, got {shown(when)}"
        )
    return None, every_ms


def _looks_like_interval(when: str) -> bool:
    text = when.strip()
    return text.startswith("every") or (text[0].isdigit() and " " not in text)


# ------------------------------------------------------------------ declared in code

_declared: dict[str, Schedule] = {}
F = TypeVar("F", bound=Callable[..., Any])


def periodic(
    when: str | timedelta,
    *,
    topic: str,
    body: Any = None,
    name: str | None = None,
    timezone: str = "UTC",
    on_missed: str = "skip",
) -> Callable[[F], F]:
    """Declare a schedule in code, next to the handlers (a module in DELAYSVC_HANDLERS):

        @periodic("0 3 * * *", topic="report.nightly", timezone="Europe/Berlin")
        @handler("report.nightly")
        def nightly(message): ...

    Also a plain call at module level. The name defaults to the topic. Delivery workers store
    the declared schedules when they start and declare them again every DECLARE_EVERY: a
    changed one is updated (its next tick computed again); one no worker declares any more is
    removed after UNDECLARED_GRACE (see the module's text)."""
    declared = schedule(
        name or topic, when, topic=topic, body=body, timezone=timezone, on_missed=on_missed
    )
    existing = _declared.get(declared.name)
    if existing is not None and existing != declared:
        raise ConfigError(
            f"two periodic schedules are named {declared.name!r}: give each its own name="
        )
    _declared[declared.name] = declared

    def keep(function: F) -> F:
        return function

    return keep


def declared() -> list[Schedule]:
    return list(_declared.values())


def store_declared(
    engine: Engine, now: datetime | None = None, declared_by: str | None = None
) -> int:
    """Store the schedules this process's code declares, noting that `declared_by` (a worker)
    declared them at `now`: new ones are added, changed ones updated. None is removed: other
    workers, with other handler modules, declare theirs (`sweep_undeclared` removes the
    ones no worker declares any more). -> schedules declared."""
    with engine.begin() as conn:
        now = now or store_schedules.statement_now(conn)
        for item in _declared.values():
            store_schedules.declare(conn, item, item.next_tick(now), now, declared_by)
    return len(_declared)


def sweep_undeclared(engine: Engine, now: datetime | None = None) -> list[str]:
    """Remove the code-declared schedules no worker has declared for UNDECLARED_GRACE; those
    made through the API or the CLI stay. -> the names removed."""
    with engine.begin() as conn:
        now = now or store_schedules.statement_now(conn)
        return store_schedules.remove_declared_before(conn, now - UNDECLARED_GRACE)


@dataclass(frozen=True)
class Declared:
    declared: int
    removed: list[str]


@dataclass
class Declarer:
    """A delivery worker's declarations: `run_once()` at its start and every DECLARE_EVERY
    after. A round stores this process's schedules (`store_declared`), then sweeps
    (`sweep_undeclared`) only if the round before also reached the database: right after the
    worker starts, or the database comes back, the other workers may not have declared
    theirs again yet."""

    engine: Engine
    name: str
    connected: bool = False  # the last round reached the database

    def run_once(self, now: datetime | None = None) -> Declared:
        was_connected, self.connected = self.connected, False
        declared = store_declared(self.engine, now, self.name)
        removed = sweep_undeclared(self.engine, now) if was_connected else []
        self.connected = True
        return Declared(declared, removed)


# ------------------------------------------------------------------ firing


@dataclass
class Fired:
    fired: int = 0
    skipped: int = 0


def fire_due(engine: Engine, now: datetime | None = None, limit: int = 100) -> Fired:
    """Fire the due ticks of every due schedule (one transaction; see the module's text):
    each tick at most GRACE late gets its own message (a beat that ran late fires the ticks it
    passed); when only older ones are due, `on_missed` says whether the latest of them runs."""
    result = Fired()
    with engine.begin() as conn:
        now = now or store_schedules.statement_now(conn)
        for row in store_schedules.lock_due(conn, now, limit):
            item = Schedule.from_row(row)
            on_time = _ticks_between(item, max(row.next_tick, now - GRACE), now)
            if not on_time and item.on_missed == "latest":
                on_time = [item.latest_tick(now)]
            if row.next_tick < (on_time[0] if on_time else now - GRACE):
                result.skipped += 1
            message_id = None
            for tick in on_time:
                message_id = _fire(conn, item, tick)
                result.fired += 1
            full = len(on_time) == MAX_TICKS_PER_RUN  # the rest at the next run
            next_tick = item.next_tick(on_time[-1] if full else now)
            fired = on_time[-1] if on_time else None
            store_schedules.advance(conn, item.name, next_tick, fired, message_id)
    return result


def _ticks_between(item: Schedule, start: datetime, end: datetime) -> list[datetime]:
    """The ticks in [start, end], at most MAX_TICKS_PER_RUN of them."""
    found: list[datetime] = []
    tick = item.next_tick(start - timedelta(microseconds=1))
    while tick <= end and len(found) < MAX_TICKS_PER_RUN:
        found.append(tick)
        tick = item.next_tick(tick)
    return found


def _fire(conn: Connection, item: Schedule, tick: datetime) -> int:
    tick_text = tick.isoformat()
    message = NewMessage(
        topic=item.topic,
        body=item.body,
        body_is_json=item.body_is_json,
        lane=NO_LANE,
        delay_level=0,
        delay_ms=0,
        deliver_at=None,
        key=f"periodic:{item.name}:{tick_text}",
        properties={"periodic": item.name, "tick": tick_text},
    )
    row, _created, _ = insert_message_on(conn, message)
    return int(row.id)


class Schedules:
    """Schedules at run time, for the API, the CLI and the dashboard: list them, create or
    replace one, pause, resume, delete. Those declared in code may be paused and resumed, and
    deleted only once no running worker declares them (STILL_DECLARED).
    `topics` (an API token's): a schedule of any other topic is NotFound, as if it were none,
    checked in the transaction that writes."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def list(self) -> list[Any]:
        with self.engine.connect() as conn:
            return store_schedules.all_schedules(conn)

    def get(self, name: str, *, topics: Collection[str] | None = None) -> Any:
        _possible(name)
        with self.engine.connect() as conn:
            return _found(store_schedules.get(conn, name), name, topics)

    def put(self, item: Schedule, *, topics: Collection[str] | None = None) -> tuple[Any, bool]:
        """Create `item`, or replace the schedule of its name. -> (row, created). A name taken
        by a schedule outside `topics` is NotFound and nothing is written, even when another
        transaction creates it between this one's read and its write (the write's own guard)."""
        with self.engine.begin() as conn:
            existing = store_schedules.get(conn, item.name, lock=True)
            if existing is not None:
                _found(existing, item.name, topics)
                if existing.declared_in == "code":
                    raise DeclaredInCode(
                        f"schedule {item.name!r} is declared in code (@periodic): change it there"
                    )
            now = store_schedules.statement_now(conn)
            allowed = None if topics is None else sorted(topics)
            store_schedules.put(conn, item, "api", item.next_tick(now), allowed)
            row = _found(store_schedules.get(conn, item.name), item.name, topics)
            return row, existing is None

    def pause(self, name: str, *, topics: Collection[str] | None = None) -> Any:
        _possible(name)
        with self.engine.begin() as conn:
            _found(store_schedules.get(conn, name, lock=True), name, topics)
            return _found(store_schedules.set_paused(conn, name, True, None), name)

    def resume(self, name: str, *, topics: Collection[str] | None = None) -> Any:
        _possible(name)
        with self.engine.begin() as conn:
            row = _found(store_schedules.get(conn, name, lock=True), name, topics)
            now = store_schedules.statement_now(conn)
            next_tick = Schedule.from_row(row).next_tick(now) if row.paused else None
            return store_schedules.set_paused(conn, name, False, next_tick)

    def delete(self, name: str, *, topics: Collection[str] | None = None) -> None:
        _possible(name)
        with self.engine.begin() as conn:
            row = _found(store_schedules.get(conn, name, lock=True), name, topics)
            if row.declared_in == "code":
                _refuse_if_still_declared(row, store_schedules.statement_now(conn))
            store_schedules.delete(conn, name)


def _possible(name: str) -> None:
    """NotFound for a name no schedule can have (a NUL in it is the database's error, not a
    missing schedule's), before the database is asked."""
    if not NAME.fullmatch(name):
        raise NotFound(f"no periodic schedule is named {shown(name)}")


def _refuse_if_still_declared(row: Any, now: datetime) -> None:
    """A code-declared schedule a running worker declares would be back at its next round."""
    age = now - row.declared_at
    if age < STILL_DECLARED:
        raise DeclaredInCode(
            f"schedule {row.name!r} is declared in code (@periodic) by a running worker "
            f"({row.declared_by or 'unnamed'}, {max(age.total_seconds(), 0):.0f}s ago): remove "
            f"it there, or pause it; once no worker has declared it for "
            f"{format_ms(int(STILL_DECLARED.total_seconds() * 1000))} it can be deleted"
        )


def _found(row: Any, name: str, topics: Collection[str] | None = None) -> Any:
    """The row; None, or of a topic outside `topics`: NotFound, in the same words."""
    if row is None or (topics is not None and row.topic not in topics):
        raise NotFound(f"no periodic schedule is named {name!r}")
    return row


def ticks(item: Schedule, start: datetime, count: int) -> Iterator[datetime]:
    """The next `count` ticks after `start` (for the dashboard and `schedules list`)."""
    at = start
    for _ in range(count):
        at = item.next_tick(at)
        yield at
