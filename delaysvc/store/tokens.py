"""The statements on API tokens (`api_token`), each named for what it does.

Like `delaysvc.store`: callers pass a SQLAlchemy `Connection` and own the transaction; nothing
here commits. Only SHA-256 hashes of tokens are stored. `topics` NULL means every topic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from delaysvc.db.names import sql


def insert_token(
    conn: Connection,
    name: str,
    token_hash: str,
    scope: str,
    topics: Sequence[str] | None = None,
) -> bool:
    """-> False, and nothing stored, when a token (live or revoked) holds the name."""
    inserted = conn.execute(
        sql(
            "INSERT INTO delaysvc.api_token (name, token_hash, scope, topics) "
            "VALUES (:name, :hash, :scope, CAST(:topics AS text[])) "
            "ON CONFLICT (name) DO NOTHING RETURNING name"
        ),
        {"name": name, "hash": token_hash, "scope": scope, "topics": topics},
    )
    return inserted.first() is not None


def find_token(conn: Connection, token_hash: str) -> Any:
    """-> the live token (id, name, scope, topics) with this hash, or None."""
    return conn.execute(
        sql(
            "SELECT id, name, scope, topics FROM delaysvc.api_token "
            "WHERE token_hash = :hash AND revoked_at IS NULL"
        ),
        {"hash": token_hash},
    ).first()


def revoke_token(conn: Connection, name: str) -> bool:
    result = conn.execute(
        sql(
            "UPDATE delaysvc.api_token SET revoked_at = now() WHERE name = :name AND revoked_at "
            "IS NULL"
        ),
        {"name": name},
    )
    return result.rowcount >= 1


def list_tokens(conn: Connection) -> list[Any]:
    """Every token, live first, by name: (name, scope, topics, created_at, revoked_at)."""
    return list(
        conn.execute(
            sql(
                "SELECT name, scope, topics, created_at, revoked_at FROM delaysvc.api_token "
                "ORDER BY revoked_at IS NOT NULL, name, created_at"
            )
        )
    )
