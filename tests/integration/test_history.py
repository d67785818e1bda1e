"""The finished messages' history: the sweep moves finished rows out of commit_log into one
partition per UTC day, every reader still finds them, retention drops whole days, a dead
letter in the history is redriven, and concurrent sweeps with consumers finishing jobs move
each message exactly once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.db.names import qualify
from delaysvc.errors import (
    Busy,
    ConfigError,
    DeadLetter,
    DelaysvcError,
    NotCancellable,
    NotFound,
)
from delaysvc.maintenance import history
from delaysvc.producer.dead_letters import DeadLetters
from delaysvc.producer.sending import Producer
from delaysvc.store import history as store_history
from delaysvc.worker.consumer import Consumer, handler

pytestmark = pytest.mark.usefixtures("own_handlers")
DAY = timedelta(days=1)


def _count(engine: Engine, table: str, where: str = "true") -> int:
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM {table} WHERE {where}")).scalar_one()


def _partitions(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return [p.name for p in store_history.partitions(conn)]


def _finish(engine: Engine, producer: Producer, count: int, topic: str = "done") -> list[int]:
    """`count` messages, finished (succeeded) now, by the handler path."""
    handler(topic)(lambda message: None)
    ids = [producer.send(topic, {"n": n}, delay_ms=0, key=f"k{n}").id for n in range(count)]
    _deliver_now(engine, ids)
    consumer = Consumer(producer.settings, engine)
    while consumer.run_once(topic).claimed:
        pass
    return ids


def _deliver_now(engine: Engine, ids: list[int]) -> None:
    with engine.begin() as conn:
        store.deliver_now(conn, ids)


def _age(engine: Engine, ids: list[int], days: int) -> None:
    """Make these finished messages (still in commit_log) finish `days` days earlier."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE commit_log SET finished_at = finished_at - make_interval(days => :d) "
                "WHERE id = ANY(:ids)"
            ),
            {"d": days, "ids": ids},
        )


def _today(engine: Engine) -> date:
    with engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return now.astimezone(UTC).date()


def test_the_sweep_moves_finished_messages_into_their_days_and_readers_still_find_them(
    engine: Engine, producer: Producer
) -> None:
    ids = _finish(engine, producer, 30)
    _age(engine, ids[:10], 3)
    waiting = producer.send("later", {"x": 1}, delay="1h", key="w")
    cancelled = producer.send("later", {"x": 2}, delay="1h")
    producer.cancel(cancelled.id)

    swept = history.sweep(engine, retention_ms=None)

    today = _today(engine)
    days = [today - 3 * DAY, today, today + DAY]
    assert _partitions(engine) == [f"message_history_{d:%Y%m%d}" for d in days]
    assert swept.moved == 31
    assert _count(engine, "commit_log") == 1  # only the message in flight is left
    assert _count(engine, f"message_history_{today - 3 * DAY:%Y%m%d}") == 10
    assert _count(engine, f"message_history_{today:%Y%m%d}") == 21
    assert _count(engine, "message") == 32
    # every reader of a message that may have finished finds it where it is now
    assert producer.get(ids[0]).status == "succeeded"
    assert producer.get(cancelled.id).status == "cancelled"
    assert producer.get(waiting.id).status == "scheduled"
    assert producer.find("done", "k5").id == ids[5]
    with pytest.raises(NotCancellable):
        producer.cancel(ids[1])
    # the key of a finished message is free again, as before
    again = producer.send("done", {"n": 5}, delay="1h", key="k5")
    assert again.id not in ids
    assert history.sweep(engine, retention_ms=None).moved == 0


def test_a_lookup_by_key_reads_no_waiting_message(engine: Engine, producer: Producer) -> None:
    """By topic and key: the unfinished holder through commit_log's unique key index, else the
    newest finished one, among commit_log's few finished rows or in the history's key indexes;
    never a scan of the backlog waiting in commit_log. (Through the view, commit_log's side had
    no index for a key that may have finished: a scan of commit_log, 200 ms at 1M waiting.)"""
    ids = _finish(engine, producer, 3)
    history.sweep(engine, retention_ms=None)
    late = _finish(engine, producer, 1, topic="late")  # finished, not swept yet
    waiting = producer.send("done", {}, delay="1h", key="w")
    for _ in range(2):
        producer.send_batch([{"topic": "bulk", "body": {}, "delay": "1h"}] * 10_000)
    with engine.begin() as conn:
        conn.execute(text("ANALYZE commit_log, message_history"))
    seq_scans = text(
        "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = 'commit_log'::regclass"
    )
    for topic, key, expected in (
        ("done", "k1", ids[1]),  # in the history
        ("late", "k0", late[0]),  # finished, still in commit_log
        ("done", "w", waiting.id),  # waiting
    ):
        with engine.begin() as conn:
            before = conn.execute(seq_scans).scalar_one()
            assert store.find_message_by_key(conn, topic, key).id == expected
            assert conn.execute(seq_scans).scalar_one() == before, (topic, key)


