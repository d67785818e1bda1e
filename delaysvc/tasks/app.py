"""The Celery app, built by a function from the settings (the edge), and the per-process
runtime the task wrappers share (engine, consumer). Queues:

- `delaysvc.maintenance.delivery`: one long-ish task per lane at a time; serve it with a thread pool
  (`-P threads -c <lanes + 2>`): the tasks wait on the database and on the clock, not the CPU.
- `delaysvc.consume`: consumer batches; serve it with the default prefork pool.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

import kombu
from celery import Celery
from celery.loaders.app import AppLoader
from celery.schedules import schedule
from celery.signals import beat_init, setup_logging, task_failure, worker_init, worker_ready
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from delaysvc.config import logs
from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine, require_one_database, require_session
from delaysvc.errors import ConfigError, DatabaseUnavailable, SchemaNotReady, one_line
from delaysvc.maintenance import history, periodic
from delaysvc.store.dashboard import SAMPLE_EVERY
from delaysvc.tasks import broker, deployment
from delaysvc.tasks.deployment import DeploymentTask
from delaysvc.worker.consumer import Consumer, Job
from delaysvc.worker.handlers import load_handler_modules

DELIVERY_QUEUE = "delaysvc.delivery"
CONSUME_QUEUE = "delaysvc.consume"
DELIVERY_NEEDS = "a delivery worker (each lane's runner)"
SWEEP_SECONDS = 1.0
RESCUE_SECONDS = 10.0
STATS_SECONDS = SAMPLE_EVERY.total_seconds()  # the dashboard's charts and moved/s
FOLD_SECONDS = 1.0  # lane_count deltas folded


def broker_options(settings: Settings) -> tuple[str, dict[str, object]]:
    """The configured broker, or the filesystem broker under var/ for the embedded mode: it
    needs no server, and each message file is deleted once consumed, so it does not grow (its
    limits: one machine, and consumers poll the folder every 20 ms)."""
    if settings.broker_url:
        _check_broker_url(settings.broker_url)
        return settings.broker_url, {}
    folder = (settings.var_dir / "broker").resolve()  # made by the first connection
    return f"{broker.SCHEME}://localhost//", {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(folder / "control"),  # kombu's default: ./control
        "store_processed": False,
        "polling_interval": 0.02,
    }


def _check_broker_url(url: str) -> None:
    """Refuse, naming DELAYSVC_BROKER_URL, a URL kombu has no transport for (or whose transport's
    library is not installed): otherwise each worker and beat would fail as it starts, and be
    started again, a traceback each time. The transport is looked up, nothing is connected;
    the URL is not repeated (it may hold a password)."""
    usage = "use redis://host:6379/0 or amqp://user:password@host:5672//"
    scheme, found, _ = url.partition("://")
    if not found or not scheme:
        raise ConfigError(f"DELAYSVC_BROKER_URL: not a URL (no scheme://); {usage}")
    try:
        kombu.Connection(url).transport  # noqa: B018 (looked up, not connected)
    except KeyError:
        raise ConfigError(
            f"DELAYSVC_BROKER_URL: no broker transport named {scheme!r}; {usage}"
        ) from None
    except ImportError as exc:
        raise ConfigError(
            f"DELAYSVC_BROKER_URL: the {scheme} transport needs a library that is not "
            f"installed ({exc})"
        ) from None


def monotonic_now() -> datetime:
    """Beat's clock. Celery's interval schedules compare wall-clock times, so a wall clock
    stepped back (NTP, a resumed VM) would hold every entry back for as long as the step; the
    monotonic clock never steps. Its datetimes mean nothing across reboots, which is why beat
    keeps its schedule in memory (`beat_scheduler` below)."""
    return datetime.fromtimestamp(time.monotonic(), tz=UTC)


def every(seconds: float) -> schedule:
    return schedule(timedelta(seconds=seconds), nowfun=monotonic_now)


class Loader(AppLoader):
    """Celery's loader, keeping delaysvc's app the current one once the handler modules are
    imported: a handler module may make a Celery app of its own (an application made durable
    with `delaysvc.contrib.celery` does), and Celery makes each new app the current one, whose
    broker would then be given delaysvc's own tasks (`consume.apply_async`)."""

    def import_default_modules(self) -> list[Any]:
        try:
            return list(super().import_default_modules())
        finally:
            self.app.set_current()


