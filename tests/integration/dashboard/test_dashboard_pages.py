"""The dashboard's pages through Flask's test client against a real database: the overview and its
charts, the stats sampler, statement timeouts, topics (pause, limits, caps), schedules, the
history, a message's page."""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime, timedelta

import pytest
from flask.testing import FlaskClient
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from delaysvc import auth, store
from delaysvc.config.settings import Settings
from delaysvc.maintenance import delivery
from delaysvc.producer.sending import Producer
from delaysvc.store import dashboard as dash
from delaysvc.tasks.app import STATS_SECONDS
from delaysvc.web import create_app
from delaysvc.web.ui_format import when
from tests.support.dashboard import ADMIN, csrf, flashes, login, make_dead


def test_overview_lanes_show_pending_offsets_next_due_and_moved_per_second(
    admin: FlaskClient, producer: Producer, engine: Engine, settings: Settings
) -> None:
    for n in range(3):
        producer.send("dash.t", {"n": n}, delay_level=2)
    producer.send("dash.t", {"n": 9}, delay_level=4)
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    dash.sample_stats(engine, at=t0)
    with engine.connect() as conn:  # deliver level 2 as if 10 s had passed
        moved = delivery.run_once(conn, 2, 100, now=datetime.now(UTC) + timedelta(seconds=10))
    assert moved.moved == 3
    dash.sample_stats(engine, at=t0 + timedelta(seconds=STATS_SECONDS))
    lanes = {row["key"]: row for row in admin.get("/ui/overview.json").get_json()["lanes"]}
    assert list(lanes) == ["level-1", "level-2", "level-3", "level-4", "level-5", "timer"]
    level2, level4 = lanes["level-2"]["cells"], lanes["level-4"]["cells"]
    assert (level2["delay"], level2["pending"], level2["offset"], level2["rate"]) == (
        "2s",
        "0",
        "3 / 3",
        "0.3/s",
    )
    assert (level2["next_due"], level2["lateness"], level2["state"]) == ("-", "-", "ok")
    assert (level4["delay"], level4["pending"], level4["offset"], level4["rate"]) == (
        "5s",
        "1",
        "0 / 1",
        "0.0/s",
    )
    assert re.fullmatch(r"in [45]\.\d s", level4["next_due"])
    assert lanes["timer"]["cells"]["delay"] == "any"
    page = admin.get("/").text
    assert '<tr data-key="level-4">' in page
    assert '<td class="num" data-field="pending">1</td>' in page


def test_overview_shows_a_due_head_as_late(
    admin: FlaskClient, producer: Producer, engine: Engine
) -> None:
    producer.send("dash.t", {}, delay_level=1)
    with engine.begin() as conn:
        conn.execute(text("UPDATE consume_queue SET deliver_ts = now() - interval '90 seconds'"))
    cells = admin.get("/ui/overview.json").get_json()["lanes"][0]["cells"]
    assert re.fullmatch(r"1 min 3\d s", cells["lateness"])
    assert re.fullmatch(r"1 min 3\d s ago", cells["next_due"])


def test_stuck_level_is_shown_and_admin_skips_its_head_to_the_dead_letters(
    admin: FlaskClient, producer: Producer, engine: Engine
) -> None:
    first = producer.send("dash.t", {"n": 1}, delay_level=1)
    second = producer.send("dash.t", {"n": 2}, delay_level=1)
    with engine.begin() as conn:
        store.mark_stuck(conn, 1, 1, "DataError: value too long")
    row = admin.get("/ui/overview.json").get_json()["lanes"][0]
    assert (row["cells"]["state"], row["cells"]["stuck_error"], row["flags"]) == (
        "STUCK",
        "DataError: value too long",
        {"stuck": True},
    )
    assert row["cells"]["stuck_since"].startswith("since 20")
    page = admin.get("/").text
    assert '<tr data-key="level-1" class="stuck">' in page
    assert 'action="/lanes/1/skip-head" data-flag="stuck">' in page  # shown (not hidden)
    assert 'action="/lanes/2/skip-head" data-flag="stuck" hidden>' in page
    response = admin.post("/lanes/1/skip-head", data={"csrf_token": csrf(admin)})
    assert flashes(admin, response) == [
        f"message {first.id} moved from level 1 to the dead letters"
    ]
    assert producer.get(first.id).status == "dead"
    assert producer.get(second.id).status == "scheduled"
    row = admin.get("/ui/overview.json").get_json()["lanes"][0]
    assert (row["cells"]["state"], row["cells"]["pending"]) == ("ok", "1")
    response = admin.post("/lanes/3/skip-head", data={"csrf_token": csrf(admin)})
    assert flashes(admin, response) == [
        "not skipped: level 3 is not stuck: its head moves; nothing to skip"
    ]


