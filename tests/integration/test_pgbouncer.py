"""Behind a real PgBouncer in transaction pooling mode (started on a free port in front of the
tests' server, one server connection per database so every client's transactions share it):
producers (single, batch, in the caller's transaction), consumers, the API and migrations work
through it, with `DELAYSVC_DATABASE_POOLING=transaction` on Debian's `pgbouncer` (1.18, which
keeps no prepared statement) and with `transaction-prepared` on a PgBouncer of 1.22 or later
keeping them (`DELAYSVC_TEST_PGBOUNCER_PREPARED`: its path; `.ci/run` builds 1.24.1); what
keeps a session (the delivery's lanes, the archive's lock) takes `DELAYSVC_DIRECT_DATABASE_URL`
or is refused at start, naming it. Reads that check the outcome go to the server directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, create_engine, exc, text
from sqlalchemy.orm import Session

from delaysvc import auth
from delaysvc.bench.pgbouncer import Bouncer, pgbouncer, version_line
from delaysvc.config.settings import Settings
from delaysvc.db.engines import libpq_url, make_engine, sqlalchemy_url
from delaysvc.errors import ConfigError
from delaysvc.maintenance import delivery
from delaysvc.producer.sending import Producer
from delaysvc.schema.migrate import upgrade
from delaysvc.schema.tables import TIMER_LANE
from delaysvc.web import create_app
from delaysvc.worker.consumer import Consumer, handler
from tests.conftest import ROOT, Server, outside_env
from tests.support.joined_checks import (  # clean_registry: a fixture
    BODY,
    NOTHING,
    Rollback,
    clean_registry,  # noqa: F401
    psycopg2_url,
    stored,
)
from tests.support.machine import keeping_pgbouncer


@pytest.fixture(scope="module")
def bouncer(pg_server: Server) -> Iterator[Bouncer]:
    """Debian's PgBouncer, which keeps no prepared statement."""
    with pgbouncer(pg_server.url("postgres"), pool_mode="transaction", pool_size=1) as running:
        yield running


@pytest.fixture(scope="module")
def keeping_bouncer(pg_server: Server) -> Iterator[Bouncer]:
    """A PgBouncer keeping its clients' prepared statements (1.22 or later)."""
    with pgbouncer(
        pg_server.url("postgres"),
        pool_size=1,
        binary=keeping_pgbouncer(),
        max_prepared_statements=200,
    ) as running:
        yield running


