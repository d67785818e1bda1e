"""`GET /metrics` as Prometheus reads it: histograms (buckets, `_sum`, `_count`) and the per-topic
outcome counters are cumulative. Scraped around real work (send, the delivery lane runner, the
consumer with handlers that succeed, fail and give up; Celery-task topics through the consumer's
callbacks) and around the prune of week-old minutes: no sample ever goes down, and the new work
is counted exactly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from flask.testing import FlaskClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.errors import DeadLetter
from delaysvc.maintenance.delivery import LaneRunner
from delaysvc.producer.sending import Producer
from delaysvc.schema.tables import TIMER_LANE
from delaysvc.web import create_app
from delaysvc.worker import consumer as consumption
from delaysvc.worker.consumer import Consumer, Job, handler

HANDLER_SECONDS = 0.02
LATENESS = "delaysvc_delivery_lateness_seconds"
DURATIONS = "delaysvc_handler_duration_seconds"
MINUTE_TABLES = ("lateness_histogram", "handler_duration_histogram")
Key = tuple[str, tuple[tuple[str, str], ...]]


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    saved = dict(consumption._registry)
    consumption._registry.clear()
    yield
    consumption._registry.clear()
    consumption._registry.update(saved)


@dataclass(frozen=True)
class Scrape:
    """One scrape, parsed by prometheus_client's own parser."""

    types: dict[str, str]
    samples: dict[Key, float]

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def cumulative(self) -> dict[Key, float]:
        """Every sample of every histogram and counter (a Prometheus counter, all of them)."""
        kinds = {name for name, kind in self.types.items() if kind in ("histogram", "counter")}
        return {key: value for key, value in self.samples.items() if _family(key[0]) in kinds}


def _family(sample: str) -> str:
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
        if sample.endswith(suffix):
            return sample[: -len(suffix)]
    return sample


