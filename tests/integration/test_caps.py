"""Backlog caps: `reject` refuses the overflowing send before writing anything; `deliver-early`
stores it and delivers the oldest waiting messages now. Nothing is ever dropped."""

from __future__ import annotations

import json
import subprocess

import pytest
from sqlalchemy import Engine, text

from delaysvc import auth, store
from delaysvc.config.settings import BacklogCap, Settings
from delaysvc.errors import BacklogFull, ConfigError
from delaysvc.producer import caps
from delaysvc.producer.sending import Producer
from delaysvc.web import create_app
from tests.conftest import TEST_LEVELS
from tests.support.commands import run_delaysvc
from tests.support.unmovable import make_unmovable


def _producer(settings: Settings, engine: Engine, configured: str) -> Producer:
    """A producer with no caps of its own, on a database with these caps (stored as
    `delaysvc migrate` stores DELAYSVC_BACKLOG_CAPS)."""
    # not model_copy: it would carry the `caps` the original settings cached
    found = Settings.model_validate({**settings.model_dump(), "backlog_caps": configured}).caps
    caps.apply_configured(engine, found)
    return Producer(settings, engine)


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


@pytest.mark.parametrize("way", ["send", "send_batch"])
def test_a_deliver_early_cap_whose_oldest_cannot_be_moved_still_stores_the_send(
    settings: Settings, engine: Engine, way: str
) -> None:
    """Every send over the cap failed with the driver's error while the level's oldest
    message could not be moved: the send is stored, the cap is over by it until the oldest
    moves (its lane marks it stuck), and the rest of the early delivery is left as it was."""
    producer = _producer(settings, engine, "level:4=2:deliver-early")
    bad = producer.send("t.flow", "bad", delay_level=4)
    make_unmovable(engine, bad.id)
    producer.send("t.flow", "ok", delay_level=4)
    if way == "send":
        more = [producer.send("t.flow", "over", delay_level=4)]
    else:
        more = producer.send_batch([{"topic": "t.flow", "body": "over", "delay_level": 4}])
    statuses = _statuses(engine)
    assert statuses[bad.id] == "scheduled" and statuses[more[0].id] == "scheduled"
    assert len(statuses) == 3 and _early(engine, 4) == 0


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


@pytest.mark.parametrize("target", ["topic:t.lowered", "level:4"])
def test_a_deliver_early_cap_lowered_under_the_backlog_is_met_at_the_next_send(
    settings: Settings, engine: Engine, target: str
) -> None:
    """A topic's backlog was counted only up to the cap and the send's own messages plus one:
    lowered from 50 to 10, each send delivered two early, and the topic stayed 39 over."""
    producer = Producer(settings, engine)
    producer.send_batch([{"topic": "t.lowered", "body": n, "delay_level": 4} for n in range(50)])
    scope, name = target.split(":")
    caps.set_cap(engine, scope, name, 10, "deliver-early")
    producer.send("t.lowered", {"n": "one more"}, delay_level=4)
    assert _waiting(engine, "t.lowered") == 10
    assert _early(engine, 4) == 41


@pytest.mark.parametrize(
    ("caps", "named"),
    [
        ("level:9=10:reject", "level 9 does not exist"),
        ("level:2=10:drop", "policy 'drop'"),
        ("queue:x=1:reject", "malformed"),
        ("topic:bad topic=1:reject", "topic"),
        ("level:2=0:reject", "must be from 1 to 1,000,000,000"),
        ("level:\uff12=1:reject", "not a number"),  # a full-width 2
        ("level:2=\uff110:reject", "malformed"),  # a full-width 1
    ],
)
def test_bad_cap_settings_name_the_problem(caps: str, named: str) -> None:
    with pytest.raises(ConfigError, match="DELAYSVC_BACKLOG_CAPS") as error:
        Settings.from_env({"DELAYSVC_BACKLOG_CAPS": caps, "DELAYSVC_DELAY_LEVELS": "1s 2s 3s"})
    assert named in str(error.value)


