"""Consumption through Consumer.run_once: claims, outcomes, retries, dead letters, leases."""

import asyncio
import functools
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import text

from delaysvc import store
from delaysvc.db import engines as db
from delaysvc.errors import DeadLetter, RetryLater
from delaysvc.schema.tables import TIMER_LANE
from delaysvc.worker import consumer as consumption
from delaysvc.worker.consumer import Consumer, handler


@pytest.fixture(autouse=True)
def clean_registry():
    saved = dict(consumption._registry)
    consumption._registry.clear()
    yield
    consumption._registry.clear()
    consumption._registry.update(saved)


@pytest.fixture
def consumer(settings, engine):
    return Consumer(settings, engine)


def make_ready(engine, message_id):
    """Deliver a waiting message now, whatever its lane (a retry skips its wait)."""
    with engine.begin() as conn:
        row = store.get_message(conn, message_id)
        store.take_out_of_lane(conn, row.lane, row.queue_offset, row.deliver_ts)
        conn.execute(
            text("UPDATE commit_log SET status='ready', lane=-1 WHERE id=:id"), {"id": message_id}
        )
        conn.execute(
            text(
                "INSERT INTO topic_queue (message_id, topic, deliver_ts) "
                "VALUES (:id, :topic, now())"
            ),
            {"id": message_id, "topic": row.topic},
        )


def test_success_records_timings(producer, consumer):
    seen = []
    handler("order.cancel")(lambda message: seen.append((message.body, message.attempts)))
    message = producer.send("order.cancel", {"id": 42}, key="order-42")
    result = consumer.run_once("order.cancel")
    assert (result.claimed, result.succeeded) == (1, 1)
    assert seen == [({"id": 42}, 1)]
    done = producer.get(message.id)
    assert done.status == "succeeded"
    assert done.started_at <= done.finished_at
    assert done.duration_ms is not None and done.duration_ms >= 0


def test_fails_twice_then_succeeds_with_three_attempts_and_two_errors(producer, consumer, engine):
    calls = []

    @handler("flaky")
    def flaky(message):
        calls.append(message.attempts)
        if message.attempts < 3:
            raise ValueError(f"boom {message.attempts}")

    message = producer.send("flaky", {})
    consumer.run_once("flaky")
    first_retry = producer.get(message.id)
    assert first_retry.status == "retrying"
    assert first_retry.delay_level == 3  # first retry goes to level 3
    make_ready(engine, message.id)
    consumer.run_once("flaky")
    second_retry = producer.get(message.id)
    assert second_retry.delay_level == 4
    make_ready(engine, message.id)
    consumer.run_once("flaky")
    done = producer.get(message.id)
    assert calls == [1, 2, 3]
    assert (done.status, done.attempts) == ("succeeded", 3)
    assert [e["error"] for e in done.errors] == ["ValueError: boom 1", "ValueError: boom 2"]
    assert "boom 2" in done.last_error
    assert "ValueError" in done.errors[1]["traceback"]


def test_out_of_retries_goes_to_the_dead_letters_and_redrive_runs_again(producer, consumer, engine):
    fail = {"on": True}

    @handler("doomed", max_retries=2)
    def doomed(message):
        if fail["on"]:
            raise RuntimeError("always")

    message = producer.send("doomed", {})
    for _ in range(3):
        consumer.run_once("doomed")
        if producer.get(message.id).status == "retrying":
            make_ready(engine, message.id)
    dead = producer.get(message.id)
    assert (dead.status, dead.attempts) == ("dead", 3)
    with engine.connect() as conn:
        letters = store.list_dead(conn)
    assert [(d.message_id, d.attempts) for d in letters] == [(message.id, 3)]
    assert "out of retries" in letters[0].reason
    with engine.begin() as conn:
        store.redrive_dead(conn, message.id)
    fail["on"] = False
    assert consumer.run_once("doomed").succeeded == 1
    assert producer.get(message.id).status == "succeeded"


def test_handler_can_dead_letter_now_or_retry_later(producer, consumer):
    @handler("explicit")
    def explicit(message):
        if message.body == "dead":
            raise DeadLetter("bad order")
        raise RetryLater(delay="45s")

    dead = producer.send("explicit", "dead")
    later = producer.send("explicit", "later")
    result = consumer.run_once("explicit")
    assert (result.dead, result.retried) == (1, 1)
    assert producer.get(dead.id).status == "dead"
    again = producer.get(later.id)
    assert again.status == "retrying"
    with consumer.engine.connect() as conn:
        row = store.get_message(conn, later.id)
    assert row.lane == TIMER_LANE
    assert timedelta(seconds=44) < row.deliver_ts - row.started_at < timedelta(seconds=46)


def test_a_retry_later_delay_not_allowed_is_said_in_the_last_error_and_retried_as_a_failure(
    producer, consumer, caplog
):
    @handler("asks")
    def asks(message):
        raise RetryLater(delay=message.body)

    unreadable = producer.send("asks", "5x")
    too_long = producer.send("asks", "500d")  # past DELAYSVC_MAX_DELAY's 400 days
    with caplog.at_level("WARNING", logger="delaysvc.worker.consumer"):
        assert consumer.run_once("asks").retried == 2
    first = producer.get(unreadable.id)
    assert (first.status, first.delay_level) == ("retrying", 3)  # the first retry's level
    assert first.last_error.startswith("RetryLater's delay: '5x' is not a duration; ")
    assert first.last_error.endswith(": retried as a failure instead. RetryLater: retry later (5x)")
    second = producer.get(too_long.id)
    assert (second.status, second.delay_level) == ("retrying", 3)
    assert "RetryLater's delay: 500d is more than the maximum delay, 400d" in second.last_error
    warned = [r for r in caplog.records if r.getMessage() == "consume.bad_retry_later"]
    assert sorted(r.message_id for r in warned) == sorted([unreadable.id, too_long.id])
    assert all("delay" in r.error for r in warned)