def test_backlog_chart_and_lateness_distribution_come_from_the_history_tables(
    admin: FlaskClient, engine: Engine
) -> None:
    with engine.begin() as conn:
        now = store.clock_now(conn)
        conn.execute(
            text(
                "INSERT INTO stats_sample (sampled_at, lane, pending, moved_total, early_total) "
                "VALUES (:old, 1, 99, 0, 0), (:a, 1, 10, 0, 0), (:b, 1, 25, 5, 0), (:b, 2, 7, 0, 0)"
            ),
            {
                "old": now - timedelta(hours=2),
                "a": now - timedelta(minutes=30),
                "b": now - timedelta(minutes=1),
            },
        )
        conn.execute(
            text(
                "INSERT INTO lateness_histogram (minute, lane, counts, max_ms) VALUES "
                "(:m1, 1, :c1, 7.5), (:m2, 2, :c2, 1800), (:old, 1, :c3, 99999)"
            ),
            {
                "m1": now - timedelta(minutes=5),
                "m2": now - timedelta(minutes=2),
                "old": now - timedelta(hours=3),
                "c1": [90, 5, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                "c2": [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0],
                "c3": [0] * 14 + [1000],
            },
        )
    data = admin.get("/ui/overview.json").get_json()
    series = {s["key"]: s for s in data["backlog"]["series"]}
    assert list(series) == ["level-1", "level-2"]
    assert [p[1] for p in series["level-1"]["points"]] == [10, 25]
    assert [round(p[0] / 60) for p in series["level-1"]["points"]] == [-30, -1]
    assert (series["level-1"]["last"], series["level-2"]["last"]) == (25, 7)
    assert data["backlog"]["window_s"] == 3600
    # a line breaks where two of beat's stats samples in a row are missing, not before
    assert data["backlog"]["gap_s"] == 3 * STATS_SECONDS
    lateness = data["lateness"]
    assert lateness["counts"] == [90, 5, 0, 4, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert lateness["labels"][:3] == ["1ms", "2ms", "5ms"]
    assert lateness["labels"][-3:] == ["10s", "1m", ">1m"]
    assert lateness["summary"] == "100 deliveries; p50 ≤ 1 ms, p99 ≤ 10 ms, max 1800 ms"


def test_overview_without_history_says_so(admin: FlaskClient) -> None:
    data = admin.get("/ui/overview.json").get_json()
    assert data["backlog"]["series"] == []
    assert data["lateness"]["summary"] == "no deliveries in the last hour"
    assert data["lateness"]["counts"] == [0] * 15


def test_sample_stats_records_every_lane_and_prunes_samples_older_than_two_days(
    engine: Engine, producer: Producer
) -> None:
    producer.send("dash.t", {}, delay_level=3)
    producer.send("dash.t", {}, delay_level=3)
    with engine.begin() as conn:
        conn.execute(text("UPDATE consume_queue SET deliver_ts = now() - interval '2 seconds'"))
    t = datetime(2030, 1, 3, tzinfo=UTC)
    old = dash.sample_stats(engine, at=t - timedelta(days=2, seconds=1))
    kept = dash.sample_stats(engine, at=t - timedelta(days=1))
    assert (old.lanes, old.pruned, kept.pruned) == (6, 0, 0)
    result = dash.sample_stats(engine, at=t)
    assert (result.sampled_at, result.lanes, result.pruned) == (t, 6, 6)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT sampled_at, lane, pending, head_lateness_ms FROM stats_sample "
                "WHERE sampled_at = :t ORDER BY lane"
            ),
            {"t": t},
        ).all()
        times = conn.execute(
            text("SELECT DISTINCT sampled_at FROM stats_sample ORDER BY 1")
        ).scalars()
        assert list(times) == [t - timedelta(days=1), t]
    assert [(r.lane, r.pending) for r in rows] == [(0, 0), (1, 0), (2, 0), (3, 2), (4, 0), (5, 0)]
    assert rows[3].head_lateness_ms is not None and 2000 <= rows[3].head_lateness_ms < 10_000
    assert rows[1].head_lateness_ms is None


