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
from delaysvc.schema.tables import DURATION_BUCKETS_MS, TIMER_LANE
from delaysvc.web import create_app
from delaysvc.web.metrics import render
from delaysvc.worker import consumer as consumption
from delaysvc.worker.consumer import Consumer, Job, handler

HANDLER_SECONDS = 0.02
LATENESS = "delaysvc_delivery_lateness_seconds"
DURATIONS = "delaysvc_handler_duration_seconds"
JOBS = "delaysvc_jobs"
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
    return parse(response.get_data(as_text=True))


def parse(exposition: str) -> Scrape:
    types, samples = {}, {}
    for family in text_string_to_metric_families(exposition):
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
    assert first.types[JOBS] == "counter"
    assert first(f"{JOBS}_total", topic="metrics.ok", outcome="succeeded") == 2

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
            grew(f"{JOBS}_total", topic=topic, outcome=outcome)
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
    # a difference of two float sums: 0.16 - 0.10 is 0.05999999999999999, not 0.06
    assert 3 * HANDLER_SECONDS - 1e-9 <= grew(f"{DURATIONS}_sum", topic="metrics.ok") <= elapsed
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
    assert pruned(f"{JOBS}_total", topic="metrics.ok", outcome="succeeded") == 4


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
        after(f"{JOBS}_total", topic="metrics.task", outcome=outcome)
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


# Bounded series: a topic label value for the busiest topics only, the rest summed into `other`.


def topic_labels(found: Scrape) -> set[str]:
    """Every `topic` label value of the scrape, in any family."""
    return {dict(labels)["topic"] for _, labels in found.samples if "topic" in dict(labels)}


def outcomes(found: Scrape) -> dict[tuple[str, str], float]:
    """`delaysvc_jobs_total` as {(topic, outcome): count}."""
    return {
        (dict(labels)["topic"], dict(labels)["outcome"]): value
        for (sample, labels), value in found.samples.items()
        if sample == f"{JOBS}_total"
    }


def add_totals(
    engine: Engine,
    counts: dict[str, tuple[int, int, int]],
    durations: dict[str, tuple[int, int, float]] | None = None,
) -> None:
    """Add (succeeded, retried, dead) to topics' running totals, as consumers' flushes do;
    `durations`: (bucket index, runs, their sum in ms) of a topic's handler runs."""
    with engine.begin() as conn:
        for topic, (succeeded, retried, dead) in counts.items():
            counted = store.OutcomeCounts(succeeded, retried, dead)
            if durations and topic in durations:
                index, runs, sum_ms = durations[topic]
                buckets = [runs if n == index else 0 for n in range(len(DURATION_BUCKETS_MS) + 1)]
                store.add_durations(conn, topic, buckets, 1.0, sum_ms, counted)
            else:
                store.add_outcomes(conn, topic, counted)


