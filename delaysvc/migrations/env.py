"""Alembic environment: runs on a connection handed in by `delaysvc.migrate`, or on one opened
from the settings when the plain `alembic` command is used."""

from typing import Any

from alembic import context
from sqlalchemy import Connection

from delaysvc.schema import is_level_partition, metadata

config = context.config


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Level partitions are made by `ensure_levels` from the settings, not by a revision."""
    return not (type_ == "table" and name is not None and is_level_partition(name))


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        compare_type=True,
        include_object=include_object,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    run_migrations(connection)
else:
    from delaysvc.db import make_engine
    from delaysvc.settings import Settings

    engine = make_engine(Settings.from_env())
    with engine.begin() as conn:
        run_migrations(conn)
