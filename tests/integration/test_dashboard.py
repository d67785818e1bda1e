"""The dashboard through Flask's test client against a real database: login and logout, CSRF
on every POST, roles, every page and every action, and the dashboard's own queries
(`delaysvc.store.dashboard`: samples, charts, keyset search, dead-letter groups, timeouts)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from delaysvc import auth, delivery, history, store
from delaysvc.consumption import Consumer, handler
from delaysvc.producer import Producer
from delaysvc.settings import Settings
from delaysvc.sql import qualify
from delaysvc.store import dashboard as dash
from delaysvc.store import history as store_history
from delaysvc.tasks.app import STATS_SECONDS
from delaysvc.web import create_app

ADMIN = ("ada", "admin-password-1")
VIEWER = ("vic", "viewer-password-1")


@pytest.fixture
def settings(settings: Settings, tmp_path: Path) -> Settings:
    """The shared settings, with var/ (where the session key is kept) in a temporary folder."""
    return settings.model_copy(update={"var_dir": tmp_path / "var"})


@pytest.fixture
def app(settings: Settings, engine: Engine) -> Iterator[Flask]:
    auth.create_user(engine, *ADMIN, role="admin")
    auth.create_user(engine, *VIEWER, role="viewer")
    app = create_app(settings)
    yield app
    app.extensions["delaysvc"]["engine"].dispose()


def login(client: FlaskClient, user: tuple[str, str], next_url: str = "") -> Any:
    page = client.get("/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert token is not None
    form = {"name": user[0], "password": user[1], "csrf_token": token.group(1), "next": next_url}
    return client.post("/login", data=form)


def csrf(client: FlaskClient) -> str:
    with client.session_transaction() as session:
        return str(session["csrf"])


@pytest.fixture
def admin(app: Flask) -> FlaskClient:
    client = app.test_client()
    assert login(client, ADMIN).status_code == 302
    return client


@pytest.fixture
def viewer(app: Flask) -> FlaskClient:
    client = app.test_client()
    assert login(client, VIEWER).status_code == 302
    return client


def flashes(client: FlaskClient, response: Any) -> list[str]:
    """Follow the redirect of an action and read the notes it left."""
    assert response.status_code == 302, response.text
    page = client.get(response.location)
    block = re.search(r'<ul class="flash" id="flash">(.*?)</ul>', page.text, re.S)
    return re.findall(r"<li>(.*?)</li>", block.group(1)) if block else []


def make_dead(
    settings: Settings, engine: Engine, producer: Producer, bodies: list[dict]
) -> list[int]:
    """Send each body to its topic and let its handler fail once (max_retries=0): dead."""
    ids = []
    for body in bodies:
        ids.append(producer.send(body["topic"], body).id)
    for topic in sorted({b["topic"] for b in bodies}):
        Consumer(settings, engine).run_once(topic)
    return ids


@handler("dash.fails", max_retries=0)
def _fails(message: Any) -> None:
    raise ValueError(message.body["error"])


@handler("dash.other", max_retries=0)
def _other(message: Any) -> None:
    raise KeyError(message.body["error"])


# ---------------------------------------------------------------- login, logout, session


PAGES = ["/", "/topics", "/messages", "/messages/1", "/dead", "/schedules", "/history"]
JSON_ENDPOINTS = [
    "/ui/overview.json",
    "/ui/topics.json",
    "/ui/messages/1.json",
    "/ui/history.json",
]


def test_every_page_redirects_to_login_and_json_answers_401_without_a_session(app: Flask) -> None:
    client = app.test_client()
    for path in PAGES:
        response = client.get(path)
        assert (response.status_code, response.location) == (302, f"/login?next={path}"), path
    for path in JSON_ENDPOINTS:
        response = client.get(path)
        assert response.status_code == 401, path
        assert response.get_json()["error"]["code"] == "unauthorized"
    assert client.get("/healthz").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_login_goes_to_next_and_sets_a_hardened_session_cookie(app: Flask) -> None:
    client = app.test_client()
    response = login(client, ADMIN, "/topics")
    assert (response.status_code, response.location) == (302, "/topics")
    cookie = response.headers["Set-Cookie"]
    assert cookie.startswith("delaysvc_session=")
    assert "; HttpOnly" in cookie and "; SameSite=Lax" in cookie and "Secure" not in cookie
    page = client.get("/topics")
    assert page.status_code == 200
    assert '<span id="user">ada (admin)</span>' in page.text
    assert page.headers["Cache-Control"] == "no-store"
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]


def test_secure_cookies_setting_marks_the_cookie_secure(settings: Settings, engine: Engine) -> None:
    auth.create_user(engine, *ADMIN, role="admin")
    app = create_app(settings.model_copy(update={"secure_cookies": True}))
    response = login(app.test_client(), ADMIN)
    assert "; Secure" in response.headers["Set-Cookie"]
    app.extensions["delaysvc"]["engine"].dispose()


def test_every_web_worker_of_a_folder_signs_sessions_with_one_key(
    app: Flask, settings: Settings
) -> None:
    """gunicorn runs several workers, each with its own create_app(): a login served by one
    must be accepted by the others."""
    other = create_app(settings)
    key_file = settings.var_dir / "secret_key"
    assert app.config["SECRET_KEY"] == other.config["SECRET_KEY"] == key_file.read_text()
    assert len(key_file.read_text()) == 64 and key_file.stat().st_mode & 0o777 == 0o600
    client = app.test_client()
    login(client, ADMIN)
    cookie = client.get_cookie("delaysvc_session")
    assert cookie is not None
    elsewhere = other.test_client()
    elsewhere.set_cookie("delaysvc_session", cookie.value)
    assert elsewhere.get("/").status_code == 200
    given = create_app(settings.model_copy(update={"secret_key": "from-the-environment"}))
    assert given.config["SECRET_KEY"] == "from-the-environment"
    for each in (other, given):
        each.extensions["delaysvc"]["engine"].dispose()


def test_login_never_redirects_off_site(app: Flask) -> None:
    for target in ("https://evil.example/", "//evil.example/x", "javascript:alert(1)"):
        response = login(app.test_client(), ADMIN, target)
        assert (response.status_code, response.location) == (302, "/"), target


def test_wrong_password_is_refused_and_repeated_failures_lock_the_account(app: Flask) -> None:
    client = app.test_client()
    response = login(client, (ADMIN[0], "wrong-password"))
    assert response.status_code == 401
    assert "wrong name or password" in response.text
    assert client.get("/").status_code == 302
    assert login(client, ("nobody", "whatever-pass")).status_code == 401
    for _ in range(4):
        assert login(client, (ADMIN[0], "wrong-password")).status_code == 401
    # five failures in a row: locked, even with the right password
    assert login(client, ADMIN).status_code == 401


def test_every_login_attempt_costs_one_scrypt_whether_the_name_exists_or_is_locked(
    app: Flask, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No timing oracle: an unknown name, a wrong password and a locked account cost the same
    password hash (one scrypt, same parameters) as a successful login, so the time a login
    takes does not tell which names exist or are locked."""
    import hashlib

    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE dashboard_user SET locked_until = now() + interval '5 minutes' "
                "WHERE name = :name"
            ),
            {"name": VIEWER[0]},
        )
    real_scrypt = hashlib.scrypt
    calls: list[tuple[int, int, int]] = []

    def counted_scrypt(*args: Any, **kwargs: Any) -> bytes:
        calls.append((kwargs["n"], kwargs["r"], kwargs["p"]))
        return real_scrypt(*args, **kwargs)

    monkeypatch.setattr(hashlib, "scrypt", counted_scrypt)
    attempts = {
        "right password": (ADMIN, 302),
        "wrong password": ((ADMIN[0], "wrong-password"), 401),
        "unknown name": (("nobody", "whatever-pass"), 401),
        "locked account, right password": (VIEWER, 401),
    }
    costs = {}
    for case, (user, status) in attempts.items():
        calls.clear()
        assert login(app.test_client(), user).status_code == status, case
        costs[case] = list(calls)
    assert len(costs["right password"]) == 1
    assert costs == {case: costs["right password"] for case in attempts}


