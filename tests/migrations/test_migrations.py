"""Migrations: one head, upgrade from an empty database, the migrated schema matches the models,
downgrade removes everything, and the level partitions follow the configured levels."""

from __future__ import annotations

import importlib
import itertools
import os
import threading
from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from delaysvc import store
from delaysvc.config.levels import DelayLevels
from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.errors import SchemaNotReady
from delaysvc.schema.migrate import downgrade, heads, upgrade
from delaysvc.schema.tables import (
    CAPPED_INDEX_PREFIX,
    is_history_partition,
    is_level_partition,
    metadata,
)
from tests.conftest import TEST_LEVELS, Server

_names = itertools.count()
TABLES = {
    "commit_log",
    "consume_queue",
    "timer_queue",
    "topic_queue",
    "schedule_offset",
    "dead_letter",
    "topic_state",
    "api_token",
    "dashboard_user",
}


@pytest.fixture
def empty_engine(pg_server: Server) -> Iterator[Engine]:
    """A database with nothing in it, not cloned from the migrated template."""
    name = f"delaysvc_empty{os.getpid()}_{next(_names)}"
    with pg_server.janitor(name):
        engine = make_engine(Settings(), pg_server.url(name), poolclass=NullPool)
        yield engine
        engine.dispose()


def _levels(text_: str) -> DelayLevels:
    return Settings(delay_levels=text_).levels


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def _partitions(engine: Engine) -> list[str]:
    found = [t for t in _tables(engine) if is_level_partition(t)]
    return sorted(found, key=lambda name: int(name.rsplit("_", 1)[1]))


def _sequences(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT sequence_name FROM information_schema.sequences"))
        return {row.sequence_name for row in rows}


def test_there_is_exactly_one_head() -> None:
    assert len(heads()) == 1


def test_upgrade_from_empty_creates_every_table_and_level(empty_engine: Engine) -> None:
    assert _tables(empty_engine) == set()
    upgrade(empty_engine, _levels(TEST_LEVELS))
    tables = _tables(empty_engine)
    assert tables >= TABLES
    assert _partitions(empty_engine) == [f"consume_queue_{n}" for n in range(1, 6)]
    with empty_engine.connect() as conn:
        version = conn.execute(text("SELECT version_num FROM delaysvc_version")).scalar_one()
        lanes = conn.execute(text("SELECT lane, delay_ms FROM schedule_offset ORDER BY lane"))
        assert [tuple(row) for row in lanes] == [
            (0, 0),
            (1, 1000),
            (2, 2000),
            (3, 3000),
            (4, 5000),
            (5, 8000),
        ]
    assert [version] == heads()


def test_migrated_schema_matches_the_models(empty_engine: Engine) -> None:
    upgrade(empty_engine, _levels(TEST_LEVELS))
    assert _differences(empty_engine) == []


def _differences(engine: Engine) -> list[object]:
    """What the models and the migrated schema differ in, but for what is made later: level
    and history partitions, the capped topics' index."""

    def include(obj, name, type_, reflected, compare_to) -> bool:  # type: ignore[no-untyped-def]
        if type_ == "index":
            return not name.startswith(CAPPED_INDEX_PREFIX)
        made_later = is_level_partition(name) or is_history_partition(name)
        return not (type_ == "table" and (made_later or name == "delaysvc_version"))

    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "include_object": include}
        )
        return list(compare_metadata(context, metadata))


def test_downgrade_to_base_removes_everything_and_upgrade_works_again(
    empty_engine: Engine,
) -> None:
    upgrade(empty_engine, _levels(TEST_LEVELS))
    downgrade(empty_engine, "base")
    assert _tables(empty_engine) <= {"delaysvc_version"}
    assert _sequences(empty_engine) == set()
    upgrade(empty_engine, _levels(TEST_LEVELS))
    assert _tables(empty_engine) >= TABLES


def test_upgrade_is_idempotent_and_safe_from_several_processes_at_once(
    empty_engine: Engine,
) -> None:
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            upgrade(empty_engine, _levels(TEST_LEVELS))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=migrate) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    upgrade(empty_engine, _levels(TEST_LEVELS))
    assert len(_partitions(empty_engine)) == 5


