"""Alembic environment: runs on a connection handed in by `delaysvc.migrate`, or on one opened
from the settings when the plain `alembic` command is used."""

from alembic import context

from delaysvc.schema import is_level_partition, metadata

config = context.config


def include_object(obj, name, type_, reflected, compare_to) -> bool:  # type: ignore[no-untyped-def]
    """Level partitions are made by `ensure_levels` from the settings, not by a revision."""
    return not (type_ == "table" and is_level_partition(name))


def run_migrations(connection) -> None:  # type: ignore[no-untyped-def]
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
