"""Processes: the `delaysvc up` supervisor (the Celery app and its tasks are `delaysvc.tasks`)."""
