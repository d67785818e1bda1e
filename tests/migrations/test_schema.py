"""delaysvc in a schema of its own: every statement names it, an application's Alembic beside it
sees nothing of delaysvc's, the name is configurable (CI's second pass runs every test in
another schema), and an install from before the schema is moved into it in place, its
messages with it."""

from __future__ import annotations

import ast
import itertools
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.pool import NullPool

from delaysvc import store
from delaysvc.config import validation
from delaysvc.config.settings import Settings
from delaysvc.db import names as sql
from delaysvc.db.engines import libpq_url, make_engine
from delaysvc.errors import ConfigError
from delaysvc.maintenance import delivery
from delaysvc.producer.sending import Producer
from delaysvc.schema import migrate
from delaysvc.schema.tables import SEQUENCES, TIMER_LANE, metadata
from delaysvc.worker.consumer import Consumer, _registry, handler
from tests.conftest import ROOT, TEST_LEVELS, TEST_SCHEMA, Server

_names = itertools.count()
LEGACY_HEAD = "0008"  # the last revision before the schema: installs at it have tables in public


@pytest.fixture
def empty(pg_server: Server) -> Iterator[tuple[str, Engine]]:
    name = f"delaysvc_schema{os.getpid()}_{next(_names)}"
    with pg_server.janitor(name):
        url = pg_server.url(name)
        engine = make_engine(Settings(), url, poolclass=NullPool)
        yield url, engine
        engine.dispose()


# ------------------------------------------------------------------ every statement names it

_TABLES = "|".join(sorted({*metadata.tables, *(s.name for s in SEQUENCES), "commit_log_id_seq"}))
_SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|FROM|JOIN|TABLE|TRUNCATE|VACUUM|nextval)\b")
_NAMES = set(_TABLES.split("|"))
_TRUNCATED = re.compile(r"\b(?:TRUNCATE|VACUUM|ANALYZE)\s+((?:[\w.\"]+\s*,\s*)*[\w.\"]+)")
_LIST = re.compile(r"\s*,\s*")
# a table named by a placeholder: `FROM {table}` must be `FROM delaysvc.{table}`
_PLACEHOLDER = re.compile(r"\b(?:FROM|JOIN|INTO|UPDATE|TABLE|OF)\s+\{+table\}+")
# a table where a statement names one (not a column of the same name: schedule_offset has one)
_BARE = re.compile(
    rf"(?:\b(?:FROM|JOIN|INTO|UPDATE|TABLE|TRUNCATE|VACUUM|ANALYZE|OF|EXISTS|USING)\s+|"
    rf"nextval\(')({_TABLES}|consume_queue_)\b"
)


def _part(value: ast.expr) -> str:
    """A piece of an f-string: its text, or its hole as `{name}` (`{}` for an expression)."""
    if isinstance(value, ast.Constant):
        return str(value.value)
    inner = getattr(value, "value", None)
    return "{" + inner.id + "}" if isinstance(inner, ast.Name) else "{}"


def _strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every string the code builds (adjacent literals joined, an f-string's holes as
    `{name}`), docstrings left out."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            parts = [_part(value) for value in node.values]
            yield node.lineno, "".join(str(part) for part in parts)


def test_every_statement_of_the_service_names_delaysvcs_schema() -> None:
    """Statements run on connections whose search_path delaysvc does not set (the caller's own,
    PgBouncer's): a bare table name would find the application's table of that name, or none.
    The tests' connections look in delaysvc's schema first, so only this check sees one."""
    bare = []
    for path in sorted((ROOT / "delaysvc").rglob("*.py")):
        if "migrations" in path.parts:  # they run with the search_path set to the schema
            continue
        for line, string in _strings(ast.parse(path.read_text())):
            if not _SQL.search(string):
                continue
            found = [match.group(0) for match in _BARE.finditer(string)]
            found += [match.group(0) for match in _PLACEHOLDER.finditer(string)]
            for listed in _TRUNCATED.finditer(string):
                found += [name for name in _LIST.split(listed.group(1)) if name in _NAMES]
            bare += [f"{path.relative_to(ROOT)}:{line}: {what}" for what in found]
    assert bare == []


def test_a_schema_name_that_is_no_plain_identifier_is_refused_naming_the_setting() -> None:
    for bad in ("Jobs", "jobs; DROP TABLE orders", "1jobs", "pg_jobs", ""):
        with pytest.raises(ConfigError, match="DELAYSVC_SCHEMA"):
            validation.check_schema_name(bad)
    with pytest.raises(ConfigError, match="lower-case letters, digits and underscores"):
        Settings.from_env({"DELAYSVC_SCHEMA": "my-jobs"})
    assert validation.check_schema_name("jobs_2") == "jobs_2"


