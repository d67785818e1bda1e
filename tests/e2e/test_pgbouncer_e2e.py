"""A deployment behind a real PgBouncer in transaction pooling mode: the delivery worker's lanes
on the direct URL, the consumers, beat and the producer through the pooler (four server
connections for all of them); every message runs once, and each level keeps its order. Debian's
PgBouncer with `DELAYSVC_DATABASE_POOLING=transaction` in CI's first pass; in the second, one
keeping prepared statements (1.22 or later, `.ci/run` builds it) with `transaction-prepared`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Engine

from delaysvc.bench.pgbouncer import Bouncer, pgbouncer
from delaysvc.db.engines import make_engine
from delaysvc.producer.sending import Producer
from tests.conftest import Server
from tests.e2e.conftest import Service, wait_for
from tests.support.machine import keeping_pgbouncer
from tests.support.passes import first_pass_only, second_pass_only

pytestmark = pytest.mark.e2e
WHY = "~10 s; a deployment through the pooler, the same on either server and broker"


@pytest.fixture
def bouncer(pg_server: Server, pooling: str) -> Iterator[Bouncer]:
    keeps = pooling == "transaction-prepared"
    with pgbouncer(
        pg_server.url("postgres"),
        pool_mode="transaction",
        pool_size=4,
        binary=keeping_pgbouncer() if keeps else "pgbouncer",
        max_prepared_statements=200 * keeps,
    ) as running:
        yield running


@pytest.mark.parametrize(
    "pooling",
    [
        pytest.param("transaction", marks=first_pass_only(f"{WHY} (Debian's PgBouncer here)")),
        pytest.param(
            "transaction-prepared",
            marks=second_pass_only(f"{WHY} (a PgBouncer keeping prepared statements here)"),
        ),
    ],
)
def test_every_message_runs_once_through_the_pooler(
    service_factory: Callable[..., Service], database_url: str, bouncer: Bouncer, pooling: str
) -> None:
    service = service_factory(
        database_url=bouncer.url(database_url),
        database_pooling=pooling,
        direct_database_url=database_url,
    )
    service.start(consumers=2, concurrency=2)
    pooled: Engine = make_engine(service.settings)
    try:
        producer = Producer(service.settings, pooled)
        sent = [producer.send("e2e.record", {"n": n}, delay_level=1 + n % 2) for n in range(60)]
        batch = producer.send_batch([{"topic": "e2e.record", "body": {}, "delay": "1s"}] * 40)
        ids = {m.id for m in sent} | {m.id for m in batch}
        wait_for(
            lambda: service.count_status("succeeded", "e2e.record") == 100,
            120,
            "100 messages sent through PgBouncer to run\n" + service.log_tail(),
        )
        runs = service.rows("SELECT message_id, count(*) AS n FROM e2e_run GROUP BY message_id")
        assert {r.message_id for r in runs} == ids
        assert max(r.n for r in runs) == 1  # each once
        for level in (1, 2):  # moved in offset order
            moved = service.rows(
                "SELECT id FROM message WHERE delay_level = :level AND topic = 'e2e.record' "
                "ORDER BY delivered_at, id",
                level=level,
            )
            assert [r.id for r in moved] == sorted(r.id for r in moved)
    finally:
        pooled.dispose()
