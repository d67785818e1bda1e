"""Storing messages: one send in one statement, a batch through a staging table, lookups by id and
by key."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from psycopg import AsyncConnection, Cursor
from psycopg.rows import namedtuple_row

from delaysvc.config.validation import json_text
from delaysvc.db.names import LOCK_KEY, lock_name, sql
from delaysvc.db.names import driver_sql as _driver_sql
from delaysvc.errors import DuplicateKey
from delaysvc.store import history as store_history
from delaysvc.store.shared import (
    _DUE,
    _ENQUEUE_FROM,
    _NEXT_OFFSET,
    _NOT_PAST,
    _PLACED_LANE,
    MESSAGE_STATE,
    NewMessage,
    Statements,
)

# One send is one call of the database's `send_one` (migration 0017, where its body is): it
# places the message in its lane (a level only while the database gives it the delay the
# producer computed, else the timer lane), stores nothing if a backlog cap covers its topic or
# level unless the caller holds the caps' locks (:caps_held; it returns one row of NULLs, and the
# producer stores the message under the caps: `delaysvc.producer.caps`), nothing if its key is
# held by an unfinished message of the topic (no row), and else returns what the database
# decided: id, stored_at, deliver_ts and the lane. PostgreSQL keeps the plans of the function's
# statements for the server connection's life, so a send through a transaction-pooling
# PgBouncer, where nothing is prepared, runs planned statements as a direct one does.
SEND_ONE = f"""
SELECT * FROM delaysvc.send_one(:topic, :key, CAST(:tags AS text[]), :body, :body_is_json,
    CAST(:properties AS jsonb), CAST(:delay_level AS smallint), CAST(:priority AS smallint),
    CAST(:lane AS integer), CAST(:delay_ms AS bigint),
    {_NOT_PAST.format(deliver_at="CAST(:deliver_at AS timestamptz)")},
    CAST(:caps_held AS boolean))
"""


def _message_params(message: NewMessage) -> dict[str, Any]:
    return {
        "topic": message.topic,
        "key": message.key,
        "tags": message.tags,
        "body": message.body,
        "body_is_json": message.body_is_json,
        "properties": json_text(message.properties) if message.properties is not None else None,
        "delay_level": message.delay_level,
        "priority": message.priority,
        "lane": message.lane,
        "delay_ms": message.delay_ms,
        "deliver_at": message.deliver_at,
    }


class Stored(NamedTuple):
    """What the database decided for a message just stored."""

    id: int
    stored_at: datetime
    deliver_ts: datetime
    lane: int


def insert_message(
    cursor: Cursor[Any], message: NewMessage, caps_held: bool
) -> tuple[Any, bool, int | None] | None:
    """Store one message and put it in its lane, in one statement. -> (row, created, origin)
    as `insert_messages` gives them: a new message's row is `Stored` (the caller has the rest;
    origin 0); a key already held by an unfinished message of the topic gives that message's
    whole row, created=False, origin None. None: a backlog cap covers the message's topic or
    level and the caller does not hold the caps' locks (`caps_held`): nothing was stored.

    `cursor` is a psycopg 3 driver cursor (an autocommitted single send:
    `db.autocommit_cursor`; in a transaction: `driver_errors`): the statement is prepared on
    the server once per connection (unless the connection has prepared statements turned off,
    as for PgBouncer), and SQLAlchemy's execution and result objects, which cost more Python
    than the statement's own execution, are skipped (docs/benchmarks/README.md, "Send").
    `insert_message_on` is the same on any `Statements`."""
    prepare = None if cursor.connection.prepare_threshold is None else True
    params = {**_message_params(message), "caps_held": caps_held}
    statement = _driver_sql(SEND_ONE)

    def find_holder() -> Any:
        with cursor.connection.cursor(row_factory=namedtuple_row) as named:
            lookup = {"topic": message.topic, "key": message.key}
            return named.execute(_driver_sql(_FIND_UNFINISHED_BY_KEY), lookup).fetchone()

    return _insert_or_find(
        message, lambda: cursor.execute(statement, params, prepare=prepare).fetchone(), find_holder
    )


# Several single sends in one statement (`delaysvc.producer.grouping`: sends of one process's
# threads that waited for each other): `send_one` called once per message, in order, so each
# message is placed, capped and keyed exactly as if sent alone, and later calls see what earlier
# ones stored (a key repeated in the group is held by its first message). One round trip and one
# commit for all of them. Tags travel as JSON text (an array of text arrays must be rectangular).
SEND_GROUP = f"""
SELECT s.sent_id, s.sent_at, s.due_at, s.sent_lane
FROM unnest(CAST(:topic AS text[]), CAST(:key AS text[]), CAST(:tags AS jsonb[]),
    CAST(:body AS bytea[]), CAST(:body_is_json AS boolean[]), CAST(:properties AS jsonb[]),
    CAST(:delay_level AS smallint[]), CAST(:priority AS smallint[]), CAST(:lane AS integer[]),
    CAST(:delay_ms AS bigint[]), CAST(:deliver_at AS timestamptz[])) WITH ORDINALITY
    AS m(topic, key, tags, body, body_is_json, properties, delay_level, priority, lane,
        delay_ms, deliver_at, ord)
