"""The batch send's COPY path and the single send's one-statement path: what they return is
exactly what is stored, keys dedup inside a batch and against stored rows, caps hold, and the
caller's transaction decides."""

import gc
import threading
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
from psycopg import pq
from sqlalchemy import Engine, text

from delaysvc.config.settings import Settings
from delaysvc.config.validation import encode_body
from delaysvc.db.engines import libpq_url
from delaysvc.errors import BacklogFull, NotFound, ValidationError
from delaysvc.maintenance.check import run_check
from delaysvc.producer.sending import Message, Producer
from delaysvc.store import batches
from tests.support.passes import first_pass_only

COMPARED = (
    "id",
    "topic",
    "key",
    "status",
    "delay_level",
    "deliver_at",
    "stored_at",
    "tags",
    "properties",
    "delivered_at",
    "attempts",
)


def _same_as_stored(producer: Producer, message: Message) -> None:
    stored = producer.get(message.id)
    assert {f: getattr(message, f) for f in COMPARED} == {f: getattr(stored, f) for f in COMPARED}


def _lanes(engine: Engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        return sorted(
            conn.execute(
                text(
                    "SELECT 'level' || level, message_id FROM consume_queue "
                    "UNION ALL SELECT 'timer', message_id FROM timer_queue "
                    "UNION ALL SELECT 'ready', message_id FROM topic_queue"
                )
            ).all()
        )


def _count(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM commit_log")).scalar_one()


def test_single_sends_return_what_is_stored_in_every_kind_of_lane(
    producer: Producer, engine: Engine
) -> None:
    level = producer.send("t", {"a": 1}, delay_level=2, tags=["x"], properties={"p": "v"})
    timer = producer.send("t", [1, 2], delay="7s", key="k1")
    ready = producer.send("t", "now")
    at = producer.send("t", 1, deliver_at=datetime.now(UTC) + timedelta(minutes=5))
    for message in (level, timer, ready, at):
        assert message.created is True
        _same_as_stored(producer, message)
    assert (level.status, ready.status, ready.delivered_at) == (
        "scheduled",
        "ready",
        ready.stored_at,
    )
    assert timer.deliver_at - timer.stored_at == timedelta(seconds=7)
    assert _lanes(engine) == sorted(
        [("level2", level.id), ("timer", timer.id), ("ready", ready.id), ("timer", at.id)]
    )
    again = producer.send("t", "other", key="k1")
    assert (again.created, again.id, again.body) == (False, timer.id, [1, 2])


def test_a_batchs_rows_hold_the_times_its_messages_give_in_every_lane(
    producer: Producer, engine: Engine
) -> None:
    """The times a batch COPYs (as int8s: `batches.wire_time`) are its messages' own, in the
    commit log and in each lane, a time given in another zone with microseconds included."""
    at = datetime.now(ZoneInfo("America/New_York")).replace(microsecond=123457)
    sent = producer.send_batch(
        [
            {"topic": "t", "body": 0, "delay_level": 2},
            {"topic": "t", "body": 1, "delay": "7s"},
            {"topic": "t", "body": 2, "deliver_at": at + timedelta(minutes=5)},
            {"topic": "t", "body": 3},
        ]
    )
    with engine.connect() as conn:
        stored = conn.execute(
            text(
                "SELECT c.id, c.stored_at, c.deliver_ts, c.delivered_at, "
                "coalesce(q.deliver_ts, t.deliver_ts, r.deliver_ts) AS in_lane "
                "FROM commit_log c LEFT JOIN consume_queue q ON q.message_id = c.id "
                "LEFT JOIN timer_queue t ON t.message_id = c.id "
                "LEFT JOIN topic_queue r ON r.message_id = c.id ORDER BY c.id"
            )
        ).all()
    assert [(row.id, row.stored_at, row.deliver_ts, row.in_lane) for row in stored] == [
        (m.id, m.stored_at, m.deliver_at, m.deliver_at) for m in sent
    ]
    assert sent[2].deliver_at == at + timedelta(minutes=5)
    assert [row.delivered_at for row in stored] == [None, None, None, sent[3].stored_at]
    assert sent[1].deliver_at - sent[1].stored_at == timedelta(seconds=7)


def test_a_batchs_due_times_are_exact_across_a_daylight_saving_change(
    producer: Producer, engine: Engine, settings: Settings
) -> None:
    """A delay is elapsed time, as a single send's `statement_timestamp() + interval` makes
    it, in a session whose time zone changes its clock meanwhile: the batch's due times used to
    be wall-clock time added to the store time psycopg gives in that zone, an hour off."""
    zone = ZoneInfo("Europe/Berlin")
    now = datetime.now(zone)
    change = next(  # the first day after which Berlin's clock has changed
        day for day in range(1, 240) if (now + timedelta(days=day)).utcoffset() != now.utcoffset()
    )
    delay = timedelta(days=change + 1)
    items = [
        {"topic": "t", "body": 0, "delay_ms": delay // timedelta(milliseconds=1)},
        {"topic": "t", "body": 1, "delay": "1h"},  # a level's
    ]
    with psycopg.connect(
        libpq_url(settings.database_url), options="-c timezone=Europe/Berlin"
    ) as conn:
        sent = producer.send_batch(items, connection=conn)
        single = producer.send("t", 2, delay_ms=items[0]["delay_ms"], connection=conn)
        conn.commit()

    def elapsed_until_due(message: Message) -> timedelta:  # not the clocks' difference
        return message.deliver_at.astimezone(UTC) - message.stored_at.astimezone(UTC)

    assert [elapsed_until_due(m) for m in [*sent, single]] == [delay, timedelta(hours=1), delay]
    with engine.connect() as conn:
        elapsed = conn.execute(
            text(
                "SELECT extract(epoch FROM c.deliver_ts - c.stored_at), "
                "extract(epoch FROM coalesce(q.deliver_ts, t.deliver_ts) - c.stored_at) "
                "FROM commit_log c LEFT JOIN consume_queue q ON q.message_id = c.id "
                "LEFT JOIN timer_queue t ON t.message_id = c.id ORDER BY c.id"
            )
        ).all()
    seconds = delay.total_seconds()
    assert [tuple(map(float, row)) for row in elapsed] == [
        (seconds, seconds),
        (3600.0, 3600.0),
        (seconds, seconds),
    ]


def test_a_batch_mixing_lanes_gives_each_lane_its_offsets_in_batch_order(
    producer: Producer, engine: Engine
) -> None:
    """Items of two levels and the timer lane, interleaved: each lane's queue holds its
    messages in batch order by queue offset, and each commit-log row names the offset its lane
    row has (`batches.reserve` draws each lane's offsets as an array of its own). Level 2 and
    the timer lane hold earlier messages, so each lane's sequence is at a point of its own."""
    before = [producer.send("t", "earlier", delay_level=2).id for _ in range(3)]
    before_timer = [producer.send("t", "earlier", delay="9s").id for _ in range(2)]
    timings = [{"delay_level": 1}, {"delay": "7s"}, {"delay_level": 2}] * 4
    sent = producer.send_batch(
        [{"topic": "t", "body": n, **timing} for n, timing in enumerate(timings)]
    )
    with engine.connect() as conn:
        levels = conn.execute(
            text(
                "SELECT level, queue_offset, message_id FROM consume_queue "
                "ORDER BY level, queue_offset"
            )
        ).all()
        timer = conn.execute(
            text("SELECT queue_offset, message_id FROM timer_queue ORDER BY queue_offset")
        ).all()
        logged = dict(conn.execute(text("SELECT id, queue_offset FROM commit_log")).all())
    ids = [m.id for m in sent]
    assert [row.message_id for row in levels] == ids[0::3] + before + ids[2::3]
    assert [row.message_id for row in timer] == before_timer + ids[1::3]
    for lane_row in (*levels, *timer):
        assert logged[lane_row.message_id] == lane_row.queue_offset


def test_a_batch_in_one_lane_takes_the_offsets_drawn_while_it_was_checked(
    producer: Producer, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When every item goes to its first item's lane (a level, the timer lane, or due now),
    the store time and offsets drawn with the ids while the items were checked are the batch's
    (`batches.drawing`): no `reserve` after the checks. An item whose key is held uses no
    offset: a gap in the lane's offsets, as a rolled-back send leaves, and the lane's count
    stays exact. A batch of several lanes still reserves each lane's offsets after the
    checks; so does one whose level the database gives another delay (the disagreeing-level
    test below)."""
    reserves: list[list[tuple[int, int]]] = []
    reserve = batches.reserve
    monkeypatch.setattr(
        batches, "reserve", lambda cursor, lanes: reserves.append(lanes) or reserve(cursor, lanes)
    )
    held = producer.send("t", "held", delay_level=2, key="held")
    for timing, lane in (({"delay_level": 2}, "level2"), ({"delay": "7s"}, "timer")):
        items = [{"topic": "t", "body": n, **timing} for n in range(4)]
        sent = producer.send_batch([*items[:2], {**items[2], "key": "held"}, items[3]])
        assert [m.created for m in sent] == [True, True, False, True]
        assert sent[2].id == held.id
        created = [m for m in sent if m.created]
        assert len({m.stored_at for m in created}) == 1  # one statement's store time
        for message in created:
            _same_as_stored(producer, message)
            assert (lane, message.id) in _lanes(engine)
    now = producer.send_batch([{"topic": "t", "body": n} for n in range(3)])
    assert {m.status for m in now} == {"ready"}
    assert reserves == []
    after = producer.send("t", "after", delay_level=2)
    with engine.connect() as conn:
        offsets = conn.execute(
            text("SELECT message_id, queue_offset FROM consume_queue WHERE level = 2")
        ).all()
    by_offset = sorted(offsets, key=lambda row: row[1])
    assert [m for m, _ in by_offset] == sorted(m for m, _ in offsets)  # FIFO: send order
    assert len(offsets) == 5 and by_offset[-1][0] == after.id
    steps = [b - a for (_, a), (_, b) in pairwise(by_offset)]
    assert steps == [1, 1, 1, 2]  # the held key's offset unused
    assert _lane_counts(engine) == ({0: 3, 2: 5}, {0: 3, 2: 5})
    assert run_check(engine).violations == []
    producer.send_batch([{"topic": "t", "body": 0, "delay_level": 1}, {"topic": "t", "body": 1}])
    assert reserves == [[(1, 1)]]


def test_a_batch_dedups_keys_inside_itself_and_against_stored_rows(
    producer: Producer, engine: Engine
) -> None:
    held = producer.send("t", "old", delay="1h", key="held")
    finished = producer.send("t", "done", key="finished")
    producer.cancel(finished.id)
    items = [
        {"topic": "t", "body": 0, "key": "held"},
        {"topic": "t", "body": 1, "key": "a", "delay_level": 1},
        {"topic": "t", "body": 2, "key": "a", "delay": "1h"},
        {"topic": "u", "body": 3, "key": "a"},
        {"topic": "t", "body": 4, "key": "finished", "delay": "7s"},
        {"topic": "t", "body": 5},
        {"topic": "t", "body": 6},
        {"topic": "t", "body": 7, "key": "held"},
    ]
    results = producer.send_batch(items)
    ids = list(results.ids)  # read before any Message is made
    assert [m.created for m in results] == [False, True, False, True, True, True, True, False]
    assert ids == [m.id for m in results]
    assert results[0].id == results[7].id == held.id and results[0].body == "old"
    assert results[2].id == results[1].id and results[2].delay_level == 1
    assert results[4].id != finished.id
    created = [m for m in results if m.created]
    assert [m.id for m in created] == sorted(m.id for m in created)  # ids in batch order
    for message in created:
        _same_as_stored(producer, message)
    assert [producer.get(m.id).body for m in created] == [1, 3, 4, 5, 6]
    assert _count(engine) == 2 + len(created)
    lanes = _lanes(engine)
    assert ("level1", results[1].id) in lanes and ("timer", results[4].id) in lanes
    assert len(lanes) == 1 + len(created)  # `held` waits too; `finished` nowhere


def test_a_key_whose_holder_finishes_between_the_insert_and_the_lookup_is_stored_again(
    producer: Producer, engine: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staged insert (psycopg2, Django, asyncio, and after a COPY's key race) skips an item
    whose key an unfinished message holds, then looks that holder up. Cancelled in between by
    another transaction (run here at that very point), the holder was gone, and the whole batch
    failed with 409 `duplicate_key` "is changing hands; retry" (found by a reviewer: 1-2 a run of
    30 HTTP clients sending, replacing and cancelling on 6 keys). The item is now stored again,
    as a key nobody holds."""
    import psycopg2

    from delaysvc.store import producing

    held = producer.send("t", "old", delay="1h", key="k")
    lookups = []
    real = producing.find_unfinished_by_keys

    def cancelled_meanwhile(*args: object, **kwargs: object) -> object:
        if not lookups:
            producer.cancel(held.id)  # another transaction, committed
        lookups.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(producing, "find_unfinished_by_keys", cancelled_meanwhile)
    conn = psycopg2.connect(libpq_url(database_url))
    try:
        with conn:  # the caller's transaction: the staged insert's way
            sent = producer.send_batch(
                [
                    {"topic": "t", "body": "new", "delay": "1h", "key": "k"},
                    {"topic": "t", "body": "again", "key": "k"},
                    {"topic": "t", "body": "free"},
                ],
                connection=conn,
            )
    finally:
        conn.close()
    assert [m.created for m in sent] == [True, False, True]
    assert sent[1].id == sent[0].id != held.id
    assert producer.get(held.id).status == "cancelled"
    assert producer.get(sent[0].id).body == "new"
    _same_as_stored(producer, sent[0])
    assert _count(engine) == 3


def test_a_batch_stores_awkward_values_exactly(producer: Producer) -> None:
    bodies = [b"\\N", b"a\tb\nc\\d\r", "tab\there \\ \u00e9\u4e2d\U0001f600", {"q": 'x"y'}, b""]
    results = producer.send_batch(
        [
            {
                "topic": "t.x-y_z",
                "body": body,
                "key": f"k\\{i} \u00e9\u2603",
                "tags": ["a:b", "c.d"],
                "properties": {"back\\slash": "tab\there", "quote": '"', "nl": "a\nb"},
            }
            for i, body in enumerate(bodies)
        ]
    )
    for body, message in zip(bodies, results, strict=True):
        stored = producer.get(message.id)
        assert stored.body == body
        assert stored.key == message.key and stored.properties == message.properties
        _same_as_stored(producer, message)


def test_batches_in_the_callers_transaction_roll_back_to_nothing(
    producer: Producer, engine: Engine
) -> None:
    with engine.connect() as conn:
        trans = conn.begin()
        first = producer.send_batch(
            [{"topic": "t", "body": n, "delay": "1h"} for n in range(3)], connection=conn
        )
        second = producer.send_batch(
            [{"topic": "t", "body": n, "key": f"k{n}"} for n in range(3)], connection=conn
        )
        assert len({m.id for m in first + second}) == 6
        trans.rollback()
    for message in first + second:
        with pytest.raises(NotFound):
            producer.get(message.id)
    assert _count(engine) == 0 and _lanes(engine) == []
    with engine.begin() as conn:
        kept = producer.send_batch(
            [{"topic": "t", "body": n, "key": f"k{n}"} for n in range(3)], connection=conn
        )
        repeated = producer.send_batch(
            [{"topic": "t", "body": 9, "key": "k1"}, {"topic": "t", "body": 3}], connection=conn
        )
    assert [m.created for m in kept + repeated] == [True, True, True, False, True]
    assert repeated[0].id == kept[1].id
    assert _count(engine) == 4


def test_a_batch_over_a_reject_cap_stores_nothing_and_deliver_early_moves_the_oldest(
    settings: Settings, engine: Engine
) -> None:
    capped = Producer(
        settings.model_copy(update={"backlog_caps": "level:2=3:reject,level:1=2:deliver-early"}),
        engine,
    )
    with pytest.raises(BacklogFull):
        capped.send_batch([{"topic": "t", "body": n, "delay_level": 2} for n in range(4)])
    assert _count(engine) == 0
    stored = capped.send_batch([{"topic": "t", "body": n, "delay_level": 1} for n in range(5)])
    lanes = _lanes(engine)
    assert [m for lane, m in lanes if lane == "level1"] == [m.id for m in stored[3:]]
    assert sorted(m for lane, m in lanes if lane == "ready") == [m.id for m in stored[:3]]


# ---------------------------------------------------------------- the COPY path


def _lane_counts(engine: Engine) -> tuple[dict[int, int], dict[int, int]]:
    """Each lane's `lane_count` sum (what caps and stats read) and the rows it holds."""
    with engine.connect() as conn:
        counted = conn.execute(
            text(
                "SELECT lane, CAST(sum(delta) AS bigint) FROM lane_count GROUP BY lane "
                "HAVING sum(delta) <> 0"
            )
        ).all()
        held = conn.execute(
            text(
                "SELECT level, count(*) FROM consume_queue GROUP BY level "
                "UNION ALL SELECT 0, count(*) FROM timer_queue HAVING count(*) > 0"
            )
        ).all()
    return dict(counted), dict(held)


def test_a_batch_copied_in_a_psycopg_transaction_is_the_callers_to_commit_or_roll_back(
    producer: Producer, engine: Engine, settings: Settings
) -> None:
    items = [
        {"topic": "t", "body": 0, "delay_level": 2},
        {"topic": "t", "body": 1, "delay": "7s", "key": "k"},
        {"topic": "t", "body": 2},
        {"topic": "t", "body": 3, "deliver_at": datetime.now(UTC) + timedelta(minutes=5)},
    ]
    with psycopg.connect(libpq_url(settings.database_url)) as conn:
        rolled_back = producer.send_batch(items, connection=conn)
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS  # still theirs
        conn.rollback()
        assert _count(engine) == 0 and _lanes(engine) == []
        assert _lane_counts(engine) == ({}, {})
        committed = producer.send_batch(items, connection=conn)
        assert _count(engine) == 0  # not before they commit
        conn.commit()
    assert [m.created for m in rolled_back + committed] == [True] * 8
    assert {m.id for m in rolled_back}.isdisjoint(m.id for m in committed)
    for message in committed:
        _same_as_stored(producer, message)
    assert _lanes(engine) == sorted(
        [
            ("level2", committed[0].id),
            ("timer", committed[1].id),
            ("ready", committed[2].id),
            ("timer", committed[3].id),
        ]
    )
    assert _lane_counts(engine) == ({0: 2, 2: 1}, {0: 2, 2: 1})


def test_a_batch_in_the_callers_pipeline_is_stored_with_what_the_pipeline_queued(
    producer: Producer, engine: Engine, settings: Settings
) -> None:
    """`with conn.pipeline(): send_batch(..., connection=conn)`: psycopg has no COPY in
    pipeline mode, so the batch is staged and inserted (as psycopg2's), each statement synced
    with what the caller queued before it; the caller's transaction commits or rolls back the
    lot, and an item refused leaves the pipeline usable."""
    held = producer.send("t", "old", delay_level=1, key="held")
    items = [
        {"topic": "t", "body": b"\x00\xff", "delay_level": 2, "tags": ["x"]},
        {"topic": "t", "body": {"n": 1}, "delay": "7s", "key": "k"},
        {"topic": "t", "body": 2, "key": "held"},
        {"topic": "t", "body": 3, "key": "k"},
        {"topic": "t", "body": 4, "properties": {"p": "v"}},
    ]
    with psycopg.connect(libpq_url(settings.database_url)) as conn:
        conn.execute("CREATE TABLE orders (id int)")
        conn.commit()
        with conn.pipeline():
            conn.execute("INSERT INTO orders VALUES (1)")
            producer.send_batch(items, connection=conn)
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (0,)
        assert _count(engine) == 1  # the held one
        with conn.pipeline():
            conn.execute("INSERT INTO orders VALUES (42)")
            with pytest.raises(ValidationError, match=r"messages\[1\]\.topic"):
                producer.send_batch([items[0], {"topic": "", "body": 0}], connection=conn)
            sent = producer.send_batch(items, connection=conn)
            one = producer.send("t", 5, delay_level=3, connection=conn)
            assert conn.info.pipeline_status == pq.PipelineStatus.ON
        conn.commit()
        assert conn.execute("SELECT id FROM orders").fetchall() == [(42,)]
    assert [m.created for m in sent] == [True, True, False, False, True]
    assert (sent[2].id, sent[3].id) == (held.id, sent[1].id)
    for message in (*sent, one):
        _same_as_stored(producer, message)
    assert producer.get(sent[0].id).body == b"\x00\xff"
    assert _lanes(engine) == sorted(
        [
            ("level1", held.id),
            ("level2", sent[0].id),
            ("timer", sent[1].id),
            ("ready", sent[4].id),
            ("level3", one.id),
        ]
    )


def test_an_item_refused_while_the_ids_are_drawn_leaves_the_callers_transaction_as_it_was(
    producer: Producer, engine: Engine, settings: Settings
) -> None:
    """The database draws a batch's ids while its items are checked (psycopg's pipeline mode):
    an item refused then raises its own error, and the caller's transaction goes on, theirs to
    commit, with none of the batch in it."""
    with psycopg.connect(libpq_url(settings.database_url)) as conn:
        conn.execute("CREATE TABLE orders (id int)")
        conn.execute("INSERT INTO orders VALUES (42)")
        items = [{"topic": "t", "body": n, "delay": "1h"} for n in range(3)]
        with pytest.raises(ValidationError) as refused:
            producer.send_batch(
                [*items, {"topic": "t", "body": 3, "colour": "red"}], connection=conn
            )
        assert refused.value.field == "messages[3].colour"
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        assert conn.info.pipeline_status == pq.PipelineStatus.OFF
        kept = producer.send_batch(items, connection=conn)
        conn.commit()
        orders = conn.execute("SELECT id FROM orders").fetchall()
    assert orders == [(42,)]
    assert [m.created for m in kept] == [True] * 3
    assert [m.id for m in kept] == sorted(m.id for m in kept)
    with engine.connect() as conn:
        ids = conn.execute(text("SELECT id FROM commit_log ORDER BY id")).scalars().all()
    assert ids == [m.id for m in kept]
    assert _lane_counts(engine) == ({kept[0].delay_level or 0: 3}, {kept[0].delay_level or 0: 3})


def test_without_pipeline_mode_the_ids_are_drawn_after_the_checks(
    producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A libpq older than 14 has no pipeline mode (psycopg says so, and refuses to enter it):
    the batch's ids are drawn once its items are checked, and the batch is stored the same."""

    def no_pipeline(self: psycopg.Connection) -> None:
        raise psycopg.NotSupportedError("libpq too old for pipeline mode")

    monkeypatch.setattr(psycopg.Pipeline, "is_supported", classmethod(lambda cls: False))
    monkeypatch.setattr(psycopg.Connection, "pipeline", no_pipeline)
    with pytest.raises(ValidationError, match=r"messages\[1\]\.topic"):
        producer.send_batch([{"topic": "t", "body": 0}, {"topic": "", "body": 1}])
    sent = producer.send_batch([{"topic": "t", "body": n, "delay": "1h"} for n in range(3)])
    assert [m.created for m in sent] == [True] * 3
    assert [m.id for m in sent] == sorted(m.id for m in sent)
    for message in sent:
        _same_as_stored(producer, message)


@pytest.mark.parametrize("keyed", [False, True], ids=["no keys", "keys"])
def test_a_body_refused_halfway_through_the_copy_leaves_the_callers_transaction_as_it_was(
    producer: Producer, engine: Engine, keyed: bool
) -> None:
    """Bodies are encoded as their rows are COPYed: one that cannot be ends the COPY there, and
    the rows already sent go again (with keys, by the savepoint the COPY runs in)."""
    items = [
        {"topic": "t", "body": n, "delay": "1h", **({"key": f"k{n}"} if keyed else {})}
        for n in range(5)
    ]
    items[3]["body"] = float("nan")  # not JSON: refused when its row is made
    with engine.connect() as conn:
        with conn.begin():
            conn.execute(text("CREATE TABLE orders (id int)"))
            conn.execute(text("INSERT INTO orders VALUES (42)"))
            with pytest.raises(ValidationError) as refused:
                producer.send_batch(items, connection=conn)
            assert refused.value.field == "messages[3].body"
            kept = producer.send_batch(
                [{"topic": "t", "body": "after", "key": "k0"}], connection=conn
            )
        orders = conn.execute(text("SELECT id FROM orders")).scalars().all()
    assert orders == [42]
    assert [m.created for m in kept] == [True]  # k0 was never held by the refused batch
    with engine.connect() as conn:
        ids = conn.execute(text("SELECT id FROM commit_log")).scalars().all()
    assert ids == [kept[0].id]
    assert _lanes(engine) == [("ready", kept[0].id)]
    assert _lane_counts(engine) == ({}, {})


def test_a_held_key_or_a_repeated_one_still_has_its_body_checked(producer: Producer) -> None:
    held = producer.send("t", "old", delay="1h", key="held")
    for items in (
        [{"topic": "t", "body": {1, 2}, "key": "held"}],
        [{"topic": "t", "body": 1, "key": "twice"}, {"topic": "t", "body": {1}, "key": "twice"}],
    ):
        with pytest.raises(ValidationError) as refused:
            producer.send_batch(items)
        assert refused.value.field == f"messages[{len(items) - 1}].body"
    assert producer.get(held.id).body == "old"


def test_a_key_taken_while_the_batch_copies_gives_the_message_that_took_it(
    producer: Producer, engine: Engine
) -> None:
    """Another transaction stores a key after the batch looked for its holders: the batch's
    COPY waits for it on the key's index, and once it commits, the batch is stored again
    through the staged insert, which gives that message for the key."""
    done: dict[str, list[Message]] = {}
    with engine.connect() as other:
        trans = other.begin()
        taken = producer.send("t", "first", delay="1h", key="k", connection=other)

        def batch() -> None:
            done["sent"] = producer.send_batch(
                [
                    {"topic": "t", "body": 1, "delay": "1h", "key": "k"},
                    {"topic": "t", "body": 2, "delay_level": 1, "key": "free"},
                    {"topic": "t", "body": 3},
                ]
            )

        thread = threading.Thread(target=batch)
        thread.start()
        _wait_for_a_copy_waiting_on_a_lock(engine)  # the race is on: the COPY met the key
        trans.commit()
        thread.join(timeout=60)
    sent = done["sent"]
    assert [m.created for m in sent] == [False, True, True]
    assert (sent[0].id, sent[0].body) == (taken.id, "first")
    for message in sent[1:]:
        _same_as_stored(producer, message)
    assert _count(engine) == 3
    assert _lanes(engine) == sorted(
        [("timer", taken.id), ("level1", sent[1].id), ("ready", sent[2].id)]
    )
    assert _lane_counts(engine) == ({0: 1, 1: 1}, {0: 1, 1: 1})


def _wait_for_a_copy_waiting_on_a_lock(engine: Engine) -> None:
    deadline = time.monotonic() + 30
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE 'COPY%commit_log%'"
                )
            ).scalar_one()
            conn.rollback()
            if waiting:
                return
            time.sleep(0.01)
    raise AssertionError("the batch's COPY never waited on the other transaction's key")


def test_a_batch_puts_a_level_the_database_disagrees_on_in_the_timer_lane_counted_there(
    settings: Settings, engine: Engine
) -> None:
    more_levels = Settings(database_url=settings.database_url, delay_levels="1s 2s 3s 5s 9s 13s")
    sent = Producer(more_levels, engine).send_batch(
        [
            {"topic": "t", "body": 0, "delay_level": 6},  # no level 6 in the database
            {"topic": "t", "body": 1, "delay_level": 5},  # 9 s here, 8 s there
            {"topic": "t", "body": 2, "delay_level": 2},
        ]
    )
    assert [m.deliver_at - m.stored_at for m in sent] == [
        timedelta(seconds=13),
        timedelta(seconds=9),
        timedelta(seconds=2),
    ]
    assert [m.delay_level for m in sent] == [6, 5, 2]
    assert _lanes(engine) == sorted(
        [("timer", sent[0].id), ("timer", sent[1].id), ("level2", sent[2].id)]
    )
    assert _lane_counts(engine) == ({0: 2, 2: 1}, {0: 2, 2: 1})
    for message in sent:
        _same_as_stored(producer=Producer(settings, engine), message=message)


def test_no_garbage_collection_runs_while_a_batch_is_checked_and_written(
    producer: Producer,
) -> None:
    """A batch keeps a few objects per message to its end; each collection its allocations
    set off would walk them all again (a third of a 10,000 batch's time). The collector is
    held off for the batch and on again after it (the first allocation then may start one),
    also after a refused batch, and left off when the application had turned it off."""
    collections: list[str] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(phase)

    items = [{"topic": "gc.batch", "body": {"n": n, "tags": ["a"]}} for n in range(20_000)]
    gc.callbacks.append(seen)
    try:
        assert len(producer.send_batch(items)) == 20_000
        assert len(collections) <= 1 and gc.isenabled()  # 206 before: at most the one after
        with pytest.raises(ValidationError, match=r"messages\[3\]\.body"):
            producer.send_batch([*items[:3], {"topic": "gc.batch", "body": {1, 2}}])
        assert gc.isenabled()
        gc.disable()
        producer.send_batch(items[:10])
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(seen)


def test_a_batchs_messages_are_made_as_they_are_read(
    producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    sent = Message.sent

    def counted(item: Any, id: int, *args: Any) -> Message:
        made.append(id)
        return sent(item, id, *args)

    monkeypatch.setattr(Message, "sent", counted)
    batch = producer.send_batch([{"topic": "t", "body": n, "delay": "1h"} for n in range(1000)])
    assert made == [] and len(batch) == 1000 and batch.ids == sorted(batch.ids)
    _same_as_stored(producer, batch[500])
    assert made == [batch.ids[500]]
    assert [m.id for m in batch] == batch.ids and len(made) == 1000
    again = producer.send_batch([{"topic": "t", "body": n} for n in range(3)])
    first = again.ids[0]
    again.ids.reverse()  # the caller's to change: the Messages do not follow it
    assert again[0].id == first and [m.id for m in again] == sorted(again.ids)


@first_pass_only("~15 s, a batch's memory, the same on either server")
def test_a_batch_of_100000_is_streamed_not_held(producer: Producer, engine: Engine) -> None:
    """The bodies are encoded as their rows are sent: what the call holds at its peak is well
    under one copy of the encoded batch (a copy held whole, as a list of encoded messages or
    a COPY buffer of the batch, would be over it)."""
    filler = "x" * 3000  # one string for all: the items themselves take little memory
    items = [
        {"topic": "t.big", "body": {"n": n, "filler": filler}, "delay": "1h"}
        for n in range(100_000)
    ]
    one_copy = sum(len(encode_body(item["body"], 1 << 20)[0]) for item in items)
    tracemalloc.start()
    try:
        sent = producer.send_batch(items)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert one_copy > 300_000_000
    assert peak < one_copy / 2, f"held {peak:,} bytes at the peak for {one_copy:,} of bodies"
    assert len(sent) == 100_000 and all(m.created for m in sent)
    assert [m.id for m in sent] == sorted(m.id for m in sent)
    with engine.connect() as conn:
        stored = conn.execute(
            text("SELECT count(*), min(id), max(id) FROM commit_log WHERE topic = 't.big'")
        ).one()
    assert tuple(stored) == (100_000, sent[0].id, sent[-1].id)
    assert producer.get(sent[77_777].id).body == {"n": 77_777, "filler": filler}
