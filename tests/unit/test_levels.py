from datetime import UTC, datetime, timedelta, timezone

import pytest

from delaysvc.config.levels import DEFAULT_LEVELS, DelayLevels, format_ms, parse_duration_ms
from delaysvc.errors import ConfigError, ValidationError
from delaysvc.producer.sending import Placement, resolve_schedule
from delaysvc.schema.tables import NO_LANE, TIMER_LANE

LEVELS = DelayLevels.parse(DEFAULT_LEVELS)
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
YEAR_MS = 400 * 86_400_000


def test_default_levels_are_rocketmqs_eighteen():
    assert LEVELS.max_level == 18
    assert LEVELS.delays_ms[:4] == (1_000, 5_000, 10_000, 30_000)
    assert LEVELS.delay_ms(16) == 30 * 60_000
    assert LEVELS.delay_ms(18) == 2 * 3_600_000
    assert str(LEVELS) == DEFAULT_LEVELS


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("1s 5x", "'5x'"),
        ("1s 1.5m", "'1.5m'"),
        ("1s  5s", "empty token at position 2"),
        ("", "empty"),
        ("   ", "empty"),
        ("0s 5s", "'0s'"),
        ("1s -5s", "'-5s'"),
        ("5s 1s", "'1s'"),
        ("5s 5s", "'5s'"),
        ("5", "'5'"),
        ("1s 401d", "'401d'"),
        (" ".join(f"{i}s" for i in range(1, 66)), "65 levels given, at most 64"),
    ],
)
def test_malformed_level_strings_name_the_problem(text, named):
    with pytest.raises(ConfigError) as error:
        DelayLevels.parse(text)
    assert named in str(error.value)


def test_surrounding_whitespace_is_ignored_and_units_are_exact():
    levels = DelayLevels.parse(" 1s 2m 3h 1d ")
    assert levels.delays_ms == (1_000, 120_000, 10_800_000, 86_400_000)


def test_clamping_like_rocketmq():
    assert LEVELS.clamp(99) == 18
    assert LEVELS.clamp(0) == 0
    assert LEVELS.clamp(-3) == 0
    assert LEVELS.delay_ms(99) == LEVELS.delay_ms(18)
    assert LEVELS.delay_ms(-1) == 0


def test_retry_levels_start_at_ten_seconds_and_clamp():
    delays = [format_ms(LEVELS.delay_ms(LEVELS.retry_level(n))) for n in range(1, 18)]
    assert delays[:5] == ["10s", "30s", "1m", "2m", "3m"]
    assert delays[15] == "2h" and delays[16] == "2h"
    short = DelayLevels.parse("1s 2s")
    assert short.retry_level(1) == 2


@pytest.mark.parametrize(
    ("text", "ms"),
    [("45m", 2_700_000), ("1h30m", 5_400_000), ("250ms", 250), ("1d", 86_400_000), ("0s", 0)],
)
def test_durations(text, ms):
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "45", "m", "1.5m", "-1s", "1 h", "1x", "1h 30m"])
def test_bad_durations(text):
    with pytest.raises(ValidationError, match="not a duration"):
        parse_duration_ms(text)


def resolve(**options):
    options.setdefault("max_delay_ms", YEAR_MS)
    return resolve_schedule(LEVELS, now=NOW, **options)


def test_level_schedule_and_deliver_time_from_injected_clock():
    schedule = resolve(delay_level=2)
    assert schedule == Placement(2, 2, 5_000, None)
    assert schedule.deliver_ts(NOW) == NOW + timedelta(seconds=5)
    assert resolve(delay_level=50) == Placement(18, 18, 7_200_000, None)
    assert resolve(delay_level=0) == Placement(NO_LANE, 0, 0, None)
    assert resolve(delay_level=-4).lane == NO_LANE


def test_delay_equal_to_a_level_uses_that_level_and_others_use_the_timer_lane():
    assert resolve(delay="30m") == Placement(16, 16, 1_800_000, None)
    assert resolve(delay_ms=45 * 60_000) == Placement(TIMER_LANE, None, 2_700_000, None)
    assert resolve(delay="45m").deliver_ts(NOW) == NOW + timedelta(minutes=45)


