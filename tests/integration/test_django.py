"""`delaysvc.contrib.django`: a send inside `transaction.atomic()` on Django's own connection, in a
real Django project (tests/django_project) on PostgreSQL, through pytest-django. Each test has
its own database, cloned from delaysvc's migrated template, with the project's `migrate` applied.

Django picks its driver once per process (psycopg 3 when it is installed): the psycopg2 backend
is tested by running this module again in a process whose Django cannot see psycopg 3
(`DELAYSVC_TEST_DJANGO_DRIVER=psycopg2`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qs, urlsplit

import pytest

DRIVER = os.environ.get("DELAYSVC_TEST_DJANGO_DRIVER", "psycopg")


def _django_without_psycopg3() -> None:
    """Load Django's PostgreSQL backend while `import psycopg` fails: it takes psycopg2."""
    saved = sys.modules.get("psycopg")
    sys.modules["psycopg"] = None  # type: ignore[assignment]
    try:
        import django.db.backends.postgresql.base  # noqa: F401
    finally:
        sys.modules["psycopg"] = saved  # type: ignore[assignment]


if DRIVER == "psycopg2":
    _django_without_psycopg3()

import django  # noqa: E402
from django.conf import settings as django_settings  # noqa: E402

if not django_settings.configured:
    # not left in the environment: processes other tests start are no Django projects; nor is
    # the TZ Django sets from TIME_ZONE when configured (at collection: every later test of
    # the session would see local times shifted)
    previous = {name: os.environ.get(name) for name in ("DJANGO_SETTINGS_MODULE", "TZ")}
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.django_project.settings"
    try:
        django.setup()
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        time.tzset()
assert django_settings.SETTINGS_MODULE == "tests.django_project.settings"

from django.core.management import call_command  # noqa: E402
from django.db import connection, connections, transaction  # noqa: E402
from django.test import override_settings  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from sqlalchemy import Engine, text  # noqa: E402

import delaysvc  # noqa: E402
import delaysvc.producer.default  # noqa: E402
from delaysvc.config.settings import Settings  # noqa: E402
from delaysvc.contrib import django as delaysvc_django  # noqa: E402
from delaysvc.db.names import table  # noqa: E402
from delaysvc.errors import BacklogFull, NotFound, ValidationError  # noqa: E402
from delaysvc.producer.sending import Producer  # noqa: E402
from tests.conftest import TEST_LEVELS  # noqa: E402
from tests.django_project.shop.models import Order  # noqa: E402
from tests.support.joined_checks import (  # noqa: E402
    BODY,
    NOTHING,
    Rollback,
    clean_registry,  # noqa: F401  (a fixture)
    runs_like_any_other,
    stored,
)

pytestmark = pytest.mark.django_db(transaction=True)  # the tests commit, as an application does


@pytest.fixture
def django_db_setup(database_url: str, django_db_blocker) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """pytest-django's database: this test's own (delaysvc's tables in it), with the Django
    project's migrations applied."""
    parts = urlsplit(database_url)
    query = parse_qs(parts.query)  # the embedded server is reached by ?host=<socket dir>&port=
    database = connections.settings["default"]  # the dict Django's connection reads
    database.update(
        NAME=parts.path.lstrip("/"),
        USER=parts.username or "",
        PASSWORD=parts.password or "",
        HOST=parts.hostname or query.get("host", [""])[0],
        PORT=str(parts.port or query.get("port", [""])[0]),
    )
    with django_db_blocker.unblock():
        connections.close_all()
        call_command("migrate", verbosity=0)
    yield
    with django_db_blocker.unblock():
        connections.close_all()


@pytest.fixture(autouse=True)
def delaysvc_settings(settings: Settings) -> Iterator[Settings]:
    delaysvc_django.configure(settings)
    yield settings
    delaysvc_django.configure(None)


def test_django_runs_on_the_driver_asked_for() -> None:
    assert connection.Database.__name__ == DRIVER