def test_retention_drops_whole_days_ended_before_it_and_their_dead_letters(
    engine: Engine, producer: Producer
) -> None:
    ids = _finish(engine, producer, 12)
    handler("doomed")(lambda message: (_ for _ in ()).throw(DeadLetter("no")))
    dead = producer.send("doomed", {}, delay_ms=0)
    _deliver_now(engine, [dead.id])
    Consumer(producer.settings, engine).run_once("doomed")
    _age(engine, [*ids[:4], dead.id], 10)
    _age(engine, ids[4:8], 2)
    assert _count(engine, "dead_letter") == 1

    swept = history.sweep(engine, retention_ms=int((3 * DAY).total_seconds() * 1000))

    today = _today(engine)
    assert swept.dropped == [f"message_history_{today - 10 * DAY:%Y%m%d}"]
    assert _partitions(engine) == [
        f"message_history_{d:%Y%m%d}" for d in (today - 2 * DAY, today, today + DAY)
    ]
    assert _count(engine, "message") == 8
    assert _count(engine, "dead_letter") == 0
    assert producer.get(ids[4]).status == "succeeded"
    with pytest.raises(NotFound):
        producer.get(ids[0])


def test_a_dead_letter_in_the_history_is_redriven_and_runs_again(
    engine: Engine, producer: Producer, settings: Settings
) -> None:
    outcomes = iter([DeadLetter("first time"), None])

    def flaky(message: object) -> None:
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    handler("flaky")(flaky)
    message = producer.send("flaky", {}, delay_ms=0, key="once")
    _deliver_now(engine, [message.id])
    consumer = Consumer(settings, engine)
    consumer.run_once("flaky")
    assert history.sweep(engine, retention_ms=None).moved == 1
    assert _count(engine, "message_history", "status = 'dead'") == 1

    letters = DeadLetters(engine)
    assert [row.message_id for row in letters.list()] == [message.id]
    redriven = letters.redrive(message.id)

    assert redriven.status == "ready"
    assert _count(engine, "message_history") == 0
    assert consumer.run_once("flaky").succeeded == 1
    assert producer.get(message.id).status == "succeeded"
    assert history.sweep(engine, retention_ms=None).moved == 1
    assert _count(engine, "message", f"id = {message.id}") == 1