def test_sample_stats_task_is_a_registered_celery_task() -> None:
    from delaysvc.tasks.stats import sample_stats

    assert sample_stats.name == "delaysvc.sample_stats"


def test_lane_rates_need_two_samples_and_never_go_negative(engine: Engine) -> None:
    t = datetime(2030, 1, 1, tzinfo=UTC)
    with engine.begin() as conn:
        assert dash.lane_rates(conn) == {}
        conn.execute(
            text(
                "INSERT INTO stats_sample (sampled_at, lane, pending, moved_total, early_total) "
                "VALUES (:a, 1, 0, 100, 0), (:b, 1, 0, 140, 0), (:c, 1, 0, 150, 0), "
                "(:b, 2, 0, 50, 0), (:c, 2, 0, 10, 0)"
            ),
            {"a": t, "b": t + timedelta(seconds=10), "c": t + timedelta(seconds=15)},
        )
        assert dash.lane_rates(conn) == {1: 2.0, 2: 0.0}


def test_lane_rates_are_not_shown_from_samples_older_than_the_apis(engine: Engine) -> None:
    """Beat's sampler stopped two hours ago: the overview showed the rate of then, where the
    API's levels say none (they read samples of the last 5 minutes)."""
    t = datetime.now(UTC) - timedelta(hours=2)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO stats_sample (sampled_at, lane, pending, moved_total, early_total) "
                "VALUES (:a, 1, 0, 100, 0), (:b, 1, 0, 600, 0)"
            ),
            {"a": t, "b": t + timedelta(seconds=1)},
        )
        assert dash.lane_rates(conn) == {}


def test_bounded_sets_the_statement_timeout_for_its_transaction(engine: Engine) -> None:
    with dash.bounded(engine, 1234) as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar_one() == "1234ms"
        assert conn.execute(text("SHOW jit")).scalar_one() == "off"
    with (
        pytest.raises(OperationalError, match="statement timeout"),
        dash.bounded(engine, 50) as conn,
    ):
        conn.execute(text("SELECT pg_sleep(2)"))
    with engine.connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar_one() == "0"


def test_a_page_whose_query_times_out_says_so(settings: Settings, engine: Engine) -> None:
    auth.create_user(engine, *ADMIN, role="admin")
    app = create_app(settings.model_copy(update={"statement_timeout_ms": 200}))
    client = app.test_client()
    login(client, ADMIN)
    locked, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with engine.begin() as conn:
            conn.execute(text("LOCK TABLE stats_sample IN ACCESS EXCLUSIVE MODE"))
            locked.set()
            release.wait(10)

    holder = threading.Thread(target=hold_lock)
    holder.start()
    try:
        assert locked.wait(10)
        page = client.get("/")
        assert page.status_code == 503
        assert "the query took too long; narrow the search and try again" in page.text
        response = client.get("/ui/overview.json")
        assert (response.status_code, response.get_json()["error"]["code"]) == (503, "timeout")
    finally:
        release.set()
        holder.join()
    assert client.get("/").status_code == 200
    app.extensions["delaysvc"]["engine"].dispose()