def scrape(client: FlaskClient) -> Scrape:
    response = client.get("/metrics")
    assert response.status_code == 200
    types, samples = {}, {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return Scrape(types, samples)


def assert_well_formed_histograms(found: Scrape) -> None:
    """Within each histogram series: buckets never fall as `le` grows, `+Inf` is `_count`,
    and `_sum` is there."""
    for name, kind in found.types.items():
        if kind != "histogram":
            continue
        series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        for (sample, labels), value in found.samples.items():
            if sample == f"{name}_bucket":
                rest = tuple(item for item in labels if item[0] != "le")
                series.setdefault(rest, []).append((float(dict(labels)["le"]), value))
        for labels, buckets in series.items():
            counts = [count for _, count in sorted(buckets)]
            assert counts == sorted(counts), (name, labels, buckets)
            assert counts[-1] == found.samples[(f"{name}_count", labels)]
            assert (f"{name}_sum", labels) in found.samples, (name, labels)


def assert_nothing_decreased(before: Scrape, after: Scrape) -> None:
    earlier = before.cumulative()
    assert earlier, "nothing cumulative to compare"
    later = after.cumulative()
    went_down = {key: (value, later.get(key)) for key, value in earlier.items()}
    went_down = {
        key: pair for key, pair in went_down.items() if pair[1] is None or pair[1] < pair[0]
    }
    assert went_down == {}


def register_handlers() -> None:
    @handler("metrics.ok")
    def ok(message: Job) -> None:
        time.sleep(HANDLER_SECONDS)

    @handler("metrics.flaky")
    def flaky(message: Job) -> None:
        time.sleep(HANDLER_SECONDS)
        raise TimeoutError("upstream slow")

    @handler("metrics.doomed")
    def doomed(message: Job) -> None:
        raise DeadLetter("never valid")


def deliver_timer_lane(engine: Engine) -> int:
    """The lane runner as the delivery task runs it, for a moment; it records its lateness."""
    return LaneRunner(engine, TIMER_LANE, batch=1000, idle_poll_seconds=0.01).run(0.2)


def work(producer: Producer, engine: Engine, settings: Settings, sends: dict[str, int]) -> int:
    """Send through the timer lane, deliver, consume every topic. -> messages moved."""
    for topic, count in sends.items():
        for n in range(count):
            producer.send(topic, {"n": n}, delay_ms=1)
    time.sleep(0.01)
    moved = deliver_timer_lane(engine)
    assert moved == sum(sends.values())
    consumer = Consumer(settings, engine)
    for topic in sends:
        result = consumer.run_once(topic)
        assert result.claimed == sends[topic]
    return moved


def test_histograms_and_outcome_counters_only_grow_and_count_new_work_exactly(
    client: FlaskClient, producer: Producer, engine: Engine, settings: Settings
) -> None:
    register_handlers()
    work(producer, engine, settings, {"metrics.ok": 2, "metrics.flaky": 1})
    first = scrape(client)
    assert_well_formed_histograms(first)
    assert first.types["delaysvc_delivery_lateness_seconds"] == "histogram"
    assert first.types["delaysvc_handler_duration_seconds"] == "histogram"
    for outcome in ("succeeded", "retried", "dead"):
        assert first.types[f"delaysvc_topic_{outcome}"] == "counter"
    assert first("delaysvc_topic_succeeded_total", topic="metrics.ok") == 2

    started = time.monotonic()
    work(producer, engine, settings, {"metrics.ok": 3, "metrics.flaky": 2, "metrics.doomed": 1})
    elapsed = time.monotonic() - started
    second = scrape(client)
    assert_well_formed_histograms(second)
    assert_nothing_decreased(first, second)

    def grew(name: str, **labels: str) -> float:
        return second(name, **labels) - first(name, **labels)

    outcomes = {
        topic: tuple(
            grew(f"delaysvc_topic_{outcome}_total", topic=topic)
            for outcome in ("succeeded", "retried", "dead")
        )
        for topic in ("metrics.ok", "metrics.flaky", "metrics.doomed")
    }
    assert outcomes == {
        "metrics.ok": (3, 0, 0),
        "metrics.flaky": (0, 2, 0),
        "metrics.doomed": (0, 0, 1),
    }
    for topic, runs in (("metrics.ok", 3), ("metrics.flaky", 2), ("metrics.doomed", 1)):
        assert grew(f"{DURATIONS}_count", topic=topic) == runs
        assert grew(f"{DURATIONS}_bucket", topic=topic, le="+Inf") == runs
    assert 3 * HANDLER_SECONDS <= grew(f"{DURATIONS}_sum", topic="metrics.ok") <= elapsed
    assert grew(f"{LATENESS}_count", lane="timer") == 6
    assert grew(f"{LATENESS}_bucket", lane="timer", le="+Inf") == 6
    assert 0 < grew(f"{LATENESS}_sum", lane="timer") <= 6 * elapsed


def test_pruning_minutes_older_than_a_week_decreases_nothing(
    client: FlaskClient, producer: Producer, engine: Engine, settings: Settings
) -> None:
    register_handlers()
    work(producer, engine, settings, {"metrics.ok": 3, "metrics.flaky": 1})
    # a week later: every minute row recorded so far is older than the 7 days kept...
    with engine.begin() as conn:
        for table in MINUTE_TABLES:
            conn.execute(text(f"UPDATE {table} SET minute = minute - interval '8 days'"))
    aged = scrape(client)
    assert aged(f"{LATENESS}_bucket", lane="timer", le="+Inf") == 4
    assert aged(f"{DURATIONS}_bucket", topic="metrics.ok", le="+Inf") == 3
    # ...and the next flushes of a lane and of a consumer prune them
    work(producer, engine, settings, {"metrics.ok": 1})
    with engine.connect() as conn:
        for table in MINUTE_TABLES:
            old = f"SELECT count(*) FROM {table} WHERE minute < now() - interval '7 days'"
            assert conn.execute(text(old)).scalar_one() == 0
            assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() == 1
    pruned = scrape(client)
    assert_nothing_decreased(aged, pruned)
    assert pruned(f"{LATENESS}_bucket", lane="timer", le="+Inf") == 5
    assert pruned(f"{DURATIONS}_bucket", topic="metrics.ok", le="+Inf") == 4
    assert pruned(f"{DURATIONS}_bucket", topic="metrics.flaky", le="+Inf") == 1
    assert pruned("delaysvc_topic_succeeded_total", topic="metrics.ok") == 4


def test_celery_task_topics_count_outcomes_recorded_by_the_task_callbacks(
    client: FlaskClient, engine: Engine, settings: Settings
) -> None:
    bound = Settings(
        database_url=settings.database_url,
        delay_levels=settings.delay_levels,
        topic_tasks="metrics.task=app.tasks.work",
    )
    dispatched: list[tuple[Job, int]] = []
    consumer = Consumer(bound, engine, lambda _task, job, claim: dispatched.append((job, claim)))
    producer = Producer(bound, engine)
    for n in range(3):
        producer.send("metrics.task", {"n": n})
    assert consumer.run_once("metrics.task").dispatched == 3
    (ok, ok_claim), (flaky, flaky_claim), (doomed, doomed_claim) = dispatched
    before = scrape(client)

    assert consumer.record_success(ok.id, ok_claim, 5)
    assert not consumer.record_success(ok.id, ok_claim, 5)  # a repeated callback: not counted
    assert not consumer.record_failure_of(flaky, flaky_claim, RuntimeError("boom"), 5)
    assert consumer.record_failure_of(doomed, doomed_claim, DeadLetter("no"), 5)
    after = scrape(client)
    assert_well_formed_histograms(after)
    assert_nothing_decreased(before, after)
    assert [
        after(f"delaysvc_topic_{outcome}_total", topic="metrics.task")
        for outcome in ("succeeded", "retried", "dead")
    ] == [1, 1, 1]
    # a Celery task's run time is not a handler's: no duration histogram for the topic
    assert (f"{DURATIONS}_count", (("topic", "metrics.task"),)) not in after.samples


def test_the_history_sweeps_backlog_and_days_are_gauges(
    client: FlaskClient, producer: Producer, engine: Engine, settings: Settings
) -> None:
    """Finished messages waiting for the sweep show as a count and the oldest one's wait (what
    to alert on: beat stopped, the sweep failing); swept, both are 0 and the days are there."""
    from delaysvc.maintenance import history
    from delaysvc.store import history as store_history

    register_handlers()
    work(producer, engine, settings, {"metrics.ok": 3, "metrics.doomed": 2})
    with engine.begin() as conn:  # one of them finished a minute ago
        conn.execute(
            text(
                "UPDATE commit_log SET finished_at = finished_at - interval '1 minute' "
                "WHERE id = (SELECT min(id) FROM commit_log)"
            )
        )
    waiting = scrape(client)
    assert waiting("delaysvc_history_unswept") == 5
    assert 60 <= waiting("delaysvc_history_unswept_oldest_seconds") < 120
    assert waiting("delaysvc_history_days") == 0

    history.sweep(engine, retention_ms=None)

    swept = scrape(client)
    assert swept("delaysvc_history_unswept") == 0
    assert swept("delaysvc_history_unswept_oldest_seconds") == 0
    with engine.connect() as conn:
        days = [p.day for p in store_history.partitions(conn)]
    assert swept("delaysvc_history_days") == len(days) >= 2  # and tomorrow's, made ahead
    assert swept.types["delaysvc_history_unswept"] == "gauge"


def _stored_total(settings: Settings) -> str:
    app = create_app(settings)
    try:
        scraped = app.test_client().get("/metrics").get_data(as_text=True).splitlines()
    finally:
        app.extensions["delaysvc"]["engine"].dispose()
    (line,) = [line for line in scraped if line.startswith("delaysvc_messages_stored_total ")]
    return line.split()[1]


def _settle(engine: Engine) -> bool:
    with engine.begin() as conn:
        return store.settle_stored(conn)


def test_messages_stored_counts_only_messages_committed(
    settings: Settings, engine: Engine, producer: Producer
) -> None:
    """The issue's defect 8a: the counter read the id sequence, which duplicate-key sends and
    rolled-back transactions advance too (1 message stored, counter 11)."""
    producer.send("t.stored", 1, key="k1")
    for _ in range(5):  # the key is held: the first message is returned, nothing stored
        producer.send("t.stored", 2, key="k1")
    with engine.connect() as conn:
        rolled_back = conn.begin()
        for n in range(5):
            producer.send("t.stored", n, connection=conn)
        rolled_back.rollback()
    assert _stored_total(settings) == "1.0"
    # settled (beat's fold) the count stays what it is, and goes on from there
    assert (_settle(engine), _settle(engine)) == (False, True)
    assert _stored_total(settings) == "1.0"
    producer.send("t.stored", 3)
    assert _stored_total(settings) == "2.0"


def test_the_stored_count_waits_for_a_transaction_that_drew_a_lower_id(
    settings: Settings, engine: Engine, producer: Producer
) -> None:
    """A send in a long transaction draws its id, a later send commits a higher one, the count
    settles past both: the long one, committed afterwards, is still counted (the watermark
    waited for it), and a rolled-back one never is."""
    with engine.connect() as slow, engine.connect() as aborted:
        slow.begin()
        aborted.begin()
        producer.send("t.stored", "slow", connection=slow)
        producer.send("t.stored", "aborted", connection=aborted)
        producer.send("t.stored", "quick")
        assert _settle(engine) is False  # the candidate: the last id drawn
        assert _settle(engine) is False  # two transactions that drew ids below it still run
        assert _stored_total(settings) == "1.0"
        slow.commit()
        assert _stored_total(settings) == "2.0"
        assert _settle(engine) is False
        aborted.rollback()
    assert _settle(engine) is True
    assert _stored_total(settings) == "2.0"
    with engine.connect() as conn:
        watermark = conn.execute(text("SELECT watermark FROM stored_count")).scalar_one()
    assert watermark == 3  # past all three ids: 'slow' counted in the settled part
    producer.send("t.stored", "later")
    assert _stored_total(settings) == "3.0"