def create_celery_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings.from_env()
    broker_url, transport_options = broker_options(settings)
    # handler modules are imported by every worker, so Celery tasks they define (topics bound
    # with DELAYSVC_TOPIC_TASKS) are registered too
    include = [
        "delaysvc.tasks.delivery",
        "delaysvc.tasks.consume",
        "delaysvc.tasks.stats",
        "delaysvc.tasks.periodic",
        "delaysvc.tasks.history",
        *settings.handler_modules,
    ]
    app = Celery(
        "delaysvc",
        broker=broker_url,
        include=include,
        loader=Loader,
        task_cls=DeploymentTask,  # runs no task stamped for another deployment
    )
    app.steps["consumer"].add("delaysvc.tasks.delivery:LanesOnConnect")
    budget = settings.lane_budget_seconds
    # an expired lease is found within a third of a lease (and at least every RESCUE_SECONDS)
    rescue_every = min(RESCUE_SECONDS, settings.lease_seconds / 3)
    app.conf.update(
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=1,
        # After a reconnect Celery lowers the prefetch while tasks run and raises it again from
        # each task's acknowledgement, which the delivery worker's thread pool makes in its
        # threads: their `basic.qos` waited on the consumer's AMQP connection beside the main
        # thread (py-amqp is not thread-safe) and the worker took nothing more after a RabbitMQ
        # restart (2 in 6 restarts here; the RabbitMQ fault tests). The prefetch stays as set.
        worker_enable_prefetch_count_reduction=False,
        worker_hijack_root_logger=False,
        task_routes={
            "delaysvc.deliver_lane": {"queue": DELIVERY_QUEUE},
            "delaysvc.sample_stats": {"queue": DELIVERY_QUEUE},
            "delaysvc.fold_lane_counts": {"queue": DELIVERY_QUEUE},
            "delaysvc.fire_schedules": {"queue": DELIVERY_QUEUE},
            "delaysvc.move_history": {"queue": DELIVERY_QUEUE},
            # beside the other maintenance, never behind a backlog of consume tasks: there it
            # expired unrun, and jobs of a killed consumer stayed `running` until the backlog
            # drained (13 minutes in a 30-minute chaos run), holding their topics' max_running
            "delaysvc.rescue_leases": {"queue": DELIVERY_QUEUE},
            "delaysvc.*": {"queue": CONSUME_QUEUE},
        },
        task_default_queue=CONSUME_QUEUE,
        # no time limit: a handler runs as long as it takes while its process lives and renews
        # its lease (consumption.Leases); a process that dies has its jobs taken again
        worker_max_memory_per_child=settings.worker_max_memory_mb * 1024 or None,
        # every entry runs every few seconds: nothing is worth persisting across restarts, and
        # the monotonic times of `every` would be wrong after a reboot
        beat_scheduler="celery.beat:Scheduler",
        beat_schedule={
            **{
                f"deliver-lane-{lane}": {
                    "task": "delaysvc.deliver_lane",
                    "schedule": every(budget),
                    "args": (lane,),
                    "options": {"expires": budget},
                }
                for lane in range(0, settings.levels.max_level + 1)
            },
            "consume-sweep": {
                "task": "delaysvc.consume_sweep",
                "schedule": every(SWEEP_SECONDS),
                "options": {"expires": SWEEP_SECONDS},
            },
            "fold-lane-counts": {
                "task": "delaysvc.fold_lane_counts",
                "schedule": every(FOLD_SECONDS),
                "options": {"expires": FOLD_SECONDS},
            },
            "fire-schedules": {
                "task": "delaysvc.fire_schedules",
                "schedule": every(periodic.FIRE_SECONDS),
                "options": {"expires": periodic.FIRE_SECONDS},
            },
            "sample-stats": {
                "task": "delaysvc.sample_stats",
                "schedule": every(STATS_SECONDS),
                "options": {"expires": STATS_SECONDS},
            },
            "move-history": {
                "task": "delaysvc.move_history",
                "schedule": every(history.SWEEP_SECONDS),
                "options": {"expires": history.SWEEP_SECONDS},
            },
            "rescue-leases": {
                "task": "delaysvc.rescue_leases",
                "schedule": every(rescue_every),
                "options": {"expires": rescue_every},
            },
        },
    )
    if not settings.broker_url:
        app.conf.worker_enable_remote_control = False
    app.conf.delaysvc_settings = settings
    return app


