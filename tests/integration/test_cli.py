"""The `delaysvc` command, run as a user runs it: the installed console script in a subprocess,
configured by `DELAYSVC_*` variables only."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from delaysvc import auth, store
from delaysvc.config.settings import Settings
from delaysvc.producer.sending import Producer
from delaysvc.worker.consumer import Consumer, handler
from tests.conftest import outside_env
from tests.support.commands import run_delaysvc

DEFAULT_DELAYS = ["1s", "5s", "10s", "30s", "1m", "2m", "3m", "4m", "5m"]
DEFAULT_DELAYS += ["6m", "7m", "8m", "9m", "10m", "20m", "30m", "1h", "2h"]

Run = Callable[..., subprocess.CompletedProcess[str]]


def _clean_env(**variables: str) -> dict[str, str]:
    env = outside_env()
    env.update(variables)
    return env


def _run(args: tuple[str, ...], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_delaysvc(*args, env=env)


@pytest.fixture
def delaysvc(database_url: str) -> Run:
    """`delaysvc ARGS...` against this test's database with the test levels."""

    def run(*args: str, **variables: str) -> subprocess.CompletedProcess[str]:
        env = _clean_env(DELAYSVC_DATABASE_URL=database_url, DELAYSVC_DELAY_LEVELS="1s 2s 3s 5s 8s")
        env.update(variables)
        return _run(args, env)

    return run


def _assert_one_line_error(result: subprocess.CompletedProcess[str], exit_code: int) -> str:
    assert result.returncode == exit_code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_levels_prints_the_18_default_levels_without_a_database() -> None:
    result = _run(("levels", "--no-db"), _clean_env())
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == [str(n) for n in range(1, 19)]
    assert [row[1] for row in rows] == DEFAULT_DELAYS


def test_levels_with_the_database_shows_pending_per_level(delaysvc: Run) -> None:
    defaults = {"DELAYSVC_DELAY_LEVELS": " ".join(DEFAULT_DELAYS)}
    assert delaysvc("migrate", **defaults).returncode == 0
    assert delaysvc("send", "order.cancel", '{"id": 1}', "--level", "2", **defaults).returncode == 0
    assert delaysvc("send", "order.cancel", '{"id": 2}', "--level", "2", **defaults).returncode == 0
    assert delaysvc("send", "sms.send", '"hi"', "--delay", "45m", **defaults).returncode == 0
    result = delaysvc("levels", **defaults)
    assert result.returncode == 0, result.stderr
    rows = {row[0]: row[1:] for row in (line.split() for line in result.stdout.splitlines()[1:])}
    assert len(rows) == 19  # 18 levels and the timer lane
    assert rows["2"] == ["5s", "2"]
    assert rows["1"] == ["1s", "0"]
    assert rows["timer"] == ["any", "1"]


@pytest.mark.parametrize(
    ("levels", "bad"),
    [("1s 5x", "'5x'"), ("1s 1.5m", "'1.5m'"), ("1s  5s", "empty"), ("5s 1s", "'1s'")],
)
def test_a_malformed_level_string_exits_non_zero_naming_the_token(levels: str, bad: str) -> None:
    result = _run(("levels",), _clean_env(DELAYSVC_DELAY_LEVELS=levels))
    line = _assert_one_line_error(result, 2)
    assert "DELAYSVC_DELAY_LEVELS" in line
    assert bad in line


def test_a_key_held_by_a_retrying_message_shows_its_lane(delaysvc: Run, engine: Engine) -> None:
    """A retrying message waits in a lane as a scheduled one does: it said `lane=none`."""
    from sqlalchemy import text

    sent = delaysvc("send", "order.cancel", "{}", "--level", "3", "--key", "o-7").stdout
    with engine.begin() as conn:  # as a failed run leaves it: retrying, at level 3
        conn.execute(text("UPDATE commit_log SET status = 'retrying', attempts = 1"))
    again = delaysvc("send", "order.cancel", "{}", "--key", "o-7").stdout
    assert again.startswith("exists (same topic and key): id=" + sent.split("id=")[1].split()[0])
    assert " status=retrying lane=level-3 " in again


