"""A migrated database of its own for the measuring scripts in this folder, dropped after."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, text

from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine, sqlalchemy_url
from delaysvc.schema.migrate import upgrade
from delaysvc.store import producing


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


def server_and_rounds(rounds: int = 5) -> tuple[str, int]:
    """A measuring script's arguments, `[SERVER_URL] [ROUNDS]`: the PostgreSQL to work on
    (default the local one) and how many alternating rounds to run."""
    server = sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres"
    return server, int(sys.argv[2]) if len(sys.argv) > 2 else rounds


def batch_lots(count: int, size: int) -> list[list[dict[str, Any]]]:
    """`count` batches of `size` items of the send suite's shape (`delaysvc bench send`: one
    topic, a body of its own each, "1h", a level), numbered on from batch to batch."""
    return [
        [
            {"topic": "bench.noop", "body": {"order_id": n, "action": "cancel"}, "delay": "1h"}
            for n in range(start, start + size)
        ]
        for start in range(0, count * size, size)
    ]


def send_one_call(new: producing.NewMessage) -> tuple[str, dict[str, Any]]:
    """`send_one`'s statement as psycopg runs it (its `%(name)s` placeholders) and its
    parameters for `new` (a `Producer.prepare` result), caps not held: a single send's one
    statement, run by hand."""
    statement = re.sub(r"(?<!:):([a-z_]+)", r"%(\1)s", producing.SEND_ONE.replace("%", "%%"))
    return statement, {**producing._message_params(new), "caps_held": False}


def send_token(url: str, name: str) -> str:
    """A new `send` API token in the database at `url`, migrated first (for a web server the
    script starts on it); `name` and this process's id name the token."""
    from delaysvc import auth

    settings = Settings(database_url=url)
    engine = make_engine(settings, url)
    try:
        upgrade(engine, settings.levels)
        return auth.create_token(engine, f"{name}-{os.getpid()}", scope="send")
    finally:
        engine.dispose()


RAW_TABLE = "CREATE TABLE raw (id bigserial PRIMARY KEY, topic text, body bytea)"
RAW_INSERT = "INSERT INTO raw (topic, body) VALUES (%s, %s)"


def raw_insert_on(conn: Any) -> Callable[[], object]:
    """The raw one-row insert a single send is compared with, on `conn` (a psycopg connection
    in autocommit): a two-column table with a primary key, made here; each call one prepared
    insert, its own transaction."""
    conn.execute(RAW_TABLE)
    return lambda: conn.execute(RAW_INSERT, ("t", b"{}"), prepare=True)


def copy_data(conn: Any, table: str, columns: str, order: str) -> bytes:
    """`table`'s rows as binary COPY data, in `order` (`conn`: a psycopg connection), to be
    sent again as one block, so no Python runs per row and a COPY's time is the server's."""
    data = bytearray()
    with conn.cursor() as cursor:
        query = f"COPY (SELECT {columns} FROM {table} ORDER BY {order}) TO STDOUT (FORMAT BINARY)"
        with cursor.copy(query) as copy:
            for block in copy:
                data += block
    assert data, f"no rows in {table}"
    return bytes(data)
