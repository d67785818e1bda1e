"""`GET /metrics` in the Prometheus text format. The engine's state lives in PostgreSQL, not in
the web process, so a collector reads it at scrape time from the same O(1)-per-lane queries as
`delaysvc stats` (offsets and sequences, never a COUNT(*) over a hot table), under a statement
timeout; beside it, the answering web process's own `process_*` and `python_*` metrics.

Histograms and counters are cumulative, as Prometheus requires: they are read from running
totals that only grow (`lateness_total`, `topic_total`), never from the week of minute rows the
dashboard reads, which are pruned.

The series are bounded: a lane is labelled by its number alone (its delay is one
`delaysvc_lane_info` series, so a level change starts no new counter series), and only the
`DELAYSVC_METRICS_MAX_TOPICS` topics with the most jobs counted since the database was created
have series of their own; every other topic is summed into `topic="other"`. That ranking is by
counts that only grow, so a topic's series, once it has one, keeps it until another topic
overtakes it, and `other` only grows in between."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import zip_longest
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from delaysvc import store
from delaysvc.config.levels import format_ms
from delaysvc.config.settings import Settings
from delaysvc.db.names import sql
from delaysvc.schema.tables import DURATION_BUCKETS_MS, LATENESS_BUCKETS_MS
from delaysvc.store import history as store_history

UNSWEPT_CAP = 1_000_000
OTHER = "other"
"""The `topic` label of the topics without series of their own, summed."""
OUTCOMES = ("succeeded", "retried", "dead")
JOB_STATES = ("ready", "running", "dead")
MAX_TOPICS: int = Settings.model_fields["metrics_max_topics"].default


class ServiceCollector(Collector):
    def __init__(self, engine: Engine, statement_timeout_ms: int, max_topics: int = MAX_TOPICS):
        self.engine = engine
        self.timeout = statement_timeout_ms
        self.max_topics = max_topics

    def collect(self) -> Iterator[Metric]:
        with self.engine.begin() as conn:
            conn.execute(sql(f"SET LOCAL statement_timeout = {int(self.timeout)}"))
            lanes = store.lane_stats(conn)
            topics = store.topic_stats(conn)
            stored = store.messages_stored(conn)
            late_rows = store.lateness_totals(conn)
            topic_rows = store.topic_totals(conn)
            unswept = store_history.unswept(conn, UNSWEPT_CAP)
            days = len(store_history.partitions(conn))
        yield CounterMetricFamily(
            "delaysvc_messages_stored",
            "Messages stored since the database was created",
            value=stored,
        )
        yield from _lane_families(lanes)
        own = topics_kept(topic_rows, (topic.topic for topic in topics), self.max_topics)
        yield from _topic_families(topics, topic_rows, own)
        yield _histogram(
            "delaysvc_delivery_lateness_seconds",
            "deliver_ts -> in the topic queue, per lane",
            "lane",
            [(_lane_label(row.lane), row.counts, row.sum_ms) for row in late_rows],
            LATENESS_BUCKETS_MS,
        )
        yield GaugeMetricFamily(
            "delaysvc_history_unswept",
            f"Finished messages not yet moved into the history (counted up to {UNSWEPT_CAP:,})",
            value=unswept.rows,
        )
        yield GaugeMetricFamily(
            "delaysvc_history_unswept_oldest_seconds",
            "How long the oldest finished message has waited for the history sweep (0: none)",
            value=unswept.oldest_seconds,
        )
        yield GaugeMetricFamily(
            "delaysvc_history_days", "Days (partitions) of finished messages kept", value=days
        )


def _lane_label(lane: int) -> str:
    return "timer" if lane == 0 else str(lane)


def _lane_families(lanes: list[Any]) -> Iterator[Metric]:
    """Per lane, labelled `lane` only; `delaysvc_lane_info` says each lane's delay."""
    info = InfoMetricFamily(
        "delaysvc_lane", "The delay of each lane (any: the timer lane)", labels=["lane"]
    )
    pending = GaugeMetricFamily(
        "delaysvc_lane_pending", "Messages waiting in a lane", labels=["lane"]
    )
    moved = CounterMetricFamily(
        "delaysvc_lane_moved", "Messages moved to topic queues", labels=["lane"]
    )
    early = CounterMetricFamily(
        "delaysvc_lane_delivered_early",
        "Messages delivered early by a backlog cap",
        labels=["lane"],
    )
    lateness = GaugeMetricFamily(
        "delaysvc_lane_lateness_seconds",
        "How long the lane's due head has waited",
        labels=["lane"],
    )
    stuck = GaugeMetricFamily(
        "delaysvc_lane_stuck", "1 when the lane's head cannot be moved", labels=["lane"]
    )
    for lane in lanes:
        key = [_lane_label(lane.lane)]
        info.add_metric(key, {"delay": format_ms(lane.delay_ms) if lane.lane else "any"})
        pending.add_metric(key, lane.pending)
        moved.add_metric(key, lane.moved_total)
        early.add_metric(key, lane.early_total)
        overdue = 0.0
        if lane.next_due is not None and lane.next_due < lane.now:
            overdue = (lane.now - lane.next_due).total_seconds()
        lateness.add_metric(key, overdue)
        stuck.add_metric(key, 1 if lane.stuck_error else 0)
    yield from (info, pending, moved, early, lateness, stuck)


