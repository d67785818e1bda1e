"""Consumption with real Celery worker processes: retries like RocketMQ, dead letters and
redrive, a worker killed mid-job, several consumers on one topic, Celery-task topics."""

from __future__ import annotations

import signal

import pytest

from delaysvc.producer.dead_letters import DeadLetters
from delaysvc.producer.sending import Producer
from tests.e2e.conftest import Service, wait_for
from tests.support.passes import first_pass_only, second_pass_only

pytestmark = pytest.mark.e2e


def _runs(service: Service, message_id: int, note: str | None = None) -> list[int]:
    return [
        row.attempt
        for row in service.rows(
            "SELECT attempt FROM e2e_run WHERE message_id = :id "
            "AND (CAST(:note AS text) IS NULL OR note = :note) ORDER BY at",
            id=message_id,
            note=note,
        )
    ]


def _message(service: Service, message_id: int):  # type: ignore[no-untyped-def]
    return service.rows("SELECT * FROM message WHERE id = :id", id=message_id)[0]


@second_pass_only(
    "~17 s of retry delays; the retry levels are the database's, the same on either server "
    "and broker"
)
def test_a_handler_failing_twice_then_succeeding_ends_succeeded_with_two_errors(
    service: Service, producer: Producer
) -> None:
    service.start()
    sent = producer.send("e2e.flaky", {"n": 1})
    wait_for(lambda: service.count_status("succeeded") == 1, 90, "the third attempt")
    row = _message(service, sent.id)
    assert row.attempts == 3
    assert _runs(service, sent.id) == [1, 2, 3]
    assert [e["attempt"] for e in row.errors] == [1, 2]
    assert [e["error"] for e in row.errors] == [
        "ConnectionError: flaky failure 1",
        "ConnectionError: flaky failure 2",
    ]
    assert row.last_error == "ConnectionError: flaky failure 2"
    # retried like RocketMQ: failure n goes to level 2 + n (3 s, then 5 s with "1s 2s 3s 5s 8s")
    starts = [
        r.at
        for r in service.rows(
            "SELECT at FROM e2e_run WHERE message_id = :id ORDER BY at", id=sent.id
        )
    ]
    assert (starts[1] - starts[0]).total_seconds() >= 3.0
    assert (starts[2] - starts[1]).total_seconds() >= 5.0


@first_pass_only(
    "~26 s of retry delays; dead letters and redrive are the database's, the same on either "
    "server and broker"
)
def test_a_handler_that_always_fails_goes_dead_and_redrive_runs_it_again(
    service: Service, producer: Producer
) -> None:
    service.start()
    sent = producer.send("e2e.broken", {"n": 1})  # max_retries=2: three attempts
    now = producer.send("e2e.broken", {"dead_now": True})
    wait_for(lambda: service.count_status("dead") == 2, 90, "both to be dead")
    assert _runs(service, sent.id) == [1, 2, 3]
    assert _runs(service, now.id) == [1]
    letters = {row.message_id: row for row in DeadLetters(service.engine).list(topic="e2e.broken")}
    assert letters[sent.id].reason == "out of retries: 3 attempts failed"
    assert letters[now.id].reason == "asked to give up"

    DeadLetters(service.engine).redrive(sent.id)
    wait_for(lambda: len(_runs(service, sent.id)) == 4, 60, "the redriven run")
    wait_for(lambda: _message(service, sent.id).status == "dead", 60, "it to die again")


def test_kill_9_of_a_worker_mid_job_runs_the_job_again_after_its_lease(
    service_factory,
    producer: Producer,  # type: ignore[no-untyped-def]
) -> None:
    service = service_factory(lease_seconds="4")
    service.delivery_worker()
    victim = service.consume_worker()
    service.beat()
    sent = producer.send("e2e.slow_first", {"sleep": 60})
    wait_for(lambda: _runs(service, sent.id, "start") == [1], 60, "the first attempt to start")
    assert _message(service, sent.id).status == "running"
    service.kill(victim)
    service.consume_worker()
    wait_for(lambda: service.count_status("succeeded") == 1, 60, "the rerun to finish")
    assert _runs(service, sent.id, "start") == [1, 2]
    assert _runs(service, sent.id, "done") == [2]
    row = _message(service, sent.id)
    assert row.attempts == 2
    assert row.errors is None  # a lost lease is not the handler's failure ...
    assert row.last_error == "lease expired: the worker running attempt 1 was lost"  # but told