def test_a_retry_later_without_a_delay_takes_the_retry_levels_and_a_last_one_says_its_refusal(
    producer, consumer
):
    """`RetryLater()` ran its job again at once: its retries were all spent within a moment
    (found by a reviewer: 4 runs in 0.3 s, then dead). It takes the retry levels now, as a
    failure would; and a refused delay on the last attempt is said in the dead letter too."""

    @handler("asks.plain", max_retries=1)
    def asks(message):
        raise RetryLater() if message.body == "plain" else RetryLater(delay="5x")

    plain = producer.send("asks.plain", "plain")
    refused = producer.send("asks.plain", "refused")
    assert consumer.run_once("asks.plain").retried == 2
    again = producer.get(plain.id)
    assert (again.status, again.delay_level) == ("retrying", 3)  # the first retry's level
    assert again.last_error == "RetryLater: retry later"
    for message in (plain, refused):
        make_ready(consumer.engine, message.id)
    assert consumer.run_once("asks.plain").dead == 2  # max_retries=1: RetryLater counts
    dead = producer.get(refused.id)
    assert dead.status == "dead"
    assert dead.last_error.startswith("RetryLater's delay: '5x' is not a duration; ")


def test_a_failure_is_said_in_the_log_with_its_error_and_a_dead_letter_with_no_reason_is_one(
    producer, consumer, caplog
):
    """A failing handler's error was only on the message (`consume.retry`, at INFO, named
    none): a developer watching the worker saw nothing while it failed. And `DeadLetter(None)`
    (a reason read from an error that had none) was retried, not dead-lettered."""

    @handler("says")
    def fails(message):
        if message.body == "dead":
            raise DeadLetter(None)
        raise ValueError("no such order: 42\nsecond line")

    retried = producer.send("says", "retry")
    dead = producer.send("says", "dead")
    with caplog.at_level("WARNING", logger="delaysvc.worker.consumer"):
        result = consumer.run_once("says")
    assert (result.retried, result.dead) == (1, 1)
    said = {r.getMessage(): r for r in caplog.records}
    assert said["consume.retry"].message_id == retried.id
    assert said["consume.retry"].error == "ValueError: no such order: 42"
    assert said["consume.dead"].message_id == dead.id
    assert said["consume.dead"].reason == "dead-lettered by handler"
    assert producer.get(dead.id).status == "dead"


def _unwrapped(func):
    """A decorator without `functools.wraps`: every function it makes has one name."""

    def run(message):
        return func(message)

    return run


def test_a_handler_without_its_topic_is_refused_and_a_second_one_for_a_topic_said(caplog):
    def cancel_order(message):
        pass

    def cancel_order_too(message):
        pass

    with pytest.raises(TypeError, match=r'write @handler\("order.cancel"\) over .*cancel_order'):
        handler(cancel_order)  # `@handler` with no parentheses
    with pytest.raises(TypeError, match=r"a string such as 'order.cancel', got 42"):
        handler(42)
    with caplog.at_level("WARNING", logger="delaysvc.worker.consumer"):
        handler("order.cancel")(cancel_order)
        handler("order.cancel")(cancel_order)  # the same function again (a module reloaded)
        handler("partial")(functools.partial(cancel_order))
        handler("partial")(functools.partial(cancel_order))  # named by its function
        for _ in range(2):  # one lambda, or one decorated function, made again: a reload
            handler("lambda")(lambda message: cancel_order(message))
            handler("wrapped")(_unwrapped(cancel_order))
        assert not caplog.records
        handler("order.cancel")(cancel_order_too)  # said (it was silent), the last one kept
        # another lambda, or another function under a decorator without `functools.wraps`:
        # the same name, another handler
        handler("lambda")(lambda message: cancel_order_too(message))
        handler("wrapped")(_unwrapped(cancel_order_too))
    said, lambdas, wrapped = caplog.records
    assert (lambdas.topic, lambdas.was, lambdas.now) == ("lambda", lambdas.now, lambdas.now)
    assert wrapped.topic == "wrapped" and wrapped.now.endswith("_unwrapped.<locals>.run")
    assert said.getMessage() == "handlers.replaced" and said.topic == "order.cancel"
    assert (said.was.endswith(".cancel_order"), said.now.endswith(".cancel_order_too")) == (
        True,
        True,
    )
    assert consumption._registry["order.cancel"].func is cancel_order_too
    # the registry's names are still given where they were before `worker.handlers`
    from delaysvc.consumption import register_handler, registered_topics

    from delaysvc.worker import handlers

    assert (register_handler, registered_topics) == (
        handlers.register_handler,
        handlers.registered_topics,
    )


def test_topic_without_handler_waits_visibly(producer, consumer, engine):
    message = producer.send("nobody.listens", {})
    assert consumer.run_once("nobody.listens").claimed == 0
    assert producer.get(message.id).status == "ready"
    with engine.connect() as conn:
        assert store.topics_with_ready(conn) == ["nobody.listens"]


def test_cancelled_messages_never_run(producer, consumer):
    ran = []
    handler("t")(lambda m: ran.append(m.id))
    cancelled = producer.send("t", 1)
    kept = producer.send("t", 2)
    producer.cancel(cancelled.id)
    consumer.run_once("t")
    assert ran == [kept.id]


def claim(engine, topic, lease_seconds=60):
    with engine.begin() as conn:
        return store.claim_ready(conn, topic, 10, lease_seconds=lease_seconds)


def start(engine, message_id, claim_id):
    with db.autocommit_cursor(engine) as cursor:
        return store.start_jobs(cursor, [message_id], claim_id).get(message_id)


