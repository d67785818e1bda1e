"""The dashboard's doors, through Flask's test client against a real database: login and logout,
the session cookie, lockout, CSRF on every POST, roles."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, text

from delaysvc import auth, store
from delaysvc.config.settings import Settings
from delaysvc.producer.sending import Producer
from delaysvc.web import create_app
from tests.support.dashboard import ADMIN, VIEWER, csrf, login, make_dead

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
    key = "from-the-environment-" + "k" * 11
    given = create_app(settings.model_copy(update={"secret_key": key}))
    assert given.config["SECRET_KEY"] == key
    for each in (other, given):
        each.extensions["delaysvc"]["engine"].dispose()


def test_login_never_redirects_off_site(app: Flask) -> None:
    # a line break: urlsplit skipped it, the redirect's header refused it, a JSON 500 after the
    # login (found by a reviewer); a backslash: `/\\host` is `//host` to browsers
    targets = ("https://evil.example/", "//evil.example/x", "javascript:alert(1)")
    targets += ("/ok\r\nSet-Cookie: x=1", "/messages\n", "/\\evil.example", "/\tx")
    for target in targets:
        response = login(app.test_client(), ADMIN, target)
        assert (response.status_code, response.location) == (302, "/"), target
    assert login(app.test_client(), ADMIN, "/dead?topic=a").location == "/dead?topic=a"


def test_a_session_ends_twelve_hours_after_its_login_however_often_it_is_used(
    admin: FlaskClient,
) -> None:
    """Every answer (the overview's polls every 3 s) moved the cookie's expiry on: an open tab,
    or a copied cookie, kept the session for good (found by a reviewer)."""
    from delaysvc.web.ui import LOGGED_IN_AT

    assert admin.get("/").status_code == 200
    with admin.session_transaction() as session:
        session[LOGGED_IN_AT] -= 11.9 * 3600
    assert admin.get("/").status_code == 200
    with admin.session_transaction() as session:
        session[LOGGED_IN_AT] -= 0.2 * 3600
    response = admin.get("/")
    assert response.status_code == 302 and response.location.startswith("/login")


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


def _login_from(app: Flask, address: str, user: tuple[str, str], **environ: str) -> Any:
    client = app.test_client()
    client.environ_base.update(REMOTE_ADDR=address, **environ)
    return login(client, user)


def test_a_client_failing_many_logins_is_refused_before_any_password_is_hashed(
    app: Flask, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failures were counted per account only: one client tried name after name, each a full
    scrypt (7.4 a second, found by a reviewer). Now a client's failures, whatever names, are
    counted too; past the limit it is refused (429, Retry-After) before any hash, while other
    clients log in; a right password takes back only its own attempt."""
    import hashlib

    monkeypatch.setattr(auth, "MAX_CLIENT_FAILED_LOGINS", 4)
    attacker, other = "203.0.113.5", "198.51.100.7"
    for n in range(3):
        assert _login_from(app, attacker, (f"guess{n}", "wrong-password")).status_code == 401
    assert _login_from(app, attacker, ADMIN).status_code == 302  # not a failure: still 3
    assert _login_from(app, attacker, ("guess3", "wrong-password")).status_code == 401
    hashes: list[object] = []
    real_scrypt = hashlib.scrypt
    monkeypatch.setattr(hashlib, "scrypt", lambda *a, **k: hashes.append(1) or real_scrypt(*a, **k))
    refused = _login_from(app, attacker, ADMIN)
    assert refused.status_code == 429 and hashes == []
    assert "too many failed logins from your address" in refused.text
    assert 0 < int(refused.headers["Retry-After"]) <= auth.CLIENT_WINDOW_SECONDS
    assert _login_from(app, other, ADMIN).status_code == 302
    # an IPv6 client is its /64; an IPv4-mapped address is the IPv4 one
    assert auth.client_of("2001:db8:1:2::5") == auth.client_of("2001:db8:1:2:ffff::9")
    assert auth.client_of("2001:db8:1:2::5") != auth.client_of("2001:db8:1:3::5")
    assert auth.client_of("::ffff:203.0.113.5") == attacker
    # a port, as some proxies forward it, is no other client
    assert auth.client_of("203.0.113.5:40001") == attacker
    assert auth.client_of("[2001:db8:1:2::7]:443") == auth.client_of("2001:db8:1:2::5")
    assert _login_from(app, "::ffff:203.0.113.5", ADMIN).status_code == 429
    with engine.begin() as conn:  # the window ends
        conn.execute(text("UPDATE login_client SET window_ends = now() - interval '1 second'"))
    assert _login_from(app, attacker, ADMIN).status_code == 302
    with engine.connect() as conn:  # ended windows are pruned by the next count
        assert conn.execute(text("SELECT client, failures FROM login_client")).all() == [
            (attacker, 0)
        ]


def test_behind_proxies_a_login_counts_against_the_address_they_forwarded(
    settings: Settings,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DELAYSVC_PROXY_HOPS=1: the client is X-Forwarded-For's last entry, not the proxy (left
    at 0 behind a proxy, every client would share the proxy's count); at 0 the header is not
    believed (a client would name itself anew each attempt)."""
    monkeypatch.setattr(auth, "MAX_CLIENT_FAILED_LOGINS", 2)
    auth.create_user(engine, *ADMIN, role="admin")
    proxied = create_app(settings.model_copy(update={"proxy_hops": 1}))
    direct = create_app(settings)
    proxy = "10.0.0.2"
    try:
        for app, status in ((proxied, 302), (direct, 429)):
            with engine.begin() as conn:
                conn.execute(text("DELETE FROM login_client"))
            for n in range(3):  # each from its own forwarded address
                forwarded = {"HTTP_X_FORWARDED_FOR": f"spoofed, 192.0.2.{n}"}
                _login_from(app, proxy, ("nobody", "wrong-password"), **forwarded)
            for forwarded in ("192.0.2.9", "192.0.2.1"):
                response = _login_from(app, proxy, ADMIN, HTTP_X_FORWARDED_FOR=forwarded)
                assert response.status_code == status, (app is direct, forwarded)
    finally:
        for app in (proxied, direct):
            app.extensions["delaysvc"]["engine"].dispose()
    # the header came while DELAYSVC_PROXY_HOPS was 0: said, once
    said = [r for r in caplog.records if r.getMessage() == "dashboard.forwarded_not_believed"]
    assert len(said) == 1 and "DELAYSVC_PROXY_HOPS" in said[0].hint  # type: ignore[attr-defined]


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


def _copy_of_the_session(app: Flask, client: FlaskClient) -> FlaskClient:
    """Another browser holding a copy of `client`'s session cookie."""
    cookie = client.get_cookie("delaysvc_session")
    assert cookie is not None
    copy = app.test_client()
    copy.set_cookie("delaysvc_session", cookie.value)
    return copy


def test_logout_ends_every_copy_of_the_session_and_the_users_other_sessions(
    app: Flask, admin: FlaskClient, viewer: FlaskClient
) -> None:
    """A copied cookie (a shared machine, a stolen one) worked on after logout until its 12
    hours ended; now logout ends it, and the user's sessions in other browsers, not another
    user's."""
    copy = _copy_of_the_session(app, admin)
    elsewhere = app.test_client()
    assert login(elsewhere, ADMIN).status_code == 302
    for client in (admin, copy, elsewhere):
        assert client.get("/").status_code == 200
    assert admin.post("/logout", data={"csrf_token": csrf(admin)}).status_code == 302
    for client in (admin, copy, elsewhere):
        assert (client.get("/").status_code, client.get("/").location) == (302, "/login?next=/")
        assert client.get("/ui/overview.json").status_code == 401
    assert copy.post("/logout", data={"csrf_token": csrf(copy)}).status_code == 302
    assert copy.get("/").location == "/login?next=/"
    assert viewer.get("/").status_code == 200
    assert login(admin, ADMIN).status_code == 302
    assert admin.get("/").status_code == 200
    assert copy.get("/").status_code == 302  # the new login is not the old cookie's


def test_a_new_password_ends_the_users_sessions(
    app: Flask, admin: FlaskClient, viewer: FlaskClient, engine: Engine
) -> None:
    """`delaysvc create-user NAME` on an existing user (a password reset) ends the sessions
    made with the old password, copies of their cookie too."""
    copy = _copy_of_the_session(app, admin)
    auth.create_user(engine, ADMIN[0], "a-new-password-1", role="admin")
    for client in (admin, copy):
        assert (client.get("/").status_code, client.get("/").location) == (302, "/login?next=/")
    assert login(admin, ADMIN).status_code == 401
    assert login(admin, (ADMIN[0], "a-new-password-1")).status_code == 302
    assert admin.get("/").status_code == 200
    assert copy.get("/").status_code == 302
    assert viewer.get("/").status_code == 200


def test_csrf_token_changes_at_login(app: Flask) -> None:
    client = app.test_client()
    client.get("/login")
    before = csrf(client)
    login(client, ADMIN)
    assert csrf(client) != before


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
    """`create-user` sets the role with a password, so it also ends the user's sessions; a
    role changed in the table alone is read on the next request."""
    sent = producer.send("dash.t", {"n": 1}, delay_level=3)
    auth.create_user(engine, ADMIN[0], ADMIN[1], role="viewer")
    response = admin.post(f"/messages/{sent.id}/cancel", data={"csrf_token": csrf(admin)})
    assert (response.status_code, response.location) == (
        302,
        f"/login?next=/messages/{sent.id}/cancel",
    )
    assert login(admin, ADMIN).status_code == 302
    response = admin.post(f"/messages/{sent.id}/cancel", data={"csrf_token": csrf(admin)})
    assert response.status_code == 403
    with engine.begin() as conn:
        conn.execute(text("UPDATE dashboard_user SET role = 'admin' WHERE name = :n"), {"n": "ada"})
    response = admin.post(f"/messages/{sent.id}/cancel", data={"csrf_token": csrf(admin)})
    assert response.status_code == 302
    assert producer.get(sent.id).status == "cancelled"
