"""A migrated database of its own for the measuring scripts in this folder, dropped after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, text

from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine, sqlalchemy_url
from delaysvc.schema.migrate import upgrade


@contextmanager
def scratch_database(
    server: str, name: str, revision: str = "head", **settings: Any
) -> Iterator[tuple[Engine, Settings]]:
    """(engine, settings) of a fresh database `name` on `server`'s PostgreSQL, migrated to
    `revision`."""
    admin = create_engine(sqlalchemy_url(server), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        conn.execute(text(f"CREATE DATABASE {name}"))
    url = server.rsplit("/", 1)[0] + "/" + name
    configured = Settings(database_url=url, **settings)
    engine = make_engine(configured, url)
    upgrade(engine, configured.levels, revision)
    try:
        yield engine, configured
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
