"""Where the Celery app sends its tasks: maintenance beside the lanes on the delivery queue,
handlers' work on the consume queue."""

from __future__ import annotations

import sys

from delaysvc.config import logs
from delaysvc.tasks import app
from delaysvc.tasks.app import CONSUME_QUEUE, DELIVERY_QUEUE


def _queue(task: str) -> str:
    """The queue the app (`celery -A delaysvc.tasks`) routes `task` to."""
    return str(app.amqp.router.route({}, task)["queue"].name)


def test_the_lease_rescue_is_never_queued_behind_consume_work() -> None:
    """Found by the 30-minute chaos run: the rescue of expired leases was a consume-queue task
    with a short expiry, so behind a backlog of consume tasks it expired unrun, and the jobs of
    a killed consumer stayed `running` for 13 minutes, holding their topic's max_running. It
    runs on the delivery queue, with the other maintenance."""
    assert _queue("delaysvc.rescue_leases") == DELIVERY_QUEUE
    for maintenance in ("delaysvc.fold_lane_counts", "delaysvc.move_history"):
        assert _queue(maintenance) == DELIVERY_QUEUE
    assert _queue("delaysvc.consume") == CONSUME_QUEUE


def test_a_handler_module_making_its_own_celery_app_leaves_delaysvc_current(
    tmp_path, monkeypatch
) -> None:
    """A handler module may make a Celery app (an application made durable does, named in
    DELAYSVC_HANDLERS), and Celery makes every new app the current one: delaysvc's own tasks
    (`consume.apply_async`) would then go to that app's broker. Failed before `Loader`."""
    from celery import current_app

    from delaysvc.config.settings import Settings
    from delaysvc.tasks.app import create_celery_app
    from delaysvc.tasks.consume import consume

    (tmp_path / "their_app.py").write_text(
        "from celery import Celery\napp = Celery('theirs', broker='memory://')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    before = current_app._get_current_object()
    ours = create_celery_app(Settings(handlers="their_app", broker_url="memory://"))
    ours.set_current()
    try:
        ours.loader.import_default_modules()
        assert current_app.main == "delaysvc"
        assert consume.app is ours
    finally:
        before.set_current()


def test_a_task_meeting_the_database_away_is_said_once_without_a_traceback(
    monkeypatch, caplog
) -> None:
    """Every task run during a database restart was an ERROR with its traceback (100 s of
    outage: 13 MB of log, found by a reviewer). Such a failure is expected (Celery's
    `throws`: one INFO line), and the worker says so once every SAY_AWAY_SECONDS."""
    from celery import current_app
    from sqlalchemy.exc import OperationalError

    from delaysvc.config.settings import Settings
    from delaysvc.tasks.app import create_celery_app
    from delaysvc.tasks.stats import sample_stats

    tasks_app = sys.modules["delaysvc.tasks.app"]  # (`delaysvc.tasks.app` is the Celery app)
    away = Settings(database_url="postgresql://nobody@127.0.0.1:9/none", broker_url="memory://")
    before = current_app._get_current_object()
    ours = create_celery_app(away)
    ours.set_current()
    monkeypatch.setattr(tasks_app, "_runtime", None)
    monkeypatch.setattr(tasks_app, "_away", logs.Sparingly(tasks_app.SAY_AWAY_SECONDS))
    try:
        with caplog.at_level("INFO"):
            runs = [ours.tasks[sample_stats.name].apply() for _ in range(3)]
    finally:
        before.set_current()
        tasks_app._runtime = None
    assert all(isinstance(run.result, OperationalError) for run in runs)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    said = [r for r in caplog.records if r.getMessage() == "tasks.database_unavailable"]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert said[0].task == "delaysvc.sample_stats" and "127.0.0.1" in said[0].error
