"""Which deployment a task of delaysvc's is for, so that a worker never runs another's.

delaysvc's Celery queues have the same names in every deployment (`delaysvc.delivery`,
`delaysvc.consume`), so two deployments given one broker database or vhost (staging and
production on one Redis, two schemas of one database) take each other's tasks. Most of them
only wake a lane or a topic, and cost the other deployment its latency; a bound task's outcome
(`delaysvc.task_succeeded`, `task_failed`) names a message and a claim by their numbers, which
another database may hold too, running: written there, it would end a job whose task had not
finished, or retry one that had not failed.

So each task of delaysvc's carries its deployment in a header: the database cluster's system
identifier, the database and the schema (`store.deployment_name`), the same from every host
and pooler. A worker or beat learns its own as it starts (`know`; with the database away, when
next needed); each task it publishes is stamped (`_stamp`); a worker runs a task stamped for
another deployment not at all, and says so (`DeploymentTask`), at most every SAY_SECONDS. A
bound task's outcomes carry the dispatcher's deployment as an argument (`foreign`): Celery
calls a failure's callback inside the worker that ran the task, where no header is read. A
task without the header (from a release before this one, or a process that does not know its
deployment yet) runs as before.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from celery import Task
from celery.signals import before_task_publish
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from delaysvc import store
from delaysvc.config import logs
from delaysvc.db.engines import make_engine
from delaysvc.db.names import schema
from delaysvc.errors import one_line

if TYPE_CHECKING:
    from delaysvc.config.settings import Settings

log = logging.getLogger(__name__)

HEADER = "delaysvc_deployment"
SAY_SECONDS = 30.0
RETRY_SECONDS = 10.0
_ours: str | None = None
_settings: Settings | None = None
_tried_at: float | None = None
_theirs_seen = logs.Sparingly(SAY_SECONDS)


def know(settings: Settings) -> None:
    """Learn this process's deployment now (a worker's or beat's start), or, with the database
    away, when it is next needed, every RETRY_SECONDS until it is known."""
    global _settings
    _settings = settings
    ours()


def ours() -> str | None:
    """This process's deployment, or None while it is not known (its tasks then go unstamped
    and it runs every task)."""
    global _tried_at
    if _ours is not None or _settings is None:
        return _ours
    now = time.monotonic()
    if _tried_at is not None and now - _tried_at < RETRY_SECONDS:
        return None
    _tried_at = now
    engine = make_engine(_settings, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return learn(conn)
    except DBAPIError as exc:
        log.warning("tasks.deployment_unknown", extra={"error": one_line(exc)[:300]})
        return None
    finally:
        engine.dispose()


def learn(conn: Connection) -> str:
    """Read this process's deployment on `conn`."""
    global _ours
    _ours = f"{store.deployment_name(conn)}/{schema()}"
    return _ours


def foreign(task: str, theirs: str | None) -> bool:
    """Is a task for `theirs` another deployment's? Said, at most every SAY_SECONDS."""
    mine = ours() if theirs else None
    if not theirs or not mine or theirs == mine:
        return False
    _say_theirs(task, theirs, mine)
    return True


@before_task_publish.connect
def _stamp(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is not None and (sender or "").startswith("delaysvc."):
        mine = ours()
        if mine:
            headers.setdefault(HEADER, mine)


class DeploymentTask(Task):
    """The class of delaysvc's Celery app's tasks: a task stamped for another deployment is
    said and not run (returns None)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if foreign(self.name, (self.request.headers or {}).get(HEADER)):
            return None
        return super().__call__(*args, **kwargs)


def _say_theirs(task: str, theirs: str, mine: str) -> None:
    if not _theirs_seen.now():
        return
    log.error(
        "tasks.other_deployment",
        extra={
            "task": task,
            "theirs": theirs,
            "ours": mine,
            "fix": "give each deployment a broker database or vhost of its own "
            "(DELAYSVC_BROKER_URL): this worker takes the other's tasks and drops them",
        },
    )