def test_topics_show_ready_running_dead_and_admin_pauses_and_resumes(
    admin: FlaskClient, producer: Producer, engine: Engine, settings: Settings
) -> None:
    producer.send("dash.ready", {"n": 1})
    producer.send("dash.ready", {"n": 2})
    make_dead(settings, engine, producer, [{"topic": "dash.fails", "error": "e"}])
    rows = {r["key"]: r for r in admin.get("/ui/topics.json").get_json()["topics"]}
    assert {
        k: (r["cells"]["ready"], r["cells"]["running"], r["cells"]["dead"]) for k, r in rows.items()
    } == {
        "dash.fails": ("0", "0", "1"),
        "dash.ready": ("2", "0", "0"),
    }
    assert rows["dash.ready"]["flags"] == {"paused": False, "active": True}
    response = admin.post("/topics/dash.ready/pause", data={"csrf_token": csrf(admin)})
    assert flashes(admin, response) == ["dash.ready paused: workers take no new jobs of it"]
    row = {r["key"]: r for r in admin.get("/ui/topics.json").get_json()["topics"]}["dash.ready"]
    assert (row["cells"]["state"], row["flags"]) == ("paused", {"paused": True, "active": False})
    page = admin.get("/topics").text
    assert 'action="/topics/dash.ready/resume" data-flag="paused">' in page
    assert 'action="/topics/dash.ready/pause" data-flag="active" hidden>' in page
    response = admin.post("/topics/dash.ready/resume", data={"csrf_token": csrf(admin)})
    assert flashes(admin, response) == ["dash.ready resumed"]
    with engine.connect() as conn:
        assert (
            conn.execute(
                text("SELECT paused FROM topic_state WHERE topic = 'dash.ready'")
            ).scalar_one()
            is False
        )
    bad = admin.post("/topics/bad topic!/pause", data={"csrf_token": csrf(admin)})
    assert bad.status_code == 400


SEED_FIELDS = ("h", "t", "l", "m", "a", "b", "c", "d", "e", "f", "g", "r", "x")


def seed_report(engine: Engine) -> datetime:
    """Report rows as `delaysvc pipeline report` writes them: two topics, two levels, three
    hours, one row outside a day's window. -> the newest hour."""
    with engine.begin() as conn:
        now = store.clock_now(conn)
        hour = now.replace(minute=0, second=0, microsecond=0)
        rows = [
            # hour, topic, level, messages, lateness p50/p95/p99/max, duration p50/p95/p99,
            # retried, dead
            (hour - timedelta(hours=2), "shop.email", 1, 100, 2, 5, 9, 12, 30, 50, 80, 4, 1),
            (hour - timedelta(hours=2), "shop.email", 3, 50, 3, 8, 40, 45, 20, 40, 60, 0, 0),
            (hour - timedelta(hours=1), "shop.email", 1, 120, 2, 6, 11, 20, 31, 52, 90, 0, 0),
            (hour, "shop.sms", 2, 7, 1, 1, 2, 2, None, None, None, 7, 7),
            (hour - timedelta(days=3), "shop.sms", 2, 999, 1, 1, 1, 1, 1, 1, 1, 0, 0),
        ]
        for row in rows:
            conn.execute(
                text(
                    "INSERT INTO report_hourly (hour, topic, level, messages, lateness_p50_ms, "
                    "lateness_p95_ms, lateness_p99_ms, lateness_max_ms, duration_p50_ms, "
                    "duration_p95_ms, duration_p99_ms, retried, dead) VALUES "
                    "(:h, :t, :l, :m, :a, :b, :c, :d, :e, :f, :g, :r, :x)"
                ),
                dict(zip(SEED_FIELDS, row, strict=True)),
            )
    return hour