def test_a_rollback_stores_neither_the_order_nor_the_message(engine: Engine) -> None:
    queries = CaptureQueriesContext(connection)
    with queries, pytest.raises(Rollback), transaction.atomic():
        order = Order.objects.create(total=120)
        message = delaysvc_django.send(
            "order.cancel", {"order_id": order.id}, delay_level=2, key=f"order-{order.id}"
        )
        assert delaysvc_django.get(message.id).status == "scheduled"  # in this transaction
        raise Rollback
    # through Django's cursor: its query log (and execute wrappers) see delaysvc's statements
    send = f"SELECT * FROM {table('send_one')}("
    assert sum(send in query["sql"] for query in queries) == 1
    assert Order.objects.count() == 0
    assert stored(engine, "order.cancel") == NOTHING
    with pytest.raises(NotFound):
        delaysvc_django.get(message.id)


@pytest.mark.usefixtures("clean_registry")
def test_a_commit_stores_both_once_and_the_key_then_returns_the_message(
    settings: Settings, engine: Engine
) -> None:
    with transaction.atomic():
        order = Order.objects.create(total=120)
        first = delaysvc_django.send("order.cancel", BODY, delay_level=2, key=f"order-{order.id}")
    assert list(Order.objects.values_list("id", flat=True)) == [order.id]
    assert stored(engine, "order.cancel") == {
        **NOTHING,
        "commit_log": [first.id],
        "levels": [(2, first.id)],
    }
    with transaction.atomic():
        again = delaysvc_django.send("order.cancel", {"n": 2}, delay="7s", key=f"order-{order.id}")
    assert (again.id, again.created, again.body, again.properties) == (first.id, False, BODY, {})
    assert stored(engine, "order.cancel")["commit_log"] == [first.id]
    runs_like_any_other(settings, engine, first)


def test_a_savepoint_rolled_back_takes_its_send_with_it(engine: Engine) -> None:
    with transaction.atomic():
        kept = delaysvc_django.send("order.cancel", 1, delay="7s")
        with pytest.raises(Rollback), transaction.atomic():
            dropped = delaysvc_django.send("order.cancel", 2, delay="7s")
            raise Rollback
    assert dropped.id != kept.id
    assert stored(engine, "order.cancel") == {
        **NOTHING,
        "commit_log": [kept.id],
        "timer": [kept.id],
    }


def test_outside_atomic_each_call_commits_by_itself(engine: Engine) -> None:
    assert connection.get_autocommit() and not connection.in_atomic_block
    one = delaysvc_django.send("order.auto", 1, delay_level=1, key="k")
    batch = delaysvc_django.send_batch(
        [{"topic": "order.auto", "body": n, "delay_level": 3} for n in range(2)]
    )
    assert delaysvc_django.cancel(topic="order.auto", key="k").status == "cancelled"
    assert connection.get_autocommit() and not connection.in_atomic_block  # as it was
    assert stored(engine, "order.auto") == {
        **NOTHING,
        "commit_log": [one.id, *(m.id for m in batch)],
        "levels": [(3, batch[0].id), (3, batch[1].id)],
    }


def test_a_batch_and_a_cancel_inside_atomic(engine: Engine) -> None:
    waiting = delaysvc_django.send("order.batch", 0, delay_level=1, key="w")
    with transaction.atomic():
        sent = delaysvc_django.send_batch(
            [
                {"topic": "order.batch", "body": b"\x00", "delay_level": 2, "key": "a"},
                {"topic": "order.batch", "body": 2, "key": "w"},
                {"topic": "order.batch", "body": 3, "properties": {"p": "v"}},
            ]
        )
        delaysvc_django.cancel(waiting.id)
    assert [m.created for m in sent] == [True, False, True]
    assert sent[1].id == waiting.id
    assert stored(engine, "order.batch") == {
        **NOTHING,
        "commit_log": [waiting.id, sent[0].id, sent[2].id],
        "levels": [(2, sent[0].id)],
        "ready": [sent[2].id],
    }
    assert delaysvc_django.get(sent[0].id).body == b"\x00"
    assert delaysvc_django.get(sent[2].id).properties == {"p": "v"}


