"""Per-topic limits: at most `max_running` jobs of a topic running at once across every
consumer and host, and at most `rate_per_s` starts per second.

Both live in the topic's `topic_state` row and are checked by the claim itself
(`store.lock_limits`, in the claim's transaction): a limited topic's claims take its row's lock
one at a time, count its running jobs and spend its tokens, so no interleaving of consumers
can exceed them. The rate is a token bucket holding one second's starts (at least one): in any
T seconds at most `rate_per_s * (T + 1)` jobs start, and a steady backlog starts `rate_per_s`
a second. A topic without limits pays one primary-key probe per claim and takes no lock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from delaysvc import store
from delaysvc.errors import ValidationError
from delaysvc.validation import validate_topic

_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*/\s*(s|m|h)")
_PER = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class TopicLimits:
    topic: str
    max_running: int | None
    rate_per_s: float | None

    @classmethod
    def from_row(cls, row: Any) -> TopicLimits:
        return cls(row.topic, row.max_running, row.rate_per_s)


def parse_rate(value: object) -> float | None:
    """`10/s`, `600/m`, `100/h`, or a number of starts per second; None lifts the limit."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value)
    elif isinstance(value, str) and (found := _RATE.fullmatch(value.strip())):
        rate = float(found.group(1)) / _PER[found.group(2)]
    else:
        raise ValidationError("rate", f"{value!r}: use starts per time such as '10/s', '600/m'")
    if not rate > 0 or rate > 1_000_000:
        raise ValidationError("rate", f"{value!r}: must be more than 0 and at most 1000000/s")
    return rate


def check_max_running(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
        raise ValidationError("max_running", f"{value!r}: a whole number from 1 to 100000")
    return value


def set_limits(
    engine: Engine, topic: str, *, max_running: int | None = None, rate: object = None
) -> TopicLimits:
    """Set a topic's limits (None lifts one); they hold from the next claim on."""
    topic = validate_topic(topic)
    checked = check_max_running(max_running)
    per_second = parse_rate(rate)
    with engine.begin() as conn:
        return TopicLimits.from_row(store.set_limits(conn, topic, checked, per_second))


def all_limits(engine: Engine) -> list[TopicLimits]:
    with engine.connect() as conn:
        return [TopicLimits.from_row(row) for row in store.topic_limits(conn)]


def apply_configured(
    engine: Engine, configured: dict[str, tuple[int | None, float | None]]
) -> None:
    """Set the limits DELAYSVC_TOPIC_MAX_RUNNING and DELAYSVC_TOPIC_RATES name (a worker's
    start): a topic named there gets them again at every start, its token bucket as it was
    (not refilled: see `store.set_limits`); others keep what the API, the CLI or the
    dashboard set."""
    with engine.begin() as conn:
        for topic, (max_running, rate_per_s) in configured.items():
            store.set_limits(conn, topic, max_running, rate_per_s)