def test_a_redrive_behind_a_long_holder_of_the_history_gives_up_saying_so(
    engine: Engine, producer: Producer, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An archive's check-and-drop of a big day holds the history lock for long: a redrive
    waits for it a while, then says the history is busy (the CLI waited for good, a web
    worker and a connection with it)."""
    handler("doomed")(lambda message: (_ for _ in ()).throw(DeadLetter("no")))
    message = producer.send("doomed", {}, delay_ms=0)
    _deliver_now(engine, [message.id])
    Consumer(settings, engine).run_once("doomed")
    monkeypatch.setattr(store_history, "HISTORY_WAIT_S", 0.5)
    outcome: list[object] = []

    def redrive() -> None:
        try:
            outcome.append(DeadLetters(engine).redrive(message.id))
        except DelaysvcError as exc:
            outcome.append(exc)

    with engine.begin() as holder:
        store_history.lock_history(holder, wait=True)
        waiting = threading.Thread(target=redrive, daemon=True)
        waiting.start()
        waiting.join(timeout=15)
        assert not waiting.is_alive(), "the redrive still waits behind the history's holder"
    (busy,) = outcome
    assert isinstance(busy, Busy) and busy.code == "busy"
    assert "history" in str(busy) and "again" in str(busy)
    assert DeadLetters(engine).redrive(message.id).status == "ready"  # once it is free


def test_the_redrives_wait_for_the_history_leaves_the_transactions_lock_timeout_as_it_was(
    engine: Engine,
) -> None:
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL lock_timeout = '3s'"))
        store_history.lock_history_within(conn, "a redrive")
        assert conn.execute(text("SHOW lock_timeout")).scalar_one() == "3s"


def test_a_days_ddl_leaves_the_transactions_lock_timeout_as_it_was(
    engine: Engine, producer: Producer
) -> None:
    """Making and dropping a day wait at most DDL_LOCK_TIMEOUT for the table, and only there:
    the rest of the transaction (an archive's, a sweep's) waits as it would have."""
    day = date(2020, 1, 2)
    for work in (
        lambda conn: store_history.make_partitions(conn, [day]),
        lambda conn: store_history.drop_partition(conn, store_history.Partition(day).name),
    ):
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '3s'"))
            work(conn)
            assert conn.execute(text("SHOW lock_timeout")).scalar_one() == "3s"


def test_sweeps_racing_consumers_move_every_message_exactly_once(
    engine: Engine, producer: Producer, settings: Settings
) -> None:
    handler("race")(lambda message: None)
    total = 3_000
    ids = [m.id for m in producer.send_batch([{"topic": "race", "body": {}}] * total)]
    _deliver_now(engine, ids)
    stop = threading.Event()
    moved: dict[str, list[tuple[int, bool]]] = {"0": [], "1": []}  # (moved, while consuming)

    def sweeping(name: str) -> None:
        while not stop.is_set():
            consuming = any(thread.is_alive() for thread in consumers)
            moved[name].append((history.move_once(engine, limit=200).moved, consuming))

    def consuming() -> None:
        consumer = Consumer(settings, engine)
        while consumer.run_once("race").claimed:
            pass

    sweepers = [threading.Thread(target=sweeping, args=(name,)) for name in moved]
    consumers = [threading.Thread(target=consuming) for _ in range(2)]
    for thread in [*sweepers, *consumers]:
        thread.start()
    for thread in consumers:
        thread.join()
    stop.set()
    for thread in sweepers:
        thread.join()
    history.move_all(engine)

    # the race happened: each sweeper moved rows in a sweep it began while jobs were still
    # finishing (a sweep begun after the consumers ended proves nothing)
    for name, sweeps in moved.items():
        assert sum(count for count, consuming in sweeps if consuming) > 0, (name, sweeps)
    with engine.connect() as conn:
        found = conn.execute(text("SELECT id, status FROM message ORDER BY id")).all()
    assert [row.id for row in found] == sorted(ids)
    assert {row.status for row in found} == {"succeeded"}
    assert _count(engine, "commit_log") == 0


@contextmanager
def reading_the_history(engine: Engine, seconds: float | None = None) -> Iterator[None]:
    """A reader of the history (a report, say) inside a transaction: its lock on every day's
    partition keeps DDL on them waiting until it ends, after `seconds` or with the block."""
    reader = engine.connect()
    reader.begin()
    reader.execute(text("SELECT count(*) FROM message"))
    timer = threading.Timer(seconds, reader.close) if seconds is not None else None
    if timer is not None:
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.join()
        reader.close()


def test_dropping_a_day_waits_for_a_long_reader_then_gives_up_saying_so(
    engine: Engine, producer: Producer
) -> None:
    """A day's DDL gives up behind a reader after DDL_LOCK_TIMEOUT (2 s); a command that must
    drop it now (the archive) tries again until the reader is gone, or says why it stopped."""
    _age(engine, _finish(engine, producer, 3), 10)
    history.sweep(engine, retention_ms=None)
    old = _partitions(engine)[0]

    def drop(conn: Connection) -> int:
        store_history.lock_history(conn, wait=True)
        return store_history.drop_partition(conn, old)

    with reading_the_history(engine), pytest.raises(DelaysvcError) as refused:
        history.patiently(engine, drop, old, patience=3)
    assert str(refused.value) == (
        f"{old}: a reader of the history (a long query or report) kept it busy for 3 s; run "
        "the command again when it has finished"
    )
    assert old in _partitions(engine)

    with reading_the_history(engine, seconds=3):  # longer than the DDL's own lock timeout
        history.patiently(engine, drop, old, patience=30)
    assert old not in _partitions(engine)
    assert _count(engine, "message") == 0


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        # it said "delay: ... such as '45m', '1h30m' or '250ms'", each refused here
        ("soon", "DELAYSVC_HISTORY_RETENTION: 'soon' is not a duration"),
        ("30", "such as '30d' or '1d12h'"),
        ("12h", "at least one day"),
    ],
)
def test_a_retention_that_cannot_be_kept_is_refused_naming_the_setting(
    value: str, complaint: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({"DELAYSVC_HISTORY_RETENTION": value})
    assert "DELAYSVC_HISTORY_RETENTION" in str(refused.value)
    assert complaint in str(refused.value)


def test_a_move_finds_its_rows_by_id_however_stale_the_statistics(engine: Engine) -> None:
    """Statistics taken when commit_log held no finished row (as the sweep keeps it), then a
    backlog of finished rows (beat was down, or an install upgraded with its history): the move
    still reaches its rows through the primary key. With `finished_at IS NOT NULL` in it, the
    planner walked the finished index past the whole backlog for every batch (24,000 rows/s
    fell to 800)."""
    with engine.begin() as conn:
        conn.execute(text("ANALYZE commit_log"))
        conn.execute(
            text(
                "INSERT INTO commit_log (topic, body, body_is_json, lane, status, deliver_ts, "
                "finished_at) SELECT 't', '', false, -1, 'succeeded', now(), now() "
                "FROM generate_series(1, 20000)"
            )
        )
        ids = [id_ for id_, _ in store_history.pick_finished(conn, 200)]
        # a table this small is cheaper read whole; the question is which index leads the way
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = conn.execute(
            text("EXPLAIN (FORMAT JSON) " + qualify(store_history._MOVE)), {"ids": ids}
        ).scalar_one()[0]["Plan"]
    indexes = [node["Index Name"] for node in _nodes(plan) if "Index Name" in node]
    assert indexes == ["commit_log_pkey"]


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(node for child in plan.get("Plans", []) for node in _nodes(child))]
