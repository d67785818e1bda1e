"""Stats sampling for the dashboard's charts: a thin wrapper around
`delaysvc.store.dashboard.sample_stats` (run it every 10 s from beat)."""

from __future__ import annotations

from celery import shared_task

from delaysvc.maintenance.heartbeats import record_heartbeat
from delaysvc.store.dashboard import sample_stats as sample
from delaysvc.tasks.app import DATABASE_AWAY, runtime


@shared_task(name="delaysvc.sample_stats", ignore_result=True, throws=DATABASE_AWAY)
def sample_stats() -> int:
    """Record one stats_sample row per lane and prune old samples; -> lanes sampled."""
    return sample(runtime().engine, runtime().settings.statement_timeout_ms).lanes


@shared_task(name="delaysvc.fold_lane_counts", ignore_result=True, throws=DATABASE_AWAY)
def fold_lane_counts() -> int:
    """Fold the lanes' count deltas into one row per lane (every second from beat), so reading
    a lane's exact backlog sums a few thousand rows at most, and move the stored count's
    watermark a step (`store.settle_stored`). Beat fires it every second, so it is also beat's
    heartbeat."""
    from delaysvc import store

    record_heartbeat(runtime().engine, "beat")
    with runtime().engine.begin() as conn:
        store.settle_stored(conn)
    with runtime().engine.begin() as conn:
        return store.fold_lane_counts(conn)