def test_deliver_at_up_to_a_year_ahead():
    at = NOW + timedelta(days=365)
    assert resolve(deliver_at=at) == Placement(TIMER_LANE, None, None, at)
    assert resolve(deliver_at=at).deliver_ts(NOW) == at


def test_deliver_at_must_be_aware_and_not_too_far():
    with pytest.raises(ValidationError, match="timezone-aware"):
        resolve(deliver_at=datetime(2026, 1, 1, 13, 0))
    with pytest.raises(ValidationError, match="ahead"):
        resolve(deliver_at=NOW + timedelta(days=401))


def test_deliver_at_before_the_year_1_in_utc_is_refused():
    """Python holds no earlier time: such a message, once stored, could not be read back (a
    single send stored it and then failed; a batch failed with an OverflowError)."""
    east = timezone(timedelta(hours=1))
    with pytest.raises(ValidationError, match="before 0001-01-01T00:00:00Z"):
        resolve(deliver_at=datetime(1, 1, 1, tzinfo=east))
    first = datetime(1, 1, 1, tzinfo=UTC)
    assert resolve(deliver_at=first) == Placement(TIMER_LANE, None, None, first)


def test_deliver_at_after_the_year_9999_in_utc_is_more_than_the_maximum_ahead():
    """9999-12-31T23:59:59-14:00 was refused as "before 0001-01-01" (found by a reviewer): it
    is after Python's last time in UTC, and far more than the maximum delay ahead."""
    west = timezone(timedelta(hours=-14))
    with pytest.raises(ValidationError, match=r"is more than 400d ahead, the maximum delay"):
        resolve(deliver_at=datetime(9999, 12, 31, 23, 59, 59, tzinfo=west))


def test_default_delay_applies_only_when_nothing_is_named():
    assert resolve(default_delay_ms=1_800_000).lane == 16
    assert resolve(default_delay_ms=1_800_000, delay_level=1).lane == 1
    assert resolve().lane == NO_LANE


@pytest.mark.parametrize(
    "options",
    [
        {"delay_level": 1, "delay": "5s"},
        {"delay": "5s", "delay_ms": 5000},
        {"delay_ms": 1, "deliver_at": NOW},
    ],
)
def test_at_most_one_timing_option(options):
    with pytest.raises(ValidationError, match="at most one"):
        resolve(**options)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"delay_level": "3"}, "delay_level"),
        ({"delay_level": True}, "delay_level"),
        ({"delay_ms": -1}, "delay_ms"),
        ({"delay_ms": 1.5}, "delay_ms"),
        ({"delay": "500d"}, "delay"),
    ],
)
def test_bad_timing_values_name_their_field(options, field):
    with pytest.raises(ValidationError) as error:
        resolve(**options)
    assert error.value.field == field


def test_a_delay_beyond_the_maximum_names_the_limit_as_a_duration_and_its_setting():
    """Not `34560000000 ms`: the limit as it is set (DELAYSVC_MAX_DELAY, 400d by default)."""
    limit = format_ms(YEAR_MS)
    with pytest.raises(ValidationError) as refused:
        resolve(delay="500d")
    assert refused.value.detail == (
        f"500d is more than the maximum delay, {limit} (DELAYSVC_MAX_DELAY)"
    )
    with pytest.raises(ValidationError) as refused:
        resolve(delay_ms=YEAR_MS + 1)
    assert refused.value.detail == (
        f"{limit}1ms is more than the maximum delay, {limit} (DELAYSVC_MAX_DELAY)"
    )
    at = NOW + timedelta(days=401)
    with pytest.raises(ValidationError) as refused:
        resolve(deliver_at=at)
    assert refused.value.detail == (
        f"{at.isoformat()} is more than {limit} ahead, the maximum delay (DELAYSVC_MAX_DELAY)"
    )