def expire_leases(engine):
    with engine.begin() as conn:
        conn.execute(text("UPDATE commit_log SET lease_until = now() - interval '1 second'"))


def test_a_lease_that_expired_before_the_servers_start_waits_a_grace_for_its_renewal(
    producer, consumer, engine
):
    """A lease that expired while the database was away (its worker alive, its renewals
    failing) was rescued as the database came back, before the worker could renew it: every
    job in flight ran again, though each had succeeded (found by a reviewer: a 45 s outage).
    Such a lease waits a lease's time after the server's start; one that expired while the
    server ran is rescued at once."""
    handler("t")(lambda m: None)
    during = producer.send("t", 1)
    after = producer.send("t", 2)
    claim(engine, "t")
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE commit_log SET lease_until = CASE WHEN id = :during "
                "THEN pg_postmaster_start_time() - interval '1 second' "
                "ELSE clock_timestamp() - interval '1 second' END"
            ),
            {"during": during.id},
        )
        started_ago = conn.execute(
            text("SELECT extract(epoch FROM clock_timestamp() - pg_postmaster_start_time())")
        ).scalar_one()
        rescued = store.rescue_expired_leases(conn, 10, float(started_ago) + 3600)
        assert [row.id for row in rescued] == [after.id]
        rescued = store.rescue_expired_leases(conn, 10, 0)  # the grace over
        assert [row.id for row in rescued] == [during.id]


def test_a_started_attempt_whose_worker_was_lost_counts(producer, consumer, engine):
    handler("t")(lambda m: None)
    message = producer.send("t", 1)
    (row,) = claim(engine, "t")
    assert start(engine, message.id, row.claim_id) == 1  # the handler started; the worker dies
    expire_leases(engine)
    assert [r.id for r in consumer.rescue_once()] == [message.id]
    lost = producer.get(message.id)
    assert (lost.status, lost.attempts) == ("ready", 1)
    assert lost.last_error == "lease expired: the worker running attempt 1 was lost"
    assert consumer.run_once("t").succeeded == 1
    done = producer.get(message.id)
    assert (done.status, done.attempts) == ("succeeded", 2)


def test_a_celery_task_topics_job_whose_runs_never_report_back_goes_dead_after_its_retries(
    producer, settings, engine
):
    """A topic bound to a Celery task (DELAYSVC_TOPIC_TASKS) whose task never reports back (a
    name no Celery worker has, a worker killed on that job each time): every lease expired
    charged an attempt, and the job was dispatched again for good, never a dead letter, its
    last error blaming a lost worker. Once its attempts pass `max_retries`, it is buried, as
    a handler's job is."""
    bound = settings.model_copy(
        update={"task_topics": {"t.task": "proj.missing"}, "max_retries": 2}
    )
    dispatched = []
    consumer = Consumer(bound, engine, lambda _task, job, claim: dispatched.append(job.attempts))
    message = producer.send("t.task", 1)
    for _ in range(5):
        consumer.run_once("t.task")
        expire_leases(engine)
        consumer.rescue_once()
    assert dispatched == [1, 2, 3]  # its first run and its two retries
    dead = producer.get(message.id)
    assert (dead.status, dead.attempts) == ("dead", 3)
    assert dead.last_error == "DeadLetter: out of retries after 3 attempts"


def test_a_topic_bound_to_a_celery_task_is_dispatched_though_a_pattern_handler_matches_it(
    producer, settings, engine
):
    """`DELAYSVC_TOPIC_TASKS="fam.x=..."` beside a `@handler("fam.*")` (or `durable(app)`'s
    `celery.*`): the pattern's handler ran the bound topic's jobs and the binding was silently
    never used. A topic's own binding comes before patterns; its own `@handler` before both."""
    ran = []
    handler("fam.*", max_retries=0)(lambda m: ran.append(m.topic))
    handler("fam.own")(lambda m: ran.append(m.topic))
    bound = settings.model_copy(
        update={"task_topics": {"fam.x": "proj.x", "fam.own": "proj.own"}, "max_retries": 2}
    )
    dispatched = []
    consumer = Consumer(bound, engine, lambda task, job, claim: dispatched.append(task))
    for topic in ("fam.x", "fam.own", "fam.other"):
        producer.send(topic, 1)
        consumer.run_once(topic)
    assert (dispatched, ran) == (["proj.x"], ["fam.own", "fam.other"])
    assert consumer.max_retries("fam.x") == 2  # the pattern's 0 is its handler's, not the task's


def test_a_claimed_job_that_never_started_is_not_charged_an_attempt(producer, consumer, engine):
    handler("t")(lambda m: None)
    message = producer.send("t", 1)
    claim(engine, "t")  # a worker claims the job and dies before starting it
    expire_leases(engine)
    assert [r.id for r in consumer.rescue_once()] == [message.id]
    lost = producer.get(message.id)
    assert (lost.status, lost.attempts, lost.last_error) == ("ready", 0, None)
    assert consumer.run_once("t").succeeded == 1
    done = producer.get(message.id)
    assert (done.status, done.attempts) == ("succeeded", 1)


def test_a_zombie_worker_cannot_start_or_finish_a_job_taken_over(producer, consumer, engine):
    handler("t")(lambda m: None)
    message = producer.send("t", 1)
    (old,) = claim(engine, "t")
    assert start(engine, message.id, old.claim_id) == 1
    expire_leases(engine)
    consumer.rescue_once()
    (new,) = claim(engine, "t")  # taken again, not started yet
    assert new.claim_id != old.claim_id
    assert consumer.record_success(message.id, old.claim_id, duration_ms=5) is False
    assert start(engine, message.id, old.claim_id) is None
    assert start(engine, message.id, new.claim_id) == 2
    assert consumer.record_success(message.id, old.claim_id, duration_ms=5) is False
    assert producer.get(message.id).status == "running"
    assert consumer.record_success(message.id, new.claim_id, duration_ms=5) is True