log = logging.getLogger(__name__)

DATABASE_AWAY: tuple[type[BaseException], ...] = (OperationalError, DatabaseUnavailable)
"""What a task of delaysvc's raises when the database is away (restarting, failing over): its
tasks declare it expected (Celery's `throws`: an INFO line, no traceback), and a worker says
it once every SAY_AWAY_SECONDS (`_said_database_away`). Each task runs again when beat fires
it, or its lane's run is re-armed: an outage of 100 s wrote 13 MB of ERROR lines with their
tracebacks, one a task run (found by a reviewer)."""
SAY_AWAY_SECONDS = 30.0
_away = logs.Sparingly(SAY_AWAY_SECONDS)


@task_failure.connect
def _said_database_away(
    sender: Any = None, exception: BaseException | None = None, **_: Any
) -> None:
    if isinstance(exception, DATABASE_AWAY) and _away.now():
        log.warning(
            "tasks.database_unavailable",
            extra={"task": getattr(sender, "name", None), "error": one_line(exception)[:300]},
        )


READY_FILE_ENV = "DELAYSVC_READY_FILE"
"""The file a worker or beat writes its pid to once it takes work, when this names one: a
reload's new process, whose supervisor stops the old one then (`runtime.supervisor`)."""


@worker_ready.connect
@beat_init.connect
def _say_ready(**_: object) -> None:
    path = os.environ.get(READY_FILE_ENV)
    if path:
        Path(path).write_text(str(os.getpid()))


@worker_init.connect
@beat_init.connect
def _know_the_deployment(sender: Any, **_: object) -> None:
    """Worker and beat stamp the tasks they publish with their deployment, and a worker runs
    no other deployment's (`tasks.deployment`)."""
    deployment.know(sender.app.conf.delaysvc_settings)


