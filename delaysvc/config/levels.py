"""Delay levels (RocketMQ's `messageDelayLevel`) and duration strings.

A level string is tokens separated by single spaces; each token is a positive whole number and a
unit: `s` seconds, `m` minutes, `h` hours, `d` days. Level N is the Nth token. Rules, each
refused with an error naming the bad token:

- `1.5m`, `5x`, `-5s`, `5`, `s` -- not a positive whole number followed by s/m/h/d;
- `0s` -- zero is not a delay (level 0 already means "no delay");
- two spaces in a row or an empty string -- an empty token;
- a token not longer than the one before -- levels must strictly increase, because a retry
  moves a message to the next level and expects a longer wait;
- more than `MAX_LEVELS` tokens or a delay over `MAX_LEVEL_DELAY_MS`.

Durations for arbitrary delays (`delay="1h30m"`) are one or more `<whole number><unit>` parts
with units ms, s, m, h, d.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from delaysvc.errors import ConfigError, ValidationError, shown

DEFAULT_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
MAX_LEVELS = 64
UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
MAX_LEVEL_DELAY_MS = 400 * UNIT_MS["d"]
# The first retry goes to level 3 (10s with the default levels), like RocketMQ's
# `3 + reconsumeTimes`: failed attempt n is retried at level 2 + n.
FIRST_RETRY_LEVEL = 3

_LEVEL_TOKEN = re.compile(r"([0-9]+)([smhd])")
DURATION_PATTERN = re.compile(r"(?:[0-9]+(?:ms|s|m|h|d))+")
_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h|d)")
MAX_DURATION_DIGITS = 18
"""Digits of one number of a duration: 18 of days is far past any bound a duration is checked
against, and still an int PostgreSQL's bigint holds as milliseconds."""


def format_ms(ms: int) -> str:
    """The shortest exact duration string for `ms` (`90000` -> `1m30s`)."""
    if ms == 0:
        return "0s"
    parts = []
    for unit in ("d", "h", "m", "s", "ms"):
        size = UNIT_MS[unit]
        if ms >= size:
            parts.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(parts)


def parse_duration_ms(text: str, *, field: str = "delay") -> int:
    """`"45m"` -> 2_700_000. Accepts `1h30m`, `250ms`; refuses anything else with a clear error."""
    if not isinstance(text, str) or not DURATION_PATTERN.fullmatch(text):
        raise ValidationError(
            field,
            f"{shown(text)} is not a duration; use whole numbers with units ms, s, m, h, d "
            "such as '45m', '1h30m' or '250ms'",
        )
    parts = _DURATION_PART.findall(text)
    if any(len(n) > MAX_DURATION_DIGITS for n, _ in parts):  # int() reads at most 4,300
        raise ValidationError(
            field, f"{shown(text)} has a number of more than {MAX_DURATION_DIGITS} digits"
        )
    return sum(int(n) * UNIT_MS[unit] for n, unit in parts)


@dataclass(frozen=True)
class DelayLevels:
    """The configured levels. `delays_ms[0]` is level 1."""

    delays_ms: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> DelayLevels:
        if text.strip() == "":
            raise ConfigError(
                f"the level string is empty; give space-separated delays such as {DEFAULT_LEVELS!r}"
            )
        tokens = text.strip().split(" ")
        if len(tokens) > MAX_LEVELS:
            raise ConfigError(f"{len(tokens)} levels given, at most {MAX_LEVELS}")
        delays: list[int] = []
        for position, token in enumerate(tokens, start=1):
            delays.append(_parse_level_token(token, position, delays))
        return cls(tuple(delays))

    @property
    def max_level(self) -> int:
        return len(self.delays_ms)

    def clamp(self, level: int) -> int:
        """Above the maximum -> the maximum; zero or below -> 0 (no delay)."""
        return max(0, min(level, self.max_level))

    def delay_ms(self, level: int) -> int:
        level = self.clamp(level)
        return 0 if level == 0 else self.delays_ms[level - 1]

    def level_for_delay_ms(self, ms: int) -> int | None:
        """The level whose delay is exactly `ms`, if any (such sends use the FIFO level)."""
        try:
            return self.delays_ms.index(ms) + 1
        except ValueError:
            return None

    def retry_level(self, failed_attempts: int) -> int:
        """Level for the retry after `failed_attempts` failures: 10s, 30s, 1m ... clamped."""
        return self.clamp(FIRST_RETRY_LEVEL - 1 + max(1, failed_attempts))

    def __str__(self) -> str:
        return " ".join(format_ms(ms) for ms in self.delays_ms)


def _parse_level_token(token: str, position: int, previous: list[int]) -> int:
    allowed = "a positive whole number followed by s, m, h or d (like 5s, 10m, 2h, 1d)"
    if token == "":
        raise ConfigError(
            f"empty token at position {position} (two spaces in a row?); "
            "separate levels with single spaces"
        )
    match = _LEVEL_TOKEN.fullmatch(token)
    if not match:
        raise ConfigError(f"bad token {token!r} at level {position}; use {allowed}")
    ms = int(match.group(1)) * UNIT_MS[match.group(2)]
    if ms == 0:
        raise ConfigError(
            f"bad token {token!r} at level {position}; a level must be longer "
            "than zero (level 0 already means no delay)"
        )
    if ms > MAX_LEVEL_DELAY_MS:
        raise ConfigError(
            f"bad token {token!r} at level {position}; at most {format_ms(MAX_LEVEL_DELAY_MS)}"
        )
    if previous and ms <= previous[-1]:
        raise ConfigError(
            f"bad token {token!r} at level {position}; levels must strictly "
            f"increase and the level before is {format_ms(previous[-1])}"
        )
    return ms
