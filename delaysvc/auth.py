"""API tokens and dashboard users: secrets are stored only as hashes."""

from __future__ import annotations

import hashlib
import ipaddress
import re
import secrets
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cachetools import TTLCache
from sqlalchemy import Engine
from werkzeug.security import check_password_hash, generate_password_hash

from delaysvc import store
from delaysvc.config.validation import validate_topic
from delaysvc.errors import ValidationError
from delaysvc.store import tokens as store_tokens
from delaysvc.store import users as store_users

SCOPES = ("send", "admin")
ROLES = ("admin", "viewer")
TOKEN_PREFIX = "dsvc_"
MAX_FAILED_LOGINS = 5
LOCKOUT_SECONDS = 300
MAX_CLIENT_FAILED_LOGINS = 30
CLIENT_WINDOW_SECONDS = 600


@dataclass(frozen=True)
class ApiToken:
    """A live token as the API sees it. `topics`: the only topics it may send to, read, cancel
    and (admin) redrive, sorted; None: every topic."""

    id: int
    name: str
    scope: str
    topics: tuple[str, ...] | None
    expires_at: datetime | None = None

    def expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= datetime.now(UTC)

    def allows(self, topic: str) -> bool:
        return self.topics is None or topic in self.topics


# A live token, once found, is trusted for TOKEN_CACHE_SECONDS without asking the database
# again: an HTTP send is then one statement, not two transactions. A token revoked by another
# process (`delaysvc revoke-token`) stops working on a web worker within that time; revoked in
# this process, at once. Unknown tokens are never cached, so made-up ones cannot fill it.
TOKEN_CACHE_SECONDS = 5
_live_tokens: TTLCache[tuple[str, str], ApiToken] = TTLCache(maxsize=4096, ttl=TOKEN_CACHE_SECONDS)
_live_tokens_lock = threading.Lock()
_databases: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()
"""Each engine's database as the cache's keys name it: its URL, rendered once an engine."""

# What a login for a name that is not a user is checked against: a hash of a password nobody
# knows, made by generate_password_hash with its defaults (scrypt, n=2**15, r=8, p=1) like the
# users' own. Checking it costs what checking a user's password costs, so the time a login
# takes does not tell whether the name exists. (A literal: making one at import would cost a
# scrypt in every process that imports this module.)
_NO_USER_HASH = (
    "scrypt:32768:8:1$eUy74NeGNGBSQeJp$fc0fcbbb33cebe49d5b5c0ccfe4263171a7a846ad25201975e2f55ca"
    "1ed031f0e8cf619d0d68bdf42facd7b7e423c9caa12dd83bd233c544b69438daf410799c"
)


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


MAX_TOKEN_LIFE_MS = 10 * 366 * 86_400_000


def create_token(
    engine: Engine,
    name: str,
    scope: str = "send",
    topics: Iterable[str] | None = None,
    expires_in_ms: int | None = None,
) -> str:
    """-> the new token (shown once; only its hash is stored). `topics` limits it to those
    topics (each must be a valid topic name); None: every topic. It expires `expires_in_ms`
    from now (up to ten years); None: never (until revoked)."""
    if scope not in SCOPES:
        raise ValidationError("scope", f"{scope!r} is not a scope; use one of {SCOPES}")
    check_name("a token's name", name)
    if expires_in_ms is not None and not 0 < expires_in_ms <= MAX_TOKEN_LIFE_MS:
        raise ValidationError(
            "expires_in", "a token's life must be above 0 and at most ten years (3660d)"
        )
    only = None if topics is None else _token_topics(topics)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with engine.begin() as conn:
        if not store_tokens.insert_token(
            conn, name, _hash_token(token), scope, only, expires_in_ms
        ):
            raise ValidationError(
                "name",
                f"a token named {name!r} exists (a revoked token keeps its name); choose another",
            )
    return token


MAX_NAME = 100


def check_name(what: str, name: str) -> str:
    """A token's or a user's name: 1-100 printable characters, not starting or ending with a
    space (` ada` would pass for `ada` on a list)."""
    if not 1 <= len(name) <= MAX_NAME:
        raise ValidationError("name", f"{what} must be 1-{MAX_NAME} characters")
    if not name.isprintable():
        raise ValidationError("name", f"{what} must not contain control characters")
    if name != name.strip():
        raise ValidationError("name", f"{what} must not start or end with a space")
    return name


def _token_topics(topics: Iterable[str]) -> list[str]:
    """Valid topic names, sorted, each once; at least one (no list means every topic)."""
    valid = sorted({validate_topic(topic) for topic in topics})
    if not valid:
        raise ValidationError("topics", "give at least one topic, or none for every topic")
    return valid


def authenticate_token(engine: Engine, token: str) -> ApiToken | None:
    """-> the live token or None (unknown, revoked or expired). Looked up by its SHA-256: an
    attacker cannot steer the hash, so the lookup leaks nothing about stored tokens through
    timing. Live tokens (with their topics) are remembered for TOKEN_CACHE_SECONDS, but not
    past their expiry."""
    key = _cache_key(engine, token)
    with _live_tokens_lock:
        found = _live_tokens.get(key)
    if found is not None and not found.expired():
        return found
    with engine.connect() as conn:
        row = store_tokens.find_token(conn, key[1])
    if row is None:
        return None
    topics = None if row.topics is None else tuple(row.topics)
    found = ApiToken(row.id, row.name, row.scope, topics, row.expires_at)
    with _live_tokens_lock:
        _live_tokens[key] = found
    return found


def remembered_token(engine: Engine, token: str) -> ApiToken | None:
    """The live token `authenticate_token` remembers for `token`, without a lookup in the
    database (None: not remembered; it may still be live)."""
    key = _cache_key(engine, token)
    with _live_tokens_lock:
        found = _live_tokens.get(key)
    return None if found is None or found.expired() else found


