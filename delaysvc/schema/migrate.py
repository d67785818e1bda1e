"""Schema upgrades: Alembic to head, then one consume-queue partition per configured level.

delaysvc keeps its tables in its own schema (`delaysvc.db.names`) and its migration history in its
own version table there, `delaysvc_version`: an application's Alembic in the same database sees
no foreign head, and its autogenerate, which looks at the default schema, proposes nothing for
delaysvc's tables. Installs from before the schema (tables and `alembic_version` in `public`)
are moved into it on the next upgrade, messages and offsets as they were (`adopt_legacy_layout`).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import ProgrammingError

from delaysvc import store
from delaysvc.config.levels import DelayLevels
from delaysvc.db.names import LOCK_KEY, MIGRATE_LOCK, lock_name, sql
from delaysvc.errors import SchemaNotReady

log = logging.getLogger(__name__)
VERSION_TABLE = "delaysvc_version"
LEGACY_VERSION_TABLE = "alembic_version"  # Alembic's default, in the schema of the tables


def alembic_config() -> Config:
    from delaysvc import migrations

    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return config


@functools.cache
def scripts() -> ScriptDirectory:
    """This release's migrations (read once: every process checks its database's revision
    against them at start)."""
    return ScriptDirectory.from_config(alembic_config())


def heads() -> list[str]:
    return list(scripts().get_heads())


def upgrade(
    engine: Engine, levels: DelayLevels, revision: str = "head", dry_run: bool = False
) -> list[store.LevelChange]:
    """Idempotent; safe to run from several processes at once. -> the levels whose delay
    changed or that went (`store.ensure_levels`: their waiting messages keep their due times).
    `dry_run`: all of it in a transaction rolled back at its end (PostgreSQL's DDL is
    transactional): what would change, and nothing changed."""
    config = alembic_config()
    with engine.connect() as conn:
        transaction = conn.begin()
        lock_migrations(conn)
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
        changes = store.ensure_levels(conn, levels)
        if dry_run:
            transaction.rollback()
            return changes
        transaction.commit()
    for change in changes:
        log.warning(
            "schema.level_changed",
            extra={
                "delay_level": change.level,
                "old_ms": change.old_ms,
                "new_ms": change.new_ms,
                "relocated_to_timer_lane": change.relocated,
            },
        )
    log.info("schema.migrated", extra={"levels": str(levels)})
    return changes


def lock_migrations(conn: Connection) -> None:
    """Wait until no other process migrates this schema, then hold that until the transaction
    ends."""
    conn.execute(
        sql(f"SELECT pg_advisory_xact_lock({LOCK_KEY})"), {"lock": lock_name(MIGRATE_LOCK)}
    )


def downgrade(engine: Engine, revision: str) -> None:
    config = alembic_config()
    with engine.begin() as conn:
        lock_migrations(conn)
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def check_schema(conn: Connection, levels: DelayLevels) -> None:
    """SchemaNotReady unless the database is migrated to this release's head with the
    configured `levels` (`store.check_levels`): every long-lived process (worker, beat, web)
    calls this at start. A database migrated by a newer release (this one's revision behind
    it) is said in the log, not refused: a rollback's processes run on it."""
    try:
        found = conn.execute(sql(f"SELECT version_num FROM delaysvc.{VERSION_TABLE}")).scalars()
        at = sorted(found)
    except ProgrammingError as exc:  # the table itself is missing: never migrated
        conn.rollback()
        raise SchemaNotReady("the database is not migrated; run `delaysvc migrate`") from exc
    wanted = heads()
    if at != wanted:
        if set(at) <= revisions():
            raise SchemaNotReady(
                f"the database's schema is at revision {', '.join(at) or 'none'}, this "
                f"delaysvc's at {', '.join(wanted)}; run `delaysvc migrate`"
            )
        log.warning("schema.newer", extra={"database": at, "installed": wanted})
    store.check_levels(conn, levels)


def revisions() -> set[str]:
    return {rev.revision for rev in scripts().walk_revisions()}