def test_a_batch_starts_no_job_after_half_a_lease_and_gives_the_rest_back_uncharged(
    producer, settings, engine
):
    slow = Consumer(settings.model_copy(update={"lease_seconds": 2}), engine)
    ran = []

    @handler("slow")
    def take_time(message):
        ran.append((message.id, message.attempts))
        time.sleep(0.6)

    ids = [producer.send("slow", i).id for i in range(5)]
    result = slow.run_once("slow")
    # started at 0, 0.6 s; at 1.2 s half the lease (1 s) has passed: three go back
    assert (result.claimed, result.succeeded, result.released) == (5, 2, 3)
    assert ran == [(ids[0], 1), (ids[1], 1)]
    for message_id in ids[2:]:
        back = slow_get(engine, message_id)
        assert (back.status, back.attempts, back.started_at) == ("ready", 0, None)
    with engine.connect() as conn:
        assert store.topics_with_ready(conn) == ["slow"]
    while slow.run_once("slow").claimed:
        pass
    assert sorted(ran) == [(message_id, 1) for message_id in ids]  # each ran once, attempt 1


def test_slow_jobs_of_one_topic_spread_over_the_consumers(producer, settings, engine):
    """A claim's jobs waited behind each other for half a lease (15 s) before going back, so a
    topic's slow jobs ran one at a time in one process while the others idled (found by a
    reviewer: ten 3 s jobs on one of two processes). Those not started within a second of
    their claim go back now, while a job runs, and an idle consumer takes them."""
    first, second = Consumer(settings, engine), Consumer(settings, engine)
    ran: dict[int, str] = {}

    @handler("slow.spread")
    def take_time(message):
        ran[message.body] = threading.current_thread().name
        time.sleep(0.6)

    for n in range(6):
        producer.send("slow.spread", n)
    busy = threading.Thread(target=first.run_once, args=("slow.spread",), name="first")
    busy.start()
    try:
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:  # the first has claimed them all
            time.sleep(0.01)
        while len(ran) < 6 and time.monotonic() < deadline:  # an idle consumer, polling
            second.run_once("slow.spread")
            time.sleep(0.05)
    finally:
        busy.join()
    assert sorted(ran) == list(range(6))
    assert ran[0] == "first" and list(ran.values()).count("MainThread") >= 2, ran


def _statuses_once(producer, messages, reached, seconds):
    """The messages' statuses once `reached(statuses)` holds, or as they are `seconds` on."""
    deadline = time.monotonic() + seconds
    while True:
        statuses = [producer.get(m.id).status for m in messages]
        if reached(statuses) or time.monotonic() >= deadline:
            return statuses
        time.sleep(0.1)


def test_jobs_done_before_a_long_one_are_written_while_it_runs(producer, consumer):
    """A batch wrote its outcomes after a job returned: three quick jobs before one of 20 s
    stayed `running` those 20 s, and ran again when the process died in them (found by a
    reviewer). They are written while the long one runs now (`Leases.flush_while_running`)."""
    seen: list[list[str]] = []

    @handler("quick.then.long")
    def run(message):
        if message.body == "long":
            seen.append(_statuses_once(producer, quick, lambda s: s == ["succeeded"] * 3, 10))

    quick = [producer.send("quick.then.long", n) for n in range(3)]
    producer.send("quick.then.long", "long")
    result = consumer.run_once("quick.then.long")
    assert (result.claimed, result.succeeded) == (4, 4)
    assert seen == [["succeeded"] * 3]  # while the long one still ran


def test_jobs_the_claim_started_still_run_once_behind_a_rerun_started_alone(
    producer, consumer, engine
):
    """Once a topic's handlers prove quick, a claim counts the attempts of its first jobs never
    attempted itself; a rerun among them starts alone, just before it runs. Jobs the claim
    started behind a rerun run in this batch, once, as attempt 1: they used to be forgotten
    when the rerun started, dropped as `consume.claim_lost`, left running until their lease
    expired and charged an attempt that never ran."""
    ran = []

    @handler("t")
    def note(message):
        ran.append((message.body, message.attempts))
        if message.body == "flaky" and message.attempts == 1:
            raise ValueError("the first attempt fails")

    flaky = producer.send("t", "flaky")
    assert consumer.run_once("t").retried == 1
    for n in range(7):
        producer.send("t", f"quick {n}")
    assert consumer.run_once("t").succeeded == 7
    make_ready(engine, flaky.id)  # the retry falls due, ahead of the jobs sent next
    fresh = [producer.send("t", f"fresh {n}").id for n in range(2)]
    ran.clear()
    result = consumer.run_once("t")
    assert (result.claimed, result.succeeded) == (3, 3)
    assert ran == [("flaky", 2), ("fresh 0", 1), ("fresh 1", 1)]
    for message_id in [flaky.id, *fresh]:
        assert producer.get(message_id).status == "succeeded"


def slow_get(engine, message_id):
    with engine.connect() as conn:
        return store.get_message(conn, message_id)


def test_paused_topic_is_not_claimed(producer, consumer, engine):
    handler("t")(lambda m: None)
    producer.send("t", 1)
    with engine.begin() as conn:
        store.set_topic_paused(conn, "t", True)
    assert consumer.run_once("t").claimed == 0
    with engine.begin() as conn:
        store.set_topic_paused(conn, "t", False)
    assert consumer.run_once("t").claimed == 1