LEFT JOIN LATERAL delaysvc.send_one(m.topic, m.key,
    CASE WHEN m.tags IS NOT NULL THEN ARRAY(SELECT jsonb_array_elements_text(m.tags)) END,
    m.body, m.body_is_json, m.properties, m.delay_level, m.priority, m.lane, m.delay_ms,
    {_NOT_PAST.format(deliver_at="m.deliver_at")}, false) s ON true
ORDER BY m.ord
"""


def insert_group(
    cursor: Cursor[Any], messages: Sequence[NewMessage]
) -> list[tuple[Stored, bool, int] | None]:
    """Store `messages` (each a single send; at least one), in one statement on `cursor` (a
    psycopg 3 driver cursor; autocommitted: `db.autocommit_cursor`), caps not held. -> per
    message, in order, (row, True, 0) as `insert_message` gives a new one, or None: nothing
    stored for it (a cap covers it, or an unfinished message holds its key), to be sent alone
    (`insert_message`)."""
    prepare = None if cursor.connection.prepare_threshold is None else True
    order = _key_order(messages)
    params = _group_params([messages[i] for i in order])
    rows = cursor.execute(_driver_sql(SEND_GROUP), params, prepare=prepare).fetchall()
    return [None if row[0] is None else (Stored(*row), True, 0) for row in _unsorted(rows, order)]


async def insert_group_async(
    conn: AsyncConnection[Any], messages: Sequence[NewMessage]
) -> list[Stored | None]:
    """Store `messages` (each a single send; at least one) in one autocommitted statement on a
    psycopg AsyncConnection, caps not held: one alone by `SEND_ONE`, more by `SEND_GROUP`
    (`delaysvc.producer.aio`). -> per message, in order, what the database decided, or None:
    nothing stored for it (a cap covers it, or an unfinished message holds its key), to be
    sent the producer's way."""
    prepare = None if conn.prepare_threshold is None else True
    if len(messages) == 1:
        params = {**_message_params(messages[0]), "caps_held": False}
        cursor = await conn.execute(_driver_sql(SEND_ONE), params, prepare=prepare)
        row = await cursor.fetchone()
        return [None if row is None or row[0] is None else Stored(*row)]
    order = _key_order(messages)
    params = _group_params([messages[i] for i in order])
    cursor = await conn.execute(_driver_sql(SEND_GROUP), params, prepare=prepare)
    rows = await cursor.fetchall()
    return [None if row[0] is None else Stored(*row) for row in _unsorted(rows, order)]


