"""A batch of messages COPYed straight into the commit log and its lanes, on a psycopg 3 cursor.

A batch's rows reach the tables by binary COPY, the fastest way PostgreSQL takes rows, with
nothing between: no staging table, no set-based insert, no rows sent back. What a send's
statement decides in the database is decided first: while the producer checks its items, the
batch's ids in batch order, the store time on the database clock, and the lane and offsets of
its first item's lane (`drawing`); when the items go elsewhere too, the lane of each level the
batch uses (the level while the database agrees on its delay, else the timer lane:
`_PLACED_LANE`, as a single send's), then each lane's queue offsets and the store time
(`reserve`). From the store time the producer computes every due time as the database would.
The commit log's rows, the lanes' rows and the lanes' counts then follow by COPY and one
insert, in the caller's transaction. A key held by an unfinished message is the caller's to
find first (`find_unfinished_by_keys`): a row COPYed with a key held meanwhile fails on the
key's unique index (`KEY_INDEX`), and only that.

Measured side by side (docs/benchmarks/2026-11-27-send-batch-copy): these statements store a
batch's messages at 125,717 a second, the staging table and its insert took them at 61,309.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, NamedTuple

from psycopg import Copy, Cursor, Pipeline
from psycopg.adapt import PyFormat
from psycopg.types.json import set_json_dumps

from delaysvc.config.validation import json_text
from delaysvc.db.names import driver_sql, qualify
from delaysvc.store.shared import _PLACED_LANE

KEY_INDEX = "uq_commit_log_topic_key"
"""The unique index a COPYed row fails on when an unfinished message holds its key."""

# The lane each (level, delay) of a batch goes to.
_PLACE_LEVELS = f"""SELECT a.lane AS asked,
    CAST({_PLACED_LANE.format(lane="a.lane", delay_ms="a.delay_ms")} AS smallint) AS lane
FROM unnest(CAST(:lanes AS smallint[]), CAST(:delays AS bigint[])) AS a(lane, delay_ms)"""

# The sequence of a lane's offsets: the timer lane's (0) or a level's; none below 0 (due now).
_LANE_SEQUENCE = """CAST(CASE WHEN {lane} = 0 THEN 'delaysvc.timer_queue_seq'
        WHEN {lane} > 0 THEN format('delaysvc.consume_queue_%s_seq', {lane}) END AS regclass)"""

# `:count` message ids in ascending order, the store time, the lane the database gives the
# lane `:lane` asked for with the delay `:delay_ms` (as `_PLACE_LEVELS`: a level only while it
# has that delay, else the timer lane 0; a lane below 0 stays), when that lane is a queue
# (>= 0) `:count` of its offsets in ascending order, and whether the database has any backlog
# cap. Its sequence is looked up once (MATERIALIZED), not once per offset.
_DRAW = f"""WITH placed AS MATERIALIZED (
    SELECT p.lane, {_LANE_SEQUENCE.format(lane="p.lane")} AS seq
    FROM (SELECT CAST({_PLACED_LANE.format(lane=":lane", delay_ms=":delay_ms")} AS smallint)
        AS lane) p
)
SELECT ARRAY(SELECT nextval('delaysvc.commit_log_id_seq')
        FROM generate_series(1, CAST(:count AS int))) AS ids,
    statement_timestamp() AS stored_at, p.lane,
    CASE WHEN p.lane >= 0 THEN ARRAY(SELECT nextval(p.seq)
        FROM generate_series(1, CAST(:count AS int))) END AS offsets,
    EXISTS (SELECT FROM delaysvc.backlog_cap) AS capped