def test_send_show_and_cancel(delaysvc: Run) -> None:
    sent = delaysvc("send", "order.cancel", '{"order_id": 42}', "--delay", "30m", "--key", "o-42")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.startswith("sent: id=")
    assert " lane=timer " in sent.stdout  # 30m is no level (it said `level=None`)
    message_id = sent.stdout.split("id=")[1].split()[0]
    leveled = delaysvc("send", "order.cancel", "{}", "--level", "2").stdout
    assert " lane=level-2 " in leveled
    now = delaysvc("send", "order.cancel", "{}").stdout  # no delay
    assert " status=ready lane=none " in now  # due at once: straight to its topic's queue

    again = delaysvc("send", "order.cancel", '{"order_id": 42}', "--delay", "30m", "--key", "o-42")
    assert again.stdout.startswith(f"exists (same topic and key): id={message_id} ")

    shown = json.loads(delaysvc("show", message_id).stdout)
    assert shown["status"] == "scheduled"
    assert shown["body"] == {"order_id": 42}
    assert shown["key"] == "o-42"

    assert delaysvc("cancel", message_id).stdout.strip() == f"cancelled: id={message_id}"
    assert json.loads(delaysvc("show", message_id).stdout)["status"] == "cancelled"
    line = _assert_one_line_error(delaysvc("cancel", message_id), 1)
    assert "cancelled" in line


def test_cancel_by_topic_and_key(delaysvc: Run) -> None:
    delaysvc("send", "order.cancel", "{}", "--level", "3", "--key", "k1")
    result = delaysvc("cancel", "--topic", "order.cancel", "--key", "k1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("cancelled: id=")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("send", "bad topic!", "{}"), "error: TOPIC: 'bad topic!' is not a topic name"),
        (("send", "t.ok", "{}", "--delay", "5 minutes"), "error: --delay: '5 minutes' is not"),
        (
            ("send", "t.ok", "{}", "--at", "2030-01-01T00:00:00"),
            "error: --at: '2030-01-01T00:00:00' has no UTC offset: add one, such as Z or +02:00",
        ),
        (("send", "t.ok", "{}", "--at", "tomorrow"), "--at"),
        (
            ("send", "t.ok", "{}", "--level", "2", "--delay", "5s"),
            "error: --level: give at most one of --delay, --level, --at (got --delay, --level)",
        ),
        (("send", "t.ok", "{}", "--level", "2", "--at", "2030-01-01T00:00:00Z"), "--at)"),
        (("send", "t.ok", "{}", "--key", ""), "error: --key: "),
        (("send", "t.ok", "{}", "--property", "novalue"), "--property"),
    ],
)
def test_bad_input_is_one_clear_line_and_stores_nothing(
    delaysvc: Run, engine: Engine, args: tuple[str, ...], named: str
) -> None:
    line = _assert_one_line_error(delaysvc(*args), 2)
    assert named in line
    from sqlalchemy import text

    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM commit_log")).scalar_one() == 0


def test_unknown_message_is_not_found(delaysvc: Run) -> None:
    line = _assert_one_line_error(delaysvc("show", "999999"), 1)
    assert "999999" in line