def rolled_back(error: Exception) -> bool:
    """Whether a statement's `error` is PostgreSQL's rolling it back (SQLSTATE class 40: a
    deadlock, a serialization failure), so nothing of it was stored and it may be sent again.
    psycopg's classes do not tell it (its DeadlockDetected is no TransactionRollback)."""
    return (getattr(error, "sqlstate", None) or "").startswith("40")


def _key_order(messages: Sequence[NewMessage]) -> list[int]:
    """The order a group writes its messages in: those with keys by (topic, key), the rest
    after, each kind in the order they came. A key's row is locked from its insert to the
    commit, and a writer inserting the same key waits for it: two groups sharing keys wait on
    each other one way only, never both ways (a deadlock, which fails every send in both)."""
    return sorted(
        range(len(messages)),
        key=lambda i: (0, messages[i].topic, messages[i].key) if messages[i].key else (1, "", ""),
    )


def _unsorted(rows: Sequence[Any], order: Sequence[int]) -> list[Any]:
    """`rows`, one per message in `order`, put back in the messages' own order."""
    put: list[Any] = [None] * len(rows)
    for row, index in zip(rows, order, strict=True):
        put[index] = row
    return put


def _group_params(messages: Sequence[NewMessage]) -> dict[str, list[Any]]:
    """`SEND_GROUP`'s parameters: each of `_message_params` as an array, a message an item."""
    each = [_message_params(message) for message in messages]
    params = {name: [one[name] for one in each] for name in each[0]}
    params["tags"] = [None if tags is None else json_text(tags) for tags in params["tags"]]
    return params


def insert_message_on(conn: Statements, message: NewMessage) -> tuple[Any, bool, int | None]:
    """`insert_message` through any `Statements` (any driver), by a caller holding the caps'
    locks or sending due now (never capped)."""
    inserted = insert_uncapped_on(conn, message, caps_held=True)
    assert inserted is not None  # with the caps held, nothing is left to them
    return inserted


def insert_uncapped_on(
    conn: Statements, message: NewMessage, caps_held: bool = False
) -> tuple[Any, bool, int | None] | None:
    """`insert_message` through any `Statements` (any driver)."""
    params = {**_message_params(message), "caps_held": caps_held}
    return _insert_or_find(
        message,
        lambda: conn.execute(sql(SEND_ONE), params).first(),
        lambda: find_unfinished_by_key(conn, message.topic, message.key),
    )


def _insert_or_find(
    message: NewMessage, insert: Callable[[], Any], find_holder: Callable[[], Any]
) -> tuple[Any, bool, int | None] | None:
    for _ in range(5):
        row = insert()
        if row is not None:
            if row[0] is None:
                return None  # a cap covers it
            return Stored(*row), True, 0
        if message.key is not None:
            existing = find_holder()
            if existing is not None:
                return existing, False, None
        # The holder of the key finished between the two statements: try again.
    raise DuplicateKey(f"key {message.key!r} of topic {message.topic!r} is changing hands; retry")