def _cache_key(engine: Engine, token: str) -> tuple[str, str]:
    database = _databases.get(engine)
    if database is None:
        database = _databases[engine] = str(engine.url)
    return database, _hash_token(token)


def revoke_token(engine: Engine, name: str) -> bool:
    """Revoke the live tokens named `name`. -> whether there was one."""
    with engine.begin() as conn:
        revoked = store_tokens.revoke_token(conn, name)
    with _live_tokens_lock:
        _live_tokens.clear()
    return revoked


def list_tokens(engine: Engine) -> list[Any]:
    """Every API token (never its secret): name, scope, topics, created_at, revoked_at,
    expires_at, expired."""
    with engine.connect() as conn:
        return store_tokens.list_tokens(conn)


def list_users(engine: Engine) -> list[Any]:
    """Every dashboard user (never its password): name, role, created_at, locked_until."""
    with engine.connect() as conn:
        return store_users.list_users(conn)


def delete_user(engine: Engine, name: str) -> bool:
    """Remove a dashboard user; its sessions end at their next request. -> whether there was
    one."""
    with engine.begin() as conn:
        return store_users.delete_user(conn, name)


def create_user(
    engine: Engine, name: str, password: str, role: str | None = None, *, new_role: str = "viewer"
) -> str:
    """Add a dashboard user (its role `role`, else `new_role`), or set an existing one's
    password, and its role only when `role` is given: a password reset keeps the role (it
    made a viewer an admin). Either ends every dashboard session the user has (see
    `end_sessions`). -> the user's role."""
    for given in (role, new_role):
        if given is not None and given not in ROLES:
            raise ValidationError("role", f"{given!r} is not a role; use one of {ROLES}")
    check_name("a user's name", name)
    if len(password) < 8:
        raise ValidationError("password", "must be at least 8 characters")
    with engine.begin() as conn:
        return store.upsert_user(conn, name, generate_password_hash(password), role, new_role)


def end_sessions(engine: Engine, user: Any) -> bool:
    """End every dashboard session of `user` (a row of `check_login` or `store.find_user`), on
    every browser and every copy of its cookie: a session carries the user's session
    generation from its login, and is no session once that moves on. -> whether it moved on
    (False: something else moved it on first, or the user is gone)."""
    with engine.begin() as conn:
        return store_users.end_sessions(conn, user.id, user.session_generation)


FIRST_ADMIN = "admin"


def create_first_admin(engine: Engine) -> str | None:
    """On a database with no dashboard user: an admin named `admin` with a new random
    password, returned (to be shown once; only its hash is stored). With any user there: None,
    and nothing changes."""
    password = secrets.token_urlsafe(12)
    with engine.begin() as conn:
        added = store_users.add_first_user(
            conn, FIRST_ADMIN, generate_password_hash(password), "admin"
        )
    return password if added else None


class TooManyLogins(Exception):
    """The client failed MAX_CLIENT_FAILED_LOGINS logins in its window: refused, unchecked."""

    def __init__(self, seconds_left: int) -> None:
        super().__init__(f"too many failed logins; try again in {seconds_left} s")
        self.seconds_left = seconds_left


_WITH_PORT = re.compile(r"\[([0-9A-Fa-f:.]+)\]:[0-9]+|([0-9.]+):[0-9]+")


def client_of(address: str | None) -> str | None:
    """Whom a login's failures are counted against: an IPv4 address, or an IPv6 address's /64
    (one host's share of a network: an attacker holds a whole /64 as easily as one address),
    without a port. None when there is no address."""
    if not address:
        return None
    bare = _WITH_PORT.fullmatch(address)  # as some proxies forward it: `ip:port`, `[v6]:port`
    try:
        ip = ipaddress.ip_address(bare.group(1) or bare.group(2) if bare else address)
    except ValueError:
        return address[:100]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def check_login(engine: Engine, name: str, password: str, client: str | None = None) -> Any:
    """-> the user row if the password is right and the account is not locked, else None.
    MAX_FAILED_LOGINS failures lock the account for LOCKOUT_SECONDS. The attempt is counted
    as a failure (committed) before the password is checked, and cleared if it is right: of
    any number of simultaneous attempts at most MAX_FAILED_LOGINS are checked, as if they had
    come one by one (checked after the hash, every attempt in flight saw the account open).
    Every attempt costs exactly one password hash, whether the name is unknown, the account
    locked or neither, so response times do not tell which names exist or are locked.

    `client` (`client_of` the request's address): its failures, whatever names it tries,
    are counted too, and past MAX_CLIENT_FAILED_LOGINS in CLIENT_WINDOW_SECONDS its attempts
    raise TooManyLogins before any password is hashed or any account counted (a lockout per
    account stops one name being guessed, not one client trying many, each a full scrypt). A
    right password takes its own attempt off the client's count, not the others."""
    with engine.begin() as conn:
        if client is not None:
            failures, seconds_left = store_users.count_client_attempt(
                conn, client, CLIENT_WINDOW_SECONDS
            )
            if failures > MAX_CLIENT_FAILED_LOGINS:
                raise TooManyLogins(max(1, seconds_left))
        user = store.count_login_attempt(conn, name, MAX_FAILED_LOGINS, LOCKOUT_SECONDS)
    ok = check_password_hash(_NO_USER_HASH if user is None else user.password_hash, password)
    if user is None or not ok:
        return None
    with engine.begin() as conn:
        store.clear_failed_logins(conn, name)
        if client is not None:
            store_users.forgive_client_attempt(conn, client)
    return user
