"""`GET /metrics` in the Prometheus text format. The engine's state lives in PostgreSQL, not in
the web process, so a collector reads it at scrape time from the same O(1)-per-lane queries as
`delaysvc stats` (offsets and sequences, never a COUNT(*) over a hot table), under a statement
timeout.

Histograms and counters are cumulative, as Prometheus requires: they are read from running
totals that only grow (`lateness_total`, `topic_total`), never from the week of minute rows the
dashboard reads, which are pruned."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from delaysvc import store
from delaysvc.config.levels import format_ms
from delaysvc.db.names import sql
from delaysvc.schema.tables import DURATION_BUCKETS_MS, LATENESS_BUCKETS_MS
from delaysvc.store import history as store_history

UNSWEPT_CAP = 1_000_000


class ServiceCollector(Collector):
    def __init__(self, engine: Engine, statement_timeout_ms: int):
        self.engine = engine
        self.timeout = statement_timeout_ms

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
        labels = ["lane", "delay"]
        pending = GaugeMetricFamily(
            "delaysvc_lane_pending", "Messages waiting in a lane", labels=labels
        )
        moved = CounterMetricFamily(
            "delaysvc_lane_moved", "Messages moved to topic queues", labels=labels
        )
        early = CounterMetricFamily(
            "delaysvc_lane_delivered_early",
            "Messages delivered early by a backlog cap",
            labels=labels,
        )
        lateness = GaugeMetricFamily(
            "delaysvc_lane_lateness_seconds",
            "How long the lane's due head has waited",
            labels=labels,
        )
        stuck = GaugeMetricFamily(
            "delaysvc_lane_stuck", "1 when the lane's head cannot be moved", labels=labels
        )
        for lane in lanes:
            key = [
                "timer" if lane.lane == 0 else str(lane.lane),
                format_ms(lane.delay_ms) if lane.lane else "any",
            ]
            pending.add_metric(key, lane.pending)
            moved.add_metric(key, lane.moved_total)
            early.add_metric(key, lane.early_total)
            overdue = 0.0
            if lane.next_due is not None and lane.next_due < lane.now:
                overdue = (lane.now - lane.next_due).total_seconds()
            lateness.add_metric(key, overdue)
            stuck.add_metric(key, 1 if lane.stuck_error else 0)
        yield from (pending, moved, early, lateness, stuck)
        jobs = GaugeMetricFamily(
            "delaysvc_topic_jobs", "Jobs of a topic by state", labels=["topic", "state"]
        )
        for topic in topics:
            for state in ("ready", "running", "dead"):
                jobs.add_metric([topic.topic, state], getattr(topic, state))
        yield jobs
        yield _histogram(
            "delaysvc_delivery_lateness_seconds",
            "deliver_ts -> in the topic queue, per lane",
            "lane",
            [
                ("timer" if row.lane == 0 else str(row.lane), row.counts, row.sum_ms)
                for row in late_rows
            ],
            LATENESS_BUCKETS_MS,
        )
        yield _histogram(
            "delaysvc_handler_duration_seconds",
            "Handler run time, per topic",
            "topic",
            [
                (row.topic, row.duration_counts, row.duration_sum_ms)
                for row in topic_rows
                if row.duration_counts  # a Celery-task topic records no handler durations
            ],
            DURATION_BUCKETS_MS,
        )
        yield from _outcome_counters(topic_rows)
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


def _histogram(
    name: str,
    documentation: str,
    label: str,
    rows: list[tuple[str, list[int], float]],
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


OUTCOMES = {
    "succeeded": "Jobs whose handler or task succeeded",
    "retried": "Failed jobs put back to wait for a retry",
    "dead": "Jobs moved to the dead letters",
}


def _outcome_counters(topic_rows: list[Any]) -> Iterator[CounterMetricFamily]:
    for outcome, documentation in OUTCOMES.items():
        family = CounterMetricFamily(
            f"delaysvc_topic_{outcome}", f"{documentation}, per topic", labels=["topic"]
        )
        for row in topic_rows:
            family.add_metric([row.topic], getattr(row, outcome))
        yield family


def render(engine: Engine, statement_timeout_ms: int) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(engine, statement_timeout_ms))
    return generate_latest(registry)
