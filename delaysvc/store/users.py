"""Dashboard users and their logins (tokens: `delaysvc.store.tokens`)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from delaysvc.db.names import sql


def upsert_user(
    conn: Connection, name: str, password_hash: str, role: str | None, new_role: str
) -> str:
    """Add the user (with `role`, else `new_role`), or set an existing one's password, and its
    role when `role` is given (else it keeps its own): that ends its dashboard sessions (their
    generation moves on) and lifts its lockout. -> the user's role."""
    return str(
        conn.execute(
            sql(
                "INSERT INTO delaysvc.dashboard_user (name, password_hash, role) VALUES (:name, "
                ":hash, COALESCE(:role, :new_role)) "
                "ON CONFLICT (name) DO UPDATE SET password_hash = EXCLUDED.password_hash, "
                "role = COALESCE(:role, delaysvc.dashboard_user.role), failed_logins = 0, "
                "locked_until = NULL, "
                "session_generation = delaysvc.dashboard_user.session_generation + 1 "
                "RETURNING role"
            ),
            {"name": name, "hash": password_hash, "role": role, "new_role": new_role},
        ).scalar_one()
    )


def add_first_user(conn: Connection, name: str, password_hash: str, role: str) -> bool:
    """Add this user only if there is no dashboard user yet. -> whether it was added. Two
    callers at once add one: the table's lock is taken first (share row exclusive, which
    conflicts with itself and with inserts, not with reads)."""
    conn.execute(sql("LOCK TABLE delaysvc.dashboard_user IN SHARE ROW EXCLUSIVE MODE"))
    added = conn.execute(
        sql(
            "INSERT INTO delaysvc.dashboard_user (name, password_hash, role) "
            "SELECT :name, :hash, :role "
            "WHERE NOT EXISTS (SELECT 1 FROM delaysvc.dashboard_user)"
        ),
        {"name": name, "hash": password_hash, "role": role},
    )
    return added.rowcount == 1


def find_user(conn: Connection, name: str) -> Any:
    return conn.execute(
        sql(
            "SELECT id, name, password_hash, role, failed_logins, locked_until, "
            "locked_until > now() AS locked, session_generation "
            "FROM delaysvc.dashboard_user WHERE name = :name"
        ),
        {"name": name},
    ).first()


def count_login_attempt(
    conn: Connection, name: str, max_failures: int, lockout_seconds: int
) -> Any:
    """Count a login attempt as failed before its password is checked, and lock the account
    for `lockout_seconds` once `max_failures` are counted (`clear_failed_logins` undoes both
    when the password is right). -> the user row if the account was not locked, else None (as
    for an unknown name). One statement: concurrent attempts queue on the row, and each sees
    the counts of those before it, so at most `max_failures` of any number of simultaneous
    attempts get their password checked. Commit before checking: the row stays locked only
    for this statement, not for the ~100 ms of a password hash."""
    return conn.execute(
        sql(
            "UPDATE delaysvc.dashboard_user SET failed_logins = failed_logins + 1, "
            "locked_until = CASE WHEN failed_logins + 1 >= :max "
            "THEN now() + :lock * interval '1 second' ELSE locked_until END "
            "WHERE name = :name AND (locked_until IS NULL OR locked_until <= now()) "
            "RETURNING id, name, password_hash, role, session_generation"
        ),
        {"name": name, "max": max_failures, "lock": lockout_seconds},
    ).first()


def clear_failed_logins(conn: Connection, name: str) -> None:
    """A right password: forget the failures counted, and the lockout they set."""
    conn.execute(
        sql(
            "UPDATE delaysvc.dashboard_user SET failed_logins = 0, locked_until = NULL "
            "WHERE name = :name"
        ),
        {"name": name},
    )


def end_sessions(conn: Connection, user_id: int, generation: int) -> bool:
    """End every dashboard session of the user made in `generation` (the user's current one):
    the generation moves on. -> whether it did (False: already moved on, or no such user)."""
    ended = conn.execute(
        sql(
            "UPDATE delaysvc.dashboard_user SET session_generation = session_generation + 1 "
            "WHERE id = :id AND session_generation = :generation"
        ),
        {"id": user_id, "generation": generation},
    )
    return ended.rowcount == 1


def list_users(conn: Connection) -> list[Any]:
    """Every dashboard user by name: (name, role, created_at, locked_until: None unless the
    account is locked now)."""
    return list(
        conn.execute(
            sql(
                "SELECT name, role, created_at, "
                "CASE WHEN locked_until > now() THEN locked_until END AS locked_until "
                "FROM delaysvc.dashboard_user ORDER BY name"
            )
        )
    )


def delete_user(conn: Connection, name: str) -> bool:
    """Remove the user: its sessions are none from its next request (`current_user` finds
    no user). -> whether there was one."""
    deleted = conn.execute(
        sql("DELETE FROM delaysvc.dashboard_user WHERE name = :name"), {"name": name}
    )
    return deleted.rowcount == 1


def count_client_attempt(conn: Connection, client: str, window_seconds: int) -> Any:
    """Count a login attempt of `client` as failed, before its password is checked, in the
    client's fixed window of `window_seconds` (a new one once the last has ended), and prune
    the clients whose window ended. -> (failures, including this one; seconds left in the
    window). `forgive_client_attempt` takes the count back when the password is right."""
    conn.execute(sql("DELETE FROM delaysvc.login_client WHERE window_ends <= now()"))
    return conn.execute(
        sql(
            "INSERT INTO delaysvc.login_client AS c (client, failures, window_ends) "
            "VALUES (:client, 1, now() + :window * interval '1 second') "
            "ON CONFLICT (client) DO UPDATE SET failures = c.failures + 1 "
            "RETURNING failures, "
            "CAST(ceil(extract(epoch FROM window_ends - now())) AS integer) AS seconds_left"
        ),
        {"client": client, "window": window_seconds},
    ).one()


def forgive_client_attempt(conn: Connection, client: str) -> None:
    """A right password: that attempt was no failure (the client's others still count)."""
    conn.execute(
        sql(
            "UPDATE delaysvc.login_client SET failures = failures - 1 "
            "WHERE client = :client AND failures > 0"
        ),
        {"client": client},
    )
