"""Where a message waits: the producer's timing options (a level, a delay, a time) turned into a
lane and a delay, as a send, a batch and a retry place a message (`resolve_schedule`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from delaysvc.config.levels import DelayLevels, format_ms, parse_duration_ms
from delaysvc.errors import ValidationError
from delaysvc.schema.tables import NO_LANE, TIMER_LANE


@dataclass(frozen=True)
class Placement:
    """Where a message waits: lane -1 (due now), 1..N (a level) or 0 (the timer lane)."""

    lane: int
    delay_level: int | None
    delay_ms: int | None
    deliver_at: datetime | None

    def deliver_ts(self, now: datetime) -> datetime:
        """The due time for a send at `now` (the database computes the same from its clock)."""
        if self.deliver_at is not None:
            return self.deliver_at
        return elapsed_after(now, self.delay_ms or 0)


def elapsed_after(at: datetime, ms: int) -> datetime:
    """`ms` of elapsed time after `at` (aware), in `at`'s zone, as the database adds an
    interval: added in UTC, since an aware datetime adds to its zone's clock, which a change
    of daylight saving time moves by an hour."""
    return (at.astimezone(UTC) + timedelta(milliseconds=ms)).astimezone(at.tzinfo)


def resolve_schedule(
    levels: DelayLevels,
    *,
    delay_level: int | None = None,
    delay: str | timedelta | None = None,
    delay_ms: int | None = None,
    deliver_at: datetime | None = None,
    default_delay_ms: int | None = None,
    max_delay_ms: int,
    now: datetime | None = None,
) -> Placement:
    """Turn the producer's one timing option into a lane. At most one option may be given;
    none means the topic's default delay, else due now. A delay equal to a level's delay uses
    that level's FIFO queue; other delays use the timer lane. `now` (default: the clock, read
    only for `deliver_at`) bounds how far ahead `deliver_at` may be."""
    given = [
        name
        for name, value in (
            ("delay_level", delay_level),
            ("delay", delay),
            ("delay_ms", delay_ms),
            ("deliver_at", deliver_at),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValidationError(
            given[1], f"give at most one of delay_level, delay, delay_ms, deliver_at (got {given})"
        )
    if delay_level is not None:
        if isinstance(delay_level, bool) or not isinstance(delay_level, int):
            raise ValidationError("delay_level", f"must be a whole number, got {delay_level!r}")
        level = levels.clamp(delay_level)
        if level == 0:
            return Placement(NO_LANE, 0, 0, None)
        return Placement(level, level, levels.delay_ms(level), None)
    if deliver_at is not None:
        return _absolute(deliver_at, max_delay_ms, now or datetime.now().astimezone())
    field_name = "delay" if delay is not None else "delay_ms"
    if isinstance(delay, timedelta):
        ms = _timedelta_ms(delay)
    elif delay is not None:
        ms = parse_duration_ms(delay)
    elif delay_ms is not None:
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, int) or delay_ms < 0:
            raise ValidationError("delay_ms", f"must be a whole number >= 0, got {delay_ms!r}")
        ms = delay_ms
    elif default_delay_ms is not None:
        ms = default_delay_ms
    else:
        return Placement(NO_LANE, 0, 0, None)
    if ms > max_delay_ms:
        raise ValidationError(
            field_name,
            f"{format_ms(ms)} is more than the maximum delay, {format_ms(max_delay_ms)} "
            "(DELAYSVC_MAX_DELAY)",
        )
    if ms == 0:
        return Placement(NO_LANE, 0, 0, None)
    exact_level = levels.level_for_delay_ms(ms)
    if exact_level is not None:
        return Placement(exact_level, exact_level, ms, None)
    return Placement(TIMER_LANE, None, ms, None)


def _timedelta_ms(delay: timedelta) -> int:
    """A `timedelta` delay in whole milliseconds (finer parts are refused, as in a string)."""
    ms, rest = divmod(delay, timedelta(milliseconds=1))
    if delay < timedelta(0) or rest:
        raise ValidationError("delay", f"{delay!r} must be >= 0 and a whole number of milliseconds")
    return int(ms)


def _absolute(deliver_at: datetime, max_delay_ms: int, now: datetime) -> Placement:
    if not isinstance(deliver_at, datetime):
        raise ValidationError("deliver_at", f"must be a datetime, got {deliver_at!r}")
    if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
        raise ValidationError(
            "deliver_at",
            "must be timezone-aware (a time without a UTC offset is ambiguous): add one, such "
            f"as Z or +02:00 after an ISO 8601 time, or tzinfo to a datetime; got "
            f"{deliver_at.isoformat()}",
        )
    too_far = ValidationError(
        "deliver_at",
        f"{deliver_at.isoformat()} is more than {format_ms(max_delay_ms)} ahead, the maximum "
        "delay (DELAYSVC_MAX_DELAY)",
    )
    try:
        deliver_at.astimezone(UTC)
    except OverflowError:  # Python has no such time: stored, it could not be read back
        if deliver_at.year > 1:  # after 9999-12-31 in UTC
            raise too_far from None
        raise ValidationError(
            "deliver_at", f"{deliver_at.isoformat()} is before 0001-01-01T00:00:00Z"
        ) from None
    if deliver_at - now > timedelta(milliseconds=max_delay_ms):
        raise too_far
    return Placement(TIMER_LANE, None, None, deliver_at)
