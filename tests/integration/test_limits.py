"""Per-topic limits (`delaysvc.worker.limits`) as the claims enforce them: at most `max_running`
running at once, at most a bucket of one second's tokens at `rate_per_s`, exact under
concurrent claims. The end-to-end test with four consumer processes is in
tests/e2e/test_limits_e2e.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine

from delaysvc import store
from delaysvc.config.settings import Settings
from delaysvc.errors import ValidationError
from delaysvc.producer.sending import Producer
from delaysvc.worker import consumer as consumption
from delaysvc.worker import limits
from delaysvc.worker.consumer import Consumer, handler

pytestmark = pytest.mark.usefixtures("own_handlers")


def _claim(engine: Engine, settings: Settings, topic: str, wanted: int) -> tuple[int, Any]:
    """One claim as a consumer makes it, committed, its jobs left running."""
    result = consumption.ConsumeResult(topic)
    with engine.begin() as conn:
        found = store.lock_limits(conn, topic)
        if found is not None:
            wanted = consumption._allowed(found, wanted, result)
        rows = store.claim_ready(conn, topic, wanted, 60) if wanted else []
        if found is not None and found.rate_per_s is not None:
            store.spend_tokens(conn, topic, found.available - len(rows), found.now)
    return len(rows), result


def test_limits_are_validated_naming_the_field() -> None:
    assert limits.parse_rate("10/s") == 10.0
    assert limits.parse_rate("600/m") == 10.0
    assert limits.parse_rate(2.5) == 2.5
    for bad in ("10", "fast", "0/s", "-1/s", True):
        with pytest.raises(ValidationError, match="rate") as caught:
            limits.parse_rate(bad)
        assert caught.value.field == "rate"
    # a consumer waits 1/rate between starts: for these the consume task's countdown
    # overflowed, again on every run; the least is one a day
    assert limits.parse_rate("1/h") == pytest.approx(1 / 3600)
    for tiny in ("0.000000000001/s", 1e-300, "0.01/h"):
        with pytest.raises(ValidationError, match="at least one a day") as caught:
            limits.parse_rate(tiny)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValidationError, match="a whole number from 1") as caught:
            limits.check_max_running(bad)
        assert caught.value.field == "max_running"


def test_max_running_caps_the_jobs_running_at_once_one_per_claim(
    engine: Engine, settings: Settings, producer: Producer
) -> None:
    for n in range(5):
        producer.send("lim.c", {"n": n})
    limits.set_limits(engine, "lim.c", max_running=2)
    assert [_claim(engine, settings, "lim.c", 100)[0] for _ in range(3)] == [1, 1, 0]
    limits.set_limits(engine, "lim.c", max_running=None)  # lifted: a whole batch again
    assert _claim(engine, settings, "lim.c", 100)[0] == 3
    unlimited = _claim(engine, settings, "other", 100)[1]
    assert not unlimited.limited


def test_rate_spends_a_bucket_of_one_seconds_tokens_and_says_when_the_next_comes(
    engine: Engine, settings: Settings, producer: Producer
) -> None:
    for n in range(40):
        producer.send("lim.r", {"n": n})
    limits.set_limits(engine, "lim.r", rate="5/s")
    emptied_from = time.monotonic()
    assert _claim(engine, settings, "lim.r", 100)[0] == 5  # a full bucket
    emptied_by = time.monotonic()
    taken, result = _claim(engine, settings, "lim.r", 100)
    assert taken == 0 and result.wait_s is not None and 0 < result.wait_s <= 0.2
    time.sleep(0.45)  # about two tokens: 5/s for the time since the bucket was emptied
    refilled_from = time.monotonic()
    taken = _claim(engine, settings, "lim.r", 100)[0]
    refilled_by = time.monotonic()
    fewest, most = (int(5 * (refilled_from - emptied_by)), int(5 * (refilled_by - emptied_from)))
    assert 2 <= fewest <= taken <= most


def test_a_new_bucket_holds_exactly_one_seconds_tokens_every_time_it_is_read(
    engine: Engine, producer: Producer
) -> None:
    """A bucket never spent has no `tokens_at`: its fill must not depend on which of two
    clock readings in one statement came first (it once read 4.99999 tokens, a whole one
    short, about one read in forty)."""
    limits.set_limits(engine, "lim.fresh", rate="5/s")
    for _ in range(300):
        with engine.connect() as conn:
            assert store.lock_limits(conn, "lim.fresh").available == 5
            conn.rollback()


def test_concurrent_claims_never_exceed_the_limits(
    engine: Engine, settings: Settings, producer: Producer
) -> None:
    """Eight threads claim as fast as they can until 150 jobs started: the running jobs never
    exceed 3, and the starts never exceed the bucket (rate * (T + 1)). (How fast the limits
    are reached is the e2e test's and the bench's: a loaded machine starts fewer per second.)"""
    for n in range(400):
        producer.send("lim.both", {"n": n})
    limits.set_limits(engine, "lim.both", max_running=3, rate="50/s")
    running_peak = 0
    started = 0
    lock = threading.Lock()
    stop = threading.Event()
    wanted = 150

    @handler("lim.both")
    def work(message: Any) -> None:
        nonlocal running_peak
        with engine.connect() as conn:
            running = store.lock_limits(conn, "lim.both").running
        with lock:
            running_peak = max(running_peak, running)
        time.sleep(0.01)

    def consume() -> None:
        nonlocal started
        consumer = Consumer(settings, engine)
        while not stop.is_set():
            claimed = consumer.run_once("lim.both").claimed
            with lock:
                started += claimed
                if started >= wanted:
                    stop.set()

    began = time.monotonic()
    threads = [threading.Thread(target=consume) for _ in range(8)]
    for thread in threads:
        thread.start()
    stop.wait(60)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - began
    assert started >= wanted, f"only {started} started in {elapsed:.1f} s"
    assert 1 <= running_peak <= 3
    assert started <= 50 * (elapsed + 1)


def test_configured_limits_are_applied_and_bad_ones_refused_naming_the_setting(
    engine: Engine,
) -> None:
    from delaysvc.errors import ConfigError

    configured = Settings.from_env(
        {
            "DELAYSVC_TOPIC_MAX_RUNNING": "sms.send=4",
            "DELAYSVC_TOPIC_RATES": "sms.send=10/s,mail=600/m",
        }
    ).topic_limits
    limits.set_limits(engine, "other", max_running=1)  # set at run time: kept
    limits.apply_configured(engine, configured)
    assert limits.all_limits(engine) == [
        limits.TopicLimits("mail", None, 10.0),
        limits.TopicLimits("other", 1, None),
        limits.TopicLimits("sms.send", 4, 10.0),
    ]
    with pytest.raises(ConfigError, match=r"DELAYSVC_TOPIC_RATES \(sms.send\): 'fast'"):
        Settings.from_env({"DELAYSVC_TOPIC_RATES": "sms.send=fast"})
    with pytest.raises(ConfigError, match=r"DELAYSVC_TOPIC_MAX_RUNNING \(a\): 0: a whole"):
        Settings.from_env({"DELAYSVC_TOPIC_MAX_RUNNING": "a=0"})


def test_a_worker_start_does_not_refill_the_bucket(
    engine: Engine, settings: Settings, producer: Producer
) -> None:
    """Every delivery worker applies the configured limits when it starts: a rolling deploy
    of four workers must not let four buckets' worth through. A changed rate keeps what the
    bucket holds too (never more than the new rate's one second). At 10/m the bucket holds
    one token, the next in 6 s."""
    for n in range(10):
        producer.send("lim.deploy", {"n": n})
    configured = Settings.from_env({"DELAYSVC_TOPIC_RATES": "lim.deploy=10/m"}).topic_limits
    limits.apply_configured(engine, configured)
    assert _claim(engine, settings, "lim.deploy", 100)[0] == 1  # a full bucket
    for _ in range(4):  # four workers start
        limits.apply_configured(engine, configured)
        assert _claim(engine, settings, "lim.deploy", 100)[0] == 0
    limits.set_limits(engine, "lim.deploy", rate="20/m")  # changed by hand: not refilled either
    assert _claim(engine, settings, "lim.deploy", 100)[0] == 0
