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
    expires_in_ms: int | None = None,
) -> bool:
    """-> False, and nothing stored, when a token (live or revoked) holds the name. It expires
    `expires_in_ms` after now (None: never)."""
    inserted = conn.execute(
        sql(
            "INSERT INTO delaysvc.api_token (name, token_hash, scope, topics, expires_at) "
            "VALUES (:name, :hash, :scope, CAST(:topics AS text[]), "
            "now() + CAST(:expires_in_ms AS bigint) * interval '1 millisecond') "
            "ON CONFLICT (name) DO NOTHING RETURNING name"
        ),
        {
            "name": name,
            "hash": token_hash,
            "scope": scope,
            "topics": topics,
            "expires_in_ms": expires_in_ms,
        },
    )
    return inserted.first() is not None


def find_token(conn: Connection, token_hash: str) -> Any:
    """-> the live token (id, name, scope, topics, expires_at) with this hash, or None (also
    when it was revoked or has expired)."""
    return conn.execute(
        sql(
            "SELECT id, name, scope, topics, expires_at FROM delaysvc.api_token "
            "WHERE token_hash = :hash AND revoked_at IS NULL "
            "AND (expires_at IS NULL OR expires_at > now())"
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
    """Every token, live first, by name: (name, scope, topics, created_at, revoked_at,
    expires_at, expired: whether expires_at is past)."""
    return list(
        conn.execute(
            sql(
                "SELECT name, scope, topics, created_at, revoked_at, expires_at, "
                "COALESCE(expires_at <= now(), false) AS expired FROM delaysvc.api_token "
                "ORDER BY revoked_at IS NOT NULL OR COALESCE(expires_at <= now(), false), name, "
                "created_at"
            )
        )
    )