def test_login_without_the_csrf_token_is_refused(app: Flask) -> None:
    client = app.test_client()
    client.get("/login")
    response = client.post("/login", data={"name": ADMIN[0], "password": ADMIN[1]})
    assert response.status_code == 400
    assert "the form has expired" in response.text
    assert client.get("/").status_code == 302


def test_logout_needs_the_token_and_ends_the_session(admin: FlaskClient) -> None:
    assert admin.post("/logout").status_code == 400
    assert admin.get("/").status_code == 200
    response = admin.post("/logout", data={"csrf_token": csrf(admin)})
    assert (response.status_code, response.location) == (302, "/login")
    assert admin.get("/").status_code == 302
    assert admin.get("/ui/overview.json").status_code == 401


def test_csrf_token_changes_at_login(app: Flask) -> None:
    client = app.test_client()
    client.get("/login")
    before = csrf(client)
    login(client, ADMIN)
    assert csrf(client) != before


# ---------------------------------------------------------------- CSRF and roles on actions


def _actions(message_id: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"/messages/{message_id}/cancel", {}),
        ("/topics/dash.t/pause", {}),
        ("/topics/dash.t/resume", {}),
        ("/lanes/1/skip-head", {}),
        ("/dead/redrive", {"ids": str(message_id)}),
        ("/dead/purge", {"ids": str(message_id)}),
        ("/dead/redrive", {"scope": "group", "topic": "dash.t"}),
        ("/dead/purge", {"scope": "group", "topic": "dash.t"}),
        ("/schedules/dash.nightly/pause", {}),
        ("/schedules/dash.nightly/resume", {}),
        ("/topics/limits", {"topic": "dash.t", "max_running": "2"}),
    ]


