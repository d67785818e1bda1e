"""Key policies: a send whose key an unfinished message of the topic holds keeps that message
(the default), replaces it (`on_duplicate="replace"`: new body and due time) or debounces it
(`"debounce"`: due no earlier than it was, the new body). Raced against the delivery moving the
holder and consumers claiming it, each key's message runs once, with one body."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from delaysvc import auth
from delaysvc.config.settings import Settings
from delaysvc.errors import ValidationError
from delaysvc.maintenance import delivery
from delaysvc.producer.sending import Producer
from delaysvc.worker.consumer import Consumer, handler

pytestmark = pytest.mark.usefixtures("own_handlers")


def test_keep_is_the_default_and_returns_the_holder(producer: Producer) -> None:
    first = producer.send("kp.t", {"v": 1}, delay="1h", key="k")
    again = producer.send("kp.t", {"v": 2}, delay="5m", key="k")
    assert (again.id, again.created) == (first.id, False)
    assert producer.get(first.id).body == {"v": 1}
    with pytest.raises(ValidationError, match=r"'keep' .*'replace' or 'debounce'"):
        producer.send("kp.t", {"v": 3}, key="k", on_duplicate="overwrite")  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["replace", "debounce"])
def test_a_policy_that_replaces_needs_a_key(
    producer: Producer, engine: Engine, client: Any, policy: str
) -> None:
    """Without a key it was a plain new send: each send of a debounced burst ran."""
    with pytest.raises(ValidationError) as refused:
        producer.send("kp.nokey", {"v": 1}, delay="1h", on_duplicate=policy)  # type: ignore[arg-type]
    assert refused.value.field == "on_duplicate"
    assert f"{policy!r} needs a key" in str(refused.value)
    with pytest.raises(ValidationError, match="needs a key"):
        producer.send_item({"topic": "kp.nokey", "body": 1, "key": None, "on_duplicate": policy})

    token = {"Authorization": f"Bearer {auth.create_token(engine, 'kp', 'send')}"}
    item = {"topic": "kp.nokey", "body": 1, "delay": "1h", "on_duplicate": policy}
    response = client.post("/api/v1/messages", json=item, headers=token)
    assert response.status_code == 400, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "invalid" and "on_duplicate" in error["message"]
    with engine.connect() as conn:
        stored = "SELECT count(*) FROM commit_log WHERE topic = 'kp.nokey'"
        assert conn.execute(text(stored)).scalar_one() == 0


def test_replace_puts_the_new_body_and_due_time_in_the_holders_place(producer: Producer) -> None:
    first = producer.send("kp.t", {"v": 1}, delay="1h", key="k", delay_level=None)
    replaced = producer.send("kp.t", {"v": 2}, delay_level=2, key="k", on_duplicate="replace")
    assert replaced.created and replaced.replaced_id == first.id
    old, new = producer.get(first.id), producer.get(replaced.id)
    assert (old.status, old.last_error) == ("cancelled", f"replaced by message {replaced.id}")
    assert (new.status, new.body, new.delay_level) == ("scheduled", {"v": 2}, 2)
    assert new.deliver_at < first.deliver_at  # replace may make it due earlier
    # without a holder, replace is a plain send
    alone = producer.send("kp.t", {"v": 3}, key="other", on_duplicate="replace")
    assert alone.created and alone.replaced_id is None


def test_debounce_pushes_the_due_time_later_never_earlier_and_takes_the_new_body(
    producer: Producer,
) -> None:
    first = producer.send("kp.t", {"v": 1}, delay="10m", key="k")
    later = producer.send("kp.t", {"v": 2}, delay="1h", key="k", on_duplicate="debounce")
    assert later.replaced_id == first.id
    assert later.deliver_at - first.deliver_at > timedelta(minutes=49)
    sooner = producer.send("kp.t", {"v": 3}, delay="1m", key="k", on_duplicate="debounce")
    kept = producer.get(sooner.id)
    assert kept.deliver_at == later.deliver_at  # not earlier than it was
    # put in the timer lane at that time: the send says so as the message does (its answer
    # gave the level it was asked for)
    leveled = producer.send("kp.t", {"v": 4}, delay_level=1, key="k", on_duplicate="debounce")
    assert (leveled.delay_level, producer.get(leveled.id).delay_level) == (None, None)
    assert leveled.deliver_at == later.deliver_at
    assert kept.body == {"v": 3}
    assert [producer.get(m).status for m in (first.id, later.id)] == ["cancelled", "cancelled"]


def test_a_running_holder_is_returned_as_it_is(
    producer: Producer, settings: Settings, engine: Engine
) -> None:
    started = threading.Event()
    finish = threading.Event()

    @handler("kp.slow")
    def slow(message: Any) -> None:
        started.set()
        finish.wait(10)

    sent = producer.send("kp.slow", {"v": 1}, key="k")
    runner = threading.Thread(target=lambda: Consumer(settings, engine).run_once("kp.slow"))
    runner.start()
    assert started.wait(10)
    try:
        again = producer.send("kp.slow", {"v": 2}, key="k", on_duplicate="replace")
        assert (again.id, again.created, again.status) == (sent.id, False, "running")
    finally:
        finish.set()
        runner.join()
    assert producer.get(sent.id).status == "succeeded"


@pytest.mark.parametrize("policy", ["replace", "debounce"])
def test_raced_against_the_move_and_the_claim_each_key_runs_once_with_one_body(
    producer: Producer, settings: Settings, engine: Engine, policy: str
) -> None:
    """60 keys due at once at level 1; while the delivery moves them and a consumer claims
    them, every key is re-sent with a new body. Whatever each replace met (waiting, in the
    topic queue, running, finished), no message runs twice and a replaced one never runs:
    a key runs a second time only as a new message sent after its first one finished."""
    ran: list[tuple[str, int, int]] = []

    @handler("kp.race")
    def record(message: Any) -> None:
        ran.append((message.key, message.id, message.body["v"]))
        time.sleep(0.01)  # some replaces meet it running, others waiting or in the queue

    keys = [f"k{n}" for n in range(60)]
    for key in keys:
        producer.send("kp.race", {"v": 1}, delay_level=1, key=key)
    with engine.connect() as conn:
        due = conn.execute(text("SELECT max(deliver_ts) FROM commit_log")).scalar_one()
        conn.execute(
            text("SELECT pg_sleep(GREATEST(0, extract(epoch FROM :due - now())))"), {"due": due}
        )
    stop = threading.Event()
    errors: list[BaseException] = []

    def deliver_and_consume() -> None:
        consumer = Consumer(settings, engine)
        try:
            while not stop.is_set():
                with engine.connect() as conn:
                    delivery.run_once(conn, 1, batch=3)
                consumer.run_once("kp.race", limit=2)
        except BaseException as exc:  # asserted below
            errors.append(exc)

    worker = threading.Thread(target=deliver_and_consume)
    worker.start()
    try:
        # the re-sends start once a first message has run, so that some meet a key already run
        # and others one still waiting (started at once, a fast producer replaced all 60 first)
        deadline = time.monotonic() + 60
        while not ran and not errors and time.monotonic() < deadline:
            time.sleep(0.005)
        for key in keys:
            producer.send("kp.race", {"v": 2}, key=key, on_duplicate=policy)
    finally:
        stop.set()
        worker.join()
    assert errors == []
    consumer = Consumer(settings, engine)
    while consumer.run_once("kp.race").claimed:
        pass
    assert len({message_id for _, message_id, _ in ran}) == len(ran)  # none ran twice
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT id, key, status, stored_at, finished_at FROM commit_log "
                "WHERE topic = 'kp.race' ORDER BY id"
            )
        ).all()
    status = {row.id: row.status for row in rows}
    assert all(status[message_id] == "succeeded" for _, message_id, _ in ran)  # none cancelled
    assert not [row for row in rows if row.finished_at is None]
    for key in keys:
        mine = [row for row in rows if row.key == key and row.status == "succeeded"]
        assert 1 <= len(mine) <= 2, key
    by_id = {message_id: v for _, message_id, v in ran}
    for key in keys:
        mine = [row.id for row in rows if row.key == key and row.status == "succeeded"]
        # the re-send found the first finished (the key free): a second message, the new body
        assert [by_id[message_id] for message_id in mine] in ([1], [2], [1, 2]), key
    replaced = [row for row in rows if row.status == "cancelled"]
    assert replaced  # some replaces met a message waiting or in the topic queue
    assert {v for _, _, v in ran} == {1, 2}


@pytest.mark.parametrize("policy", ["replace", "debounce"])
def test_many_senders_replacing_one_key_at_once_each_take_its_place_in_turn(
    producer: Producer, engine: Engine, policy: str
) -> None:
    """16 threads replace one waiting key at once, four times each. Each replace read the
    holder, cancelled it and stored its own, and tried again when another had cancelled it
    first: under that contention the tries ran out, and a send failed with NotCancellable
    ("keeps changing state", 409 over HTTP) though nothing ran (found by a reviewer: 25-65% of
    40 HTTP clients). Replaces of one key now wait for each other: every one succeeds, each
    replacing the message the one before it stored, and one message is left holding the key."""
    first = producer.send("kp.many", {"v": -1}, delay="1h", key="k")
    barrier = threading.Barrier(16)
    sent: list[Any] = []
    errors: list[BaseException] = []

    def replace(n: int) -> None:
        try:
            for round_ in range(4):
                barrier.wait(timeout=60)
                sent.append(
                    producer.send(
                        "kp.many",
                        {"v": n * 10 + round_},
                        delay="1h",
                        key="k",
                        on_duplicate=policy,  # type: ignore[arg-type]
                    )
                )
        except BaseException as exc:  # asserted below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=replace, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert len(sent) == 64 and all(message.created for message in sent)
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status FROM commit_log WHERE topic = 'kp.many' ORDER BY id")
        ).all()
    assert len(rows) == 65
    assert [row.id for row in rows if row.status == "scheduled"] == [rows[-1].id]
    # a chain: each replaced a different one, every message but the last (`first` included)
    replaced = [message.replaced_id for message in sent]
    assert sorted(replaced) == [row.id for row in rows[:-1]] and rows[0].id == first.id