def test_no_database_configured_is_an_error_naming_the_variable_never_a_new_database(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """A typo in the variable's name used to start an embedded PostgreSQL under ./var."""
    env = _clean_env(DELAYSVC_DATABSE_URL="postgresql://root@127.0.0.1/typo")
    result = subprocess.run(
        [sys.executable, "-m", "delaysvc", "send", "t", "1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "DELAYSVC_DATABSE_URL is not a delaysvc setting and is ignored "
        "(did you mean DELAYSVC_DATABASE_URL?)"
    ) in result.stderr
    assert "error: DELAYSVC_DATABASE_URL is not set: set it to your PostgreSQL" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no var/, no database


def test_levels_shows_the_databases_levels_and_names_a_configured_difference(
    delaysvc: Run, producer: Producer
) -> None:
    """It showed the configured delays beside the database's counts: with a level string not
    yet migrated, a message due in 5s was listed at 5m, and a level holding messages was left
    out."""
    producer.send("t", 1, delay_level=4)
    for n in range(3):
        producer.send("t", n, delay_level=5)
    result = delaysvc("levels", DELAYSVC_DELAY_LEVELS="1s 2s 3s 5m")
    assert result.returncode == 0, result.stderr
    rows = {row[0]: row[1:] for row in (line.split() for line in result.stdout.splitlines()[1:])}
    assert (rows["4"], rows["5"]) == (["5s", "1"], ["8s", "3"])
    assert "level 4: 5m configured, 5s in the database" in result.stderr
    assert "level 5: none configured, 8s in the database" in result.stderr
    listed = json.loads(delaysvc("levels", "--json", DELAYSVC_DELAY_LEVELS="1s 2s 3s 5m").stdout)
    assert [level["delay"] for level in listed["levels"]] == ["1s", "2s", "3s", "5s", "8s"]
    assert "level 4: 5m configured" in listed["differs"]
    same = json.loads(delaysvc("levels", "--json").stdout)
    assert same["differs"] is None


def test_version_and_json_output(delaysvc: Run, producer: Producer) -> None:
    version = delaysvc("--version")
    assert (version.returncode, version.stdout.split()[:2]) == (0, ["delaysvc,", "version"])
    producer.send("cli.json", {"n": 1}, delay_level=2)
    levels = json.loads(delaysvc("levels", "--json").stdout)
    assert levels["levels"][1] == {"level": 2, "delay": "2s", "delay_ms": 2000, "pending": 1}
    assert levels["timer_pending"] == 0
    stats = json.loads(delaysvc("stats", "--json").stdout)
    level_2 = next(lane for lane in stats["lanes"] if lane["level"] == 2)
    assert (level_2["pending"], level_2["delay_ms"]) == (1, 2000)
    assert stats["topics"] == []  # nothing ready, running or dead yet


def test_an_unreachable_database_is_one_line() -> None:
    env = _clean_env(DELAYSVC_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")
    line = _assert_one_line_error(_run(("stats",), env), 1)
    assert line.startswith("error: database: connection failed: ")


def test_create_token_prints_the_token_alone_on_the_last_line(
    delaysvc: Run, engine: Engine
) -> None:
    result = delaysvc("create-token", "shop", "--scope", "admin")
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip().splitlines()[-1]
    assert " " not in token and len(token) >= 32
    found = auth.authenticate_token(engine, token)
    assert found is not None
    assert (found.name, found.scope) == ("shop", "admin")


def test_create_token_limited_to_topics(delaysvc: Run, engine: Engine) -> None:
    result = delaysvc(
        "create-token", "orders", "--topic", "order.remind", "--topic", "order.cancel"
    )
    assert result.returncode == 0, result.stderr
    assert "for topics order.cancel, order.remind" in result.stdout
    found = auth.authenticate_token(engine, result.stdout.strip().splitlines()[-1])
    assert found is not None
    assert (found.name, found.scope, found.topics) == (
        "orders",
        "send",
        ("order.cancel", "order.remind"),
    )
    refused = delaysvc("create-token", "bad", "--topic", "order.cancel", "--topic", "no spaces")
    line = _assert_one_line_error(refused, 2)
    assert "'no spaces' is not a topic name" in line
    with engine.connect() as conn:
        names = conn.execute(text("SELECT name FROM api_token")).scalars().all()
    assert names == ["orders"]


def test_stats_shows_lanes_and_topics_waiting_for_a_handler(
    delaysvc: Run, producer: Producer, engine: Engine
) -> None:
    producer.send("nobody.handles", {"n": 1})
    producer.send("nobody.handles", {"n": 2}, delay_level=1)  # 1 s, and no delivery runs
    time.sleep(1.2)
    result = delaysvc("stats")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.split("\n\n")[0].splitlines()
    assert header.split()[-2:] == ["late", "state"]
    lanes = {row.split()[0]: row.split() for row in rows}
    assert list(lanes) == ["1", "2", "3", "4", "5", "timer"]
    late = float(lanes["1"][8].removesuffix("s"))  # its head is due: how long ago
    assert 0.2 <= late < 60 and lanes["1"][7] == "now"  # not "-0.5s" beside its lateness
    assert lanes["2"][7:9] == ["-", "-"]  # empty
    topic_line = next(line for line in result.stdout.splitlines() if "nobody.handles" in line)
    assert topic_line.split()[:4] == ["nobody.handles", "1", "0", "0"]
    assert topic_line.endswith("NONE: no live worker has one (waiting)")
    with engine.begin() as conn:  # a worker with its handler reports in
        store.record_handlers(conn, ["nobody.handles"], "host-a")
    topic_line = next(line for line in delaysvc("stats").stdout.splitlines() if "nobody" in line)
    assert topic_line.split()[-1] == "yes"


def test_dead_letters_list_redrive_and_purge(
    delaysvc: Run, settings: Settings, engine: Engine, producer: Producer
) -> None:
    @handler("cli.always.fails", max_retries=0)
    def always_fails(message):  # type: ignore[no-untyped-def]
        raise RuntimeError(f"boom {message.body['n']}")

    ids = [producer.send("cli.always.fails", {"n": n}).id for n in range(3)]
    consumer = Consumer(settings, engine)
    assert consumer.run_once("cli.always.fails").claimed == 3

    listed = delaysvc("dead", "list", "--topic", "cli.always.fails")
    assert listed.returncode == 0, listed.stderr
    for message_id in ids:
        assert str(message_id) in listed.stdout
    assert "boom 1" in listed.stdout
    assert re.search(r" \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ attempts=1 ", listed.stdout), listed.stdout

    redriven = delaysvc("dead", "redrive", str(ids[0]))
    assert redriven.returncode == 0, redriven.stderr
    assert producer.get(ids[0]).status == "ready"

    as_json = json.loads(delaysvc("dead", "list", "--json").stdout)["dead"]
    assert sorted(letter["id"] for letter in as_json) == ids[1:]
    assert {letter["last_error"] for letter in as_json} == {
        "RuntimeError: boom 1",
        "RuntimeError: boom 2",
    }

    unasked = delaysvc("dead", "purge", "--topic", "cli.always.fails")  # no terminal to ask on
    line = _assert_one_line_error(unasked, 2)
    assert line == (  # it said `yes:`, as if an answer
        "error: --yes: purging the dead letters of topic cli.always.fails needs it off a terminal"
    )
    assert str(ids[1]) in delaysvc("dead", "list").stdout  # nothing purged
    purged = delaysvc("dead", "purge", "--topic", "cli.always.fails", "--yes")
    assert purged.returncode == 0, purged.stderr
    assert producer.get(ids[1]).status == "dead"  # purge drops the letter, keeps the history
    after = delaysvc("dead", "list", "--topic", "cli.always.fails")
    assert str(ids[1]) not in after.stdout
    assert (after.stdout, after.stderr) == ("", "no dead letters of cli.always.fails\n")


def test_load_sends_a_steady_stream_into_the_service_database(
    delaysvc: Run, engine: Engine
) -> None:
    result = delaysvc("load", "--rate", "100", "--seconds", "1", "--levels", "1,3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "sent 100 messages to load.demo at 100/s over levels [1, 3]"
    from sqlalchemy import text

    with engine.connect() as conn:
        levels = dict(
            conn.execute(
                text("SELECT delay_level, count(*) FROM commit_log GROUP BY 1 ORDER BY 1")
            ).all()
        )
    assert levels == {1: 50, 3: 50}


def test_load_refuses_a_bad_topic_before_sending(delaysvc: Run) -> None:
    line = _assert_one_line_error(delaysvc("load", "--topic", "no spaces", "--seconds", "1"), 2)
    assert "topic" in line


def test_periodic_schedules_are_added_listed_paused_resumed_and_deleted(delaysvc: Run) -> None:
    added = delaysvc(
        "schedules", "add", "nightly", "30 2 * * *", "--topic", "report.nightly",
        "--body", '{"kind": "full"}', "--timezone", "Europe/Berlin", "--on-missed", "latest",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert added.stdout.startswith("added: nightly") and "30 2 * * *" in added.stdout
    assert added.stderr == ""
    interval = delaysvc("schedules", "add", "warm", "every 10m", "--topic", "cache.warm")
    assert interval.returncode == 0, interval.stderr

    listed = delaysvc("schedules", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    items = {item["name"]: item for item in json.loads(listed.stdout)["schedules"]}
    assert items["nightly"]["body"] == {"kind": "full"}
    assert (items["nightly"]["timezone"], items["nightly"]["on_missed"]) == (
        "Europe/Berlin",
        "latest",
    )
    assert items["warm"]["schedule"] == "every 10m" and items["warm"]["body"] is None

    assert "paused: warm" in delaysvc("schedules", "pause", "warm").stdout
    lines = delaysvc("schedules", "list").stdout.splitlines()
    assert "paused" in next(line for line in lines if line.startswith("warm"))
    assert "resumed: warm" in delaysvc("schedules", "resume", "warm").stdout
    assert delaysvc("schedules", "delete", "warm").stdout == "deleted: warm\n"

    line = _assert_one_line_error(delaysvc("schedules", "add", "x", "* * *", "--topic", "t"), 2)
    assert "not a cron expression" in line
    line = _assert_one_line_error(delaysvc("schedules", "pause", "warm"), 1)
    assert "no periodic schedule is named 'warm'" in line


def test_send_on_duplicate_replace_says_what_it_replaced(delaysvc: Run) -> None:
    first = delaysvc("send", "cli.kp", '{"v": 1}', "--delay", "1h", "--key", "k")
    assert first.returncode == 0, first.stderr
    first_id = re.search(r"id=(\d+)", first.stdout).group(1)
    kept = delaysvc("send", "cli.kp", '{"v": 2}', "--key", "k")
    assert kept.stdout.startswith(f"exists (same topic and key): id={first_id} ")
    replaced = delaysvc("send", "cli.kp", '{"v": 3}', "--key", "k", "--on-duplicate", "replace")
    assert replaced.returncode == 0, replaced.stderr
    assert replaced.stdout.startswith(f"sent, replacing {first_id}: id=")


def test_topic_limits_are_set_listed_and_lifted(delaysvc: Run) -> None:
    set_ = delaysvc("limits", "set", "sms.send", "--max-running", "4", "--rate", "10/s")
    assert set_.returncode == 0, set_.stderr
    assert set_.stdout == "sms.send: at most 4 running, at most 10 starts/s\n"
    listed = json.loads(delaysvc("limits", "list", "--json").stdout)
    assert listed == {"limits": [{"topic": "sms.send", "max_running": 4, "rate_per_s": 10.0}]}
    line = _assert_one_line_error(delaysvc("limits", "set", "sms.send", "--rate", "fast"), 2)
    assert "'10/s'" in line
    lifted = delaysvc("limits", "set", "sms.send")
    assert lifted.stdout == "sms.send: any number running, no rate limit\n"
    assert delaysvc("limits", "list").stdout == ""


def test_the_spellings_from_before_the_groups_still_work(delaysvc: Run) -> None:
    """`limit`, `limits [--json]`, `cap`, `caps [--json]`, `pause [--resume]`: hidden from
    --help, doing what `limits set|list`, `caps set|list`, `topics pause|resume` do."""
    assert delaysvc("limit", "sms.send", "--max-running", "2").stdout.startswith("sms.send: at")
    assert json.loads(delaysvc("limits", "--json").stdout)["limits"][0]["max_running"] == 2
    assert delaysvc("limits").stdout.startswith("sms.send ")
    assert delaysvc("cap", "topic:sms.send", "--max-waiting", "9").returncode == 0
    assert json.loads(delaysvc("caps", "--json").stdout)["caps"][0]["max_waiting"] == 9
    assert delaysvc("pause", "sms.send").stdout == "sms.send: paused\n"
    assert delaysvc("pause", "sms.send", "--resume").stdout == "sms.send: resumed\n"
    listed = delaysvc("--help").stdout.split("Commands:")[1]
    names = {line.split()[0] for line in listed.splitlines() if line.startswith("  ")}
    assert "topics" in names and not names & {"pause", "limit", "cap"}


def test_topics_are_listed_paused_and_resumed(delaysvc: Run, producer: Producer) -> None:
    producer.send("cli.topic", {})
    assert delaysvc("topics", "pause", "cli.topic").stdout == "cli.topic: paused\n"
    (row,) = json.loads(delaysvc("topics", "list", "--json").stdout)["topics"]
    assert (row["topic"], row["ready"], row["paused"], row["handled"]) == (
        "cli.topic",
        1,
        True,
        False,
    )
    assert delaysvc("topics", "list").stdout.splitlines()[1].endswith("(waiting) (paused)")
    assert delaysvc("topics", "resume", "cli.topic").stdout == "cli.topic: resumed\n"
    line = _assert_one_line_error(delaysvc("topics", "pause", "no spaces"), 2)
    assert "'no spaces' is not a topic name" in line


def test_send_with_a_priority_shows_it(delaysvc: Run) -> None:
    sent = delaysvc("send", "cli.p", "{}", "--priority", "3")
    message_id = re.search(r"id=(\d+)", sent.stdout).group(1)
    assert json.loads(delaysvc("show", message_id).stdout)["priority"] == 3


def test_create_user_reads_its_password_from_the_environment_without_a_warning(
    delaysvc: Run, engine: Engine
) -> None:
    """`DELAYSVC_NEW_USER_PASSWORD` is create-user's, not a setting: it used to be reported as
    "not a delaysvc setting and is ignored", and then used."""
    made = delaysvc("create-user", "ops", DELAYSVC_NEW_USER_PASSWORD="a long enough password")
    assert made.returncode == 0, made.stderr
    assert "not a delaysvc setting" not in made.stderr
    assert auth.check_login(engine, "ops", "a long enough password") is not None


def test_create_user_on_an_existing_user_keeps_its_role_unless_given(
    delaysvc: Run, engine: Engine
) -> None:
    """The documented password reset (`create-user NAME`) made a viewer an admin: --role
    defaulted to admin, and every save wrote it (found by a reviewer)."""

    def create(*args: str) -> str:
        made = delaysvc("create-user", *args, DELAYSVC_NEW_USER_PASSWORD="a long password 1")
        assert made.returncode == 0, made.stderr
        return made.stdout.strip()

    assert create("vic", "--role", "viewer") == "user 'vic' ready with role viewer"
    assert create("vic") == "user 'vic' ready with role viewer"  # a password reset
    assert auth.check_login(engine, "vic", "a long password 1").role == "viewer"
    assert create("vic", "--role", "admin") == "user 'vic' ready with role admin"
    assert create("new") == "user 'new' ready with role admin"  # a new user: admin
    assert auth.create_user(engine, "vic", "another password") == "admin"  # kept
    assert auth.create_user(engine, "fresh", "another password") == "viewer"


def test_tokens_and_users_are_listed_without_their_secrets_and_a_user_deleted(
    delaysvc: Run, engine: Engine
) -> None:
    """Found by a reviewer: tokens and users could not be listed, nor a user deleted, but by
    SQL (the dashboard's docs told of a deleted user losing access at once)."""
    secret = auth.create_token(engine, "shop", "send", topics=["order.cancel"])
    auth.create_token(engine, "ops", "admin")
    auth.revoke_token(engine, "ops")
    auth.create_user(engine, "vic", "a long password 1", "viewer")
    listed = json.loads(delaysvc("tokens", "--json").stdout)["tokens"]
    assert [(t["name"], t["scope"], t["topics"], t["revoked_at"] is None) for t in listed] == [
        ("shop", "send", ["order.cancel"], True),
        ("ops", "admin", None, False),
    ]
    table = delaysvc("tokens").stdout
    assert "order.cancel" in table and "revoked" in table and secret not in table
    (user,) = json.loads(delaysvc("users", "--json").stdout)["users"]
    assert (user["name"], user["role"], user["locked_until"]) == ("vic", "viewer", None)
    assert "password" not in delaysvc("users").stdout
    assert delaysvc("delete-user", "vic").stdout == "deleted: vic\n"
    assert auth.check_login(engine, "vic", "a long password 1") is None
    assert json.loads(delaysvc("users", "--json").stdout)["users"] == []
    line = _assert_one_line_error(delaysvc("delete-user", "vic"), 1)
    assert "no dashboard user named 'vic'" in line


def test_a_token_made_with_a_life_is_listed_with_its_expiry_and_a_bad_life_refused(
    delaysvc: Run, engine: Engine
) -> None:
    made = delaysvc("create-token", "ci", "--expires-in", "90d").stdout.splitlines()
    assert "expiring in 90d" in made[0]
    assert auth.authenticate_token(engine, made[-1]) is not None
    (listed,) = json.loads(delaysvc("tokens", "--json").stdout)["tokens"]
    assert listed["expires_at"] is not None and listed["expired"] is False
    assert " / expires " in delaysvc("tokens").stdout
    for life, problem in (("0s", "above 0"), ("soon", "not a duration"), ("3661d", "ten years")):
        line = _assert_one_line_error(delaysvc("create-token", "x", "--expires-in", life), 2)
        assert "expires_in" in line and problem in line, line
    assert len(json.loads(delaysvc("tokens", "--json").stdout)["tokens"]) == 1


@pytest.mark.parametrize(
    ("command", "variables", "named"),
    [
        (
            ("worker",),
            {"DELAYSVC_BROKER_URL": "foo://user:secret@broker.example/0"},
            "DELAYSVC_BROKER_URL: no broker transport named 'foo'",
        ),
        (
            ("beat",),
            {"DELAYSVC_BROKER_URL": "foo://user:secret@broker.example/0"},
            "DELAYSVC_BROKER_URL: no broker transport named 'foo'",
        ),
        (
            ("up", "--port", "1"),
            {"DELAYSVC_BROKER_URL": "broker.example:6379"},
            "DELAYSVC_BROKER_URL: not a URL",
        ),
        (
            ("worker",),
            {"DELAYSVC_HANDLERS": "myapp.jobs, no_such_package.handlers"},
            "DELAYSVC_HANDLERS: no module named 'no_such_package.handlers'",
        ),
    ],
    ids=["worker-broker", "beat-broker", "up-broker", "worker-handlers"],
)
def test_a_bad_broker_url_or_handler_module_is_refused_before_anything_starts(
    database_url: str,
    tmp_path: Path,
    command: tuple[str, ...],
    variables: dict[str, str],
    named: str,
) -> None:
    """Each of the service's processes would fail to start, and be started again until its
    supervisor gave up, with a traceback each time: the command names the setting first."""
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "jobs.py").write_text("")  # found: the first module is fine
    result = run_delaysvc(
        *command,
        cwd=tmp_path,  # where the workers, started with `python -m`, find the handlers
        DELAYSVC_DATABASE_URL=database_url,
        DELAYSVC_DELAY_LEVELS="1s 2s 3s 5s 8s",
        DELAYSVC_VAR_DIR=str(tmp_path / "var"),
        **variables,
    )
    line = _assert_one_line_error(result, 2)
    assert named in line, line
    assert "secret" not in result.stderr  # a URL's password is not repeated


@pytest.mark.parametrize("command", ["up", "web"])
def test_a_port_in_use_is_refused_before_anything_starts(
    database_url: str, tmp_path: Path, command: str
) -> None:
    """gunicorn would try for a few seconds and exit, and be started again until the
    supervisor gave up, while the rest ran: the command says so first."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_delaysvc(
            command,
            "--port",
            str(port),
            DELAYSVC_DATABASE_URL=database_url,
            DELAYSVC_DELAY_LEVELS="1s 2s 3s 5s 8s",
            DELAYSVC_VAR_DIR=str(tmp_path / "var"),
        )
    line = _assert_one_line_error(result, 2)
    assert f"127.0.0.1:{port} is in use" in line, line
    assert "--port" in line


def test_an_empty_list_says_so_on_stderr_and_prints_nothing(delaysvc: Run) -> None:
    """`limits list`, `caps list` and `schedules list` of nothing printed nothing at all (as
    `dead list` does, they say so on stderr, so a script still reads an empty list)."""
    for command, said in [
        (("limits", "list"), "no topic has limits"),
        (("caps", "list"), "no level or topic has a backlog cap"),
        (("schedules", "list"), "no periodic schedules"),
        (("dead", "list"), "no dead letters"),
    ]:
        result = delaysvc(*command)
        assert (result.returncode, result.stdout, result.stderr.strip()) == (0, "", said)