def test_purge_and_redrive_by_filter(producer, consumer, engine):
    @handler("d", max_retries=0)
    def always(message):
        raise KeyError(message.body)

    ids = [producer.send("d", f"m{i}").id for i in range(4)]
    consumer.run_once("d")
    with engine.begin() as conn:
        assert store.dead_ids(conn, "d", "m1", 100) == [ids[1]]
        assert store.purge_dead(conn, [ids[0]]) == 1
        assert sorted(store.dead_ids(conn, "d", None, 100)) == ids[1:]


def test_a_handler_running_many_leases_keeps_its_job_while_its_process_lives(
    producer, settings, engine
):
    """The lease is renewed while the process runs the batch: another consumer's rescue,
    run well past the lease, takes nothing, and the job runs once."""
    live = Consumer(settings.model_copy(update={"lease_seconds": 1}), engine)
    rescuer = Consumer(settings, engine)
    rescued = []

    @handler("long")
    def run_long(message):
        for _ in range(4):  # 4 leases
            time.sleep(1)
            rescued.extend(rescuer.rescue_once())

    sent = producer.send("long", {})
    result = live.run_once("long")
    assert (result.claimed, result.succeeded, rescued) == (1, 1, [])
    assert (producer.get(sent.id).status, producer.get(sent.id).attempts) == ("succeeded", 1)


def test_a_claim_nobody_renews_is_taken_again_after_one_lease(producer, engine, consumer):
    """What a dead process leaves: a claim and no renewal."""
    sent = producer.send("orphan", {})
    [claimed] = claim(engine, "orphan", lease_seconds=1)
    assert start(engine, sent.id, claimed.claim_id) == 1
    assert consumer.rescue_once() == []
    time.sleep(1.1)
    assert [row.id for row in consumer.rescue_once()] == [sent.id]
    back = slow_get(engine, sent.id)
    assert (back.status, back.attempts) == ("ready", 1)
    assert back.last_error == "lease expired: the worker running attempt 1 was lost"


def test_a_lease_a_moment_from_its_end_is_not_rescued(producer, engine, consumer):
    """The test above checks a lease of 1 s at its start: a rescue of leases up to 300 ms
    before their end passed it (the mutation review). 150 ms from its end, a lease is kept."""
    sent = producer.send("orphan", {})
    [claimed] = claim(engine, "orphan", lease_seconds=60)
    assert start(engine, sent.id, claimed.claim_id) == 1
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE commit_log SET lease_until = clock_timestamp() + interval '150 ms' "
                "WHERE id = :id"
            ),
            {"id": sent.id},
        )
    assert consumer.rescue_once() == []
    time.sleep(0.2)
    assert [row.id for row in consumer.rescue_once()] == [sent.id]


def test_a_failures_retry_is_due_its_retry_levels_delay_after_the_failure(
    producer, consumer, engine, settings
):
    """Only `RetryLater("45s")` had its due time checked, to a second: retries due 2% early
    passed every test, and the history checker (which trusts the due time a claim reports)
    passed retries at half their delay (the mutation review). The failure's time and the
    retry's due time are written by one statement: they are the level's delay apart."""
    handler("fails", max_retries=3)(lambda m: 1 / 0)
    message = producer.send("fails", 1)
    assert consumer.run_once("fails").retried == 1
    delay_ms = settings.levels.delay_ms(settings.levels.retry_level(1))
    with engine.connect() as conn:
        gap = conn.execute(
            text(
                "SELECT deliver_ts - CAST(errors->-1->>'at' AS timestamptz) FROM commit_log "
                "WHERE id = :id"
            ),
            {"id": message.id},
        ).scalar_one()
    assert timedelta(milliseconds=delay_ms - 1) <= gap < timedelta(milliseconds=delay_ms + 50)


class ProcessDied(BaseException):
    """Raised to leave `run_once` as a process that dies would: mid-batch, with jobs claimed
    and maybe charged, nothing recorded (`_dying_after`: a handler's own is its job's
    failure)."""


def _dying_after(consumer, ran, runs):
    """`consumer` dies (`ProcessDied`) just after its `runs`th handler returns."""
    run = consumer._run

    def then_dies(*args):
        outcome = run(*args)
        if len(ran) == runs:
            raise ProcessDied
        return outcome

    consumer._run = then_dies


def test_a_topic_without_retries_never_dead_letters_a_job_that_never_ran(
    producer, settings, engine
):
    """Quick jobs have their attempts counted a chunk at a time; a process dying mid-chunk has
    charged the chunk's jobs that had not started. With no retries that lost attempt would be
    the only one: such a topic starts every job alone."""
    consumer = Consumer(settings.model_copy(update={"lease_seconds": 1}), engine)
    ran = []

    handler("fragile", max_retries=0)(lambda message: ran.append(message.id))
    _dying_after(consumer, ran, 4)  # by then chunks of 2 and 4 jobs would have been charged
    ids = [producer.send("fragile", n).id for n in range(10)]
    with pytest.raises(ProcessDied):
        consumer.run_once("fragile")
    time.sleep(1.1)
    assert len(consumer.rescue_once()) == 10  # no outcome was written: the whole batch
    while consumer.run_once("fragile").claimed:
        pass
    status = {message_id: producer.get(message_id).status for message_id in ids}
    # the jobs that ran before the death used their one attempt; every other one runs now
    assert [m for m in ids if status[m] == "dead"] == ran[:4]
    assert [m for m in ids if status[m] == "succeeded"] == ids[4:] == ran[4:]