def test_history_charts_and_rows_come_from_report_hourly(
    admin: FlaskClient, engine: Engine
) -> None:
    hour = seed_report(engine)
    data = admin.get("/ui/history.json?days=1").get_json()
    messages = {s["key"]: [p[1] for p in s["points"]] for s in data["messages"]["series"]}
    assert messages == {"shop.email": [150, 120], "shop.sms": [7]}  # levels summed per hour
    lateness = {s["key"]: [p[1] for p in s["points"]] for s in data["lateness"]["series"]}
    assert lateness == {"shop.email": [40, 11], "shop.sms": [2]}  # the worst level's p99
    duration = {s["key"]: s["last"] for s in data["duration"]["series"]}
    assert duration == {"shop.email": "90 ms"}  # shop.sms ran no handler
    assert data["messages"]["window_s"] == 86_400
    assert data["messages"]["gap_s"] == 1.5 * 3600  # an hour without a report row: a gap
    assert [t[1] for t in data["messages"]["ticks"]] == ["-24 h", "-18 h", "-12 h", "-6 h", "now"]
    assert [r["cells"]["hour"][-5:] for r in data["rows"]] == [
        hour.strftime("%H:00"),
        (hour - timedelta(hours=1)).strftime("%H:00"),
        (hour - timedelta(hours=2)).strftime("%H:00"),
        (hour - timedelta(hours=2)).strftime("%H:00"),
    ]
    newest = data["rows"][0]["cells"]
    assert (newest["topic"], newest["level"], newest["messages"]) == ("shop.sms", "2", "7")
    assert (newest["retried"], newest["dead"], newest["run_p50"]) == ("100.0%", "100.0%", "-")
    oldest = data["rows"][-1]["cells"]
    assert (oldest["late_p99"], oldest["run_p99"], oldest["retried"]) == ("9 ms", "80 ms", "4.0%")

    week = admin.get("/ui/history.json?days=7&topic=shop.sms").get_json()
    assert {s["key"]: [p[1] for p in s["points"]] for s in week["messages"]["series"]} == {
        "shop.sms": [999, 7]
    }
    page = admin.get("/history?days=7")
    assert page.status_code == 200
    assert page.text.count('<tr data-key="') == 5 + 1  # the rows and the row template


def test_history_without_a_report_says_how_to_make_one(admin: FlaskClient) -> None:
    data = admin.get("/ui/history.json").get_json()
    assert data["rows"] == [] and data["messages"]["series"] == []
    assert data["messages"]["empty"] == "no report yet: run `delaysvc pipeline report`"


@pytest.mark.parametrize(
    ("query", "field", "allowed"),
    [
        ("days=2", "days", "1, 7, 30, 90"),
        ("days=x", "days", "1, 7, 30, 90"),
        ("topic=a%20b", "topic", ""),
    ],
)
def test_history_refuses_bad_arguments_naming_them(
    admin: FlaskClient, query: str, field: str, allowed: str
) -> None:
    response = admin.get("/ui/history.json?" + query)
    assert response.status_code == 400
    assert field in response.text and allowed in response.text


def test_schedules_page_shows_next_and_last_runs_and_pauses_and_resumes(
    admin: FlaskClient, viewer: FlaskClient, engine: Engine
) -> None:
    from delaysvc.maintenance.periodic import Schedules, fire_due, schedule

    assert "No periodic schedule yet" in admin.get("/schedules").text
    schedules = Schedules(engine)
    schedules.put(schedule("dash.every", "1s", topic="dash.t"))
    schedules.put(schedule("dash.nightly", "30 2 * * *", topic="dash.t", timezone="Europe/Berlin"))
    with engine.connect() as conn:
        due = conn.execute(
            text("SELECT next_tick FROM periodic_schedule WHERE name = 'dash.every'")
        )
        next_tick = due.scalar_one()
    fire_due(engine, now=next_tick)
    page = admin.get("/schedules").text
    every = re.search(r'<tr data-name="dash.every".*?</tr>', page, re.S).group(0)
    assert "every 1s" in every and "/messages/" in every  # the last run links its message
    nightly = re.search(r'<tr data-name="dash.nightly".*?</tr>', page, re.S).group(0)
    assert "30 2 * * *" in nightly and "Europe/Berlin" in nightly and ">Pause<" in nightly
    assert re.search(r'class="time last-run">-<', nightly)  # never ran
    # the times are UTC (the schedules' own zones are another column): the headers say so
    assert "<th>time zone</th>" in page
    assert "<th>next run (UTC)</th><th>last run (UTC)</th>" in page

    notes = flashes(
        admin, admin.post("/schedules/dash.nightly/pause", data={"csrf_token": csrf(admin)})
    )
    assert notes == ["dash.nightly paused"]
    nightly = re.search(r'<tr data-name="dash.nightly".*?</tr>', admin.get("/schedules").text, re.S)
    assert ">Resume<" in nightly.group(0) and "paused" in nightly.group(0)
    resumed = admin.post("/schedules/dash.nightly/resume", data={"csrf_token": csrf(admin)})
    next_run = when(schedules.get("dash.nightly").next_tick)
    assert flashes(admin, resumed) == [f"dash.nightly resumed: next run {next_run} UTC"]
    assert not schedules.get("dash.nightly").paused
    missing = admin.post("/schedules/nope/pause", data={"csrf_token": csrf(admin)})
    assert flashes(admin, missing) == ["not changed: no periodic schedule is named &#39;nope&#39;"]
    assert ">Pause<" not in viewer.get("/schedules").text  # a viewer sees no buttons


