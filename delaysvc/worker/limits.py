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

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from delaysvc import store
from delaysvc.config.validation import check_max_running, parse_rate, validate_topic


@dataclass(frozen=True)
class TopicLimits:
    topic: str
    max_running: int | None
    rate_per_s: float | None

    @classmethod
    def from_row(cls, row: Any) -> TopicLimits:
        return cls(row.topic, row.max_running, row.rate_per_s)


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
