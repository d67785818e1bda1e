"""Backlog caps: `reject` refuses the overflowing send before writing anything; `deliver-early`
stores it and delivers the oldest waiting messages now. Nothing is ever dropped."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text

from delaysvc.errors import BacklogFull, ConfigError
from delaysvc.producer import Producer
from delaysvc.settings import Settings


def _producer(settings: Settings, engine: Engine, caps: str) -> Producer:
    return Producer(settings.model_copy(update={"backlog_caps": caps}), engine)


def _statuses(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, status FROM commit_log")).all())


def _early(engine: Engine, lane: int) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT early_total FROM schedule_offset WHERE lane = :lane"), {"lane": lane}
        ).scalar_one()


def test_a_level_cap_with_reject_refuses_the_overflowing_send(
    settings: Settings, engine: Engine
) -> None:
    producer = _producer(settings, engine, "level:3=3:reject")
    kept = [producer.send("t.capped", {"n": n}, delay_level=3).id for n in range(3)]
    with pytest.raises(BacklogFull, match=r"level 3 holds 3 waiting messages and its cap is 3"):
        producer.send("t.capped", {"n": 3}, delay_level=3)
    with pytest.raises(BacklogFull):
        producer.send_batch([{"topic": "t.capped", "body": 1, "delay_level": 3}] * 2)
    assert sorted(_statuses(engine)) == kept  # nothing of the refused sends was stored
    producer.send("t.capped", {"n": 4}, delay_level=2)  # other levels are not capped
    producer.cancel(kept[0])
    producer.send("t.capped", {"n": 5}, delay_level=3)  # room again after a cancel


def test_a_refused_send_leaves_the_callers_transaction_usable(
    settings: Settings, engine: Engine
) -> None:
    producer = _producer(settings, engine, "topic:t.capped=1:reject")
    producer.send("t.capped", {"n": 0}, delay_level=3)
    with engine.connect() as conn, conn.begin():
        with pytest.raises(BacklogFull):
            producer.send("t.capped", {"n": 1}, delay_level=1, connection=conn)
        producer.send("t.other", {"n": 2}, delay_level=1, connection=conn)
    with engine.connect() as conn:
        topics = conn.execute(text("SELECT topic FROM commit_log ORDER BY id")).scalars().all()
    assert topics == ["t.capped", "t.other"]


def test_a_topic_cap_with_reject_counts_every_lane_but_not_due_now(
    settings: Settings, engine: Engine
) -> None:
    producer = _producer(settings, engine, "topic:sms.send=2:reject")
    producer.send("sms.send", {"n": 1}, delay_level=1)
    producer.send("sms.send", {"n": 2}, delay="7s")  # the timer lane
    with pytest.raises(BacklogFull, match=r"topic sms\.send holds 2"):
        producer.send("sms.send", {"n": 3}, delay_level=5)
    producer.send("sms.send", {"n": 4})  # due now: not waiting, not capped


def test_a_level_cap_with_deliver_early_delivers_the_oldest_now(
    settings: Settings, engine: Engine
) -> None:
    producer = _producer(settings, engine, "level:4=3:deliver-early")
    ids = [producer.send("t.flow", {"n": n}, delay_level=4).id for n in range(5)]
    statuses = _statuses(engine)
    assert [statuses[i] for i in ids] == ["ready", "ready", "scheduled", "scheduled", "scheduled"]
    assert _early(engine, 4) == 2
    with engine.connect() as conn:
        queued = conn.execute(text("SELECT message_id FROM topic_queue ORDER BY seq")).all()
    assert [row.message_id for row in queued] == ids[:2]

    batch = producer.send_batch(
        [{"topic": "t.flow", "body": n, "delay_level": 4} for n in range(4)]
    )
    statuses = _statuses(engine)
    waiting = sorted(i for i, s in statuses.items() if s == "scheduled")
    assert waiting == [m.id for m in batch][1:]  # the newest 3 wait; everything older is ready
    assert len(statuses) == 9  # none dropped
    assert _early(engine, 4) == 6


def test_a_topic_cap_with_deliver_early_takes_the_soonest_due_across_lanes(
    settings: Settings, engine: Engine
) -> None:
    producer = _producer(settings, engine, "topic:t.mixed=2:deliver-early")
    late = producer.send("t.mixed", {"n": 1}, delay_level=5)  # due in 8 s
    soon = producer.send("t.mixed", {"n": 2}, delay="1500ms")  # timer lane, due in 1.5 s
    producer.send("t.mixed", {"n": 3}, delay_level=4)  # due in 5 s: the cap overflows
    statuses = _statuses(engine)
    assert statuses[soon.id] == "ready"
    assert statuses[late.id] == "scheduled"
    assert _early(engine, 0) == 1


@pytest.mark.parametrize(
    ("caps", "named"),
    [
        ("level:9=10:reject", "level 9 does not exist"),
        ("level:2=10:drop", "policy 'drop'"),
        ("queue:x=1:reject", "malformed"),
        ("topic:bad topic=1:reject", "topic"),
        ("level:2=0:reject", "must be positive"),
    ],
)
def test_bad_cap_settings_name_the_problem(caps: str, named: str) -> None:
    with pytest.raises(ConfigError, match="DELAYSVC_BACKLOG_CAPS") as error:
        Settings.from_env({"DELAYSVC_BACKLOG_CAPS": caps, "DELAYSVC_DELAY_LEVELS": "1s 2s 3s"})
    assert named in str(error.value)
