"""Group commit on a real database: single sends of several threads that wait behind one under
way are stored together, in one statement, each as if sent alone (`delaysvc.producer.grouping`).

A producer writing one send at a time (`group_writers=1`): a first send is held on a table lock
(a due-now send waits to insert into `topic_queue`), the sends under test queue behind it, and
the lock is let go: they are then written as one group."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from delaysvc.config.settings import Settings
from delaysvc.errors import BacklogFull, DatabaseUnavailable
from delaysvc.producer.aio import AsyncSends
from delaysvc.producer.sending import Producer
from delaysvc.store import insert_group
from delaysvc.web import WEB_GROUP_WRITERS
from tests.integration.test_caps import _producer


@pytest.fixture
def producer(settings: Settings, engine: Engine) -> Producer:
    return Producer(settings, engine, group_writers=1)


@contextmanager
def locked(engine: Engine, table: str) -> Iterator[Connection]:
    """`table` locked against inserts until the block ends."""
    with engine.connect() as conn, conn.begin():
        conn.execute(text(f"LOCK TABLE {table} IN SHARE MODE"))
        yield conn


class Sends:
    """Sends, each from a thread of its own, started one at a time so they queue in order."""

    def __init__(self, producer: Producer):
        self.producer = producer
        self.results: list[Any] = []
        self.threads: list[threading.Thread] = []

    def start(self, topic: str, body: Any, **options: Any) -> None:
        index = len(self.results)
        self.results.append(None)

        def send() -> None:
            try:
                self.results[index] = self.producer.send(topic, body, **options)
            except Exception as exc:  # the test reads it
                self.results[index] = exc

        thread = threading.Thread(target=send)
        self.threads.append(thread)
        thread.start()

    def queue(self, topic: str, body: Any, **options: Any) -> None:
        """Start a send and wait until it waits behind the one under way."""
        waiting = len(self.producer._sends._waiting)
        self.start(topic, body, **options)
        until(lambda: len(self.producer._sends._waiting) > waiting, "the send to queue")

    def join(self) -> list[Any]:
        for thread in self.threads:
            thread.join(30)
            assert not thread.is_alive(), "a send did not return"
        return self.results


def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 15
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def held_first(engine: Engine, sends: Sends) -> None:
    """Start a due-now send that waits on the lock of `topic_queue` (held by the caller)."""
    sends.start("t.first", "first")
    until(lambda: _waiting_on_a_lock(engine) == 1, "the first send to wait on the lock")


def _waiting_on_a_lock(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
        ).scalar_one()


def test_sends_queued_behind_one_are_stored_together_each_as_if_sent_alone(
    producer: Producer, engine: Engine
) -> None:
    at = datetime.now(UTC).replace(microsecond=0) + timedelta(days=3)
    sends = Sends(producer)
    with locked(engine, "topic_queue"):
        held_first(engine, sends)
        sends.queue("t.a", {"n": 1}, delay_level=1, tags=["x", "y"])
        sends.queue("t.b", {"n": 2}, delay_level=3, key="b-1", priority=5)
        sends.queue("t.c", "text body", delay="45m", properties={"trace": "abc"})
        sends.queue("t.d", {"n": 4}, deliver_at=at)
        sends.queue("t.e", [5], delay_level=2, tags=[])
    first, *grouped = sends.join()
    assert all(m.created for m in [first, *grouped])
    # one statement: the database gave the group one store time, not the first send's
    assert len({m.stored_at for m in grouped}) == 1
    assert first.stored_at != grouped[0].stored_at
    a, b, c, d, e = grouped
    assert (a.delay_level, a.tags, a.deliver_at - a.stored_at) == (
        1,
        ["x", "y"],
        timedelta(seconds=1),
    )
    assert (b.key, b.priority, b.deliver_at - b.stored_at) == ("b-1", 5, timedelta(seconds=3))
    assert (c.delay_level, c.properties, c.deliver_at - c.stored_at) == (
        None,
        {"trace": "abc"},
        timedelta(minutes=45),
    )
    assert d.deliver_at == at
    for sent, body in zip(grouped, [{"n": 1}, {"n": 2}, "text body", {"n": 4}, [5]], strict=True):
        stored = producer.get(sent.id)
        assert (stored.topic, stored.body, stored.key, stored.tags, stored.properties) == (
            sent.topic,
            body,
            sent.key,
            sent.tags,
            sent.properties,
        )
        assert (stored.status, stored.deliver_at, stored.priority) == (
            "scheduled",
            sent.deliver_at,
            sent.priority,
        )
    with engine.connect() as conn:
        levels = conn.execute(
            text("SELECT level, message_id FROM consume_queue ORDER BY level")
        ).all()
        timers = conn.execute(text("SELECT message_id FROM timer_queue ORDER BY 1")).scalars()
        counted = dict(
            conn.execute(text("SELECT lane, sum(delta) FROM lane_count GROUP BY lane")).all()
        )
    assert levels == [(1, a.id), (2, e.id), (3, b.id)]
    assert list(timers) == sorted([c.id, d.id])
    assert counted == {0: 2, 1: 1, 2: 1, 3: 1}


def test_a_key_repeated_in_a_group_or_held_already_gives_its_holder(
    producer: Producer, engine: Engine
) -> None:
    holder = producer.send("t.k", "held", delay_level=1, key="k0")
    sends = Sends(producer)
    with locked(engine, "topic_queue"):
        held_first(engine, sends)
        sends.queue("t.k", "a", delay_level=1, key="k1")
        sends.queue("t.k", "b", delay_level=2, key="k1")
        sends.queue("t.k", "c", delay_level=1, key="k0")
        sends.queue("t.k", "d", delay_level=1, key="k2")
    _, a, b, c, d = sends.join()
    assert (a.created, b.created, c.created, d.created) == (True, False, False, True)
    assert (b.id, c.id) == (a.id, holder.id)
    with engine.connect() as conn:
        keys = conn.execute(text("SELECT key, count(*) FROM commit_log GROUP BY key")).all()
    assert dict(keys) == {None: 1, "k0": 1, "k1": 1, "k2": 1}


def test_a_group_deadlocked_on_a_key_sends_each_of_its_messages_alone(
    producer: Producer, engine: Engine
) -> None:
    """A group waits on a key another transaction inserted, and that transaction then sends a
    key the group inserted: PostgreSQL ends the group's statement as a deadlock. Nothing of the
    group was stored, so each of its sends is written alone and gives what it would have given
    (the holder of its key, a new message): they all used to fail with the deadlock, the
    unkeyed one too. A group writes its keys in (topic, key) order, so two groups cannot wait
    on each other so."""
    with engine.connect() as theirs, theirs.begin():
        _outwaits_the_deadlock_check(theirs)
        k2 = producer.send("t.k", "theirs", delay_level=1, key="k2", connection=theirs)
        sends = Sends(producer)
        with locked(engine, "topic_queue"):
            held_first(engine, sends)
            sends.queue("t.k", "mine", delay_level=1, key="k1")
            sends.queue("t.k", "mine", delay_level=1, key="k2")
            sends.queue("t.k", "unkeyed", delay_level=1)
        # the group has inserted k1 and waits on k2, theirs
        until(lambda: _waiting_on_a_lock(engine) == 1, "the group to wait on k2")
        k1 = producer.send("t.k", "theirs", delay_level=1, key="k1", connection=theirs)
    _, mine_k1, mine_k2, unkeyed = sends.join()
    assert not isinstance(mine_k1, Exception), mine_k1
    assert (mine_k2.created, mine_k2.id) == (False, k2.id)
    # k1 is one message, made by whichever of the two came first once the group's statement
    # ended (theirs, waiting on the group's k1, or the group's send of it alone): a race
    assert mine_k1.id == k1.id and mine_k1.created is not k1.created
    assert unkeyed.created


def test_an_asyncio_group_deadlocked_on_a_key_leaves_its_sends_to_be_sent_alone(
    settings: Settings, engine: Engine
) -> None:
    """The same deadlock on the asyncio way (`AsyncSends`, the ASGI server's): the group stored
    nothing, and says so (each send is then sent the producer's way). It used to be reported
    as a lost connection: DatabaseUnavailable, "may be stored"."""
    producer = Producer(settings, engine)
    sends = AsyncSends(producer)
    group = [producer.prepare("t.k", "mine", delay_level=1, key=key) for key in ("k1", "k2")]
    group.append(producer.prepare("t.k", "unkeyed", delay_level=1))

    async def main(theirs: Connection) -> list[Any]:
        await sends.open()
        try:
            written = asyncio.create_task(sends._written(group))
            while _waiting_on_a_lock(engine) == 0:  # the group has k1, and waits on k2
                await asyncio.sleep(0.01)
            send = functools.partial(producer.send, "t.k", "theirs", delay_level=1, key="k1")
            await asyncio.to_thread(send, connection=theirs)
            return await written
        finally:
            await sends.close()

    with engine.connect() as theirs, theirs.begin():
        _outwaits_the_deadlock_check(theirs)
        producer.send("t.k", "theirs", delay_level=1, key="k2", connection=theirs)
        assert asyncio.run(main(theirs)) == [None, None, None]
    assert _count_topic(engine, "t.k") == 2  # theirs


def _outwaits_the_deadlock_check(theirs: Connection) -> None:
    """The other transaction checks for a deadlock only after 10 s, the group after the
    server's 1 s: the group, which waits first, is the one PostgreSQL ends (left to the two
    1 s timers, a loaded machine once ended the other)."""
    theirs.execute(text("SET LOCAL deadlock_timeout = '10s'"))


def _count_topic(engine: Engine, topic: str) -> int:
    with engine.connect() as conn:
        query = text("SELECT count(*) FROM commit_log WHERE topic = :topic")
        return conn.execute(query, {"topic": topic}).scalar_one()


def test_a_capped_send_in_a_group_is_refused_alone(settings: Settings, engine: Engine) -> None:
    _producer(settings, engine, "topic:t.capped=1:reject")  # the database's caps
    producer = Producer(settings, engine, group_writers=1)
    kept = producer.send("t.capped", "kept", delay_level=1)
    sends = Sends(producer)
    with locked(engine, "topic_queue"):
        held_first(engine, sends)
        sends.queue("t.other", "stored", delay_level=1)
        sends.queue("t.capped", "refused", delay_level=2)
        sends.queue("t.other", "stored too", delay_level=2)
    _, stored, refused, stored_too = sends.join()
    assert isinstance(refused, BacklogFull)
    assert stored.created and stored_too.created
    with engine.connect() as conn:
        ids = conn.execute(text("SELECT id FROM commit_log WHERE topic LIKE 't.%'")).scalars()
        assert sorted(ids) == sorted([kept.id, stored.id, stored_too.id, *_first_ids(conn)])


def _first_ids(conn: Connection) -> list[int]:
    return list(conn.execute(text("SELECT id FROM commit_log WHERE topic = 't.first'")).scalars())


def test_a_group_whose_connection_is_lost_fails_every_send_in_it_and_stores_none(
    producer: Producer, engine: Engine
) -> None:
    sends = Sends(producer)
    with locked(engine, "lane_count"):
        with locked(engine, "topic_queue"):
            held_first(engine, sends)
            for n in range(3):
                sends.queue("t.lost", {"n": n}, delay_level=1)
        # the first send ends (wait for it: until then it may still show as waiting on the
        # lock of topic_queue); the group then waits on lane_count's lock: cut its connection
        sends.threads[0].join(15)
        assert not sends.threads[0].is_alive(), "the first send did not return"
        until(lambda: _waiting_on_a_lock(engine) == 1, "the group to wait on the lock")
        with engine.connect() as conn:
            cut = conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            ).scalars()
            assert list(cut) == [True]
    first, *lost = sends.join()
    assert first.created
    assert all(isinstance(error, DatabaseUnavailable) for error in lost), lost
    assert all(error.maybe_stored for error in lost)  # it was sent: the caller cannot know
    assert len({id(error) for error in lost}) == 3
    with engine.connect() as conn:
        topics = conn.execute(text("SELECT topic FROM commit_log")).scalars().all()
    assert topics == ["t.first"]  # one transaction: nothing of the group stayed
    assert producer.send("t.lost", "again", delay_level=1).created


@pytest.mark.parametrize("writers", [1, WEB_GROUP_WRITERS])
def test_many_threads_sending_get_one_message_each(
    settings: Settings, engine: Engine, writers: int
) -> None:
    """No coordination by the test: whatever groups form, every send is one message, counted
    once in its lane."""
    producer = Producer(settings, engine, group_writers=writers)
    threads = 8
    results: list[Any] = []

    def send(worker: int) -> None:
        for n in range(40):
            results.append(producer.send("t.many", {"w": worker, "n": n}, delay_level=1 + n % 3))

    workers = [threading.Thread(target=send, args=(w,)) for w in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert len(results) == threads * 40
    assert len({m.id for m in results}) == len(results)
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT count(*) FROM commit_log")).scalar_one()
        queued = conn.execute(text("SELECT count(*) FROM consume_queue")).scalar_one()
        counted = conn.execute(text("SELECT sum(delta) FROM lane_count")).scalar_one()
    assert stored == queued == counted == len(results)


def test_the_group_statement_keeps_one_plan(producer: Producer, engine: Engine) -> None:
    """PostgreSQL takes the group statement's generic plan after its first few runs instead of
    planning it again each time (migration 0019: `send_one` is estimated at one row)."""
    new = producer.prepare("t.plan", {"n": 1}, delay_level=1)
    raw = engine.raw_connection()
    try:
        driver = raw.driver_connection
        assert driver is not None
        driver.autocommit = True
        with driver.cursor() as cursor:
            for size in [2, 3, 2, 5, 2, 4, 3, 2, 6, 2]:
                insert_group(cursor, [new] * size)
            plans = cursor.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE '%LATERAL %send_one(m.topic%'"
            ).fetchall()
        driver.autocommit = False
    finally:
        raw.close()
    ((generic, custom),) = plans
    assert generic >= 4 and custom <= 5, (generic, custom)
