"""Which deployment a task of delaysvc's is for, so that a worker never runs another's.

delaysvc's Celery queues have the same names in every deployment (`delaysvc.delivery`,
`delaysvc.consume`), so two deployments given one broker database or vhost (staging and
production on one Redis, two schemas of one database) take each other's tasks. Most of them
only wake a lane or a topic, and cost the other deployment its latency; a bound task's outcome
(`delaysvc.task_succeeded`, `task_failed`) names a message and a claim by their numbers, which
another database may hold too, running: written there, it would end a job whose handler had
not finished (or lose its failure).

So each task of delaysvc's carries its deployment in a header: the database cluster's system
identifier, the database and the schema (`store.deployment_name`), the same from every host
and pooler. A worker or beat learns its own at start (`learn`); each task it publishes is
stamped (`_stamp`), a bound task's outcomes with the dispatcher's deployment, not the one of
the worker that ran it (`for_this_deployment`); and a worker runs a task stamped for another
deployment not at all, and says so (`DeploymentTask`), at most every SAY_SECONDS. A task
without the header (from a release before this one, or a process that could not learn its
deployment) runs as before.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Task
from celery.signals import before_task_publish
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from delaysvc import store
from delaysvc.db.names import schema
from delaysvc.errors import one_line

log = logging.getLogger(__name__)

HEADER = "delaysvc_deployment"
SAY_SECONDS = 30.0
_ours: str | None = None
_said_at: float | None = None


def learn(conn: Connection) -> str | None:
    """Read this process's deployment (once, at start), or None, said, when the server does
    not tell (its tasks then go unstamped and it runs every task, as before)."""
    global _ours
    try:
        _ours = f"{store.deployment_name(conn)}/{schema()}"
    except DBAPIError as exc:
        reason = one_line(exc)[:300]
        log.warning("tasks.deployment_unknown", extra={"error": reason})
        _ours = None
    return _ours


def ours() -> str | None:
    return _ours


def for_this_deployment() -> dict[str, str]:
    """Headers that say a task is this deployment's, for a signature another worker may
    publish (a bound task's outcome, published by whichever worker ran the task)."""
    return {HEADER: _ours} if _ours else {}


@before_task_publish.connect
def _stamp(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    if _ours and headers is not None and (sender or "").startswith("delaysvc."):
        headers.setdefault(HEADER, _ours)


class DeploymentTask(Task):
    """The class of delaysvc's Celery app's tasks: a task stamped for another deployment is
    said and not run (returns None)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        theirs = (self.request.headers or {}).get(HEADER)
        if theirs and _ours and theirs != _ours:
            _say_theirs(self.name, theirs)
            return None
        return super().__call__(*args, **kwargs)


def _say_theirs(task: str, theirs: str) -> None:
    global _said_at
    now = time.monotonic()
    if _said_at is not None and now - _said_at < SAY_SECONDS:
        return
    _said_at = now
    log.error(
        "tasks.other_deployment",
        extra={
            "task": task,
            "theirs": theirs,
            "ours": _ours,
            "fix": "give each deployment a broker database or vhost of its own "
            "(DELAYSVC_BROKER_URL): this worker takes the other's tasks and drops them",
        },
    )