# ---------------------------------------------------------------- sends that add nothing


def _waiting(engine: Engine, topic: str) -> int:
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM commit_log c WHERE topic = :topic "
                "AND status IN ('scheduled', 'retrying') "
                "AND NOT EXISTS (SELECT 1 FROM topic_queue q WHERE q.message_id = c.id)"
            ),
            {"topic": topic},
        ).scalar_one()


@pytest.mark.parametrize("cap", ["topic:t.full=2:reject", "level:3=2:reject"])
def test_a_resend_of_a_held_key_is_never_refused_by_a_full_cap(
    settings: Settings, engine: Engine, cap: str
) -> None:
    """The README's recovery for `maybe_stored` (send again with the same key) must work where
    the caps are: a send that returns the message holding its key adds nothing."""
    producer = _producer(settings, engine, cap)
    first = producer.send("t.full", {"n": 0}, delay_level=3, key="k")
    producer.send("t.full", {"n": 1}, delay_level=3)
    again = producer.send("t.full", {"n": 0}, delay_level=3, key="k")
    assert (again.id, again.created) == (first.id, False)
    due_now = producer.send("t.full", {"n": 2}, key="ready")  # due now: not in the backlog
    assert producer.send("t.full", {"n": 2}, delay_level=3, key="ready").id == due_now.id
    with pytest.raises(BacklogFull):
        producer.send("t.full", {"n": 3}, delay_level=3, key="new")
    assert _waiting(engine, "t.full") == 2


def test_a_resend_of_a_held_key_delivers_nothing_early(settings: Settings, engine: Engine) -> None:
    """A backlog over its cap (the cap was set lower than what waits) is trimmed by a send that
    adds to it, never by one that adds nothing."""
    plain = Producer(settings, engine)
    held = plain.send("t.over", {"n": 0}, delay_level=3, key="k")
    for n in range(1, 4):
        plain.send("t.over", {"n": n}, delay_level=3)
    producer = _producer(settings, engine, "level:3=2:deliver-early")
    again = producer.send("t.over", {"n": 0}, delay_level=3, key="k")
    assert (again.id, again.created) == (held.id, False)
    (batched,) = producer.send_batch([{"topic": "t.over", "body": 0, "delay_level": 3, "key": "k"}])
    assert (batched.id, batched.created) == (held.id, False)
    assert _early(engine, 3) == 0
    assert _waiting(engine, "t.over") == 4
    producer.send("t.over", {"n": 4}, delay_level=3)  # adds one: trimmed to the cap
    assert (_early(engine, 3), _waiting(engine, "t.over")) == (3, 2)


@pytest.mark.parametrize("policy", ["replace", "debounce"])
@pytest.mark.parametrize("cap", ["topic:t.full=2:reject", "level:3=2:reject"])
def test_replace_and_debounce_on_a_full_cap_take_one_out_and_put_one_in(
    settings: Settings, engine: Engine, cap: str, policy: str
) -> None:
    producer = _producer(settings, engine, cap)
    first = producer.send("t.full", {"v": 1}, delay_level=3, key="k")
    producer.send("t.full", {"v": 0}, delay_level=3)
    placed = producer.send("t.full", {"v": 2}, delay_level=3, key="k", on_duplicate=policy)
    assert (placed.created, placed.replaced_id) == (True, first.id)
    assert producer.get(first.id).status == "cancelled"
    assert (producer.get(placed.id).status, producer.get(placed.id).body) == ("scheduled", {"v": 2})
    assert _waiting(engine, "t.full") == 2