def test_a_refused_send_leaves_the_atomic_block_usable(database_url: str, engine: Engine) -> None:
    delaysvc_django.configure(
        Settings(
            database_url=database_url, delay_levels=TEST_LEVELS, backlog_caps="level:2=1:reject"
        )
    )
    with transaction.atomic():
        kept = delaysvc_django.send("order.capped", 1, delay_level=2)
        with pytest.raises(BacklogFull):
            delaysvc_django.send("order.capped", 2, delay_level=2)
        with pytest.raises(ValidationError):
            delaysvc_django.send("order.capped", 3, delay="forever")
        order = Order.objects.create(total=1)  # no TransactionManagementError
    assert list(Order.objects.values_list("id", flat=True)) == [order.id]
    assert stored(engine, "order.capped")["commit_log"] == [kept.id]


def test_a_database_error_delaysvc_does_not_name_is_djangos_own() -> None:
    """A send in an atomic block an earlier statement aborted: it raised SQLAlchemy's
    InternalError, which `except django.db.DatabaseError` does not catch."""
    from django.db import DatabaseError

    with transaction.atomic():
        with pytest.raises(DatabaseError), connection.cursor() as cursor:
            cursor.execute("SELECT 1/0")
        with pytest.raises(DatabaseError, match="current transaction is aborted"):
            delaysvc_django.send("order.aborted", 1)
        transaction.set_rollback(True)


def test_the_core_send_joins_django_db_connection_too(producer: Producer, engine: Engine) -> None:
    with transaction.atomic():
        sent = producer.send("order.core", 1, delay_level=1, connection=connection)
        same = producer.send("order.core", 2, connection=connections["default"])
    assert stored(engine, "order.core")["commit_log"] == [sent.id, same.id]
    saved = delaysvc.producer.default._producer
    delaysvc.producer.default._producer = producer
    try:
        with pytest.raises(Rollback), transaction.atomic():
            delaysvc.send("order.core", 3, connection=connection)
            raise Rollback
    finally:
        delaysvc.producer.default._producer = saved
    assert stored(engine, "order.core")["commit_log"] == [sent.id, same.id]


@pytest.mark.usefixtures("clean_registry")
def test_a_django_handler_commits_its_orm_rows_with_the_jobs_success(
    settings: Settings, engine: Engine, producer: Producer
) -> None:
    """`delaysvc.contrib.django.handler`: the handler's ORM writes and the job's `succeeded`
    go through Django's connection in one `atomic()`: a failure takes both back."""
    from delaysvc.worker.consumer import Consumer

    @delaysvc_django.handler("order.create")
    def create(message):  # type: ignore[no-untyped-def]
        Order.objects.create(total=message.body["total"])
        assert transaction.get_connection().in_atomic_block
        if message.attempts == 1:
            raise ValueError("after the write")

    sent = producer.send("order.create", {"total": 7})
    consumer = Consumer(settings, engine)
    queries = CaptureQueriesContext(connection)
    with queries:
        consumer.run_once("order.create")
    assert Order.objects.count() == 0  # rolled back with the failure
    assert producer.get(sent.id).status == "retrying"
    # the job's lock went through Django's cursor (its success was never reached)
    assert sum(table("commit_log") in query["sql"] for query in queries) == 1
    assert producer.get(sent.id).attempts == 1

    from delaysvc import store
    from delaysvc.maintenance import delivery

    with engine.connect() as conn:
        lane = store.get_message(conn, sent.id).lane
    with engine.connect() as conn:  # its retry delivered as if its wait were over
        later = datetime.now(UTC) + timedelta(hours=3)
        assert delivery.run_once(conn, lane, 100, now=later).moved == 1
    assert consumer.run_once("order.create").succeeded == 1
    assert list(Order.objects.values_list("total", flat=True)) == [7]
    assert producer.get(sent.id).status == "succeeded"


def test_a_django_handler_that_marks_its_transaction_for_rollback_is_retried_saying_so(
    settings: Settings, engine: Engine, producer: Producer
) -> None:
    """Found by a reviewer: `transaction.set_rollback(True)` (no exception) was recorded as
    Django's "An error occurred in the current transaction", from delaysvc's own success
    write, though no query had failed."""
    from delaysvc.worker.consumer import Consumer

    @delaysvc_django.handler("order.undone")
    def undo(message):  # type: ignore[no-untyped-def]
        Order.objects.create(total=1)
        transaction.set_rollback(True)

    sent = producer.send("order.undone", {})
    assert Consumer(settings, engine).run_once("order.undone").retried == 1
    assert Order.objects.count() == 0
    job = producer.get(sent.id)
    assert job.status == "retrying"
    assert job.last_error.startswith("TransactionRolledBack: the handler left its transaction")