def test_added_levels_get_their_queues_and_empty_removed_ones_go(engine: Engine) -> None:
    upgrade(engine, _levels(TEST_LEVELS + " 13s 21s"))
    assert len(_partitions(engine)) == 7
    upgrade(engine, _levels("1s 2s 3s"))
    assert _partitions(engine) == ["consume_queue_1", "consume_queue_2", "consume_queue_3"]
    with engine.connect() as conn:
        assert sorted(store.stored_levels(conn)) == [1, 2, 3]


def test_changed_levels_are_detected_until_migrated(engine: Engine) -> None:
    changed = _levels("1s 2s 4s 5s 8s")
    with engine.connect() as conn, pytest.raises(SchemaNotReady, match="delaysvc migrate"):
        store.check_levels(conn, changed)
    upgrade(engine, changed)
    with engine.connect() as conn:
        store.check_levels(conn, changed)


def test_0005_keeps_each_dead_letters_grouping_error_on_the_letter(empty_engine: Engine) -> None:
    """Letters that died before 0005 get their error from commit_log (the last handler error,
    else the reason they died), so the dashboard's groups do not change across the upgrade."""
    upgrade(empty_engine, _levels(TEST_LEVELS), revision="0004")
    with empty_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO commit_log (id, topic, body, body_is_json, lane, status, deliver_ts, "
                "last_error) VALUES (1, 't', '', false, -1, 'dead', now(), 'ValueError: bad'), "
                "(2, 't', '', false, -1, 'dead', now(), NULL)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO dead_letter (message_id, topic, reason, attempts) "
                "VALUES (1, 't', 'retries exhausted', 3), (2, 't', 'expired', 0)"
            )
        )
    upgrade(empty_engine, _levels(TEST_LEVELS))
    with empty_engine.connect() as conn:
        errors = conn.execute(text("SELECT message_id, error FROM dead_letter ORDER BY 1")).all()
    assert [tuple(row) for row in errors] == [(1, "ValueError: bad"), (2, "expired")]


def test_0008_starts_the_running_totals_from_the_kept_minutes(empty_engine: Engine) -> None:
    """The week of minute rows is kept, and /metrics' running totals start from it; the sums
    and outcomes of those minutes were never recorded, so they start at 0."""
    upgrade(empty_engine, _levels(TEST_LEVELS), revision="0007")
    with empty_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO lateness_histogram (minute, lane, counts, max_ms) VALUES "
                "(now() - interval '1 hour', 1, '{2,0,1}', 7), (now(), 1, '{1,1,0}', 3), "
                "(now(), 0, '{0,0,4}', 9)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO handler_duration_histogram (minute, topic, counts, max_ms) VALUES "
                "(now() - interval '2 days', 't.a', '{5,1}', 12), (now(), 't.a', '{1,0}', 1)"
            )
        )
    upgrade(empty_engine, _levels(TEST_LEVELS))
    with empty_engine.connect() as conn:
        lanes = conn.execute(text("SELECT * FROM lateness_total ORDER BY lane")).all()
        topics = conn.execute(text("SELECT * FROM topic_total")).all()
        minutes = conn.execute(
            text(
                "SELECT (SELECT count(*) FROM lateness_histogram), "
                "(SELECT count(*) FROM handler_duration_histogram)"
            )
        ).one()
    assert [tuple(row) for row in lanes] == [(0, [0, 0, 4], 0.0), (1, [3, 1, 1], 0.0)]
    assert [tuple(row) for row in topics] == [("t.a", [6, 1], 0.0, 0, 0, 0)]
    assert tuple(minutes) == (3, 2)
    downgrade(empty_engine, "0007")
    assert {"lateness_total", "topic_total"} & _tables(empty_engine) == set()
    with empty_engine.connect() as conn:
        kept = conn.execute(text("SELECT count(*) FROM lateness_histogram")).scalar_one()
    assert kept == 3