def test_a_topic_no_live_worker_handles_says_no_handler_and_the_overview_warns(
    admin: FlaskClient, producer: Producer, engine: Engine
) -> None:
    """Workers report their handlers' topics (`handler <topic>` heartbeats, every 30 s); a
    topic none has reported for 90 s is "no handler" on the Topics page, in /api/v1/topics
    and `delaysvc stats`, and its ready messages are a warning on the overview."""
    producer.send("dash.orphan", {"n": 1})
    producer.send("dash.orphan", {"n": 2})
    producer.send("dash.served", {"n": 1})

    def handlers() -> dict[str, str]:
        rows = admin.get("/ui/topics.json").get_json()["topics"]
        return {row["key"]: row["cells"]["handler"] for row in rows}

    def warnings() -> list[str]:
        return admin.get("/ui/overview.json").get_json()["warnings"]

    assert handlers() == {"dash.orphan": "no handler", "dash.served": "no handler"}
    with engine.begin() as conn:
        store.record_handlers(conn, ["dash.served", "dash.elsewhere"], "host-a")
    assert handlers() == {"dash.orphan": "no handler", "dash.served": "yes"}
    assert warnings() == [
        "2 ready messages of dash.orphan wait: no live worker has a handler for this topic"
    ]
    assert 'id="warnings" data-list="warnings">' in admin.get("/").text  # shown, not hidden
    with engine.begin() as conn:  # the worker stopped 91 s ago: its report is stale
        conn.execute(
            text(
                "UPDATE heartbeat SET seen_at = clock_timestamp() - interval '91 seconds' "
                "WHERE component = 'handler dash.served'"
            )
        )
    assert handlers()["dash.served"] == "no handler"
    assert [line.split(" of ")[1].split()[0] for line in warnings()] == [
        "dash.orphan",
        "dash.served",
    ]
    with engine.begin() as conn:
        store.record_handlers(conn, ["dash.orphan", "dash.served"], "host-b")
    assert warnings() == []
    assert 'id="warnings" data-list="warnings" hidden>' in admin.get("/").text


def test_topics_page_sets_and_shows_limits(
    admin: FlaskClient, viewer: FlaskClient, engine: Engine
) -> None:
    from delaysvc.worker import limits

    assert "No topic has limits." in admin.get("/topics").text
    form = {"topic": "dash.sms", "max_running": "3", "rate": "600/m", "csrf_token": csrf(admin)}
    notes = flashes(admin, admin.post("/topics/limits", data=form))
    assert notes == ["dash.sms: at most 3 running, 10 starts/s"]
    assert limits.all_limits(engine) == [limits.TopicLimits("dash.sms", 3, 10.0)]
    row = re.search(r'<tr data-topic="dash.sms">.*?</tr>', admin.get("/topics").text, re.S)
    assert row is not None and ">3<" in row.group(0) and ">10<" in row.group(0)
    bad = {"topic": "dash.sms", "max_running": "many", "csrf_token": csrf(admin)}
    assert "not changed: " in flashes(admin, admin.post("/topics/limits", data=bad))[0]
    lifted = {"topic": "dash.sms", "csrf_token": csrf(admin)}
    flashes(admin, admin.post("/topics/limits", data=lifted))
    assert limits.all_limits(engine) == []
    assert 'id="limits-form"' not in viewer.get("/topics").text


def test_the_message_page_shows_its_priority(admin: FlaskClient, producer: Producer) -> None:
    sent = producer.send("dash.p", {"n": 1}, priority=4)
    assert '<dd data-field="priority">4</dd>' in admin.get(f"/messages/{sent.id}").text


