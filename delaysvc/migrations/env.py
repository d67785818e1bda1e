"""Alembic environment: runs on a connection handed in by `delaysvc.schema.migrate`, or on one
opened from the settings when the plain `alembic` command is used.

Everything is made in delaysvc's own schema (`delaysvc.db.names.schema()`), with its own version
table there (`delaysvc_version`), so an application's Alembic beside it sees neither. The
revisions name no schema: they run with the search_path set to delaysvc's for their
transaction only. An install from before the schema moves first (`migrate.adopt_legacy_layout`).
"""

from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import Connection, text

from delaysvc.db import names as sql
from delaysvc.schema import migrate
from delaysvc.schema.tables import (
    CAPPED_INDEX_PREFIX,
    is_history_partition,
    is_level_partition,
    metadata,
)

config = context.config


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Level partitions are made by `ensure_levels` from the settings, history partitions by
    the history sweep, day by day, and the capped topics' index by `caps_index` when the caps
    change, not by a revision."""
    if type_ == "index":
        return name is None or not name.startswith(CAPPED_INDEX_PREFIX)
    made_later = name is not None and (is_level_partition(name) or is_history_partition(name))
    return not (type_ == "table" and made_later)


def run_migrations(connection: Connection) -> None:
    # a test may lay out an old install (schema "public", Alembic's default version table)
    schema = config.attributes.get("schema", sql.schema())
    version_table = config.attributes.get("version_table", migrate.VERSION_TABLE)
    connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    if config.attributes.get("adopt", True):
        migrate.adopt_legacy_layout(connection, schema)
    connection.execute(text(f'SET LOCAL search_path TO "{schema}"'))
    context.configure(
        connection=connection,
        target_metadata=metadata,
        compare_type=True,
        include_object=include_object,
        version_table=version_table,
        version_table_schema=schema,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:  # the `alembic` command, with an alembic.ini
    if config.config_file_name is not None:
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    from delaysvc.config.settings import Settings
    from delaysvc.db.engines import make_engine

    engine = make_engine(Settings.from_env())
    with engine.begin() as conn:
        migrate.lock_migrations(conn)
        run_migrations(conn)
