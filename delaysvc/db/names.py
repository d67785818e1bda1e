"""delaysvc's tables live in a schema of their own, `delaysvc` unless `DELAYSVC_SCHEMA` names
another, so that they sit beside an application's tables without touching them (and its
Alembic never sees them: see `delaysvc.schema.migrate`).

Every statement names its tables `delaysvc.<table>` and goes through `sql()` (SQLAlchemy) or
`qualify()` (a driver's own cursor), which put the process's schema in that place. Nothing
relies on `search_path`: a statement runs the same on delaysvc's own connections, on a
connection the caller holds (whatever its search_path), and through PgBouncer in transaction
mode (where a session setting would not stay with the connection).

The schema is one per process: read from `DELAYSVC_SCHEMA` at the first statement, or set by
`use_schema()` before it.
"""

from __future__ import annotations

import functools
import os
import re

from sqlalchemy import TextClause, text
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect

from delaysvc.config.validation import check_schema_name

DEFAULT_SCHEMA = "delaysvc"
_PLACE = re.compile(r"(?<![\w.])delaysvc\.(?=[a-z_])")
_schema: str | None = None
_PSYCOPG = psycopg_dialect()


def schema() -> str:
    """The schema this process's statements use."""
    global _schema
    if _schema is None:
        _schema = check_schema_name(os.environ.get("DELAYSVC_SCHEMA") or DEFAULT_SCHEMA)
    return _schema


def use_schema(name: str) -> None:
    """Use `name` for every statement from now on (before the first one, normally)."""
    global _schema
    _schema = check_schema_name(name)
    for cached in (qualify, sql, driver_sql):
        cached.cache_clear()


@functools.lru_cache(maxsize=4096)
def qualify(statement: str) -> str:
    """`statement` with its `delaysvc.` names in this process's schema."""
    name = schema()
    if name == DEFAULT_SCHEMA:
        return statement
    return _PLACE.sub(f'"{name}".', statement)


@functools.lru_cache(maxsize=4096)
def sql(statement: str) -> TextClause:
    """`text(qualify(statement))`, parsed once (text() scans its string for parameters)."""
    return text(qualify(statement))


@functools.lru_cache(maxsize=4096)
def driver_sql(statement: str) -> str:
    """A statement as SQLAlchemy would send it to psycopg (`%(name)s` placeholders, `%`
    doubled), for a driver's own cursor (psycopg 3, psycopg2, Django's)."""
    return sql(statement).compile(dialect=_PSYCOPG).string


def table(name: str) -> str:
    """A table's qualified name, for a statement's parameters (`'delaysvc.commit_log'`)."""
    return qualify(f"delaysvc.{name}")


LOCK_KEY = "hashtextextended(:lock, 0)"
"""The key of an advisory lock named by the parameter `:lock` (a `lock_name`)."""


MIGRATE_LOCK = "migrate"
"""The advisory lock a migration holds for its transaction (`schema.migrate.lock_migrations`);
the lanes' count fold takes it too, for its own (`store.fold_lane_counts`)."""


def lock_name(what: str) -> str:
    """The name of one of this schema's advisory locks (`'jobs lane 3'`), for `LOCK_KEY`: every
    lock names its schema, so two deployments in one database (two schemas) never hold, wait
    for or starve each other's lanes, archive runs or migrations."""
    return f"{schema()} {what}"