def adopt_legacy_layout(conn: Connection, schema: str) -> None:
    """Move an install from before delaysvc had its own schema into `schema`: every table,
    partition and sequence of delaysvc's (`ALTER ... SET SCHEMA` keeps their rows, sequences'
    positions, indexes and grants), and its revision from the shared `alembic_version` into
    delaysvc's own version table. A no-op once done, or on a new database. Runs in the
    migration's transaction, so a failure moves nothing."""
    if _exists(conn, f'"{schema}".{VERSION_TABLE}'):
        return
    ours = revisions()
    found = [
        row.schema
        for row in conn.execute(
            text(
                "SELECT n.nspname AS schema FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE c.relname = :table AND c.relkind = 'r' "
                "AND n.nspname <> :schema"
            ),
            {"table": LEGACY_VERSION_TABLE, "schema": schema},
        )
    ]
    for legacy in found:
        versions = conn.execute(
            text(f'SELECT version_num FROM "{legacy}".{LEGACY_VERSION_TABLE}')
        ).scalars()
        mine = sorted(set(versions) & ours)
        if mine and _exists(conn, f'"{legacy}".commit_log'):
            _move(conn, legacy, schema, mine)
            return


FUNCTIONS = ("send_one",)
"""delaysvc's functions (migration 0017 on): each names its tables with its schema, in its body."""


def _functions_in(conn: Connection, namespace: str) -> list[Any]:
    return list(
        conn.execute(
            text(
                "SELECT p.oid, p.proname AS name FROM pg_proc p "
                "WHERE p.pronamespace = CAST(:namespace AS regnamespace) "
                "AND p.proname = ANY(:ours)"
            ),
            {"namespace": f'"{namespace}"', "ours": list(FUNCTIONS)},
        )
    )


def _move_function(conn: Connection, function: Any, legacy: str, schema: str) -> None:
    """Make `function` again in `schema`, its body's names in `schema` (a function's body is
    text: ALTER FUNCTION ... SET SCHEMA would leave it naming the old tables)."""
    definition = conn.execute(text("SELECT pg_get_functiondef(:oid)"), {"oid": function.oid})
    quoted_legacy = conn.execute(text("SELECT quote_ident(:n)"), {"n": legacy}).scalar_one()
    made = definition.scalar_one()
    made = made.replace(f"FUNCTION {quoted_legacy}.", f'FUNCTION "{schema}".', 1)
    conn.execute(text(made.replace(f'"{legacy}".', f'"{schema}".')))
    conn.execute(text(f'DROP FUNCTION "{legacy}".{function.name}'))


def _exists(conn: Connection, relation: str) -> bool:
    return conn.execute(text("SELECT to_regclass(:r)"), {"r": relation}).scalar() is not None


def _move(conn: Connection, legacy: str, schema: str, versions: list[str]) -> None:
    from delaysvc.schema.tables import (
        MESSAGE_VIEW,
        SEQUENCES,
        is_history_partition,
        is_level_partition,
        metadata,
    )

    names = set(metadata.tables) | {sequence.name for sequence in SEQUENCES} | {MESSAGE_VIEW}
    relations = conn.execute(
        text(
            "SELECT c.relname AS name, c.relkind AS kind FROM pg_class c "
            "WHERE c.relnamespace = CAST(:legacy AS regnamespace) "
            "AND c.relkind IN ('r', 'p', 'S', 'v') "
            # a sequence owned by a column moves with its table
            "AND NOT (c.relkind = 'S' AND EXISTS (SELECT 1 FROM pg_depend d WHERE "
            "d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype IN ('a', 'i'))) "
            "ORDER BY c.relname"
        ),
        {"legacy": f'"{legacy}"'},
    ).all()
    moved = 0
    for name, kind in relations:
        level_sequence = name.endswith("_seq") and is_level_partition(name[: -len("_seq")])
        partition = is_level_partition(name) or is_history_partition(name)
        if name not in names and not partition and not level_sequence:
            continue
        what = {"S": "SEQUENCE", "v": "VIEW"}.get(kind, "TABLE")
        conn.execute(text(f'ALTER {what} "{legacy}"."{name}" SET SCHEMA "{schema}"'))
        moved += 1
    for function in _functions_in(conn, legacy):
        _move_function(conn, function, legacy, schema)
    conn.execute(
        text(
            f'CREATE TABLE "{schema}".{VERSION_TABLE} (version_num VARCHAR(32) NOT NULL, '
            f"CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num))"
        )
    )
    shared = f'"{legacy}".{LEGACY_VERSION_TABLE}'
    for version in versions:
        conn.execute(
            text(f'INSERT INTO "{schema}".{VERSION_TABLE} (version_num) VALUES (:v)'),
            {"v": version},
        )
        conn.execute(text(f"DELETE FROM {shared} WHERE version_num = :v"), {"v": version})
    if conn.execute(text(f"SELECT NOT EXISTS (SELECT 1 FROM {shared})")).scalar():
        conn.execute(text(f"DROP TABLE {shared}"))  # it held delaysvc's revision alone
    log.warning(
        "schema.moved",
        extra={"tables_and_sequences": moved, "from_schema": legacy, "to_schema": schema},
    )