def test_a_topic_without_retries_charges_no_attempt_for_a_claim_whose_process_died(
    producer, settings, engine, monkeypatch
):
    """The issue's defect 7: the claim counted the first job's attempt before its handler
    started; a worker killed right after the claim committed (kill -9, the OOM killer) left a
    `max_retries=0` job charged its only attempt, and after the rescue it went dead, "out of
    retries after 1 attempts", never having run. Such a topic's claim charges nothing: each
    attempt is counted just before its handler starts (`start_jobs`)."""
    consumer = Consumer(settings.model_copy(update={"lease_seconds": 1}), engine)
    ran = []
    handler("fragile", max_retries=0)(lambda message: ran.append(message.id))
    message = producer.send("fragile", 1)

    def dies_after_the_claim(claim_id, message_ids, start_by=None):
        raise ProcessDied  # the claim has committed; no handler has started

    monkeypatch.setattr(consumer.leases, "hold", dies_after_the_claim)
    with pytest.raises(ProcessDied):
        consumer.run_once("fragile")
    monkeypatch.undo()
    expire_leases(engine)
    assert [r.id for r in consumer.rescue_once()] == [message.id]
    assert producer.get(message.id).attempts == 0
    assert consumer.run_once("fragile").succeeded == 1
    assert ran == [message.id]
    done = producer.get(message.id)
    assert (done.status, done.attempts) == ("succeeded", 1)


# -- transactional handlers: the handler's rows and the job's success in one transaction -----


@pytest.fixture
def effects(engine):
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS tx_effect (message_id bigint, note text)"))
        conn.execute(text("DELETE FROM tx_effect"))
    return lambda: dict(
        engine.connect().execute(text("SELECT message_id, note FROM tx_effect")).all()
    )


def _write_effect(conn, message, note="done"):
    conn.execute(
        text("INSERT INTO tx_effect (message_id, note) VALUES (:id, :note)"),
        {"id": message.id, "note": note},
    )


def test_an_async_handler_is_awaited_and_a_generator_refused(producer, consumer, effects):
    """An `async def` handler's coroutine was dropped unawaited and its job written down as
    succeeded, its work never done; a generator function's the same, without a word."""

    ran = []

    @handler("async.ok")
    async def ok(message):
        await asyncio.sleep(0)
        ran.append(message.body)

    @handler("async.fails")
    async def fails(message):
        await asyncio.sleep(0)
        raise ValueError("async boom")

    left: list[str] = []

    @handler("async.leaves")
    async def leaves_a_task(message):
        async def later():
            try:
                await asyncio.sleep(30)
                left.append("ran on")
            except asyncio.CancelledError:
                left.append("cancelled")
                raise

        asyncio.get_running_loop().create_task(later())
        await asyncio.sleep(0)

    @handler("async.tx", transaction=True)
    async def in_transaction(message, conn):
        await asyncio.sleep(0)
        _write_effect(conn, message)

    sent = [producer.send(topic, n) for n, topic in enumerate(["async.ok", "async.ok"])]
    failing = producer.send("async.fails", {})
    in_tx = producer.send("async.tx", {})
    assert consumer.run_once("async.ok").succeeded == 2
    assert consumer.run_once("async.fails").retried == 1
    assert consumer.run_once("async.tx").succeeded == 1
    assert ran == [0, 1] and [producer.get(m.id).status for m in sent] == ["succeeded"] * 2
    retrying = producer.get(failing.id)
    assert retrying.status == "retrying" and "ValueError: async boom" in retrying.last_error
    assert effects() == {in_tx.id: "done"}
    producer.send("async.leaves", {})
    assert consumer.run_once("async.leaves").succeeded == 1
    assert left == ["cancelled"]  # as `asyncio.run` would, not inside the next job's handler

    def steps(message):
        yield message

    async def async_steps(message):
        yield message

    for func in (steps, async_steps, functools.partial(steps)):
        with pytest.raises(TypeError, match="is a generator function, which runs nothing"):
            handler("gen")(func)
    handler("gen.returned")(lambda message: steps(message))  # a generator only when it runs
    returned = producer.send("gen.returned", {})
    assert consumer.run_once("gen.returned").retried == 1
    assert "gave a generator, which runs nothing" in producer.get(returned.id).last_error


def test_a_transactional_handler_commits_its_rows_with_the_jobs_success(
    producer, consumer, effects
):
    @handler("tx.ok", transaction=True)
    def ok(message, conn):
        _write_effect(conn, message)
        # the job is this transaction's to finish: still running, as everyone else sees it
        assert producer.get(message.id).status == "running"

    message = producer.send("tx.ok", {})
    result = consumer.run_once("tx.ok")
    assert (result.claimed, result.succeeded, result.retried) == (1, 1, 0)
    assert effects() == {message.id: "done"}
    assert producer.get(message.id).status == "succeeded"
    with consumer.engine.connect() as conn:
        (total,) = [row for row in store.topic_totals(conn) if row.topic == "tx.ok"]
    assert total.succeeded == 1


@pytest.mark.parametrize("ends", ["commit", "rollback"])
def test_a_transactional_handler_that_ends_its_transaction_itself_is_a_dead_letter_at_once(
    producer, consumer, effects, ends
):
    """A handler committing the connection it is given (a helper that commits) had its rows
    committed on every attempt while its job was retried, the error SQLAlchemy's ("Can't
    operate on closed transaction"). The job is a dead letter naming why, its work done once
    (committed) or not at all (rolled back), not again at each retry."""

    @handler("tx.ends", transaction=True)
    def ends_it(message, conn):
        _write_effect(conn, message)
        getattr(conn, ends)()

    message = producer.send("tx.ends", {})
    result = consumer.run_once("tx.ends")
    assert (result.succeeded, result.retried, result.dead) == (0, 0, 1)
    kept = ends == "commit"
    assert effects() == ({message.id: "done"} if kept else {})  # done once, at most
    dead = producer.get(message.id)
    assert dead.status == "dead"
    assert dead.last_error == (
        f"DeadLetter: a transactional handler must not {ends} the connection it is given: "
        "delaysvc commits it with the job's success (raise to roll it back); its work was "
        + ("kept" if kept else "undone")
    )