@worker_init.connect
def _refuse_to_start(sender: object, **_: object) -> None:
    """`celery -A delaysvc.tasks worker` starts only as `delaysvc worker` would (which checks
    before it starts Celery): on a database migrated to this release with its delay levels
    (`migrate.check_schema`); to serve the delivery queue, with a URL that keeps a session
    (`db.require_session`); to serve the consume queue, with every task `DELAYSVC_TOPIC_TASKS`
    binds (its jobs come to this queue: a task it lacks is "unregistered", each job retried
    until dead). Celery logs and ignores an exception a signal handler raises, so a refusal
    ends the process itself, with the reason on stderr and exit status 2, as the CLI's own
    errors. (The handler modules are imported by then: `Loader`.)"""
    from delaysvc.schema import migrate

    settings = sender.app.conf.delaysvc_settings  # type: ignore[attr-defined]
    queues = set(sender.app.amqp.queues.consume_from)  # type: ignore[attr-defined]
    try:
        if DELIVERY_QUEUE in queues:
            require_session(settings, DELIVERY_NEEDS)
            require_one_database(settings)
        if CONSUME_QUEUE in queues:
            _require_bound_tasks(settings, sender.app.tasks)  # type: ignore[attr-defined]
        engine = make_engine(settings)
        try:
            with engine.connect() as conn:
                migrate.check_schema(conn, settings.levels)
        finally:
            engine.dispose()
    except (ConfigError, SchemaNotReady) as refused:
        print(f"error: {refused}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _require_bound_tasks(settings: Settings, tasks: Any) -> None:
    """ConfigError naming the first task `DELAYSVC_TOPIC_TASKS` binds that `tasks` lacks."""
    for topic, name in sorted(settings.task_topics.items()):
        if name not in tasks:
            raise ConfigError(
                f"DELAYSVC_TOPIC_TASKS binds {topic} to {name}, a task this worker does not "
                "have: list the module that defines it in DELAYSVC_HANDLERS (delaysvc's consume "
                "workers run it); to run tasks on your own Celery workers, see durable(app)"
            )


@setup_logging.connect
def _configure_logging(
    loglevel: int | str | None = None, logfile: str | None = None, **_: object
) -> None:
    """Worker and beat log through `delaysvc.config.logs` (DELAYSVC_LOG_FORMAT), Celery's own
    records too: with a receiver of this signal connected, Celery installs no handler of its own."""
    from celery import current_app

    settings = getattr(current_app.conf, "delaysvc_settings", None) or Settings.from_env()
    logs.configure(settings, loglevel or "WARNING", logfile)


@dataclass
class Runtime:
    """What tasks in one worker process share; built lazily after the pool forks."""

    settings: Settings
    pid: int

    @cached_property
    def engine(self) -> Engine:
        return make_engine(self.settings, pool_size=max(5, self.settings.levels.max_level + 5))

    @cached_property
    def delivery_engine(self) -> Engine:
        """The lanes' engine: a lane runner keeps its lane's advisory lock on its session
        (`db.require_session`), so with a direct URL it is that URL's, else the consumers'."""
        require_session(self.settings, DELIVERY_NEEDS)
        direct = self.settings.direct_database_url
        if direct in (None, self.settings.database_url):
            return self.engine
        return make_engine(self.settings, direct, pool_size=self.settings.levels.max_level + 2)

    @cached_property
    def consumer(self) -> Consumer:
        load_handler_modules(self.settings.handler_modules)
        return Consumer(self.settings, self.engine, dispatch_to_celery)


def dispatch_to_celery(task_name: str, job: Job, claim_id: int) -> None:
    """Send a due job to its Celery task now (no ETA, no countdown); the outcome comes back
    through the link callbacks (`tasks.consume.task_succeeded`, `task_failed`, named here by
    their task names) into the same retry / dead-letter path as handlers."""
    from celery import current_app

    sent_at = time.time()
    # written by this deployment only, whichever worker runs the task (`tasks.deployment`)
    outcome = {"args": (job.id, claim_id, sent_at), "kwargs": {"deployment": deployment.ours()}}
    current_app.send_task(
        task_name,
        args=[job.body],
        kwargs={},
        headers={"delaysvc_message_id": job.id, "delaysvc_attempt": job.attempts},
        link=current_app.signature("delaysvc.task_succeeded", **outcome),
        link_error=current_app.signature("delaysvc.task_failed", **outcome),
    )


_runtime: Runtime | None = None


def runtime() -> Runtime:
    global _runtime
    if _runtime is None or _runtime.pid != os.getpid():
        from celery import current_app

        _runtime = Runtime(current_app.conf.delaysvc_settings, os.getpid())
    return _runtime


class Stopping:
    """A worker's stop for its long-running tasks (lane runs, the periodic declarer), asked by
    Celery's `worker_shutting_down`. Celery sends that signal inside the worker's SIGTERM
    handler, and a second SIGTERM (the kernel's on the supervisor's death, a deploy's own)
    runs the handler again in the same thread, interrupting the first: found inside
    `Event.set`, holding the Event's lock, the first would be waited for forever (a delivery
    worker once never stopped after its `up` was killed -9). Only the first request touches
    the Event; the rest see the plain flag and return."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._asked = False

    def ask(self) -> None:
        if self._asked:
            return
        self._asked = True
        self.event.set()