def test_a_replaced_message_links_the_message_that_replaced_it(
    admin: FlaskClient, producer: Producer
) -> None:
    first = producer.send("dash.kp", {"v": 1}, delay="1h", key="k")
    second = producer.send("dash.kp", {"v": 2}, delay="1h", key="k", on_duplicate="replace")
    page = admin.get(f"/messages/{first.id}").text
    assert f'<a href="/messages/{second.id}">message {second.id}</a>' in page
    assert 'id="replaced-by"' not in admin.get(f"/messages/{second.id}").text


def test_topics_page_sets_shows_and_lifts_backlog_caps(
    admin: FlaskClient, viewer: FlaskClient, engine: Engine, producer: Producer
) -> None:
    """The caps form: a cap set here binds every producer's next send (from the database),
    bad input changes nothing and says why, an empty limit lifts it, a viewer has no form."""
    from delaysvc.errors import BacklogFull
    from delaysvc.producer import caps

    assert 'id="no-caps"' in admin.get("/topics").text
    form = {"target": "topic:dash.capped", "max_waiting": "2", "policy": "reject"}
    notes = flashes(admin, admin.post("/topics/caps", data=form | {"csrf_token": csrf(admin)}))
    assert notes == ["topic:dash.capped: at most 2 waiting, reject"]
    assert [(c.scope, c.target, c.limit, c.policy) for c in caps.all_caps(engine)] == [
        ("topic", "dash.capped", 2, "reject")
    ]
    row = re.search(r'<tr data-target="topic:dash.capped">.*?</tr>', admin.get("/topics").text)
    assert row is not None and ">2<" in row.group(0) and "reject" in row.group(0)
    for n in range(2):
        producer.send("dash.capped", n, delay="1h")
    with pytest.raises(BacklogFull):
        producer.send("dash.capped", 3, delay="1h")
    for bad in ({"target": "nowhere:x", "max_waiting": "2"}, {**form, "max_waiting": "\u00b2"}):
        note = flashes(admin, admin.post("/topics/caps", data=bad | {"csrf_token": csrf(admin)}))
        assert note[0].startswith("not changed: "), note
    assert len(caps.all_caps(engine)) == 1
    lifted = {"target": "topic:dash.capped", "max_waiting": "", "csrf_token": csrf(admin)}
    assert flashes(admin, admin.post("/topics/caps", data=lifted)) == ["topic:dash.capped: no cap"]
    assert caps.all_caps(engine) == []
    assert producer.send("dash.capped", 4, delay="1h").status == "scheduled"
    assert 'id="caps-form"' not in viewer.get("/topics").text


def test_two_beats_sampling_a_moment_apart_record_one_sample_a_stats_interval(
    admin: FlaskClient, producer: Producer, engine: Engine
) -> None:
    """Two beats (each fires `delaysvc.sample_stats` every 10 s, at its own phase) would each
    record a sample: the dashboard's moved/s, taken between the two newest, then divided a
    moment's moves by a moment (0/s or thousands/s by turns)."""
    producer.send("dash.t", {"n": 1}, delay_level=2)
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    first = dash.sample_stats(engine, at=t0)
    with engine.connect() as conn:
        assert delivery.run_once(conn, 2, 100, now=datetime.now(UTC) + timedelta(seconds=10)).moved
    half = timedelta(seconds=STATS_SECONDS / 2)
    other_beat = dash.sample_stats(engine, at=t0 + half - timedelta(milliseconds=50))
    assert (first.lanes, other_beat.lanes) == (6, 0)  # the other beat's, a moment later: none
    later = dash.sample_stats(engine, at=t0 + timedelta(seconds=STATS_SECONDS))
    assert later.lanes == 6
    with engine.connect() as conn:
        times = conn.execute(text("SELECT DISTINCT sampled_at FROM stats_sample ORDER BY 1"))
        assert list(times.scalars()) == [t0, t0 + timedelta(seconds=STATS_SECONDS)]
    lanes = {row["key"]: row for row in admin.get("/ui/overview.json").get_json()["lanes"]}
    assert lanes["level-2"]["cells"]["rate"] == "0.1/s"