# The staged insert: a batch's way where it is not COPYed straight into the tables (psycopg2,
# Django's cursor, asyncio connections; on psycopg 3, `store.batches`), and after a key race
# there (`delaysvc.producer.batching`). The batch goes into a temporary staging table (by COPY,
# else from a JSON document; one per session, emptied by the insert that reads it, and at
# commit), then is stored by one statement: ids are drawn in batch order
# first, so each created row maps back to its item; lanes, offsets, the key rule and
# database-clock deliver_ts are the single send's. A key held already, or earlier in the batch,
# creates nothing (ON CONFLICT DO NOTHING sees rows this statement inserted).
_STAGE_TABLE = "delaysvc_send_stage"
_STAGE_COLUMNS = (
    "ord, topic, key, tags, body, body_is_json, properties, delay_level, lane, delay_ms, "
    "deliver_at, priority"
)
_CREATE_STAGE = f"""CREATE TEMP TABLE IF NOT EXISTS {_STAGE_TABLE} (
    ord int, topic text, key text, tags text[], body bytea, body_is_json boolean,
    properties jsonb, delay_level smallint, lane smallint, delay_ms bigint,
    deliver_at timestamptz, priority smallint
) ON COMMIT DELETE ROWS"""
_COPY_STAGE = f"COPY {_STAGE_TABLE} ({_STAGE_COLUMNS}) FROM STDIN"
INSERT_STAGED = f"""
WITH staged AS (
    DELETE FROM {_STAGE_TABLE} RETURNING *
), numbered AS (
    SELECT nextval('delaysvc.commit_log_id_seq') AS id, s.ord, s.topic, s.key, s.tags, s.body,
        s.body_is_json, s.properties, s.delay_level, s.priority,
        CAST({_PLACED_LANE.format(lane="s.lane", delay_ms="s.delay_ms")} AS smallint) AS lane,
        s.delay_ms, s.deliver_at
    FROM (SELECT * FROM staged ORDER BY ord) s
), msg AS (
    INSERT INTO delaysvc.commit_log (id, topic, key, tags, body, body_is_json, properties,
        delay_level, priority, lane, queue_offset, status, stored_at, deliver_ts, delivered_at)
    SELECT id, topic, key, tags, body, body_is_json, properties, delay_level, priority, lane,
        {_NEXT_OFFSET.format(lane="lane")},
        CASE WHEN lane < 0 THEN 'ready' ELSE 'scheduled' END,
        statement_timestamp(),
        {_DUE.format(deliver_at="deliver_at", delay_ms="delay_ms")},
        CASE WHEN lane < 0 THEN statement_timestamp() END
    FROM numbered ORDER BY ord
    ON CONFLICT (topic, key) WHERE key IS NOT NULL AND finished_at IS NULL DO NOTHING
    RETURNING id, topic, lane, queue_offset, stored_at, deliver_ts, priority
){_ENQUEUE_FROM.format(src="msg")}
SELECT n.ord, m.id, m.stored_at, m.deliver_ts FROM msg m JOIN numbered n ON n.id = m.id
"""


# Without a psycopg 3 cursor to COPY with (psycopg2, Django's cursor, asyncio connections), a
# batch is staged by one statement from a JSON document of its rows (`_stage_document`).
_STAGE_FROM_JSON = f"""INSERT INTO {_STAGE_TABLE} ({_STAGE_COLUMNS})
SELECT ord, topic, key, tags, decode(body, 'base64'), body_is_json, properties, delay_level,
    lane, delay_ms, deliver_at, priority
FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS s(ord int, topic text, key text, tags text[],
    body text, body_is_json boolean, properties jsonb, delay_level smallint, lane smallint,
    delay_ms bigint, deliver_at timestamptz, priority smallint)"""


def stage_rows(cursor: Cursor[Any], rows: Iterable[tuple[Any, ...]]) -> None:
    """COPY `stage_row`s into the session's staging table (made if it is missing), for
    INSERT_STAGED to store, in the cursor's transaction."""
    cursor.execute(_CREATE_STAGE)
    with cursor.copy(_COPY_STAGE) as copy:
        for row in rows:
            copy.write_row(row)


def stage_row(ord_: int, message: NewMessage) -> tuple[Any, ...]:
    properties = message.properties
    return (
        ord_,
        message.topic,
        message.key,
        message.tags,
        message.body,
        message.body_is_json,
        json_text(properties) if properties is not None else None,
        message.delay_level,
        message.lane,
        message.delay_ms,
        message.deliver_at,
        message.priority,
    )