def test_a_transactional_handlers_run_time_is_counted_as_any_handlers(producer, consumer):
    """Its success is written in its own transaction; its run time was never written, so the
    duration histogram (dashboard, /metrics) left such handlers out."""
    handler("tx.timed", transaction=True)(lambda message, conn: None)
    producer.send("tx.timed", {})
    assert consumer.run_once("tx.timed").succeeded == 1
    with consumer.engine.connect() as conn:
        counts = store.recent_durations(conn)
    assert sum(counts["tx.timed"][0]) == 1, counts


def test_a_transactional_handler_that_raises_leaves_no_row_and_is_retried(
    producer, consumer, engine, effects
):
    @handler("tx.flaky", transaction=True)
    def flaky(message, conn):
        _write_effect(conn, message, f"attempt {message.attempts}")
        if message.attempts == 1:
            raise ValueError("boom after writing")

    message = producer.send("tx.flaky", {})
    consumer.run_once("tx.flaky")
    assert effects() == {}  # rolled back with the failure
    assert producer.get(message.id).status == "retrying"
    make_ready(engine, message.id)
    consumer.run_once("tx.flaky")
    assert effects() == {message.id: "attempt 2"}
    assert producer.get(message.id).status == "succeeded"


@pytest.mark.parametrize("fails", [False, True])
def test_an_orm_session_and_the_psycopg_connection_share_the_handlers_transaction(
    producer, consumer, effects, fails
):
    """As docs/how-to/handlers.md says: `Session(bind=conn)` and
    `conn.connection.driver_connection` write in the job's transaction, committed with its
    success or rolled back with its failure."""
    from sqlalchemy.orm import Session

    @handler("tx.layers", transaction=True, max_retries=0)
    def layers(message, conn):
        session = Session(bind=conn)
        session.execute(
            text("INSERT INTO tx_effect (message_id, note) VALUES (:id, 'orm')"), {"id": message.id}
        )
        session.flush()
        raw = conn.connection.driver_connection
        raw.execute(
            "INSERT INTO tx_effect (message_id, note) VALUES (%s, 'psycopg')", (-message.id,)
        )
        if fails:
            raise ValueError("after both writes")

    message = producer.send("tx.layers", {})
    consumer.run_once("tx.layers")
    if fails:
        assert effects() == {}
        assert producer.get(message.id).status == "dead"
    else:
        assert effects() == {message.id: "orm", -message.id: "psycopg"}
        assert producer.get(message.id).status == "succeeded"


def test_a_job_whose_handler_transaction_is_open_is_neither_rescued_nor_renewed(
    settings, engine, producer, effects
):
    """Its row is locked until the commit: a lease that expires meanwhile (renewal skips the
    locked row) gives no other consumer the job, and `delaysvc check` finds nothing wrong with
    it (it used to report the lease expired and not rescued)."""
    import threading

    from delaysvc.maintenance.check import run_check

    short = Consumer(settings.model_copy(update={"lease_seconds": 1}), engine)
    inside, rescued = threading.Event(), []

    @handler("tx.slow", transaction=True)
    def slow(message, conn):
        _write_effect(conn, message)
        inside.set()
        time.sleep(2.5)  # the 1 s lease expires meanwhile

    message = producer.send("tx.slow", {})
    runner = threading.Thread(target=short.run_once, args=("tx.slow",))
    runner.start()
    assert inside.wait(10)
    time.sleep(1.5)
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL lock_timeout = '200ms'"))  # waiting on the row would fail
        held = conn.execute(
            text("SELECT claim_id FROM commit_log WHERE id = :id"), {"id": message.id}
        )
        assert store.renew_leases(conn, {held.scalar_one(): [message.id]}, 30) == 0  # skipped
        rescued = store.rescue_expired_leases(conn, 10, 30)
    checked = run_check(engine, lease_tolerance_s=0.2)  # the lease expired over 0.2 s ago
    runner.join(30)
    assert checked.ok, checked.lines()
    assert rescued == []
    assert effects() == {message.id: "done"}
    assert producer.get(message.id).status == "succeeded"


def test_a_transactional_handler_whose_job_was_taken_runs_nothing_and_writes_nothing(
    settings, engine, producer, effects
):
    """Its lease expired and another consumer took the job before it started: LeaseLost, the
    handler is never called, nothing is written, the job is the other consumer's."""
    from delaysvc.errors import LeaseLost

    calls = []
    handler("tx.taken", transaction=True)(lambda message, conn: calls.append(message.id))
    message = producer.send("tx.taken", {})
    with engine.begin() as conn:
        (row,) = store.claim_ready(conn, "tx.taken", 1, 1, 1)
        conn.execute(
            text("UPDATE commit_log SET lease_until = now() - interval '1 second' WHERE id = :id"),
            {"id": message.id},
        )
        assert [r.id for r in store.rescue_expired_leases(conn, 10, 30)] == [message.id]
    job = consumption.Job.from_row(row)
    found = consumption.registered("tx.taken")
    with pytest.raises(LeaseLost, match=f"message {message.id}: its lease expired"):
        Consumer(settings, engine)._run_in_transaction(
            found, job, row.claim_id, time.perf_counter()
        )
    assert calls == [] and effects() == {}
    assert producer.get(message.id).status == "ready"


def _three_the_second_raising(producer, topic, raised):
    """Three messages of `topic`, whose handler raises `raised` for the second. -> (the
    bodies run, in order, the messages sent)."""
    ran = []

    @handler(topic)
    def second_raises(message):
        ran.append(message.body)
        if message.body == 1:
            raise raised

    return ran, [producer.send(topic, n) for n in range(3)]


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


