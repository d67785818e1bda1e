"""Several worker hosts on one database: three process groups, each with its own delivery
worker, consumer worker and beat (its own folder: beat schedule and, without Redis, its own
filesystem broker), as three machines would run them. Every message is moved once and in its
level's order, and runs once."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from delaysvc.producer.sending import Producer
from tests.e2e.conftest import Service, send_many, wait_for

pytestmark = pytest.mark.e2e
HOSTS = 3


def test_three_hosts_move_each_message_once_in_order_and_run_it_once(
    service_factory: Callable[..., Service], producer: Producer
) -> None:
    hosts = [service_factory() for _ in range(HOSTS)]
    for host in hosts:
        host.delivery_worker()
        host.beat()
    by_level = {
        level: send_many(producer, 800, "e2e.record", delay_level=level) for level in (1, 2, 3)
    }
    timer = send_many(producer, 600, "e2e.record", delay_ms=1500)
    total = 3 * 800 + 600
    first = hosts[0]
    wait_for(
        lambda: first.count_status("ready") == total, 120, f"{total} deliveries\n{first.log_tail()}"
    )
    assert first.scalar("SELECT count(DISTINCT message_id) FROM topic_queue") == total
    for level, ids in by_level.items():
        queued = first.rows(
            "SELECT q.message_id FROM topic_queue q JOIN message m ON m.id = q.message_id "
            "WHERE m.delay_level = :level ORDER BY q.seq",
            level=level,
        )
        assert [r.message_id for r in queued] == ids  # the level's order
    assert first.scalar("SELECT sum(moved_total) FROM schedule_offset") == total

    for host in hosts:
        host.consume_worker(concurrency=2)
    wait_for(
        lambda: first.count_status("succeeded") == total, 180, f"{total} runs\n{first.log_tail()}"
    )
    runs = first.rows("SELECT message_id, count(*) AS n FROM e2e_run GROUP BY message_id")
    assert len(runs) == total and max(r.n for r in runs) == 1  # each ran once
    assert {r.message_id for r in runs} == {i for ids in by_level.values() for i in ids} | set(
        timer
    )