def _stage_document(staged: Iterable[tuple[int, NewMessage]]) -> str:
    return json_text(
        [
            {
                "ord": ord_,
                "topic": m.topic,
                "key": m.key,
                "tags": m.tags,
                "body": base64.b64encode(m.body).decode("ascii"),
                "body_is_json": m.body_is_json,
                "properties": m.properties,
                "delay_level": m.delay_level,
                "lane": m.lane,
                "delay_ms": m.delay_ms,
                "deliver_at": m.deliver_at.isoformat() if m.deliver_at is not None else None,
                "priority": m.priority,
            }
            for ord_, m in staged
        ]
    )


def insert_messages(
    conn: Statements, messages: Sequence[NewMessage], cursor: Cursor[Any] | None = None
) -> list[tuple[Any, bool, int | None]]:
    """Store many messages in the caller's transaction: into the staging table (COPY on
    `cursor`, a psycopg 3 cursor of `conn`'s connection; without one, one statement from a
    JSON document), then one insert. -> [(row, created, origin)] in input order. A created row
    holds `id, stored_at, deliver_ts` and `origin` is the item's index; a key taken earlier in
    the batch gives that item's row and index with created=False; a key held by an unfinished
    message already gives that message's whole row, created=False and origin None."""
    created: list[Any] = [None] * len(messages)
    holders: dict[tuple[str, str], Any] = {}
    pending: Iterable[int] = range(len(messages))
    for _ in range(5):
        _stage(conn, cursor, ((ord_, messages[ord_]) for ord_ in pending))
        for row in conn.execute(sql(INSERT_STAGED)):
            created[row.ord] = row
        missing = [ord_ for ord_ in pending if created[ord_] is None]  # each with a key
        pairs = [(messages[ord_].topic, messages[ord_].key) for ord_ in missing]
        holders.update(find_unfinished_by_keys(conn, pairs))  # this batch's own rows too
        # a key skipped by the insert whose holder finished before this lookup (cancelled by
        # another transaction): nobody holds it now, so it is stored again
        pending = [ord_ for ord_, pair in zip(missing, pairs, strict=True) if pair not in holders]
        if not pending:
            break
    results: list[tuple[Any, bool, int | None]] = []
    first_in_batch: dict[tuple[str, str], int] = {}
    for index, (message, row) in enumerate(zip(messages, created, strict=True)):
        pair = (message.topic, message.key) if message.key is not None else None
        if row is not None:
            if pair is not None:
                first_in_batch.setdefault(pair, index)
            results.append((row, True, index))
        elif pair is not None and pair in first_in_batch:
            origin = first_in_batch[pair]
            results.append((created[origin], False, origin))
        elif pair is not None and pair in holders:
            results.append((holders[pair], False, None))
        else:
            raise DuplicateKey(
                f"key {message.key!r} of topic {message.topic!r} is changing hands; retry"
            )
    return results


def _stage(
    conn: Statements, cursor: Cursor[Any] | None, staged: Iterable[tuple[int, NewMessage]]
) -> None:
    """Put `staged` ((ord, message) each) in the session's staging table, for INSERT_STAGED:
    by COPY on `cursor`, else by one statement from a JSON document."""
    if cursor is not None:
        stage_rows(cursor, (stage_row(ord_, message) for ord_, message in staged))
    else:
        conn.execute(sql(_CREATE_STAGE))
        conn.execute(sql(_STAGE_FROM_JSON), {"rows": _stage_document(staged)})


def lock_key(conn: Statements, topic: str, key: str | None) -> None:
    """Serialise the replacing sends of one key of a topic (of this schema) until the
    transaction ends (`Producer.send`'s `on_duplicate`)."""
    conn.execute(
        sql(f"SELECT pg_advisory_xact_lock({LOCK_KEY})"),
        {"lock": lock_name(f"key {len(topic)} {topic} {key}")},
    )