def test_0013_an_install_with_finished_history_upgrades_in_place_and_loses_no_message(
    empty_engine: Engine, own_handlers: None
) -> None:
    """An install at 0012 with finished messages (succeeded, dead, cancelled, some from days
    ago) and messages in flight (waiting, ready): the upgrade moves nothing; the sweep then moves
    the finished ones into their days, the others run as before, the dead one is redriven out
    of the history, and a downgrade puts the history back into commit_log."""
    from delaysvc.errors import DeadLetter
    from delaysvc.maintenance import history
    from delaysvc.producer.dead_letters import DeadLetters
    from delaysvc.producer.sending import Producer
    from delaysvc.worker.consumer import Consumer, handler

    upgrade(empty_engine, _levels(TEST_LEVELS), revision="0012")
    with empty_engine.begin() as conn:  # what this version's sends use: caps (0015), send_one
        conn.execute(text("CREATE TABLE backlog_cap (scope text, target text)"))
        send_one = importlib.import_module("delaysvc.migrations.versions.0017_send_function")
        schema = conn.execute(text("SELECT current_schema()")).scalar_one()
        conn.execute(text(send_one.SEND_ONE.format(s=f'"{schema}"')))
    settings = Settings(delay_levels=TEST_LEVELS)
    producer, consumer = Producer(settings, empty_engine), Consumer(settings, empty_engine)
    fate = {"doomed": True}

    def job(message: object) -> None:
        if fate["doomed"]:
            raise DeadLetter("not yet")

    handler("old.job")(job)
    dead = producer.send("old.job", {"n": 0}).id
    consumer.run_once("old.job")
    fate["doomed"] = False
    done = [producer.send("old.job", {"n": n}).id for n in range(1, 6)]
    consumer.run_once("old.job")
    cancelled = producer.send("old.job", {}, delay="1h")
    with empty_engine.begin() as conn:  # cancelled as 0012's release did (no message view yet)
        row = conn.execute(
            text("SELECT lane, queue_offset, deliver_ts FROM commit_log WHERE id = :id"),
            {"id": cancelled.id},
        ).one()
        assert store.take_out_of_lane(conn, row.lane, row.queue_offset, row.deliver_ts)
        store.mark_cancelled(conn, cancelled.id)
    waiting = producer.send("old.job", {"n": "later"}, delay_level=1).id
    ready = producer.send("old.job", {"n": "now"}).id
    with empty_engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE commit_log SET finished_at = finished_at - interval '3 days' "
                "WHERE id = ANY(:ids)"
            ),
            {"ids": done[:2]},
        )
        before = dict(conn.execute(text("SELECT id, status FROM commit_log")).all())
    assert sorted(before.values()) == [
        *["cancelled", "dead", "ready", "scheduled"],
        *["succeeded"] * 5,
    ]

    with empty_engine.begin() as conn:
        conn.execute(text("DROP TABLE backlog_cap"))
    upgrade(empty_engine, _levels(TEST_LEVELS))
    with empty_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM message_history")).scalar_one() == 0
    assert history.move_all(empty_engine) == 7
    with empty_engine.connect() as conn:
        after = dict(conn.execute(text("SELECT id, status FROM message")).all())
        in_flight = conn.execute(text("SELECT id FROM commit_log ORDER BY id")).scalars().all()
        days = conn.execute(
            text("SELECT tableoid::regclass::text, count(*) FROM message_history GROUP BY 1")
        ).all()
    assert after == before
    assert in_flight == [waiting, ready]
    assert sorted(count for _, count in days) == [2, 5]

    with empty_engine.begin() as conn:
        store.deliver_now(conn, [waiting])
    assert consumer.run_once("old.job").succeeded == 2
    assert DeadLetters(empty_engine).redrive(dead).status == "ready"
    assert consumer.run_once("old.job").succeeded == 1
    assert history.move_all(empty_engine) == 3
    with empty_engine.connect() as conn:
        statuses = conn.execute(text("SELECT status, count(*) FROM message GROUP BY 1")).all()
    assert dict(statuses) == {"succeeded": 8, "cancelled": 1}

    downgrade(empty_engine, "0012")
    with empty_engine.connect() as conn:
        back = conn.execute(text("SELECT status, count(*) FROM commit_log GROUP BY 1")).all()
    assert dict(back) == {"succeeded": 8, "cancelled": 1}
    assert "message_history" not in _tables(empty_engine)


