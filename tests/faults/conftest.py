"""The fault suite runs on the end-to-end harness: real Celery workers and beat."""

from tests.e2e.conftest import service, service_factory  # noqa: F401  (fixtures)