def find_unfinished_by_keys(
    conn: Statements, pairs: Sequence[tuple[str, str | None]], lock: bool = False
) -> dict[tuple[str, str], Any]:
    """The unfinished messages holding these (topic, key) pairs, in one statement (`lock`:
    each locked FOR SHARE until the transaction ends)."""
    wanted = {(topic, key) for topic, key in pairs if key is not None}
    if not wanted:
        return {}
    topics, keys = zip(*wanted, strict=True)
    rows = conn.execute(
        sql(
            f"SELECT {MESSAGE_STATE} FROM delaysvc.commit_log c WHERE c.key IS NOT NULL AND "
            "c.finished_at IS NULL AND "
            "(c.topic, c.key) IN (SELECT * FROM unnest(CAST(:topics AS text[]), "
            "CAST(:keys AS text[])))" + (" FOR SHARE OF c" if lock else "")
        ),
        {"topics": list(topics), "keys": list(keys)},
    )
    return {(row.topic, row.key): row for row in rows}


_FIND_UNFINISHED_BY_KEY = f"""SELECT {MESSAGE_STATE} FROM delaysvc.commit_log c
    WHERE c.topic = :topic AND c.key = :key AND c.finished_at IS NULL"""


def find_unfinished_by_key(conn: Statements, topic: str, key: str | None) -> Any:
    if key is None:
        return None
    return conn.execute(sql(_FIND_UNFINISHED_BY_KEY), {"topic": topic, "key": key}).first()


def unfinished_keys_in_family(
    conn: Statements, topic_prefix: str, keys: Sequence[str]
) -> list[tuple[str, str]]:
    """(topic, key) of the unfinished messages that hold one of `keys` in a topic beginning
    with `topic_prefix`: the topics holding keys are found by a loose index scan along the key
    index (one probe per topic), then each is probed for each key."""
    rows = conn.execute(
        sql(
            """
WITH RECURSIVE t AS (
    (SELECT topic FROM delaysvc.commit_log WHERE key IS NOT NULL AND finished_at IS NULL
     ORDER BY topic LIMIT 1)
    UNION ALL
    SELECT (SELECT c.topic FROM delaysvc.commit_log c
            WHERE c.key IS NOT NULL AND c.finished_at IS NULL AND c.topic > t.topic
            ORDER BY c.topic LIMIT 1)
    FROM t WHERE t.topic IS NOT NULL
)
SELECT c.topic, c.key FROM t JOIN delaysvc.commit_log c ON c.topic = t.topic
WHERE starts_with(t.topic, :prefix) AND c.key = ANY(CAST(:keys AS text[]))
  AND c.finished_at IS NULL
ORDER BY c.topic, c.key
"""
        ),
        {"prefix": topic_prefix, "keys": list(keys)},
    )
    return [(row.topic, row.key) for row in rows]


def get_message(conn: Statements, message_id: int) -> Any:
    return conn.execute(
        sql(f"SELECT {MESSAGE_STATE} FROM delaysvc.message c WHERE c.id = :id"),
        {"id": message_id},
    ).first()


# The newest finished message of a key: among commit_log's few finished rows (their partial
# index) or in the history (its days' key indexes), each table's newest on its own. Through
# the view, commit_log's side had no index for a key that may have finished: a scan of the
# whole backlog.
_FIND_FINISHED_BY_KEY = f"""SELECT {MESSAGE_STATE} FROM (
    (SELECT {store_history.COLUMNS} FROM delaysvc.commit_log
        WHERE topic = :topic AND key = :key AND finished_at IS NOT NULL ORDER BY id DESC LIMIT 1)
    UNION ALL
    (SELECT {store_history.COLUMNS} FROM delaysvc.message_history
        WHERE topic = :topic AND key = :key ORDER BY id DESC LIMIT 1)
) c ORDER BY c.id DESC LIMIT 1"""


def find_message_by_key(conn: Statements, topic: str, key: str) -> Any:
    """The unfinished message holding the key, else the newest finished one."""
    unfinished = find_unfinished_by_key(conn, topic, key)
    if unfinished is not None:
        return unfinished
    return conn.execute(sql(_FIND_FINISHED_BY_KEY), {"topic": topic, "key": key}).first()