def test_every_post_without_a_valid_csrf_token_is_refused(
    admin: FlaskClient, producer: Producer, engine: Engine
) -> None:
    sent = producer.send("dash.t", {"n": 1}, delay_level=1)
    for path, form in _actions(sent.id):
        assert admin.post(path, data=form).status_code == 400, path
        bad = admin.post(path, data={**form, "csrf_token": "forged"})
        assert bad.status_code == 400, path
        assert "the form has expired" in bad.text
    assert producer.get(sent.id).status == "scheduled"
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM topic_state")).scalar_one() == 0


def test_viewer_sees_no_action_buttons_and_every_action_is_403(
    viewer: FlaskClient, producer: Producer, engine: Engine, settings: Settings
) -> None:
    sent = producer.send("dash.t", {"n": 1}, delay_level=1)
    [dead_id] = make_dead(settings, engine, producer, [{"topic": "dash.fails", "error": "x"}])
    with engine.begin() as conn:
        store.mark_stuck(conn, 1, 1, "boom")
    pages = "".join(
        viewer.get(p).text
        for p in ("/", "/topics", f"/messages/{sent.id}", f"/messages/{dead_id}", "/dead")
    )
    for button in ("Skip head", "Pause", "Resume", "Cancel this message", "Redrive", "Purge"):
        assert button not in pages
    assert "STUCK" in pages
    token = csrf(viewer)
    for path, form in _actions(sent.id):
        response = viewer.post(path, data={**form, "csrf_token": token})
        assert response.status_code == 403, path
        assert "this action needs the admin role" in response.text
    assert producer.get(sent.id).status == "scheduled"
    assert producer.get(dead_id).status == "dead"


