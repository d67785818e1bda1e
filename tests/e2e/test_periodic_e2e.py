"""Periodic schedules in the real deployment: two delivery workers and two beats, one
schedule declared in code (stored by the workers as they start) and one made through the API's
code path; every tick is one message, run once, and no tick is left out. And two teams'
delivery workers, each with its own handler modules, starting in turn: each keeps the other's
schedules."""

from __future__ import annotations

import itertools
import signal
from datetime import datetime, timedelta

import pytest
from sqlalchemy import Engine, text

from delaysvc.maintenance.periodic import Schedules, schedule
from tests.e2e.conftest import wait_for
from tests.support.passes import first_pass_only, second_pass_only

pytestmark = pytest.mark.e2e


def _ticks(service, name: str) -> list[tuple[datetime, int]]:  # type: ignore[no-untyped-def]
    rows = service.rows(
        "SELECT properties->>'tick' AS tick, id FROM message "
        "WHERE properties->>'periodic' = :name ORDER BY 1",
        name=name,
    )
    return [(datetime.fromisoformat(row.tick), row.id) for row in rows]


@first_pass_only(
    "~17 s; a tick is fired once by the database's lock, the same on either server and "
    "broker (the second pass runs the longer periodic test)"
)
def test_two_beats_and_two_delivery_workers_fire_every_tick_once(
    service_factory,
    engine: Engine,  # type: ignore[no-untyped-def]
) -> None:
    service = service_factory(handlers="tests.e2e.handlers,tests.e2e.periodic_handlers")
    Schedules(engine).put(schedule("api-tick", "every 2s", topic="e2e.record", body={"n": 1}))
    service.delivery_worker()
    service.delivery_worker()
    service.consume_worker(concurrency=2)
    service.beat()
    service.beat()
    wait_for(
        lambda: (
            service.scalar(
                "SELECT count(*) FROM message WHERE topic = 'e2e.tick' AND status = 'succeeded'"
            )
            >= 8
        ),
        90,
        "eight ticks of the 1 s schedule to run",
    )
    service.stop()

    stored = {row.name: row for row in Schedules(engine).list()}
    assert stored["e2e.tick"].declared_in == "code"
    assert stored["api-tick"].declared_in == "api"
    for name, step in (("e2e.tick", 1), ("api-tick", 2)):
        ticks = _ticks(service, name)
        times = [tick for tick, _ in ticks]
        assert len(times) == len(set(times)) >= 3, name  # one message per tick
        gaps = {b - a for a, b in itertools.pairwise(times)}
        assert gaps == {timedelta(seconds=step)}, (name, gaps)  # none left out
    not_once = service.scalar(
        "SELECT count(*) FROM message c WHERE c.topic = 'e2e.tick' AND c.status = 'succeeded' "
        "AND (SELECT count(*) FROM e2e_run r WHERE r.message_id = c.id) <> 1"
    )
    assert not_once == 0  # each tick's message ran once


@second_pass_only("about 70 s (it waits for a real minute's round), the same on either server")
def test_delivery_workers_of_two_handler_modules_keep_each_others_schedules(
    service_factory,  # type: ignore[no-untyped-def]
    engine: Engine,
) -> None:
    """Team A's worker starts, team B's, then team A's again (a deploy of A): each start
    stores its own schedule and leaves the other's, and both go on firing. The workers'
    minute rounds declare theirs again and remove a third team's, whose workers are gone."""
    team_a = service_factory(handlers="tests.e2e.periodic_handlers")
    team_b = service_factory(handlers="tests.e2e.periodic_handlers_b")

    def declared() -> set[str]:
        rows = team_a.rows("SELECT name FROM periodic_schedule WHERE declared_in = 'code'")
        return {row.name for row in rows}

    def declared_by(name: str) -> str:
        sql = "SELECT declared_by FROM periodic_schedule WHERE name = :name"
        return team_a.scalar(sql, name=name) or ""

    first_a = team_a.delivery_worker("team-a")
    wait_for(lambda: "e2e.tick" in declared(), 60, "team A's worker to declare e2e.tick")
    team_b.delivery_worker("team-b")
    wait_for(lambda: "e2e.tock" in declared(), 60, "team B's worker to declare e2e.tock")
    assert declared() == {"e2e.tick", "e2e.tock"}

    team_a.kill(first_a, signal.SIGTERM)  # a deploy of team A: its worker stops, a new one starts
    team_a.delivery_worker("team-a")
    wait_for(
        lambda: declared_by("e2e.tick").startswith("team-a1@"),
        60,
        "team A's new worker to declare e2e.tick",
    )
    assert declared() == {"e2e.tick", "e2e.tock"}
    restarted = team_a.scalar("SELECT statement_timestamp()")
    team_a.beat()

    def ticked_since_restart(name: str) -> list[datetime]:
        return [tick for tick, _ in _ticks(team_a, name) if tick > restarted]

    wait_for(lambda: ticked_since_restart("e2e.tick"), 60, "a tick of e2e.tick after the restart")
    wait_for(lambda: ticked_since_restart("e2e.tock"), 60, "a tick of e2e.tock after the restart")

    def declared_at(name: str) -> datetime:
        sql = "SELECT declared_at FROM periodic_schedule WHERE name = :name"
        return team_a.scalar(sql, name=name)

    started_b = declared_at("e2e.tock")
    with engine.begin() as conn:  # a third team's schedule, its last worker gone 11 minutes ago
        conn.execute(
            text(
                "INSERT INTO periodic_schedule (name, topic, body, body_is_json, every_ms, "
                "declared_in, declared_at, declared_by, next_tick) VALUES ('e2e.gone', "
                "'e2e.gone', 'null', true, 3600000, 'code', now() - interval '11 minutes', "
                "'team-c0@gone', now() + interval '1 hour')"
            )
        )
    wait_for(
        lambda: "e2e.gone" not in declared(),
        150,
        "a running worker's round to remove the schedule no worker declares",
    )
    assert declared() == {"e2e.tick", "e2e.tock"}
    assert declared_at("e2e.tock") > started_b  # team B's worker declared it again
    team_a.stop()
    team_b.stop()
    assert declared() == {"e2e.tick", "e2e.tock"}