@pytest.mark.parametrize(
    ("raised", "kept"),
    [
        (ValueError("nul \x00 inside"), "ValueError: nul \\x00 inside"),
        (ValueError("file \udce9.txt"), "ValueError: file \\udce9.txt"),
        (_Unprintable(), "_Unprintable: <str() failed: RuntimeError: no text>"),
        (DeadLetter("bad \x00 reason"), "DeadLetter: bad \\x00 reason"),
    ],
    ids=["nul", "surrogate", "str-raises", "dead-letter-nul"],
)
def test_an_error_text_the_database_cannot_store_is_kept_escaped_with_its_batchs_outcomes(
    producer, consumer, raised, kept
):
    """An error holding a NUL or a lone surrogate (a file name that is not UTF-8), or whose
    str() raises: writing the batch's outcomes failed, so nothing of the batch was written:
    the jobs that had succeeded ran again after the lease, the error was never kept, and an
    error on every attempt ran the whole batch once a lease until all of it was dead (found by
    a reviewer: 4 good jobs run 17 times). The text is kept escaped now, with the others'
    outcomes."""
    ran, sent = _three_the_second_raising(producer, "odd.errors", raised)
    result = consumer.run_once("odd.errors")
    assert ran == [0, 1, 2]
    assert (result.succeeded, result.retried + result.dead) == (2, 1)
    statuses = [producer.get(m.id).status for m in sent]
    failing = "dead" if isinstance(raised, DeadLetter) else "retrying"
    assert statuses == ["succeeded", failing, "succeeded"]
    failed = producer.get(sent[1].id)
    assert failed.last_error == kept
    assert failed.errors[0]["error"] == kept


@pytest.mark.parametrize("raised", [SystemExit("bad option"), KeyboardInterrupt()])
def test_a_handler_raising_systemexit_or_keyboardinterrupt_fails_its_job_and_keeps_the_rest(
    producer, consumer, engine, raised
):
    """`sys.exit()` (argparse code reused in a handler) ended the worker's process with
    nothing recorded: the jobs of its batch that had returned ran again, and the job was
    retried a lease later with no error kept (found by a reviewer). It is a failure like any
    other now, recorded with the batch's outcomes and the unstarted jobs given back; then it
    goes on up, so the process still ends as asked (a Ctrl-C still stops a worker)."""
    ran, sent = _three_the_second_raising(producer, "exits", raised)
    with pytest.raises(type(raised)):
        consumer.run_once("exits")
    assert ran == [0, 1]
    first, exited, unstarted = (producer.get(m.id) for m in sent)
    assert first.status == "succeeded"
    assert (exited.status, exited.attempts) == ("retrying", 1)
    assert exited.last_error.startswith(type(raised).__name__)
    assert (unstarted.status, unstarted.attempts) == ("ready", 0)
    result = consumer.run_once("exits")
    assert (result.claimed, result.succeeded) == (1, 1)
    assert ran == [0, 1, 2]


class _OwnBase(BaseException):
    """A library's own exception that is no `Exception`."""


class _StrRaisesBase(Exception):
    def __str__(self):
        raise _OwnBase("no text either")


@pytest.mark.parametrize(
    "raised",
    [_OwnBase("custom base"), asyncio.CancelledError("inner run cancelled"), _StrRaisesBase()],
    ids=["own-base-exception", "cancelled", "str-raises-base-exception"],
)
def test_a_handler_raising_a_base_exception_fails_its_job_alone(producer, consumer, raised):
    """A `BaseException` that is no `Exception` (an `asyncio.CancelledError` out of an
    `asyncio.run` in a handler, a library's own) went up through the consumer: nothing of the
    batch was written, the jobs that had returned ran again after the lease, and the job's own
    error was never kept, its retries spent as lost leases (found by a reviewer). It fails its
    own job now, like any exception, and the batch goes on."""
    ran, sent = _three_the_second_raising(producer, "base.errors", raised)
    result = consumer.run_once("base.errors")
    assert ran == [0, 1, 2]
    assert (result.succeeded, result.retried) == (2, 1)
    first, failed, third = (producer.get(m.id) for m in sent)
    assert (first.status, failed.status, third.status) == ("succeeded", "retrying", "succeeded")
    assert failed.attempts == 1
    assert failed.last_error.startswith(type(raised).__name__ + ": ")


def test_jobs_claimed_behind_a_long_handler_go_back_while_it_runs(producer, settings, engine):
    """A claim's jobs not started within half a lease go back to the queue: that was checked
    only between two jobs, and the lease's renewal kept them all, so four quick jobs claimed
    behind one of 40 s stayed `running` the whole 40 s, not run by idle consumers nor
    cancellable (found by a reviewer). They go back while it runs now, uncharged, and another
    consumer runs them."""
    slow = Consumer(settings.model_copy(update={"lease_seconds": 2}), engine)
    other = Consumer(settings, engine)
    ran: list[tuple[int, str]] = []
    released_while_running: list[list[str]] = []

    @handler("behind")
    def run(message):
        if message.body == "long":
            statuses = _statuses_once(producer, quick, lambda s: "running" not in s, 20)
            if "running" not in statuses:
                released_while_running.append(statuses)
                other.run_once("behind")  # an idle consumer takes them meanwhile
        ran.append((message.id, message.body))

    long = producer.send("behind", "long")
    quick = [producer.send("behind", f"q{n}") for n in range(4)]
    result = slow.run_once("behind")
    assert released_while_running == [["ready"] * 4]
    assert sorted(body for _, body in ran) == ["long", "q0", "q1", "q2", "q3"]  # each once
    assert (result.claimed, result.succeeded) == (5, 1)
    for message in (long, *quick):
        done = producer.get(message.id)
        assert (done.status, done.attempts) == ("succeeded", 1)