def test_statements_are_put_in_the_configured_schema() -> None:
    try:
        sql.use_schema("jobs")
        assert sql.qualify("SELECT 1 FROM delaysvc.commit_log c") == (
            'SELECT 1 FROM "jobs".commit_log c'
        )
        assert sql.qualify("SELECT nextval('delaysvc.claim_seq')") == (
            """SELECT nextval('"jobs".claim_seq')"""
        )
        assert sql.table("topic_queue") == '"jobs".topic_queue'
    finally:
        sql.use_schema(TEST_SCHEMA)


# ------------------------------------------------------------------ a host application's Alembic

HOST_MODELS = """
from sqlalchemy import BigInteger, Column, MetaData, Table, Text

metadata = MetaData()
orders = Table("orders", metadata, Column("id", BigInteger, primary_key=True),
               Column("status", Text, nullable=False))
"""

HOST_ENV = """
from alembic import context
from sqlalchemy import create_engine

from models import metadata

engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=metadata)
    with context.begin_transaction():
        context.run_migrations()
"""

HOST_REVISION = """
from alembic import op
import sqlalchemy as sa

revision = "host0001"
down_revision = None

def upgrade():
    op.create_table("orders", sa.Column("id", sa.BigInteger, primary_key=True),
                    sa.Column("status", sa.Text, nullable=False))

def downgrade():
    op.drop_table("orders")
"""


def _host_alembic(folder: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PGOPTIONS"}  # the host's own search_path
    env["PYTHONPATH"] = str(folder)
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-x", "unused=1", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_host_applications_alembic_autogenerates_nothing_for_delaysvcs_tables(
    tmp_path: Path, empty: tuple[str, Engine]
) -> None:
    url, engine = empty
    (tmp_path / "models.py").write_text(HOST_MODELS)
    (tmp_path / "migrations" / "versions").mkdir(parents=True)
    (tmp_path / "migrations" / "env.py").write_text(HOST_ENV)
    (tmp_path / "migrations" / "versions" / "host0001_orders.py").write_text(HOST_REVISION)
    host_url = libpq_url(url).replace("postgresql://", "postgresql+psycopg://", 1)
    (tmp_path / "alembic.ini").write_text(
        f"[alembic]\nscript_location = migrations\nsqlalchemy.url = {host_url}\n"
    )

    host = _host_alembic(tmp_path, url, "upgrade", "head")
    assert host.returncode == 0, host.stderr
    migrate.upgrade(engine, Settings(delay_levels=TEST_LEVELS).levels)  # beside it, after it

    check = _host_alembic(tmp_path, url, "check")
    assert check.returncode == 0, check.stdout + check.stderr  # "No new upgrade operations"
    current = _host_alembic(tmp_path, url, "current")
    assert current.returncode == 0 and "host0001 (head)" in current.stdout, current.stderr
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM public.alembic_version")).all() == [
            ("host0001",)
        ]
        ours = conn.execute(sql.sql("SELECT version_num FROM delaysvc.delaysvc_version"))
        assert ours.scalars().all() == migrate.heads()
        public = conn.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")
        )
        assert public.scalars().all() == ["alembic_version", "orders"]
    # and the other way round: delaysvc's upgrade again, then the host's, still nothing to do
    migrate.upgrade(engine, Settings(delay_levels=TEST_LEVELS).levels)
    assert _host_alembic(tmp_path, url, "check").returncode == 0


# ------------------------------------------------------------------ an install from before


def test_an_install_at_the_last_revision_before_the_schema_moves_and_upgrades(
    empty: tuple[str, Engine],
) -> None:
    url, engine = empty
    try:
        sql.use_schema("public")
        _legacy_install(engine, TEST_LEVELS)
    finally:
        sql.use_schema(TEST_SCHEMA)
    migrate.upgrade(engine, Settings(delay_levels=TEST_LEVELS).levels)
    with engine.connect() as conn:
        version = conn.execute(sql.sql("SELECT version_num FROM delaysvc.delaysvc_version"))
        assert version.scalars().all() == migrate.heads()
        left = conn.execute(
            text("SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace")
        )
        assert left.scalars().all() == []
    producer = Producer(Settings(database_url=url, delay_levels=TEST_LEVELS), engine)
    assert producer.send("move.after", {"n": 1}, delay_level=1, priority=5).status == "scheduled"


@pytest.fixture
def handlers() -> Iterator[None]:
    saved = dict(_registry)
    yield
    _registry.clear()
    _registry.update(saved)


def _legacy_install(engine: Engine, levels: str, revision: str = LEGACY_HEAD) -> None:
    """What the last release before the schema made: revisions up to 0008 in the connection's
    schema (public) with Alembic's default `alembic_version` beside them, and the partitions.
    With `revision="head"`, the same layout at today's revisions, so that today's statements
    can put messages in it (the move does not depend on the revision)."""
    config = migrate.alembic_config()
    with engine.begin() as conn:
        config.attributes.update(
            connection=conn, schema="public", version_table="alembic_version", adopt=False
        )
        command.upgrade(config, revision)
        store.ensure_levels(conn, Settings(delay_levels=levels).levels)