FROM placed p"""

# The store time (`statement_timestamp()`, pos 0), then for each lane of `:lanes` (0: the timer
# lane) as many queue offsets as `:counts` says, in ascending order, a row a lane (pos 1, 2,
# ...). A lane's sequence is looked up once (MATERIALIZED), not once per offset; each lane's
# offsets are drawn into an array of their own, so no row is sorted
# (docs/benchmarks/2026-11-28-batch-reserve: 1.3-1.4x the one array of every lane's offsets
# sorted by lane that this replaced).
_RESERVE = f"""WITH lanes AS MATERIALIZED (
    SELECT a.pos, a.n, {_LANE_SEQUENCE.format(lane="a.lane")} AS seq
    FROM unnest(CAST(:lanes AS smallint[]), CAST(:counts AS int[]))
        WITH ORDINALITY AS a(lane, n, pos)
)
SELECT 0 AS pos, statement_timestamp() AS stored_at, NULL AS drawn
UNION ALL
SELECT l.pos, NULL, ARRAY(SELECT nextval(l.seq) FROM generate_series(1, l.n)) FROM lanes l
ORDER BY pos"""

WIRE_TIME = "int8"
"""How the layouts below take a time (a timestamptz column): as `wire_time` gives it, the value
binary COPY carries, sent as an int8. psycopg's datetime dumper costs ~0.6 us a value, and a
batch message has three: two thirds of a commit-log row's `write_row` went to its two
(docs/benchmarks/2026-11-27-batch-wire-times)."""

_POSTGRES_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def wire_time(at: datetime) -> int:
    """`at` (aware) as binary COPY carries a timestamptz: microseconds since 2000-01-01 UTC."""
    since = at - _POSTGRES_EPOCH
    return (since.days * 86_400 + since.seconds) * 1_000_000 + since.microseconds


MESSAGE_ROW = (
    ("id", "int8"),
    ("topic", "text"),
    ("key", "text"),
    ("tags", "text[]"),
    ("body", "bytea"),
    ("body_is_json", "bool"),
    ("properties", "jsonb"),
    ("delay_level", "int2"),
    ("priority", "int2"),
    ("lane", "int2"),
    ("queue_offset", "int8"),
    ("status", "text"),
    ("stored_at", WIRE_TIME),
    ("deliver_ts", WIRE_TIME),
    ("delivered_at", WIRE_TIME),
)
"""A commit-log row as `copying` takes it: (column, type), in order. `properties` is a dict,
`tags` a list, times `wire_time`s."""
LEVEL_ROW = (
    ("level", "int2"),
    ("queue_offset", "int8"),
    ("message_id", "int8"),
    ("topic", "text"),
    ("deliver_ts", WIRE_TIME),
    ("priority", "int2"),
)
"""A level's queue row (`consume_queue`, routed to the level's partition)."""
TIMER_ROW = (
    ("deliver_ts", WIRE_TIME),
    ("queue_offset", "int8"),
    ("message_id", "int8"),
    ("topic", "text"),
    ("priority", "int2"),
)
"""A timer-lane row (`timer_queue`)."""
READY_ROW = (
    ("message_id", "int8"),
    ("topic", "text"),
    ("deliver_ts", WIRE_TIME),
    ("priority", "int2"),
)
"""A topic-queue row of a message due now (`topic_queue`; its `seq` and `enqueued_at` are the
table's defaults)."""

_COUNT_INTO_LANES = """INSERT INTO delaysvc.lane_count (lane, delta)
SELECT * FROM unnest(CAST(:lanes AS smallint[]), CAST(:deltas AS bigint[]))"""

_UNSEND = "DELETE FROM delaysvc.commit_log WHERE id = ANY(CAST(:ids AS bigint[]))"


class Reserved(NamedTuple):
    """What `reserve` drew: the store time (the database clock) and each lane's queue offsets
    (in the order the lanes were asked for)."""

    stored_at: datetime
    offsets: list[list[int]]


class Drawn:
    """What `drawing` drew, once its block has ended: the batch's ids, the store time, the lane
    the database gives the lane asked for, that lane's offsets (None: no queue's), and whether
    the database has any backlog cap (none: no batch needs to look for the caps covering it)."""

    ids: list[int]
    stored_at: datetime
    lane: int
    offsets: list[int] | None
    capped: bool


@contextmanager
def drawing(cursor: Cursor[Any], count: int, lane: int, delay_ms: int) -> Iterator[Drawn]:
    """`count` message ids, in ascending order, drawn by the database while the block runs,
    with the store time and, for the lane a batch most likely goes to (`lane`, its first
    item's, with its delay), `count` of its offsets: the statement is sent as the block starts
    (psycopg's pipeline mode) and its result read as it ends, into the `Drawn` it gives. A
    batch checks its items meanwhile (docs/benchmarks/2026-12-02-batch-ids-while-checked,
    2026-12-04-batch-offsets-while-checked), and, when they all go to that lane, takes its
    offsets from there, not from a `reserve` of its own after the checks, while the
    database works alone. Offsets a batch does not use (its items go elsewhere, or some hold
    keys) are a gap in that lane's offsets, as a rolled-back send's are: a lane's offsets
    order its messages, they do not count them (`lane_count` does). The read of
    `schedule_offset` keeps a change of the levels waiting until the transaction ends, as
    `place_levels`'s does. The arrays come back in binary, which psycopg reads quicker than
    text (ad hoc, 15 rounds in turn: 14.5 against 16.6 ms for 10,000 ids and offsets). With a
    libpq older than 14, which has no pipeline mode, they are drawn once the block has
    ended."""
    drawn = Drawn()
    params = {"count": count, "lane": lane, "delay_ms": delay_ms}
    if Pipeline.is_supported():
        with cursor.connection.pipeline():
            cursor.execute(driver_sql(_DRAW), params, binary=True)
            yield drawn
    else:
        yield drawn
        cursor.execute(driver_sql(_DRAW), params, binary=True)
    row = cursor.fetchone()
    assert row is not None  # the statement gives one row
    drawn.ids, drawn.stored_at, drawn.lane, drawn.offsets, drawn.capped = row


def place_levels(cursor: Cursor[Any], delays: Mapping[int, int]) -> dict[int, int]:
    """{level: the lane its messages go to} for `delays` ({level: the delay the producer
    computed for it, ms}): the level itself while the database gives it that delay, else the
    timer lane (0). The read of `schedule_offset` keeps a change of the levels waiting until the
    transaction ends, so the lanes stay right until the batch commits."""
    cursor.execute(
        driver_sql(_PLACE_LEVELS), {"lanes": list(delays), "delays": list(delays.values())}
    )
    return {asked: lane for asked, lane in cursor.fetchall()}


def reserve(cursor: Cursor[Any], lanes: Sequence[tuple[int, int]]) -> Reserved:
    """For each (lane, n) of `lanes` n queue offsets of that lane (0: the timer lane),
    ascending, with the store time, `statement_timestamp()`; read in binary (`drawing`)."""
    cursor.execute(
        driver_sql(_RESERVE),
        {"lanes": [lane for lane, _ in lanes], "counts": [n for _, n in lanes]},
        binary=True,
    )
    (_, stored_at, _), *drawn = cursor.fetchall()
    return Reserved(stored_at, [offsets for _, _, offsets in drawn])


@contextmanager
def copying(cursor: Cursor[Any], table: str, row: Sequence[tuple[str, str]]) -> Iterator[Copy]:
    """A binary COPY into `table` (`"commit_log"`, `"consume_queue"`, ...) of rows laid out as
    `row` (`MESSAGE_ROW`, `LEVEL_ROW`, `TIMER_ROW`, `READY_ROW`): `write_row` each. Rows are
    sent as they are written, so a batch is never held whole; the COPY ends with the block."""
    columns = ", ".join(name for name, _ in row)
    statement = qualify(f"COPY delaysvc.{table} ({columns}) FROM STDIN (FORMAT BINARY)")
    # A bytea column set by type name gets the dumper psycopg registered last for bytea: the
    # one of its DB-API `Binary` wrapper, Python code run for every body. This cursor's own
    # adapters (the connection's are left alone) take bytes' own, C in psycopg's binary build.
    cursor.adapters.register_dumper(bytes, cursor.adapters.get_dumper(bytes, PyFormat.BINARY))
    # and `properties` (a dict, jsonb) is written by `json_text` rather than psycopg's json.dumps
    set_json_dumps(json_text, cursor)
    with cursor.copy(statement) as copy:
        copy.set_types([kind for _, kind in row])
        yield copy


def copy_rows(
    cursor: Cursor[Any], table: str, row: Sequence[tuple[str, str]], rows: Iterable[Any]
) -> None:
    """COPY `rows` (tuples laid out as `row`) into `table` (see `copying`)."""
    with copying(cursor, table, row) as copy:
        for values in rows:
            copy.write_row(values)


def count_into_lanes(cursor: Cursor[Any], counts: Mapping[int, int]) -> None:
    """Append each lane's count (`{lane: messages put into it}`) to `lane_count`."""
    cursor.execute(
        driver_sql(_COUNT_INTO_LANES), {"lanes": list(counts), "deltas": list(counts.values())}
    )


def unsend(cursor: Cursor[Any], ids: Sequence[int]) -> None:
    """Delete commit-log rows this transaction COPYed before their lanes' rows were written
    (a batch refused halfway through its COPY: nothing of it stays)."""
    cursor.execute(driver_sql(_UNSEND), {"ids": list(ids)})


@contextmanager
def savepoint(cursor: Cursor[Any]) -> Iterator[None]:
    """The block's statements undone on an error, the transaction kept usable (a batch whose
    COPY meets a key taken meanwhile is stored again another way)."""
    cursor.execute("SAVEPOINT delaysvc_batch")
    try:
        yield
    except BaseException:
        if not (cursor.connection.closed or cursor.connection.broken):
            cursor.execute("ROLLBACK TO SAVEPOINT delaysvc_batch")
            cursor.execute("RELEASE SAVEPOINT delaysvc_batch")
        raise
    cursor.execute("RELEASE SAVEPOINT delaysvc_batch")
