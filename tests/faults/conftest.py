"""The fault suite runs on the end-to-end harness: real Celery workers and beat."""

from tests.e2e.conftest import (  # noqa: F401  (fixtures)
    check_clean_at_the_end,
    service,
    service_factory,
)