@pytest.mark.parametrize("policy", ["replace", "debounce"])
def test_a_replace_that_grows_a_full_backlog_is_refused_before_anything_is_written(
    settings: Settings, engine: Engine, policy: str
) -> None:
    """The holder is due now (in its topic's queue, not waiting): its replacement would wait,
    one more in a full backlog. Refused in the caller's transaction, which stays clean: the
    holder is not cancelled."""
    producer = _producer(settings, engine, "topic:t.full=1:reject")
    holder = producer.send("t.full", {"v": 1}, key="k")
    producer.send("t.full", {"v": 0}, delay_level=3)
    with (
        engine.connect() as conn,
        conn.begin(),
        pytest.raises(BacklogFull, match=r"topic t\.full holds 1 waiting messages"),
    ):
        producer.send(
            "t.full", {"v": 2}, delay_level=3, key="k", on_duplicate=policy, connection=conn
        )
    assert producer.get(holder.id).status == "ready"
    assert _waiting(engine, "t.full") == 1


@pytest.mark.parametrize("policy", ["replace", "debounce"])
def test_replace_and_debounce_over_a_cap_deliver_nothing_early(
    settings: Settings, engine: Engine, policy: str
) -> None:
    plain = Producer(settings, engine)
    first = plain.send("t.over", {"v": 1}, delay_level=3, key="k")
    for n in range(3):
        plain.send("t.over", {"n": n}, delay_level=3)
    producer = _producer(settings, engine, "topic:t.over=2:deliver-early")
    placed = producer.send("t.over", {"v": 2}, delay_level=3, key="k", on_duplicate=policy)
    assert placed.replaced_id == first.id
    assert _early(engine, 3) == 0
    assert _waiting(engine, "t.over") == 4


def test_a_batch_counts_only_what_it_adds(settings: Settings, engine: Engine) -> None:
    """Held keys and a key repeated in the batch add nothing: a batch of two held keys, a key
    twice and one new message adds two."""
    producer = _producer(settings, engine, "topic:t.batch=4:reject")
    held = [producer.send("t.batch", {"n": n}, delay_level=3, key=f"k{n}") for n in range(2)]
    item = {"topic": "t.batch", "body": 0, "delay_level": 3}
    sent = producer.send_batch(
        [
            {**item, "key": "k0"},
            {**item, "key": "k1"},
            {**item, "key": "twice"},
            {**item, "key": "twice"},
            item,
        ]
    )
    assert [m.created for m in sent] == [False, False, True, False, True]
    assert [m.id for m in sent[:2]] == [m.id for m in held]
    assert _waiting(engine, "t.batch") == 4
    assert [m.created for m in producer.send_batch([{**item, "key": "k0"}] * 2)] == [False] * 2
    with pytest.raises(BacklogFull, match="1 more refused"):
        producer.send_batch([{**item, "key": "k0"}, {**item, "key": "new"}])


# ---------------------------------------------------------------- caps in the database


def _cli(database_url: str, *args: str, **variables: str) -> subprocess.CompletedProcess[str]:
    return run_delaysvc(
        *args, DELAYSVC_DATABASE_URL=database_url, DELAYSVC_DELAY_LEVELS=TEST_LEVELS, **variables
    )