def _status_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sql.sql(f"SELECT {store.STATUS} AS s, count(*) FROM delaysvc.commit_log c GROUP BY 1")
        )
        return {status: count for status, count in rows}


def test_an_install_from_before_the_schema_moves_in_place_and_loses_no_message(
    empty: tuple[str, Engine], handlers: None
) -> None:
    url, engine = empty
    settings = Settings(database_url=url, delay_levels=TEST_LEVELS, lease_seconds=1)
    ran: list[int] = []
    try:
        sql.use_schema("public")  # the old release's statements: its tables, bare in public
        _legacy_install(engine, TEST_LEVELS, "head")
        producer = Producer(settings, engine)
        level = [producer.send("move.level", n, delay_level=1).id for n in range(5)]
        timer = [producer.send("move.timer", n, delay="1500ms").id for n in range(3)]
        ready = [producer.send("move.ready", n, key=f"k-{n}").id for n in range(3)]
        with engine.begin() as conn:  # one job was running when the old release stopped
            running = store.claim_ready(conn, "move.ready", 1, lease_seconds=1)[0].id
        before = _status_counts(engine)
        assert before == {"scheduled": 8, "ready": 2, "running": 1}
    finally:
        sql.use_schema(TEST_SCHEMA)

    changes = migrate.upgrade(engine, Settings(delay_levels=TEST_LEVELS).levels)

    assert changes == []
    assert _status_counts(engine) == before
    with engine.connect() as conn:
        left = conn.execute(
            text("SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace")
        )
        assert left.scalars().all() == []  # every table, partition, sequence, index moved
        version = conn.execute(sql.sql("SELECT version_num FROM delaysvc.delaysvc_version"))
        assert version.scalars().all() == migrate.heads()
    producer = Producer(settings, engine)
    again = producer.send("move.ready", "again", key="k-2")  # its key still held
    assert again.id == ready[2]
    later = producer.send("move.ready", "new")
    assert later.id > max(level + timer + ready)  # the id sequence moved with its table

    for topic in ("move.level", "move.timer", "move.ready"):
        handler(topic, max_retries=3)(lambda message: ran.append(message.id))
    time.sleep(2.0)  # every level-1 and timer message due; the running job's lease gone
    consumer = Consumer(settings, engine)
    with engine.begin() as conn:
        assert [row.id for row in store.rescue_expired_leases(conn, 100, 30)] == [running]
    with engine.connect() as conn:
        for lane in (1, TIMER_LANE):
            delivery.run_once(conn, lane, batch=100)
    for topic in ("move.level", "move.timer", "move.ready"):
        consumer.run_once(topic)
    assert sorted(ran) == sorted(level + timer + ready + [later.id])  # each once
    assert _status_counts(engine) == {"succeeded": 12}


def _other_schema() -> str:
    return "other_jobs" if TEST_SCHEMA != "other_jobs" else "more_jobs"


def test_two_schemas_in_one_database_share_no_lock(engine: Engine) -> None:
    """The issue's defect 3: lane, archive, migration and cap locks were one key space for every
    schema, so a second deployment in the same database (another DELAYSVC_SCHEMA) found its
    lanes held by the first and did not deliver them. Every lock now names its schema."""
    from delaysvc.maintenance import delivery
    from delaysvc.pipeline import store as pipeline_store
    from delaysvc.schema import migrate

    runner = delivery.LaneRunner(engine, 1, 1000, 0.05)
    with engine.connect() as first, engine.connect() as second:
        assert runner._try_lock(first)  # this deployment's lane 1 runner
        with first.begin():
            assert pipeline_store.try_lock_archive(first)
        first.begin()  # this deployment migrating, and sending to a capped topic
        migrate.lock_migrations(first)
        store.lock_cap(first, "topic:t")
        try:
            sql.use_schema(_other_schema())
            assert runner._try_lock(second), "the other schema's lane 1 was held"
            with second.begin():
                assert pipeline_store.try_lock_archive(second), "its archive lock was held"
                second.execute(sql.sql("SET LOCAL lock_timeout = '1s'"))
                migrate.lock_migrations(second)  # would wait 1 s, then fail, if shared
                store.lock_cap(second, "topic:t")
            runner._unlock(second)
            with second.begin():
                pipeline_store.unlock_archive(second)
        finally:
            sql.use_schema(TEST_SCHEMA)
        # within one schema, each lock is still exclusive
        assert not runner._try_lock(second)
        with second.begin():
            assert not pipeline_store.try_lock_archive(second)
        first.rollback()
        runner._unlock(first)
        with first.begin():
            pipeline_store.unlock_archive(first)