def test_0018_the_status_rule_moves_to_a_domain_keeping_every_status_and_index(
    empty_engine: Engine,
) -> None:
    """0018 takes the status rule off the commit log (a CHECK) and puts it on a domain: the
    stored statuses stay, the partial indexes over them stay usable, a status outside the list
    is refused by name either way, and a downgrade puts the CHECK back."""
    from delaysvc.producer.sending import Producer

    upgrade(empty_engine, _levels(TEST_LEVELS), revision="0017")
    producer = Producer(Settings(delay_levels=TEST_LEVELS), empty_engine)
    ids = [producer.send("t.job", {"n": n}, delay_level=1).id for n in range(3)]
    with empty_engine.begin() as conn:
        for status, id_ in [("running", ids[0]), ("retrying", ids[1])]:
            conn.execute(
                text("UPDATE commit_log SET status = :s, lease_until = now() WHERE id = :id"),
                {"s": status, "id": id_},
            )

    def statuses() -> list[str]:
        with empty_engine.connect() as conn:
            return list(conn.execute(text("SELECT status FROM message ORDER BY id")).scalars())

    def refused_by(rule: str) -> None:
        with pytest.raises(IntegrityError, match=rule), empty_engine.begin() as conn:
            conn.execute(
                text("UPDATE commit_log SET status = 'lost' WHERE id = :id"), {"id": ids[2]}
            )

    refused_by("ck_commit_log_status")
    upgrade(empty_engine, _levels(TEST_LEVELS), revision="0019")  # 0020 drops the waiting index
    assert statuses() == ["running", "retrying", "scheduled"]
    refused_by("ck_message_status")
    with empty_engine.begin() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        for index, where in [
            ("ix_commit_log_running_lease", "status = 'running' AND lease_until < now()"),
            ("ix_commit_log_waiting_topic", "status IN ('scheduled', 'retrying') AND topic = 't'"),
            ("ix_commit_log_retrying_topic", "status = 'retrying' AND topic = 't'"),
        ]:
            plan = conn.execute(text(f"EXPLAIN SELECT id FROM commit_log WHERE {where}"))
            assert index in "\n".join(plan.scalars()), where
        typed = "SELECT pg_typeof(status)::text FROM {} LIMIT 1"
        assert conn.execute(text(typed.format("commit_log"))).scalar_one() == "message_status"
        assert conn.execute(text(typed.format("message"))).scalar_one() == "message_status"

    downgrade(empty_engine, "0017")
    assert statuses() == ["running", "retrying", "scheduled"]
    refused_by("ck_commit_log_status")


def test_0020_drops_the_index_of_every_waiting_message_for_one_of_the_capped_topics(
    empty_engine: Engine,
) -> None:
    """0020 drops `ix_commit_log_waiting_topic`; `caps_index` then indexes the capped topics
    alone, and the models (which name neither) still match; a downgrade drops the capped
    topics' index and builds the old one again."""
    from delaysvc.maintenance import caps_index
    from delaysvc.producer import caps

    def indexes() -> list[str]:
        names = inspect(empty_engine).get_indexes("commit_log")
        return sorted(i["name"] for i in names if "waiting" in i["name"] or "capped" in i["name"])

    upgrade(empty_engine, _levels(TEST_LEVELS), revision="0019")
    assert indexes() == ["ix_commit_log_waiting_topic"]
    upgrade(empty_engine, _levels(TEST_LEVELS))
    assert indexes() == []
    caps.set_cap(empty_engine, "topic", "t.capped", 10)
    built = caps_index.run_once(empty_engine).built
    assert built is not None and indexes() == [built]
    assert _differences(empty_engine) == []
    downgrade(empty_engine, "0019")
    assert indexes() == ["ix_commit_log_waiting_topic"]


def test_a_downgrade_below_token_expiry_revokes_the_tokens_made_to_expire(
    empty_engine: Engine,
) -> None:
    """Found by a reviewer: the downgrade dropped `expires_at` and left such tokens live, an
    expired one working again, and for good after the next upgrade."""
    from delaysvc import auth

    upgrade(empty_engine, _levels(TEST_LEVELS))
    auth.create_token(empty_engine, "short", expires_in_ms=60_000)
    auth.create_token(empty_engine, "forever")
    downgrade(empty_engine, "0022")
    with empty_engine.connect() as conn:
        live = conn.execute(text("SELECT name FROM api_token WHERE revoked_at IS NULL")).all()
    assert live == [("forever",)]
    upgrade(empty_engine, _levels(TEST_LEVELS))
    assert [t.name for t in auth.list_tokens(empty_engine) if t.revoked_at is None] == ["forever"]