def topics_kept(totals: Iterable[Any], seen: Iterable[str], limit: int) -> frozenset[str]:
    """The topics with series of their own: the `limit` with the most jobs counted in
    `topic_total` (succeeded, retried and dead), ties and topics counted nothing yet (`seen`:
    ready jobs only) by name. A topic named `other` never has its own: it is in `other`."""
    counted = {row.topic: row.succeeded + row.retried + row.dead for row in totals}
    ranked = sorted(
        (counted.keys() | set(seen)) - {OTHER}, key=lambda topic: (-counted.get(topic, 0), topic)
    )
    return frozenset(ranked[:limit])


def _summed(
    rows: Iterable[tuple[str, Sequence[float]]], own: frozenset[str]
) -> dict[str, list[float]]:
    """Values per `topic` label: a kept topic's own, and under `other` the element-wise sums of
    every other topic's (a shorter list counts as zeros)."""
    summed: dict[str, list[float]] = {}
    for topic, values in rows:
        label = topic if topic in own else OTHER
        before = summed.get(label, [])
        summed[label] = [a + b for a, b in zip_longest(before, values, fillvalue=0)]
    return summed


def _topic_families(
    topics: list[Any], topic_rows: list[Any], own: frozenset[str]
) -> Iterator[Metric]:
    jobs = GaugeMetricFamily(
        "delaysvc_topic_jobs", "Jobs of a topic by state", labels=["topic", "state"]
    )
    by_state = ((t.topic, [getattr(t, state) for state in JOB_STATES]) for t in topics)
    for label, counts in _summed(by_state, own).items():
        for state, count in zip(JOB_STATES, counts, strict=True):
            jobs.add_metric([label, state], count)
    yield jobs
    outcomes = CounterMetricFamily(
        "delaysvc_jobs",
        "Jobs that succeeded, failed and were put back for a retry, or went to the dead letters",
        labels=["topic", "outcome"],
    )
    by_outcome = ((row.topic, [getattr(row, name) for name in OUTCOMES]) for row in topic_rows)
    for label, counts in _summed(by_outcome, own).items():
        for outcome, count in zip(OUTCOMES, counts, strict=True):
            outcomes.add_metric([label, outcome], count)
    yield outcomes
    timed = [row for row in topic_rows if row.duration_counts]  # Celery-task topics: none
    buckets = _summed(((row.topic, row.duration_counts) for row in timed), own)
    sums = _summed(((row.topic, [row.duration_sum_ms]) for row in timed), own)
    yield _histogram(
        "delaysvc_handler_duration_seconds",
        "Handler run time, per topic",
        "topic",
        [(label, counts, sums[label][0]) for label, counts in buckets.items()],
        DURATION_BUCKETS_MS,
    )


def _histogram(
    name: str,
    documentation: str,
    label: str,
    rows: list[tuple[str, Sequence[float], float]],
    bounds_ms: tuple[int, ...],
) -> HistogramMetricFamily:
    """A Prometheus histogram from per-bucket counts (not cumulative) and their sum in ms."""
    family = HistogramMetricFamily(name, documentation, labels=[label])
    for key, counts, sum_ms in rows:
        cumulative, buckets = 0, []
        for bound, count in zip((*bounds_ms, None), counts, strict=True):
            cumulative += int(count)
            buckets.append(("+Inf" if bound is None else str(bound / 1000), cumulative))
        family.add_metric([key], buckets, sum_value=sum_ms / 1000)
    return family


def render(engine: Engine, statement_timeout_ms: int, max_topics: int = MAX_TOPICS) -> bytes:
    """One scrape: delaysvc's metrics, and this process's (`process_*`, `python_*`)."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    registry.register(ServiceCollector(engine, statement_timeout_ms, max_topics))
    return generate_latest(registry)
