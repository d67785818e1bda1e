"""Dashboard logins under concurrency: the lockout counts each attempt before its password is
checked, so no number of simultaneous attempts gets more than MAX_FAILED_LOGINS passwords
checked against the account; every attempt still costs one hash. Real threads, a real
PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text

from delaysvc import auth, store

NAME, PASSWORD = "ada", "right-password-1"


@pytest.fixture
def user(engine: Engine) -> str:
    auth.create_user(engine, NAME, PASSWORD, role="admin")
    return NAME


class Hashes:
    """check_password_hash as auth calls it, counting the calls against the user's own hash
    (an attempt evaluated) and the rest (the stand-in hash of a refused or unknown login);
    calls checking `hold` wait until `release` is set, so a test can keep them in flight."""

    def __init__(self, real: Callable[[str, str], bool], hold: str | None = None) -> None:
        self.real, self.hold = real, hold
        self.lock = threading.Lock()
        self.against_user = 0
        self.against_stand_in = 0
        self.holding = 0
        self.held = threading.Condition(self.lock)
        self.release = threading.Event()

    def __call__(self, pwhash: str, password: str) -> bool:
        with self.lock:
            if pwhash == auth._NO_USER_HASH:
                self.against_stand_in += 1
            else:
                self.against_user += 1
            if password == self.hold:
                self.holding += 1
                self.held.notify_all()
        if password == self.hold:
            assert self.release.wait(30), "never released"
        return self.real(pwhash, password)

    def wait_holding(self, count: int) -> None:
        with self.held:
            assert self.held.wait_for(lambda: self.holding >= count, timeout=30)


def _failed_logins(engine: Engine) -> tuple[int, bool]:
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT failed_logins, coalesce(locked_until > now(), false) "
                "FROM dashboard_user WHERE name = :name"
            ),
            {"name": NAME},
        ).one()
    return int(row[0]), bool(row[1])


def test_the_right_password_after_the_limit_of_wrong_ones_in_flight_is_refused(
    engine: Engine, user: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAX_FAILED_LOGINS wrong attempts, all still hashing, then the right one: the limit is
    reached, so the right one is refused, as it would be after them one by one."""
    hashes = Hashes(auth.check_password_hash, hold="wrong-password")
    monkeypatch.setattr(auth, "check_password_hash", hashes)
    wrong = auth.MAX_FAILED_LOGINS
    barrier = threading.Barrier(wrong)
    answers: list[Any] = []

    def attempt() -> None:
        barrier.wait()
        answers.append(auth.check_login(engine, NAME, "wrong-password"))

    threads = [threading.Thread(target=attempt) for _ in range(wrong)]
    for thread in threads:
        thread.start()
    try:
        hashes.wait_holding(wrong)  # every wrong attempt is in its hash, none has finished
        right = auth.check_login(engine, NAME, PASSWORD)
    finally:
        hashes.release.set()
        for thread in threads:
            thread.join(30)
    assert right is None
    assert answers == [None] * wrong
    assert (hashes.against_user, hashes.against_stand_in) == (wrong, 1)  # one hash each
    assert _failed_logins(engine) == (wrong, True)
    assert auth.check_login(engine, NAME, PASSWORD) is None  # still locked


