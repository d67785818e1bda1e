"""The history sweep (`delaysvc.maintenance.history.sweep`), run by beat every few seconds."""

from __future__ import annotations

from celery import shared_task

from delaysvc.maintenance import history
from delaysvc.tasks.app import DATABASE_AWAY, runtime


@shared_task(name="delaysvc.move_history", ignore_result=True, throws=DATABASE_AWAY)
def move_history() -> int:
    """Move finished messages into the history, drop days past the retention; -> rows moved."""
    settings = runtime().settings
    return history.sweep(runtime().engine, settings.history_retention_ms).moved