def test_a_cap_set_with_the_cli_binds_a_producer_without_caps_of_its_own(
    settings: Settings, engine: Engine, database_url: str
) -> None:
    producer = Producer(settings, engine)  # no DELAYSVC_BACKLOG_CAPS
    assert settings.caps == ()
    set_ = _cli(database_url, "cap", "topic:t.cli", "--max-waiting", "1")
    assert (set_.returncode, set_.stdout) == (0, "topic:t.cli: at most 1 waiting, reject\n")
    early = _cli(database_url, "cap", "level:2", "--max-waiting", "2", "--policy", "deliver-early")
    assert early.stdout == "level:2: at most 2 waiting, deliver-early\n"
    assert _cli(database_url, "caps").stdout.splitlines() == [
        "level:2                        at most 2 waiting, deliver-early",
        "topic:t.cli                    at most 1 waiting, reject",
    ]
    assert json.loads(_cli(database_url, "caps", "--json").stdout) == {
        "caps": [
            {"scope": "level", "target": "2", "max_waiting": 2, "policy": "deliver-early"},
            {"scope": "topic", "target": "t.cli", "max_waiting": 1, "policy": "reject"},
        ]
    }
    with engine.connect() as conn:  # the CLI made the capped topic's index
        assert [index.name for index in store.capped_indexes(conn)] == [
            store.capped_index_for(["t.cli"])[0]  # type: ignore[index]
        ]
    producer.send("t.cli", {"n": 0}, delay="1h")
    with pytest.raises(BacklogFull, match=r"topic t\.cli holds 1 waiting messages"):
        producer.send("t.cli", {"n": 1}, delay_level=3)  # the single send's statement
    with engine.connect() as conn, conn.begin(), pytest.raises(BacklogFull):
        producer.send("t.cli", {"n": 1}, delay_level=3, connection=conn)  # in a transaction
    ids = [producer.send("t.lvl", {"n": n}, delay_level=2).id for n in range(3)]
    assert [producer.get(i).status for i in ids] == ["ready", "scheduled", "scheduled"]
    assert _early(engine, 2) == 1

    bad = _cli(database_url, "cap", "level:9", "--max-waiting", "5")
    assert (bad.returncode, "level 9 does not exist" in bad.stderr) == (2, True)
    assert _cli(database_url, "cap", "queue:x").returncode == 2
    lifted = _cli(database_url, "cap", "topic:t.cli")
    assert lifted.stdout == "topic:t.cli: no cap\n"
    with engine.connect() as conn:
        assert store.capped_indexes(conn) == []
    producer.send("t.cli", {"n": 2}, delay_level=3)  # lifted: stored at once
    assert _waiting(engine, "t.cli") == 2


def test_delaysvc_backlog_caps_is_stored_by_migrate_for_every_producer(
    settings: Settings, engine: Engine, database_url: str
) -> None:
    _cli(database_url, "cap", "topic:kept", "--max-waiting", "9")  # set at run time: kept
    migrated = _cli(
        database_url, "migrate", DELAYSVC_BACKLOG_CAPS="topic:t.env=1:reject,level:03=5:reject"
    )
    assert migrated.returncode == 0, migrated.stderr
    assert caps.all_caps(engine) == [
        BacklogCap("level", "3", 5, "reject"),
        BacklogCap("topic", "kept", 9, "reject"),
        BacklogCap("topic", "t.env", 1, "reject"),
    ]
    with engine.connect() as conn:  # and the capped topics' index made to fit them
        assert [index.name for index in store.capped_indexes(conn)] == [
            store.capped_index_for(["kept", "t.env"])[0]  # type: ignore[index]
        ]
    producer = Producer(settings, engine)
    producer.send("t.env", {"n": 0}, delay_level=1)
    with pytest.raises(BacklogFull):
        producer.send("t.env", {"n": 1}, delay_level=1)


def test_a_producers_own_caps_hold_where_the_database_has_none(
    settings: Settings, engine: Engine
) -> None:
    """DELAYSVC_BACKLOG_CAPS in a producer's settings binds its sends at once, before any
    migrate or worker stored it; where the database caps the same target, the database's
    cap holds."""
    own = Producer(
        Settings.model_validate(
            {**settings.model_dump(), "backlog_caps": "topic:t.own=1:reject,topic:t.both=1:reject"}
        ),
        engine,
    )
    caps.set_cap(engine, "topic", "t.both", 3)
    own.send("t.own", {"n": 0}, delay_level=1)
    with pytest.raises(BacklogFull):
        own.send("t.own", {"n": 1}, delay_level=1)
    for n in range(3):
        own.send("t.both", {"n": n}, delay_level=1)
    with pytest.raises(BacklogFull, match="its cap is 3"):
        own.send("t.both", {"n": 3}, delay_level=1)