@pytest.fixture(params=["transaction", "transaction-prepared"])
def pooled(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    """The test's settings with its database reached through a PgBouncer: Debian's with
    `database_pooling=transaction`, and one keeping prepared statements with
    `transaction-prepared`."""
    mode = request.param
    through = request.getfixturevalue("bouncer" if mode == "transaction" else "keeping_bouncer")
    return through.pooled(settings, settings.database_url or "", mode)


@pytest.fixture
def pooled_engine(pooled: Settings) -> Iterator[Engine]:
    engine = make_engine(pooled, pool_size=4)
    yield engine
    engine.dispose()


def test_without_the_setting_prepared_statements_collide_on_the_shared_server_connection(
    settings: Settings, bouncer: Bouncer
) -> None:
    """Why the setting exists: psycopg prepares the single send on the server; the next client
    on the same server connection prepares its own under the same name."""
    unaware = settings.model_copy(update={"database_url": bouncer.url(settings.database_url or "")})
    engines = [make_engine(unaware) for _ in range(2)]
    try:
        Producer(unaware, engines[0]).send("pgb.plain", {"n": 1})
        with pytest.raises(exc.DBAPIError, match=r"prepared statement .* already exists"):
            Producer(unaware, engines[1]).send("pgb.plain", {"n": 2})
    finally:
        for engine in engines:
            engine.dispose()


def test_a_pgbouncer_keeping_prepared_statements_has_the_sends_prepared_on_the_server(
    settings: Settings, keeping_bouncer: Bouncer, engine: Engine
) -> None:
    """With `transaction-prepared` the statements that collided above are prepared, and do not
    collide: PgBouncer prepares each on the server connection it hands the transaction, under
    a name of its own."""
    prepared = keeping_bouncer.pooled(settings, settings.database_url or "", "transaction-prepared")
    engines = [make_engine(prepared) for _ in range(2)]
    try:
        sent = [
            Producer(prepared, engines[n % 2]).send("pgb.kept", {"n": n}, delay="1h")
            for n in range(12)
        ]
    finally:
        for each in engines:
            each.dispose()
    assert stored(engine, "pgb.kept")["commit_log"] == sorted(m.id for m in sent)
    through = libpq_url(prepared.database_url or "")
    with psycopg.connect(through, autocommit=True) as conn:  # the one server session
        statements = conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()
    assert any("send_one(" in statement for (statement,) in statements), statements


def test_transaction_prepared_on_a_pgbouncer_that_keeps_no_prepared_statement_is_refused(
    settings: Settings, bouncer: Bouncer, engine: Engine
) -> None:
    """Debian's 1.18 (or any PgBouncer with `max_prepared_statements = 0`) hands the clients'
    own statement names to the shared server connection: besides sends failing with "already
    exists", a client ran another's statement of the same name without an error (a read of a
    message ran the cancel's UPDATE: the message cancelled, left in its topic's queue). Each
    engine now asks at its first connection, before any statement of delaysvc's."""
    wrong = bouncer.pooled(settings, settings.database_url or "", "transaction-prepared")
    pooled = make_engine(wrong)
    try:
        for _ in range(2):  # asked again at every connection until it is right
            with pytest.raises(ConfigError) as refused:
                Producer(wrong, pooled).send("pgb.wrong", 1)
            assert str(refused.value) == (
                "DELAYSVC_DATABASE_POOLING=transaction-prepared, but the pooler at "
                "DELAYSVC_DATABASE_URL keeps no prepared statement of its clients (PgBouncer "
                "before 1.22, or max_prepared_statements = 0): a client could run another's "
                "statement; use DELAYSVC_DATABASE_POOLING=transaction, or PgBouncer 1.22 or "
                "later with max_prepared_statements above 0"
            )
    finally:
        pooled.dispose()
    assert stored(engine, "pgb.wrong") == NOTHING


def test_transaction_prepared_refuses_a_psycopg_that_drops_statements_by_sql(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before libpq 17 psycopg drops a prepared statement with `DEALLOCATE name`, which
    PgBouncer refuses: `transaction-prepared` says what is needed before anything connects."""
    monkeypatch.setattr(psycopg.pq, "version", lambda: 160004)
    prepared = Settings(
        database_url="postgresql://shop@127.0.0.1:6432/shop",
        database_pooling="transaction-prepared",
        direct_database_url="postgresql://shop@127.0.0.1:5432/shop",
    )
    with pytest.raises(ConfigError, match=r"needs psycopg 3\.2 or later on libpq 17 .*160004"):
        make_engine(prepared)
    make_engine(prepared, prepared.direct_database_url).dispose()  # the direct URL: a server
    make_engine(prepared.model_copy(update={"database_pooling": "transaction"})).dispose()


def test_single_sends_from_many_threads_and_a_batch_go_through(
    pooled: Settings, pooled_engine: Engine, engine: Engine
) -> None:
    producer = Producer(pooled, pooled_engine)
    errors: list[BaseException] = []

    def send_some(worker: int) -> None:
        try:
            for n in range(25):  # past psycopg's prepare threshold (5) on each connection
                producer.send("pgb.single", {"w": worker, "n": n}, key=f"{worker}-{n}")
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=send_some, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    again = producer.send("pgb.single", {"w": 0, "n": 0}, key="0-0")  # the key dedupes
    assert not again.created
    results = producer.send_batch(
        [{"topic": "pgb.batch", "body": {"n": n}, "delay": "1h", "key": f"b{n}"} for n in range(50)]
    )
    assert sum(r.created for r in results) == 50
    with engine.connect() as conn:
        counts = dict(
            conn.execute(
                text("SELECT topic, count(*) FROM commit_log GROUP BY topic ORDER BY topic")
            ).all()
        )
    assert counts == {"pgb.batch": 50, "pgb.single": 100}


def test_in_the_callers_transaction_a_rollback_stores_nothing_and_a_commit_once(
    pooled: Settings, pooled_engine: Engine, engine: Engine
) -> None:
    """The application's own engines through the PgBouncer: psycopg 3 with prepared statements
    off (as PgBouncer's users configure it), and psycopg2 (which prepares nothing)."""
    producer = Producer(pooled, pooled_engine)
    url = sqlalchemy_url(pooled.database_url or "")
    apps = {
        "psycopg": create_engine(url, connect_args={"prepare_threshold": None}),
        "psycopg2": create_engine(psycopg2_url(url)),
    }
    try:
        for name, app_engine in apps.items():
            topic = f"pgb.joined.{name}"
            with pytest.raises(Rollback), Session(app_engine) as session, session.begin():
                producer.send(topic, BODY, key="order-1", connection=session)
                raise Rollback
            assert stored(engine, topic) == NOTHING
            for _ in range(6):  # the key holds across transactions (and past the threshold)
                with Session(app_engine) as session, session.begin():
                    sent = producer.send(topic, BODY, key="order-1", connection=session)
            assert stored(engine, topic)["commit_log"] == [sent.id]
    finally:
        for app_engine in apps.values():
            app_engine.dispose()


@pytest.mark.usefixtures("clean_registry")
def test_consumers_run_jobs_that_the_direct_delivery_moved(
    pooled: Settings, pooled_engine: Engine, engine: Engine
) -> None:
    seen: list[int] = []
    handler("pgb.job")(lambda job: seen.append(job.body["n"]))
    producer = Producer(pooled, pooled_engine)
    sent = [producer.send("pgb.job", {"n": n}, delay="1s") for n in range(30)]
    with engine.connect() as conn:  # straight to the server, as the lanes move
        later = sent[-1].deliver_at + timedelta(seconds=1)
        moved = delivery.run_once(conn, sent[0].delay_level or TIMER_LANE, 100, now=later)
    assert moved.moved == 30
    consumer = Consumer(pooled, pooled_engine)
    while consumer.run_once("pgb.job").claimed:
        pass
    assert sorted(seen) == list(range(30))
    with engine.connect() as conn:
        statuses = conn.execute(text("SELECT DISTINCT status FROM commit_log")).scalars().all()
    assert statuses == ["succeeded"]


def test_the_api_and_dashboard_and_migrations_work_through_it(
    pooled: Settings, pooled_engine: Engine, engine: Engine
) -> None:
    assert upgrade(pooled_engine, pooled.levels) == []  # migrated already: nothing to change
    app = create_app(pooled)
    client = app.test_client()
    token = {"Authorization": f"Bearer {auth.create_token(engine, 'shop', 'admin')}"}
    for n in range(8):
        response = client.post(
            "/api/v1/messages",
            json={"topic": "pgb.api", "body": {"n": n}, "delay": "1h", "key": f"k{n}"},
            headers=token,
        )
        assert response.status_code == 201, response.get_json()
    message_id = response.get_json()["id"]
    got = client.get(f"/api/v1/messages/{message_id}", headers=token)
    assert got.get_json()["status"] == "scheduled"
    for path in ("/api/v1/levels", "/api/v1/topics", "/api/v1/dead", "/metrics"):
        assert client.get(path, headers=token).status_code == 200, path
    assert client.delete(f"/api/v1/messages/{message_id}", headers=token).status_code == 200
    health = client.get("/healthz")  # the database answers; no workers run here
    assert (health.status_code, health.get_json()["status"]) == (200, "degraded")
    assert health.get_json()["database"] is True
    app.extensions["delaysvc"]["engine"].dispose()
    with engine.connect() as conn:
        statuses = conn.execute(
            text("SELECT status, count(*) FROM commit_log GROUP BY status ORDER BY status")
        ).all()
    assert [tuple(row) for row in statuses] == [("cancelled", 1), ("scheduled", 7)]


def _pooled_env(pooled: Settings) -> dict[str, str]:
    env = outside_env() | {
        "DELAYSVC_DATABASE_URL": pooled.database_url or "",
        "DELAYSVC_DATABASE_POOLING": pooled.database_pooling,
        "DELAYSVC_DELAY_LEVELS": pooled.delay_levels,
    }
    return env


@pytest.mark.parametrize(
    "command",
    [
        ["delaysvc", "worker", "--no-consume"],
        ["celery", "-A", "delaysvc.tasks", "worker", "-Q", "delaysvc.delivery", "-P", "threads"],
    ],
    ids=["delaysvc-worker", "celery-worker"],
)
def test_a_delivery_worker_without_a_direct_url_is_refused_at_start(
    pooled: Settings, command: list[str], tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *command],
        env=_pooled_env(pooled) | {"DELAYSVC_VAR_DIR": str(tmp_path)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "DELAYSVC_DIRECT_DATABASE_URL" in done.stderr
    assert "transaction-pooling PgBouncer" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_archive_without_a_direct_url_is_refused_before_spark_starts(
    pooled: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from delaysvc.pipeline import cli as pipeline_cli

    for key, value in _pooled_env(pooled).items():
        if key.startswith("DELAYSVC_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(pipeline_cli.Services, "require", lambda self, jdbc: None)

    def no_spark(self: object) -> None:
        raise AssertionError("Spark was started")

    monkeypatch.setattr(pipeline_cli.Services, "spark", no_spark)
    result = CliRunner().invoke(pipeline_cli.pipeline, ["archive", "--older-than", "1d"])
    assert result.exit_code != 0
    assert "delaysvc pipeline archive keeps a PostgreSQL session" in str(
        result.output or result.exception
    )
    assert "DELAYSVC_DIRECT_DATABASE_URL" in str(result.output or result.exception)


def test_a_session_level_lock_does_not_survive_the_pooler(
    bouncer: Bouncer, settings: Settings
) -> None:
    """What the refusal guards: an advisory lock taken through the PgBouncer is held by a
    server connection that then serves other clients, and is released by none of them."""
    url = libpq_url(bouncer.url(settings.database_url or ""))
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as first:
        first.execute("SELECT pg_try_advisory_lock(4242)")
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as second:
            # the same server connection: the other client "holds" the first one's lock too
            held = second.execute("SELECT pg_try_advisory_lock(4242)").fetchone()
            assert held == (True,)
            second.execute("SELECT pg_advisory_unlock_all()")


@pytest.mark.parametrize("keeps", [False, True], ids=["debian", "keeping-prepared"])
def test_the_bench_measures_sends_straight_and_through_pgbouncer_in_one_run(
    settings: Settings, tmp_path: Path, keeps: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Debian's PgBouncer measured without prepared statements; one that keeps them (the
    first `pgbouncer` on PATH, here the one CI builds) both without and with."""
    from delaysvc.bench import require_parts, run

    require_parts(["pgbouncer"])  # the bench would report the suite not run
    keeping = keeping_pgbouncer() if keeps else ""
    if keeps:
        monkeypatch.setenv("PATH", f"{Path(keeping).parent}{os.pathsep}{os.environ['PATH']}")
    # half a second a way: in 0.2 s, one stall of a busy CI machine (both passes at once) left
    # Debian's PgBouncer 6 sends stored
    seconds = 0.5
    out = run(settings, ["pgbouncer"], tmp_path / "run", seconds=seconds)
    results = json.loads((out / "results.json").read_text())["results"]
    ways = ("direct", "direct_unprepared", "pgbouncer") + (("pgbouncer_prepared",) * keeps)
    for name in ("pgbouncer_send_c1", "pgbouncer_send_c4", "pgbouncer_send_c16"):
        figures = results[name]
        assert sorted(k for k in figures if k.endswith("_stored")) == sorted(
            f"{way}_stored" for way in ways
        ), figures
        for way in ways:
            # each rate is what the way stored in its time (the elapsed time runs a little
            # over: a send that began before the end still counts)
            stored, rate = figures[f"{way}_stored"], figures[f"{way}_msgs_per_s"]
            assert stored >= 10, (way, figures)
            assert 0.5 * stored / seconds <= rate <= 1.05 * stored / seconds, (way, figures)
        for ratio, way in (("ratio", "pgbouncer"), ("ratio_prepared", "pgbouncer_prepared")):
            if way in ways:
                assert figures[ratio] == pytest.approx(
                    figures[f"{way}_msgs_per_s"] / figures["direct_msgs_per_s"], abs=0.002
                ), figures
    batches = results["pgbouncer_send_batch_1000"]
    assert [batches[f"{way}_stored"] for way in ways] == [20_000] * len(ways), batches
    setup = results["pgbouncer_setup"]["pgbouncer_version"]
    assert setup == version_line(keeping) if keeps else setup.startswith("PgBouncer")
    report = (out / "results.md").read_text()
    assert "| pgbouncer_send_c4: msgs/s through PgBouncer" in report
    assert ("PgBouncer keeping prepared statements" in report) == keeps
