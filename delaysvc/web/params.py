"""Whole numbers from query strings and forms, for the API and the dashboard alike.

Only the ASCII digits 0-9: Python's `str.isdigit()` also takes superscripts (`²`, on which
`int()` then raises: an HTTP 500) and `int()` reads Arabic-Indic or full-width digits as a
number nobody typed. Anything else is a ValidationError naming the parameter and what it
takes, which the API answers as 400 `{"error": {"code", "message"}}` and the dashboard as its
400 page (or a note on the next page, for a form it redirects from).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from werkzeug.datastructures import MultiDict

from delaysvc.errors import ValidationError

MAX_BIGINT = 2**63 - 1
"""The largest id or count PostgreSQL's bigint holds: a larger number is refused here, not by
the database."""
_DIGITS = re.compile(r"[0-9]+")  # [0-9], not \d: \d matches every script's digits


def whole_number(name: str, raw: str, low: int, high: int | None = None) -> int:
    """`raw` read as a whole number in [low, high] (high None: up to MAX_BIGINT)."""
    allowed = f"a whole number from {low}" + (f" to {high}" if high is not None else " up")
    if not _DIGITS.fullmatch(raw) or len(raw) > 19:
        raise ValidationError(name, f"must be {allowed} in the digits 0-9, got {raw!r}")
    value = int(raw)
    if value < low or value > (MAX_BIGINT if high is None else high):
        raise ValidationError(name, f"must be {allowed} in the digits 0-9, got {value}")
    return value


def _one(args: MultiDict[str, str], name: str, blank: bool) -> str | None:
    """The parameter's one value; None if absent (or empty, when `blank`: a form's empty
    field). Given twice: a ValidationError."""
    values = args.getlist(name)
    if len(values) > 1:
        raise ValidationError(name, f"give it once, got {values!r}")
    raw = values[0].strip() if values and blank else (values[0] if values else None)
    return None if raw is None or (blank and not raw) else raw


def text_arg(args: MultiDict[str, str], name: str) -> str | None:
    """A text parameter's one value, None if absent; given twice: a ValidationError."""
    return _one(args, name, blank=False)


def only(args: MultiDict[str, str], *names: str) -> None:
    """Refuse a parameter the route does not take: a misspelt filter (`?topc=`) would
    otherwise be ignored, and the answer widened to what it meant to leave out."""
    for name in args:
        if name not in names:
            raise ValidationError(name, f"unknown query parameter; allowed: {', '.join(names)}")


def int_arg(
    args: MultiDict[str, str],
    name: str,
    default: int | None,
    low: int,
    high: int | None = None,
    *,
    blank: bool = False,
) -> int | None:
    """A whole-number parameter within [low, high], `default` when absent (or empty, with
    `blank`)."""
    raw = _one(args, name, blank)
    return default if raw is None else whole_number(name, raw, low, high)


def choice_arg(args: MultiDict[str, str], name: str, default: int, choices: Sequence[int]) -> int:
    """A whole-number parameter that must be one of `choices`; `default` when absent or
    empty."""
    raw = _one(args, name, blank=True)
    if raw is None:
        return default
    if _DIGITS.fullmatch(raw) and len(raw) <= 19 and int(raw) in choices:
        return int(raw)
    allowed = ", ".join(map(str, choices))
    raise ValidationError(name, f"{raw!r} is not one of {allowed} (in the digits 0-9)")