def test_a_role_change_takes_effect_on_the_next_request(
    admin: FlaskClient, engine: Engine, producer: Producer
) -> None:
    sent = producer.send("dash.t", {"n": 1}, delay_level=3)
    auth.create_user(engine, ADMIN[0], ADMIN[1], role="viewer")
    response = admin.post(f"/messages/{sent.id}/cancel", data={"csrf_token": csrf(admin)})
    assert response.status_code == 403
    assert producer.get(sent.id).status == "scheduled"


# ---------------------------------------------------------------- overview


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
    dash.sample_stats(engine, at=t0 + timedelta(seconds=2))
    lanes = {row["key"]: row for row in admin.get("/ui/overview.json").get_json()["lanes"]}
    assert list(lanes) == ["level-1", "level-2", "level-3", "level-4", "level-5", "timer"]
    level2, level4 = lanes["level-2"]["cells"], lanes["level-4"]["cells"]
    assert (level2["delay"], level2["pending"], level2["offset"], level2["rate"]) == (
        "2s",
        "0",
        "3 / 3",
        "1.5/s",
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
        now = store.database_now(conn)
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


# ---------------------------------------------------------------- the stats sampler


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


# ---------------------------------------------------------------- statement timeout


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


# ---------------------------------------------------------------- topics


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


# ---------------------------------------------------------------- messages


def _ids_on(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr data-key="(\d+)">', page)]


def _link(page: str, name: str) -> Any:
    found = re.search(rf'href="([^"]+)" id="{name}"', page)
    return found.group(1).replace("&amp;", "&") if found else None


def test_message_search_filters_and_pages_by_id(admin: FlaskClient, producer: Producer) -> None:
    ids = [
        producer.send("dash.a" if n % 2 else "dash.b", {"n": n}, key=f"k{n}", delay_level=5).id
        for n in range(7)
    ]
    page = admin.get("/messages?limit=20")
    assert _ids_on(page.text) == ids[::-1]
    first = admin.get("/messages?limit=3").text
    assert _ids_on(first) == ids[6:3:-1]
    assert _link(first, "newer") is None
    second = admin.get(_link(first, "older")).text
    assert _ids_on(second) == ids[3:0:-1]
    assert _ids_on(admin.get(_link(second, "newer")).text) == ids[6:3:-1]
    third = admin.get(_link(second, "older")).text
    assert _ids_on(third) == [ids[0]]
    assert _link(third, "older") is None
    assert _ids_on(admin.get("/messages?topic=dash.a").text) == [ids[5], ids[3], ids[1]]
    assert _ids_on(admin.get("/messages?topic=dash.b&key=k4").text) == [ids[4]]
    assert _ids_on(admin.get(f"/messages?id={ids[2]}").text) == [ids[2]]
    assert _ids_on(admin.get("/messages?status=scheduled&limit=2").text) == ids[6:4:-1]
    assert _ids_on(admin.get("/messages?status=dead").text) == []
    assert _ids_on(admin.get("/messages?from=2000-01-01T00:00&to=2000-01-02T00:00").text) == []
    assert _ids_on(admin.get("/messages?from=2000-01-01T00:00:00%2B00:00").text) == ids[::-1]
    bad = admin.get("/messages?status=lost")
    assert bad.status_code == 400 and "status: &#39;lost&#39; is not one of" in bad.text
    assert admin.get("/messages?id=abc").status_code == 400
    assert admin.get("/messages?from=yesterday").status_code == 400


def test_search_messages_keyset_cursors(engine: Engine, producer: Producer) -> None:
    ids = [producer.send("dash.a", {"n": n}, delay_level=5).id for n in range(5)]
    with engine.connect() as conn:
        page = dash.search_messages(conn, dash.MessageSearch(limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == (
            [ids[4], ids[3]],
            ids[3],
            None,
        )
        page = dash.search_messages(conn, dash.MessageSearch(before=ids[3], limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == (
            [ids[2], ids[1]],
            ids[1],
            ids[2],
        )
        page = dash.search_messages(conn, dash.MessageSearch(before=ids[1], limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == ([ids[0]], None, ids[0])
        page = dash.search_messages(conn, dash.MessageSearch(after=ids[0], limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == (
            [ids[2], ids[1]],
            ids[1],
            ids[2],
        )
        page = dash.search_messages(conn, dash.MessageSearch(after=ids[2], limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == (
            [ids[4], ids[3]],
            ids[3],
            None,
        )


def _scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a plan, depth first."""
    return [plan, *(node for child in plan.get("Plans", []) for node in _scans(child))]


@pytest.mark.parametrize("finished_days", [0, 2])
def test_keyset_page_walks_the_ids_backwards(
    engine: Engine, producer: Producer, finished_days: int
) -> None:
    """The plan of a page at any depth: a LIMIT over backward scans of the ids, commit_log's
    primary key and each history day's id index (each table's page, merged in id order),
    starting at the cursor (a moved message's state probes the topic queue's); no sort (but
    of an empty history's nothing), no sequential scan and no count, so page cost does not
    grow with the tables."""
    for _ in range(2):
        producer.send_batch([{"topic": "dash.bulk", "body": {"n": n}} for n in range(10_000)])
    with engine.begin() as conn:
        for day in range(finished_days):  # finished messages, moved into two days of history
            conn.execute(
                text(
                    "UPDATE commit_log SET status = 'succeeded', finished_at = now() - "
                    "make_interval(days => :day) WHERE id % 3 = :day"
                ),
                {"day": day},
            )
            conn.execute(text("DELETE FROM topic_queue WHERE message_id % 3 = :day"), {"day": day})
    history.move_all(engine)
    with engine.begin() as conn:
        conn.execute(text("ANALYZE commit_log, message_history"))
        days = len(store_history.partitions(conn))
        assert days == finished_days
        for search in (
            dash.MessageSearch(before=15_000, limit=50),
            dash.MessageSearch(before=15_000, limit=50, topic="dash.bulk"),
            dash.MessageSearch(limit=50, status="ready"),
        ):
            sql, params = dash._search_statement(search, search.limit + 1)
            plan = conn.execute(text("EXPLAIN (FORMAT JSON) " + qualify(sql)), params).scalar_one()[
                0
            ]["Plan"]
            while plan["Node Type"] == "Subquery Scan":  # the page, then its rows' state
                plan = plan["Plans"][0]
            assert plan["Node Type"] == "Limit", search
            nodes = _scans(plan["Plans"][0])
            kinds = {node["Node Type"] for node in nodes}
            assert not kinds & {"Seq Scan", "Bitmap Heap Scan", "Aggregate"}, search
            sorted_ = [sort["Plans"][0] for sort in nodes if sort["Node Type"] == "Sort"]
            assert all(n["Node Type"] == "Result" for n in sorted_), search  # an empty history
            walks = [
                (node["Index Name"], node["Scan Direction"])
                for node in nodes
                if node["Node Type"] in ("Index Scan", "Index Only Scan")
            ]
            if search.status == "ready":  # the topic queue's ids, walked, each probing its row
                assert ("topic_queue_pkey", "Backward") in walks or (
                    "commit_log_pkey",
                    "Backward",
                ) in walks, search
                continue
            assert ("commit_log_pkey", "Backward") in walks, search
            assert len(walks) == 1 + days, search
            assert {direction for _, direction in walks} == {"Backward"}, search


@pytest.mark.parametrize("status", ["dead", "succeeded", "cancelled"])
def test_a_finished_status_is_not_sought_through_the_backlog(
    engine: Engine, producer: Producer, status: str
) -> None:
    """Finished messages are in the history (or, for seconds, among commit_log's few finished
    rows): a search by a finished status reads commit_log's finished rows only, not every
    waiting message in it. (It walked the whole backlog backwards for none: 0.5 s a page with
    5M waiting, `delaysvc bench dashboard`.)"""
    for _ in range(2):
        producer.send_batch([{"topic": "dash.bulk", "body": {}, "delay": "1h"}] * 10_000)
    finished = [m.id for m in producer.send_batch([{"topic": "dash.old", "body": {}}] * 120)]
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE commit_log SET status = :s, finished_at = now() WHERE id = ANY(:ids)"),
            {"s": status, "ids": finished[:100]},
        )
        conn.execute(
            text("DELETE FROM topic_queue WHERE message_id = ANY(:ids)"), {"ids": finished}
        )
    history.move_all(engine)  # the 100 into the history; 20 of them finish after the sweep
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE commit_log SET status = :s, finished_at = now() WHERE id = ANY(:ids)"),
            {"s": status, "ids": finished[100:]},
        )
        conn.execute(text("ANALYZE commit_log, message_history"))
        search = dash.MessageSearch(status=status, limit=50)
        sql, params = dash._search_statement(search, search.limit + 1)
        plan = conn.execute(
            text("EXPLAIN (ANALYZE, FORMAT JSON) " + qualify(sql)), params
        ).scalar_one()[0]["Plan"]
        page = dash.search_messages(conn, search)
    assert [row.id for row in page.rows] == finished[::-1][:50]
    read_in_commit_log = sum(
        node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        for node in _scans(plan)
        if node.get("Relation Name") == "commit_log"
    )
    assert read_in_commit_log <= 20


def test_message_page_shows_the_timeline_errors_and_body(
    admin: FlaskClient, producer: Producer, engine: Engine, settings: Settings
) -> None:
    [dead_id] = make_dead(
        settings, engine, producer, [{"topic": "dash.fails", "error": "no stock"}]
    )
    view = admin.get(f"/ui/messages/{dead_id}.json").get_json()
    assert view["cells"] == {
        "status": "dead",
        "attempts": "1",
        "last_error": "ValueError: no stock",
    }
    assert view["flags"] == {"cancellable": False, "dead": True}
    labels = [(e["label"], e["detail"]) for e in view["timeline"]]
    assert labels[:3] == [("stored", ""), ("due", ""), ("delivered", "moved to the topic queue")]
    assert labels[3:5] == [("attempt 1 started", ""), ("attempt 1 failed", "ValueError: no stock")]
    assert labels[5][0] == "dead" and re.fullmatch(r"handler ran \d+ ms", labels[5][1])
    assert "ValueError: no stock" in view["timeline"][4]["trace"]
    times = [e["at"] for e in view["timeline"]]
    assert times == sorted(times)
    page = admin.get(f"/messages/{dead_id}").text
    assert "<strong>attempt 1 failed</strong>" in page and "<summary>traceback</summary>" in page
    body = '{\n  "error": "no stock",\n  "topic": "dash.fails"\n}'
    assert f'<pre id="body" class="body">{body.replace(chr(34), "&#34;")}</pre>' in page
    assert 'action="/dead/redrive" data-flag="dead" >' in page
    raw = producer.send("dash.bytes", b"\x00\x01\xff", delay_level=5)
    assert "3 bytes (not JSON):\n00000000  0001 ff<" in admin.get(f"/messages/{raw.id}").text
    missing = admin.get("/messages/999999")
    assert missing.status_code == 404 and "no message with id 999999" in missing.text
    assert admin.get("/ui/messages/999999.json").status_code == 404


def test_admin_cancels_a_message_once(admin: FlaskClient, producer: Producer) -> None:
    sent = producer.send("dash.t", {"n": 1}, delay="1h", key="order-7")
    page = admin.get(f"/messages/{sent.id}").text
    assert f'action="/messages/{sent.id}/cancel" data-flag="cancellable" >' in page
    response = admin.post(f"/messages/{sent.id}/cancel", data={"csrf_token": csrf(admin)})
    assert response.location == f"/messages/{sent.id}"
    assert flashes(admin, response) == [f"message {sent.id} cancelled"]
    assert producer.get(sent.id).status == "cancelled"
    labels = [e["label"] for e in admin.get(f"/ui/messages/{sent.id}.json").get_json()["timeline"]]
    assert labels == ["stored", "cancelled", "due"]
    again = admin.post(f"/messages/{sent.id}/cancel", data={"csrf_token": csrf(admin)})
    assert flashes(admin, again) == [
        f"not cancelled: message {sent.id} is cancelled; it cannot be cancelled"
    ]


# ---------------------------------------------------------------- dead letters


@pytest.fixture
def dead_ids(settings: Settings, engine: Engine, producer: Producer) -> list[int]:
    return make_dead(
        settings,
        engine,
        producer,
        [
            {"topic": "dash.fails", "error": "no stock"},
            {"topic": "dash.fails", "error": "no stock"},
            {"topic": "dash.fails", "error": "no stock"},
            {"topic": "dash.fails", "error": "timeout"},
            {"topic": "dash.fails", "error": "timeout"},
            {"topic": "dash.other", "error": "sku"},
        ],
    )


def _groups(client: FlaskClient, query: str = "") -> list[tuple[str, str, int]]:
    page = client.get("/dead" + query).text
    body = page.split('<table id="dead-groups">')[1].split("</table>")[0]
    return [
        (topic, error.replace("&#39;", "'"), int(n))
        for topic, error, n in re.findall(
            r'<tr data-topic="([^"]*)" data-error="([^"]*)".*?<td class="num">(\d+)</td>',
            body,
            re.S,
        )
    ]


def test_dead_letters_are_grouped_by_topic_and_error(
    admin: FlaskClient, dead_ids: list[int]
) -> None:
    assert _groups(admin) == [
        ("dash.fails", "ValueError: no stock", 3),
        ("dash.fails", "ValueError: timeout", 2),
        ("dash.other", "KeyError: 'sku'", 1),
    ]
    assert _groups(admin, "?topic=dash.other") == [("dash.other", "KeyError: 'sku'", 1)]
    page = admin.get("/dead?topic=dash.fails&error=ValueError:+timeout").text
    letters = page.split('<table id="dead-letters">')[1]
    assert _ids_on(letters) == [dead_ids[4], dead_ids[3]]
    assert "Letters of this group" in page


def test_dead_letters_page_steps_back_by_id(
    admin: FlaskClient, dead_ids: list[int], engine: Engine
) -> None:
    with engine.connect() as conn:
        rows, older = dash.dead_letters_page(conn, "dash.fails", limit=2)
        assert ([r.message_id for r in rows], older) == ([dead_ids[4], dead_ids[3]], dead_ids[3])
        rows, older = dash.dead_letters_page(conn, "dash.fails", before=older, limit=2)
        assert ([r.message_id for r in rows], older) == ([dead_ids[2], dead_ids[1]], dead_ids[1])
        rows, older = dash.dead_letters_page(conn, "dash.fails", before=older, limit=2)
        assert ([r.message_id for r in rows], older) == ([dead_ids[0]], None)


def test_redrive_and_purge_one_and_a_selection(
    admin: FlaskClient, dead_ids: list[int], producer: Producer
) -> None:
    token = csrf(admin)
    response = admin.post("/dead/redrive", data={"csrf_token": token, "ids": str(dead_ids[0])})
    assert flashes(admin, response) == [f"1 redriven ({dead_ids[0]})"]
    assert producer.get(dead_ids[0]).status == "ready"
    response = admin.post(
        "/dead/redrive", data={"csrf_token": token, "ids": [str(dead_ids[1]), str(dead_ids[0])]}
    )
    assert flashes(admin, response) == [
        f"1 redriven ({dead_ids[1]}); not redriven: message {dead_ids[0]} is not a dead letter"
    ]
    response = admin.post(
        "/dead/purge",
        data={
            "csrf_token": token,
            "ids": [str(dead_ids[2]), str(dead_ids[3])],
            "topic": "dash.fails",
        },
    )
    assert response.location == "/dead?topic=dash.fails"
    assert flashes(admin, response) == ["2 purged"]
    assert _groups(admin) == [
        ("dash.fails", "ValueError: timeout", 1),
        ("dash.other", "KeyError: 'sku'", 1),
    ]
    response = admin.post("/dead/purge", data={"csrf_token": token})
    assert flashes(admin, response) == ["nothing selected"]


def test_redrive_and_purge_all_matching_a_group(
    admin: FlaskClient, dead_ids: list[int], producer: Producer
) -> None:
    token = csrf(admin)
    group = {"csrf_token": token, "scope": "group", "topic": "dash.fails"}
    response = admin.post("/dead/redrive", data={**group, "error": "ValueError: no stock"})
    assert flashes(admin, response) == ["3 redriven"]
    assert [producer.get(i).status for i in dead_ids] == ["ready"] * 3 + ["dead"] * 3
    response = admin.post("/dead/purge", data={**group, "error": "ValueError: timeout"})
    assert flashes(admin, response) == ["2 purged"]
    assert _groups(admin) == [("dash.other", "KeyError: 'sku'", 1)]
    assert [producer.get(i).status for i in dead_ids[3:5]] == ["dead", "dead"]  # history kept


def test_dead_ids_in_group_matches_the_error_exactly(engine: Engine, dead_ids: list[int]) -> None:
    with engine.connect() as conn:
        assert (
            dash.dead_ids_in_group(conn, "dash.fails", "ValueError: no stock", 10) == dead_ids[:3]
        )
        assert dash.dead_ids_in_group(conn, "dash.fails", "ValueError: no", 10) == []
        assert dash.dead_ids_in_group(conn, None, None, 10, after=dead_ids[3]) == dead_ids[4:]
        assert dash.dead_ids_in_group(conn, "dash.fails", None, 2) == dead_ids[:2]


# ---------------------------------------------------------------- history (report_hourly)


SEED_FIELDS = ("h", "t", "l", "m", "a", "b", "c", "d", "e", "f", "g", "r", "x")


def seed_report(engine: Engine) -> datetime:
    """Report rows as `delaysvc pipeline report` writes them: two topics, two levels, three
    hours, one row outside a day's window. -> the newest hour."""
    with engine.begin() as conn:
        now = store.database_now(conn)
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
    from delaysvc.periodic_schedules import Schedules, fire_due, schedule

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

    notes = flashes(
        admin, admin.post("/schedules/dash.nightly/pause", data={"csrf_token": csrf(admin)})
    )
    assert notes == ["dash.nightly paused"]
    nightly = re.search(r'<tr data-name="dash.nightly".*?</tr>', admin.get("/schedules").text, re.S)
    assert ">Resume<" in nightly.group(0) and "paused" in nightly.group(0)
    resumed = admin.post("/schedules/dash.nightly/resume", data={"csrf_token": csrf(admin)})
    assert flashes(admin, resumed)[0].startswith("dash.nightly resumed: next run ")
    assert not schedules.get("dash.nightly").paused
    missing = admin.post("/schedules/nope/pause", data={"csrf_token": csrf(admin)})
    assert flashes(admin, missing) == ["not changed: no periodic schedule is named &#39;nope&#39;"]
    assert ">Pause<" not in viewer.get("/schedules").text  # a viewer sees no buttons


def test_topics_page_sets_and_shows_limits(
    admin: FlaskClient, viewer: FlaskClient, engine: Engine
) -> None:
    from delaysvc import limits

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
    from delaysvc import caps
    from delaysvc.errors import BacklogFull

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