def test_caps_through_the_api(settings: Settings, engine: Engine) -> None:
    app = create_app(settings)
    client = app.test_client()
    admin = {"Authorization": f"Bearer {auth.create_token(engine, 'ops', 'admin')}"}
    scoped = {
        "Authorization": f"Bearer {auth.create_token(engine, 'shop', 'admin', topics=['t.api'])}"
    }
    sender = {"Authorization": f"Bearer {auth.create_token(engine, 'app', 'send')}"}
    try:
        put = client.put("/api/v1/topics/t.api/cap", json={"max_waiting": 1}, headers=scoped)
        assert put.status_code == 200, put.get_json()
        assert put.get_json() == {
            "scope": "topic",
            "target": "t.api",
            "max_waiting": 1,
            "policy": "reject",
        }
        level = client.put(
            "/api/v1/levels/2/cap",
            json={"max_waiting": 5, "policy": "deliver-early"},
            headers=admin,
        )
        assert level.get_json() == {
            "scope": "level",
            "target": "2",
            "max_waiting": 5,
            "policy": "deliver-early",
        }
        every = [
            {"scope": "level", "target": "2", "max_waiting": 5, "policy": "deliver-early"},
            {"scope": "topic", "target": "t.api", "max_waiting": 1, "policy": "reject"},
        ]
        assert client.get("/api/v1/caps", headers=admin).get_json() == {"caps": every}
        assert client.get("/api/v1/caps", headers=scoped).get_json() == {"caps": every[1:]}
        # a token limited to topics touches only their caps: others are not there for it
        other = client.put("/api/v1/topics/t.other/cap", json={"max_waiting": 1}, headers=scoped)
        assert other.status_code == 404
        assert client.put("/api/v1/levels/2/cap", json={}, headers=scoped).status_code == 404
        assert client.put("/api/v1/topics/t.api/cap", json={}, headers=sender).status_code == 403
        bad = client.put("/api/v1/topics/t.api/cap", json={"max_waiting": 0}, headers=admin)
        assert bad.status_code == 400
        assert "a whole number from 1" in bad.get_json()["error"]["message"]
        bad = client.put(
            "/api/v1/levels/2/cap", json={"max_waiting": 1, "policy": "drop"}, headers=admin
        )
        assert "reject or deliver-early" in bad.get_json()["error"]["message"]
        # a level the database does not have: no cap to set, nor one to lift (it answered 200)
        for options in ({"max_waiting": 1}, {}):
            absent = client.put("/api/v1/levels/9/cap", json=options, headers=admin)
            assert absent.status_code == 400, (options, absent.get_json())
            assert "level 9 does not exist in the database" in absent.get_json()["error"]["message"]
        # digits of other scripts: a 500 for '²', a cap set on level 1 or 3 for the others
        for level in ("\u00b2", "\u0661", "\uff13"):  # ², Arabic-Indic 1, full-width 3
            bad = client.put(f"/api/v1/levels/{level}/cap", json={"max_waiting": 1}, headers=admin)
            assert bad.status_code == 400, (level, bad.get_json())
            assert "in the digits 0-9" in bad.get_json()["error"]["message"]

        # the cap binds every producer: this one has none of its own, the HTTP send too
        first = client.post(
            "/api/v1/messages", json={"topic": "t.api", "body": 1, "delay": "1h"}, headers=sender
        )
        assert first.status_code == 201
        full = client.post(
            "/api/v1/messages", json={"topic": "t.api", "body": 2, "delay": "1h"}, headers=sender
        )
        assert full.status_code == 429
        with pytest.raises(BacklogFull):
            Producer(settings, engine).send("t.api", 3, delay_level=1)

        lifted = client.put("/api/v1/topics/t.api/cap", json={}, headers=scoped)
        assert lifted.get_json() == {
            "scope": "topic",
            "target": "t.api",
            "max_waiting": None,
            "policy": None,
        }
        assert Producer(settings, engine).send("t.api", 3, delay_level=1).created
    finally:
        app.extensions["delaysvc"]["engine"].dispose()
