"""Celery entry point: `celery -A delaysvc.tasks worker|beat` finds the app as `app` here."""

from delaysvc.tasks.app import create_celery_app

app = create_celery_app()

__all__ = ["app"]