def test_a_django_handler_after_its_connection_was_cut_runs_on_a_new_one(
    settings: Settings, engine: Engine, producer: Producer
) -> None:
    """Django's connection cut by the server between jobs (a restart, an idle timeout): the
    next job failed once (AdminShutdown, an attempt charged) before Django reconnected. Its
    connection is refreshed before each job, as Celery's Django fixup does before each task."""
    from delaysvc.worker.consumer import Consumer

    @delaysvc_django.handler("order.after_cut")
    def create(message):  # type: ignore[no-untyped-def]
        Order.objects.create(total=message.body["total"])

    consumer = Consumer(settings, engine)
    producer.send("order.after_cut", {"total": 1})
    assert consumer.run_once("order.after_cut").succeeded == 1
    connection.ensure_connection()
    with engine.begin() as conn:
        conn.execute(
            text("SELECT pg_terminate_backend(:pid)"),
            {"pid": connection.connection.info.backend_pid},
        )
    sent = producer.send("order.after_cut", {"total": 2})
    assert consumer.run_once("order.after_cut").succeeded == 1
    assert producer.get(sent.id).attempts == 1


@pytest.fixture
def naive_times() -> Iterator[str]:
    """The project with `USE_TZ=False` and a `TIME_ZONE` other than UTC: Django's connection
    then gives a timestamptz as a naive time of that zone. Django sets `TZ` for the zone;
    it is put back after, as it was."""
    saved = os.environ.get("TZ")
    try:
        with override_settings(USE_TZ=False, TIME_ZONE="America/New_York"):
            yield "America/New_York"
    finally:
        if saved is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = saved
        time.tzset()


def test_with_use_tz_false_a_messages_times_are_aware_utc(naive_times: str) -> None:
    with connection.cursor() as cursor:  # the connection really is in that mode
        cursor.execute("SELECT now(), current_setting('TimeZone')")
        now, zone = cursor.fetchone()
    assert (now.tzinfo, zone) == (None, naive_times)
    before = datetime.now(UTC)
    at = (before + timedelta(hours=2)).replace(microsecond=0)
    with transaction.atomic():
        sent = delaysvc_django.send("order.tz", 1, delay="7s")
        timed = delaysvc_django.send("order.tz", 2, deliver_at=at)
        batch = delaysvc_django.send_batch([{"topic": "order.tz", "body": 3, "delay_level": 1}])
        read = delaysvc_django.get(sent.id)
        # a naive deliver_at is refused, as everywhere (docs/how-to/producing.md)
        with pytest.raises(ValidationError, match="timezone-aware"):
            delaysvc_django.send("order.tz", 4, deliver_at=at.replace(tzinfo=None))
    after = datetime.now(UTC)
    times = [
        value
        for message in (sent, timed, *batch, read)
        for value in (message.stored_at, message.deliver_at)
    ]
    assert [value.utcoffset() for value in times] == [timedelta(0)] * len(times)
    assert before - timedelta(seconds=5) <= sent.stored_at <= after + timedelta(seconds=5)
    assert sent.deliver_at - sent.stored_at == timedelta(seconds=7)
    assert timed.deliver_at == at
    assert batch[0].deliver_at - batch[0].stored_at == timedelta(seconds=1)  # level 1: 1s
    assert (read.stored_at, read.deliver_at) == (sent.stored_at, sent.deliver_at)


@pytest.mark.skipif(DRIVER != "psycopg", reason="run once, from the psycopg 3 process")
def test_the_same_on_djangos_psycopg2_backend() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        # Django set up by this module, after it hides psycopg 3 (not by pytest-django at start)
        env={
            **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
            "DELAYSVC_TEST_DJANGO_DRIVER": "psycopg2",
        },
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "13 passed, 1 skipped" in done.stdout
