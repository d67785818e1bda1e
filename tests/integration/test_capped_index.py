"""The capped topics' index (`delaysvc.maintenance.caps_index`): it holds the waiting messages of
the topics a cap covers and no others, follows the caps as they are set and lifted, is what a
topic cap's count and early delivery read, and the counts are exact with it or without it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import Connection, Engine, event, text

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.errors import BacklogFull
from delaysvc.maintenance import caps_index
from delaysvc.producer import caps
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import CAPPED_INDEX_PREFIX


def _indexes(engine: Engine) -> dict[str, str]:
    """{name: predicate} of the capped topics' indexes on the commit log."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT i.relname, pg_get_expr(x.indpred, x.indrelid) FROM pg_index x "
                "JOIN pg_class i ON i.oid = x.indexrelid "
                "WHERE x.indrelid = CAST('commit_log' AS regclass) AND x.indisvalid "
                "AND starts_with(i.relname, :prefix)"
            ),
            {"prefix": CAPPED_INDEX_PREFIX},
        )
        return dict(rows.all())


def _one_index(engine: Engine) -> tuple[str, str]:
    (found,) = _indexes(engine).items()
    return found


def test_the_index_follows_the_topic_caps_as_they_are_set_and_lifted(engine: Engine) -> None:
    assert caps_index.run_once(engine) == caps_index.Indexed([])
    assert _indexes(engine) == {}

    caps.set_cap(engine, "level", "2", 5)  # a level cap counts its lane: no index
    caps.set_cap(engine, "topic", "sms.send", 5)
    first = caps_index.run_once(engine)
    assert (first.topics, first.dropped) == (["sms.send"], [])
    name, predicate = _one_index(engine)
    assert name == first.built
    assert "topic = 'sms.send'" in predicate  # a list of one is written as an equality
    assert "'scheduled'" in predicate and "'retrying'" in predicate

    assert caps_index.run_once(engine) == caps_index.Indexed(["sms.send"])  # nothing to do

    caps.set_cap(engine, "topic", "mail.send", 5, "deliver-early")
    second = caps_index.run_once(engine)
    assert (second.topics, second.dropped) == (["mail.send", "sms.send"], [name])
    name, predicate = _one_index(engine)
    assert name == second.built
    assert "ARRAY['mail.send'::text, 'sms.send'::text]" in predicate

    caps.set_cap(engine, "topic", "sms.send")  # lifted
    caps.set_cap(engine, "topic", "mail.send")
    assert caps_index.run_once(engine) == caps_index.Indexed([], None, [name])
    assert _indexes(engine) == {}


@contextmanager
def _statements(engine: Engine) -> Iterator[list[str]]:
    """The statements run on `engine` meanwhile."""
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        seen.append(statement % parameters if isinstance(parameters, dict) else statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def _plan(conn: Connection, statement: str) -> str:
    return "\n".join(conn.execute(text("EXPLAIN " + statement.replace("%%", "%"))).scalars())


def test_a_topic_caps_count_and_early_delivery_read_the_index(
    settings: Settings, engine: Engine
) -> None:
    caps.set_cap(engine, "topic", "t.capped", 2, "deliver-early")
    name = caps_index.run_once(engine).built
    producer = Producer(settings, engine)
    for n in range(40):  # enough other rows that the planner would rather not scan them all
        producer.send("t.free", {"n": n}, delay_level=1)
    with engine.begin() as conn:
        conn.execute(text("ANALYZE commit_log"))
    with _statements(engine) as seen, engine.begin() as conn:
        assert store.topic_pending(conn, "t.capped", 3) == 0
        assert store.oldest_waiting_of_topic(conn, "t.capped", 1) == []
    counting, oldest = seen
    with engine.connect() as conn:
        conn.execute(text("SET enable_seqscan = off"))  # a tiny table: any index beats none
        for statement in (counting, oldest):
            assert "'t.capped'" in statement  # the topic is written in: any plan may use it
            assert name in _plan(conn, statement), statement


def test_counts_are_exact_without_the_index_and_take_messages_sent_before_the_cap(
    settings: Settings, engine: Engine
) -> None:
    producer = Producer(settings, engine)
    before = [producer.send("t.late", {"n": n}, delay_level=3).id for n in range(2)]
    caps.set_cap(engine, "topic", "t.late", 3)  # no index yet: the count scans
    producer.send("t.late", {"n": 2}, delay="1h")
    with pytest.raises(BacklogFull, match=r"topic t\.late holds 3 waiting messages"):
        producer.send("t.late", {"n": 3}, delay_level=1)

    caps_index.run_once(engine)  # built over the messages already waiting
    with pytest.raises(BacklogFull, match=r"topic t\.late holds 3 waiting messages"):
        producer.send_batch([{"topic": "t.late", "body": 4, "delay_level": 1}])
    caps.set_cap(engine, "topic", "t.late", 3, "deliver-early")
    producer.send("t.late", {"n": 5}, delay="2h")
    assert producer.get(before[0]).status == "ready"  # the soonest due of the four, early
    assert [producer.get(i).status for i in before[1:]] == ["scheduled"]


def test_more_topic_caps_than_a_predicate_can_list_index_every_waiting_message(
    engine: Engine,
) -> None:
    with engine.begin() as conn:
        for n in range(store.caps.LISTED_AT_MOST + 1):
            store.set_backlog_cap(conn, "topic", f"t.{n:03}", 10, "reject")
    assert caps_index.run_once(engine).built == CAPPED_INDEX_PREFIX + "all"
    _, predicate = _one_index(engine)
    assert "topic" not in predicate and "'scheduled'" in predicate


def test_a_build_that_failed_is_dropped_and_made_again(settings: Settings, engine: Engine) -> None:
    producer = Producer(settings, engine)
    for n in range(2):
        producer.send("t.twice", {"n": n}, delay_level=1)
    caps.set_cap(engine, "topic", "t.twice", 10)
    wanted = store.capped_index_for(["t.twice"])
    assert wanted is not None
    name = wanted[0]
    # what a CREATE INDEX CONCURRENTLY that failed leaves: an invalid index of that name
    autocommitting = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    with autocommitting as conn, pytest.raises(Exception, match="could not create unique index"):
        conn.execute(text(f"CREATE UNIQUE INDEX CONCURRENTLY {name} ON commit_log (topic)"))
    assert [(i.name, i.valid, i.building) for i in _store_indexes(engine)] == [(name, False, False)]
    assert caps_index.run_once(engine).built == name
    assert [(i.name, i.valid) for i in _store_indexes(engine)] == [(name, True)]
    assert "t.twice" in _indexes(engine)[name]


def _store_indexes(engine: Engine) -> list[store.CappedIndex]:
    with engine.connect() as conn:
        return store.capped_indexes(conn)
