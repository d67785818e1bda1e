"""Per-topic limits with four consumer processes: a topic limited to 2 running jobs never runs
more and keeps both slots busy; a topic limited to 10 starts a second starts 10 a second."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from delaysvc.producer.sending import Producer
from delaysvc.worker import limits
from tests.e2e.conftest import Service, wait_for

pytestmark = pytest.mark.e2e


def _start_and_end(service: Service, topic: str) -> list[tuple[float, float]]:
    rows = service.rows(
        "SELECT extract(epoch FROM min(r.at) FILTER (WHERE r.note = 'start')) AS started, "
        "extract(epoch FROM max(r.at) FILTER (WHERE r.note = 'end')) AS ended "
        "FROM e2e_run r JOIN message c ON c.id = r.message_id WHERE c.topic = :topic "
        "GROUP BY r.message_id",
        topic=topic,
    )
    return [(float(row.started), float(row.ended)) for row in rows]


def test_four_consumers_keep_a_topic_at_its_concurrency_limit_and_never_above(
    service_factory: Callable[..., Service], producer: Producer
) -> None:
    service = service_factory(topic_max_running="e2e.limited=2")  # from the configuration
    limits.set_limits(service.engine, "e2e.record", rate="10/s")  # at run time
    service.delivery_worker()
    for _ in range(4):
        service.consume_worker(concurrency=1)
    service.beat()
    wait_for(
        lambda: (
            {item.topic for item in limits.all_limits(service.engine)}
            == {"e2e.limited", "e2e.record"}
        ),
        60,
        "the delivery worker to apply the configured limit",
    )
    for n in range(30):
        producer.send("e2e.limited", {"n": n})
    for n in range(60):
        producer.send("e2e.record", {"n": n})
    wait_for(lambda: service.count_status("succeeded") == 90, 120, "every job to run")

    spans = _start_and_end(service, "e2e.limited")
    assert len(spans) == 30
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    assert peak == 2  # never above the limit, and it was reached
    busy = sum(end - start for start, end in spans)
    window = max(end for _, end in spans) - min(start for start, _ in spans)
    # both slots kept busy most of the time (a share, not a rate: a loaded machine's claims
    # wait longer between jobs, 1.45 seen with another test run beside it)
    assert busy / window > 1.2

    starts = sorted(
        float(row.at)
        for row in service.rows(
            "SELECT extract(epoch FROM r.at) AS at FROM e2e_run r "
            "JOIN message c ON c.id = r.message_id WHERE c.topic = 'e2e.record'"
        )
    )
    assert len(starts) == 60
    for index, at in enumerate(starts):  # a bucket of one second's starts, refilled at 10/s
        in_window = sum(1 for other in starts[index:] if other - at < 1.0)
        assert in_window <= 20, (index, in_window)
    rate = (len(starts) - 10) / (starts[-1] - starts[0])  # past the first full bucket
    assert 7 <= rate <= 12, rate