def test_simultaneous_wrong_attempts_get_at_most_the_limit_checked(
    engine: Engine, user: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 attempts released together: exactly MAX_FAILED_LOGINS are checked against the
    account, the others are refused unchecked, each still costing one hash."""
    hashes = Hashes(auth.check_password_hash)
    monkeypatch.setattr(auth, "check_password_hash", hashes)
    racers = 16
    barrier = threading.Barrier(racers)
    answers: list[Any] = []

    def attempt(number: int) -> None:
        barrier.wait()
        answers.append(auth.check_login(engine, NAME, f"wrong-{number}"))

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == [None] * racers
    assert hashes.against_user == auth.MAX_FAILED_LOGINS
    assert hashes.against_stand_in == racers - auth.MAX_FAILED_LOGINS
    assert _failed_logins(engine) == (auth.MAX_FAILED_LOGINS, True)
    assert auth.check_login(engine, NAME, PASSWORD) is None


def test_the_right_password_within_the_limit_logs_in_and_clears_the_failures(
    engine: Engine, user: str
) -> None:
    for _ in range(auth.MAX_FAILED_LOGINS - 1):
        assert auth.check_login(engine, NAME, "wrong-password") is None
    assert _failed_logins(engine) == (auth.MAX_FAILED_LOGINS - 1, False)
    found = auth.check_login(engine, NAME, PASSWORD)
    assert found is not None and (found.name, found.role) == (NAME, "admin")
    assert _failed_logins(engine) == (0, False)


def test_after_the_lockout_ends_one_more_failure_locks_again(engine: Engine, user: str) -> None:
    for _ in range(auth.MAX_FAILED_LOGINS):
        auth.check_login(engine, NAME, "wrong-password")
    with engine.begin() as conn:  # the lockout has run out
        conn.execute(text("UPDATE dashboard_user SET locked_until = now() - interval '1 second'"))
    assert auth.check_login(engine, NAME, "wrong-password") is None
    assert _failed_logins(engine) == (auth.MAX_FAILED_LOGINS + 1, True)
    with engine.begin() as conn:
        conn.execute(text("UPDATE dashboard_user SET locked_until = now() - interval '1 second'"))
    assert auth.check_login(engine, NAME, PASSWORD) is not None
    assert _failed_logins(engine) == (0, False)


def _session_generation(engine: Engine) -> int:
    with engine.connect() as conn:
        found = store.find_user(conn, NAME)
    return int(found.session_generation)


def test_a_login_checked_while_the_password_is_reset_gets_a_session_of_the_old_generation(
    engine: Engine, user: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old password, right when the login read the user, still hashing when `create-user`
    sets a new one: the login succeeds with the generation it read, which the reset has moved
    on from, so the session it makes is no session (the dashboard checks the generation on every
    request). Ending sessions names the generation it ends: a stale row ends nothing."""
    hashes = Hashes(auth.check_password_hash, hold=PASSWORD)
    monkeypatch.setattr(auth, "check_password_hash", hashes)
    assert _session_generation(engine) == 0
    answers: list[Any] = []
    login = threading.Thread(
        target=lambda: answers.append(auth.check_login(engine, NAME, PASSWORD))
    )
    login.start()
    hashes.wait_holding(1)
    auth.create_user(engine, NAME, "a-new-password-1", role="admin")
    hashes.release.set()
    login.join(60)
    [found] = answers
    assert (found.name, found.session_generation) == (NAME, 0)
    assert _session_generation(engine) == 1
    assert auth.end_sessions(engine, found) is False
    assert _session_generation(engine) == 1
    current = auth.check_login(engine, NAME, "a-new-password-1")
    assert current.session_generation == 1
    assert auth.end_sessions(engine, current) is True
    assert _session_generation(engine) == 2


def test_the_first_admin_is_made_once_on_a_database_without_users(engine: Engine) -> None:
    """`up` on a new embedded database shows this password once; of several callers at once
    one makes the admin, the others (and every later call) get None and change nothing."""
    results: list[str | None] = []
    barrier = threading.Barrier(4)

    def make() -> None:
        barrier.wait()
        results.append(auth.create_first_admin(engine))

    threads = [threading.Thread(target=make) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    (password,) = [p for p in results if p is not None]
    assert results.count(None) == 3
    assert len(password) >= 16
    assert auth.check_login(engine, auth.FIRST_ADMIN, password).role == "admin"
    assert auth.create_first_admin(engine) is None
    assert auth.check_login(engine, auth.FIRST_ADMIN, password) is not None  # unchanged


def test_no_first_admin_where_a_user_exists(engine: Engine, user: str) -> None:
    assert auth.create_first_admin(engine) is None
    with engine.connect() as conn:
        names = conn.execute(text("SELECT name FROM dashboard_user")).scalars().all()
    assert names == [user]
