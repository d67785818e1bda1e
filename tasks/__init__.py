"""Celery entry point: `celery -A tasks worker|beat` finds `tasks.app`... as `app` here."""

from tasks.app import create_celery_app

app = create_celery_app()

__all__ = ["app"]