@second_pass_only("kills real workers, ~16 s; the handler's transaction, the same on either broker")
def test_a_transactional_handler_killed_mid_transaction_leaves_each_jobs_row_exactly_once(
    service_factory,
    producer: Producer,  # type: ignore[no-untyped-def]
) -> None:
    """`@handler(..., transaction=True)`: the handler's row and the job's success commit
    together. The consumers are killed -9 twice while jobs run inside their transactions; the
    jobs they held run again after their lease, and every job ends with its row once."""
    service = service_factory(lease_seconds="3")
    service.delivery_worker()
    service.beat()
    consumer = service.consume_worker(concurrency=2)
    ids = [
        m.id
        for m in producer.send_batch(
            [{"topic": "e2e.in_transaction", "body": {"sleep": 0.03}} for _ in range(240)]
        )
    ]
    for done in (40, 120):
        wait_for(lambda d=done: service.count_status("succeeded") >= d, 90, f"{done} to run")
        service.kill(consumer)  # mid-handler: a job's transaction is open, rows inserted
        consumer = service.consume_worker(concurrency=2)
    wait_for(lambda: service.count_status("succeeded") == len(ids), 120, "every job to run")
    runs = service.rows("SELECT message_id, count(*) AS n FROM e2e_run GROUP BY message_id")
    assert {row.message_id: row.n for row in runs} == dict.fromkeys(ids, 1)
    reran = service.scalar(
        "SELECT count(*) FROM message WHERE attempts > 1 AND id = ANY(:ids)", ids=ids
    )
    assert reran >= 1  # the kills did land inside running jobs


def test_slow_handlers_at_the_end_of_a_batch_are_never_charged_an_attempt_they_did_not_run(
    service_factory,
    producer: Producer,  # type: ignore[no-untyped-def]
) -> None:
    """Six 0.7 s jobs claimed in one batch under a 2 s lease. Before, the batch's task was
    stopped at the lease and its last jobs, charged at the claim without having run, were
    rescued and ran as attempt 2 (and could reach the dead letters without ever running)."""
    service = service_factory(lease_seconds="2")
    sent = [producer.send("e2e.slow", {"sleep": 0.7}) for _ in range(6)]
    service.consume_worker()
    service.beat()
    wait_for(lambda: service.count_status("succeeded") == 6, 90, "all six to succeed")
    for message in sent:
        assert _runs(service, message.id, "start") == [1]
        assert _message(service, message.id).attempts == 1


def test_four_consumers_on_one_topic_run_each_message_exactly_once(
    service: Service, producer: Producer
) -> None:
    service.start(consumers=2, concurrency=2)
    total = 3000
    ids = [
        m.id
        for start in range(0, total, 1000)
        for m in producer.send_batch(
            [{"topic": "e2e.record", "body": {"n": n}} for n in range(start, start + 1000)]
        )
    ]
    wait_for(lambda: service.count_status("succeeded") == total, 180, f"{total} jobs to run")
    runs = service.rows("SELECT message_id, count(*) AS n FROM e2e_run GROUP BY message_id")
    assert sorted(r.message_id for r in runs) == ids
    assert {r.n for r in runs} == {1}
    pids = service.scalar("SELECT count(DISTINCT pid) FROM e2e_run")
    assert pids >= 2, "the work was shared between consumer processes"


def test_a_topic_bound_to_a_celery_task_runs_it_with_retries(
    service_factory,
    producer: Producer,  # type: ignore[no-untyped-def]
) -> None:
    service = service_factory(topic_tasks="e2e.task=e2e.celery_task")
    service.start()
    ok = producer.send("e2e.task", {"n": 1})
    flaky = producer.send("e2e.task", {"n": 2, "fail_first": True})
    wait_for(lambda: service.count_status("succeeded") == 2, 90, "both tasks to succeed")
    assert _runs(service, ok.id, "task") == [1]
    assert _runs(service, flaky.id, "task") == [1, 2]
    row = _message(service, flaky.id)
    assert row.attempts == 2
    assert row.last_error == "RuntimeError: task failed on its first attempt"


def test_a_graceful_shutdown_finishes_the_running_job(service: Service, producer: Producer) -> None:
    service.delivery_worker()
    worker = service.consume_worker()
    service.beat()
    sent = producer.send("e2e.slow_first", {"sleep": 3})
    wait_for(lambda: _runs(service, sent.id, "start") == [1], 60, "the job to start")
    worker.send_signal(signal.SIGTERM)  # Celery's warm shutdown
    assert worker.wait(timeout=60) == 0
    assert _runs(service, sent.id, "done") == [1]  # finished before the worker left
    row = _message(service, sent.id)
    assert (row.status, row.attempts) == ("succeeded", 1)


def test_sends_due_at_once_run_soon_without_beats_sweep(
    service: Service, producer: Producer
) -> None:
    """A send due at once goes straight to its topic's queue, which no lane moves: with no beat
    (whose 1 s sweep was the only wake, behind the consume tasks), the timer lane's runner
    wakes its topic. Each send below lands in an empty topic queue."""
    service.delivery_worker()
    service.consume_worker()
    producer.send("e2e.record", {}, delay_level=1)  # the lanes and the consumer are up
    wait_for(lambda: service.count_status("succeeded") == 1, 90, "the first message")
    ids = []
    for n in range(3):
        ids.append(producer.send("e2e.record", {"n": n}).id)
        wait_for(
            lambda n=n: service.count_status("succeeded") == 2 + n,
            30,
            f"the send due at once {n}",
        )
    waited = [
        row.waited.total_seconds()
        for row in service.rows(
            "SELECT started_at - stored_at AS waited FROM message WHERE id = ANY(:ids)", ids=ids
        )
    ]
    print("sends due at once, stored -> started, s:", waited)
    assert max(waited) < 5, waited  # a look every 100 ms, then a consume task's round trip