def test_only_the_topics_with_most_jobs_have_series_of_their_own_the_rest_is_other(
    engine: Engine, producer: Producer
) -> None:
    """At most `max_topics` topic label values plus `other`, chosen by all-time job counts (ties
    by name); `other` sums the rest in every family (a real topic named `other` included); it
    only grows until a topic overtakes one kept, which then moves into `other`."""
    add_totals(
        engine,
        {
            "other": (1000, 0, 0),  # the most of all, but its name is the bucket's
            "cap.a": (50, 5, 5),
            "cap.b": (40, 8, 2),
            "cap.d": (30, 0, 0),  # 30 jobs, as cap.c: cap.c is kept, by name
            "cap.c": (20, 10, 0),
            "cap.e": (1, 2, 3),
        },
        durations={"cap.a": (2, 4, 30.0), "cap.d": (0, 3, 3.0), "cap.e": (4, 2, 80.0)},
    )
    for topic in ("cap.ready", "cap.ready", "cap.d", "cap.a"):  # ready jobs, counted nothing yet
        producer.send(topic, 1)

    def scraped(max_topics: int) -> Scrape:
        return parse(render(engine, 5_000, max_topics=max_topics).decode())

    first = scraped(3)
    assert topic_labels(first) == {"cap.a", "cap.b", "cap.c", "other"}
    assert outcomes(first) == {
        (topic, outcome): count
        for topic, counts in {
            "cap.a": (50, 5, 5),
            "cap.b": (40, 8, 2),
            "cap.c": (20, 10, 0),
            "other": (1031, 2, 3),  # other + cap.d + cap.e
        }.items()
        for outcome, count in zip(("succeeded", "retried", "dead"), counts, strict=True)
    }
    assert first("delaysvc_topic_jobs", topic="other", state="ready") == 3  # cap.ready, cap.d
    assert first("delaysvc_topic_jobs", topic="cap.a", state="ready") == 1
    assert_well_formed_histograms(first)
    assert first(f"{DURATIONS}_count", topic="cap.a") == 4
    # other: cap.d's 3 runs under 1 ms and cap.e's 2 under 50 ms, 83 ms in all
    assert [
        first(f"{DURATIONS}_bucket", topic="other", le=le) for le in ("0.001", "0.025", "0.05")
    ] == [3, 3, 5]
    assert first(f"{DURATIONS}_count", topic="other") == 5
    assert first(f"{DURATIONS}_sum", topic="other") == pytest.approx(0.083)

    add_totals(engine, {"cap.e": (1, 0, 0)})  # 7 jobs: still behind cap.c
    grown = scraped(3)
    assert_nothing_decreased(first, grown)
    assert grown(f"{JOBS}_total", topic="other", outcome="succeeded") == 1032

    add_totals(engine, {"cap.e": (0, 0, 30)})  # 37 jobs: past cap.c's 30, which moves out
    swapped = scraped(3)
    assert topic_labels(swapped) == {"cap.a", "cap.b", "cap.e", "other"}
    moved = {key: value for key, value in outcomes(swapped).items() if key[0] in ("cap.e", "other")}
    assert moved == {
        ("cap.e", "succeeded"): 2,
        ("cap.e", "retried"): 2,
        ("cap.e", "dead"): 33,
        ("other", "succeeded"): 1050,  # other + cap.c + cap.d
        ("other", "retried"): 10,
        ("other", "dead"): 0,  # cap.e's 3 left with it: the documented drop at a swap
    }
    assert swapped(f"{DURATIONS}_count", topic="cap.e") == 2
    assert swapped(f"{DURATIONS}_count", topic="other") == 3

    none_kept = scraped(0)
    assert topic_labels(none_kept) == {"other"}
    assert [
        none_kept(f"{JOBS}_total", topic="other", outcome=outcome)
        for outcome in ("succeeded", "retried", "dead")
    ] == [1000 + 50 + 40 + 30 + 20 + 2, 5 + 8 + 10 + 2, 5 + 2 + 33]
    assert none_kept("delaysvc_topic_jobs", topic="other", state="ready") == 4
    assert none_kept(f"{DURATIONS}_count", topic="other") == 9


def test_the_app_keeps_fifty_topics_by_default(client: FlaskClient, engine: Engine) -> None:
    add_totals(engine, {f"many.{n:02}": (n, 0, 0) for n in range(1, 53)})
    found = scrape(client)
    assert topic_labels(found) == {f"many.{n:02}" for n in range(3, 53)} | {"other"}
    assert found(f"{JOBS}_total", topic="other", outcome="succeeded") == 1 + 2
    assert found(f"{JOBS}_total", topic="many.03", outcome="succeeded") == 3


def test_the_app_keeps_as_many_topics_as_the_setting_says(
    settings: Settings, engine: Engine
) -> None:
    add_totals(engine, {"kept.a": (5, 0, 0), "kept.b": (3, 0, 0), "kept.c": (1, 0, 0)})
    app = create_app(settings.model_copy(update={"metrics_max_topics": 1}))
    try:
        found = scrape(app.test_client())
    finally:
        app.extensions["delaysvc"]["engine"].dispose()
    assert topic_labels(found) == {"kept.a", "other"}
    assert found(f"{JOBS}_total", topic="other", outcome="succeeded") == 3 + 1


def test_lanes_are_labelled_by_lane_alone_and_the_process_metrics_are_there(
    client: FlaskClient, producer: Producer
) -> None:
    """A lane's delay is one info series, not a label of every lane series (a level change
    would start new counter series); the web process's `process_*` and `python_*` metrics are
    in the same scrape."""
    producer.send("t.lanes", 1, delay_level=2)
    found = scrape(client)
    info = {
        dict(labels)["lane"]: (dict(labels)["delay"], value)
        for (sample, labels), value in found.samples.items()
        if sample == "delaysvc_lane_info"
    }
    assert info == {
        "timer": ("any", 1),
        "1": ("1s", 1),
        "2": ("2s", 1),
        "3": ("3s", 1),
        "4": ("5s", 1),
        "5": ("8s", 1),
    }
    assert found("delaysvc_lane_pending", lane="2") == 1
    assert found("delaysvc_lane_moved_total", lane="2") == 0
    delay_labelled = {sample for sample, labels in found.samples if "delay" in dict(labels)}
    assert delay_labelled == {"delaysvc_lane_info"}
    assert {
        name: found.types.get(name)
        for name in (
            "process_cpu_seconds",
            "process_resident_memory_bytes",
            "process_open_fds",
            "python_gc_collections",
            "python_info",
        )
    } == {
        "process_cpu_seconds": "counter",
        "process_resident_memory_bytes": "gauge",
        "process_open_fds": "gauge",
        "python_gc_collections": "counter",
        "python_info": "gauge",
    }
    assert found("process_resident_memory_bytes") > 1_000_000
