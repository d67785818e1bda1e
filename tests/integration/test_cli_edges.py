"""The `delaysvc` command at its edges, run as a user runs it (a process of its own): a number
in another script's digits or out of range, an id given with filters that would be ignored,
several ids of which one fails, an address the web server cannot listen on, a lane that does
not exist, a database that is down. Each is refused in words naming the problem, before
anything acts, and nothing is changed."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from delaysvc.config.settings import Settings
from delaysvc.producer.sending import Producer
from delaysvc.worker.consumer import Consumer, handler
from tests.support.commands import run_delaysvc

Run = Callable[..., subprocess.CompletedProcess[str]]
LEVELS = "1s 2s 3s 5s 8s"


@pytest.fixture
def delaysvc(database_url: str, tmp_path: Path) -> Run:
    def run(*args: str, **variables: str) -> subprocess.CompletedProcess[str]:
        settings = {
            "DELAYSVC_DATABASE_URL": database_url,
            "DELAYSVC_DELAY_LEVELS": LEVELS,
            "DELAYSVC_VAR_DIR": str(tmp_path / "var"),
        }
        return run_delaysvc(*args, **(settings | variables))

    return run


def _refused(result: subprocess.CompletedProcess[str], exit_code: int, *said: str) -> str:
    assert result.returncode == exit_code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for words in said:
        assert words in result.stderr, result.stderr
    return result.stderr


def _messages(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM commit_log")).scalar_one())


@pytest.mark.parametrize(
    ("args", "said"),
    [
        # click's int reads other scripts' digits as the number nobody typed (٣ -> level 3)
        (("send", "t.ok", "{}", "--level", "٣"), "'٣' is not a whole number (digits 0-9)"),
        (("send", "t.ok", "{}", "--priority", "5000"), "5000 is not in the range"),
        (("cancel", "١٢"), "is not a whole number (digits 0-9)"),
        (("show", "0"), "0 is not in the range"),
        (("dead", "list", "--limit", "-1"), "-1 is not in the range"),
        (("dead", "list", "--limit", "99999999999999999999"), "is not in the range"),
        (("dead", "purge", "99999999999999999999", "--yes"), "is not in the range"),
        (("check", "--timeout", "nan"), "'nan' is not a number of seconds"),
        (("check", "--timeout", "inf"), "'inf' is not a number of seconds"),
        (("check", "--limit", "-1"), "-1 is not in the range"),
        (("check", "--lease-tolerance", "-5"), "is not in the range"),
        # passed to the child before, which failed as it started, again and again
        (("web", "--port", "70000"), "70000 is not in the range"),
        (("web", "--port", "-1"), "-1 is not in the range"),
        (("web", "--workers", "0"), "0 is not in the range"),
        (("worker", "-c", "-1"), "-1 is not in the range"),
    ],
)
def test_a_number_out_of_range_or_in_other_digits_is_a_usage_error(
    delaysvc: Run, engine: Engine, args: tuple[str, ...], said: str
) -> None:
    _refused(delaysvc(*args), 2, said)
    assert _messages(engine) == 0


def test_nan_sent_as_plain_text_is_sent_as_that_text(delaysvc: Run, producer: Producer) -> None:
    """BODY is JSON when it parses as JSON: Python's parser takes `NaN`, JSON has none, so the
    body was refused as an out-of-range float instead of being the text it is."""
    sent = delaysvc("send", "t.text", "NaN")
    assert sent.returncode == 0, sent.stderr
    message_id = int(sent.stdout.split("id=")[1].split()[0])
    assert producer.get(message_id).body == "NaN"


def test_an_id_with_filters_is_refused_not_acted_on_with_the_filters_ignored(
    delaysvc: Run, producer: Producer
) -> None:
    """`cancel ID --topic T --key K` cancelled message ID whatever its topic and key."""
    message = producer.send("t.mine", {}, delay_level=3, key="k")
    refused = delaysvc("cancel", str(message.id), "--topic", "t.other", "--key", "k")
    _refused(refused, 2, "give a message id, or topic and key, not both")
    assert producer.get(message.id).status == "scheduled"


@pytest.fixture
def dead_letters(settings: Settings, engine: Engine, producer: Producer) -> list[int]:
    @handler("cli.edges.fails", max_retries=0)
    def fails(message):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    ids = [producer.send("cli.edges.fails", {"n": n}).id for n in range(2)]
    assert Consumer(settings, engine).run_once("cli.edges.fails").claimed == 2
    assert {producer.get(i).status for i in ids} == {"dead"}
    return ids


@pytest.mark.parametrize("command", ["redrive", "purge"])
def test_dead_letter_ids_with_a_filter_are_refused(
    delaysvc: Run, producer: Producer, dead_letters: list[int], command: str
) -> None:
    """`dead purge ID --topic other` purged ID: the filter was ignored."""
    for option in ("--topic", "--error-contains"):
        yes = ("--yes",) if command == "purge" else ()
        result = delaysvc("dead", command, str(dead_letters[0]), option, "other", *yes)
        _refused(result, 2, "give message ids, or --topic / --error-contains, not both")
    listed = json.loads(delaysvc("dead", "list", "--json").stdout)["dead"]
    assert sorted(letter["id"] for letter in listed) == dead_letters


def test_redriving_several_ids_is_all_or_nothing(
    delaysvc: Run, producer: Producer, dead_letters: list[int]
) -> None:
    """`dead redrive A B` with B no dead letter redrove A and then failed: an error that
    left half the work done."""
    first, second = dead_letters
    alive = producer.send("t.alive", {}, delay_level=3).id
    result = delaysvc("dead", "redrive", str(first), str(alive), str(second))
    _refused(result, 1, f"message {alive} is not a dead letter; none was redriven")
    assert {producer.get(i).status for i in dead_letters} == {"dead"}
    done = delaysvc("dead", "redrive", str(first), str(second))
    assert done.stdout.strip() == "redriven: 2", done.stderr
    assert {producer.get(i).status for i in dead_letters} == {"ready"}


def test_skipping_the_head_of_a_lane_that_does_not_exist_says_so(delaysvc: Run) -> None:
    """It said the lane was "being delivered right now (or does not exist)"."""
    result = delaysvc("skip-head", "99")
    stderr = _refused(result, 1, "there is no lane 99: 0 is the timer lane, 1..5 the levels")
    assert "being delivered" not in stderr


@pytest.mark.parametrize(
    ("host", "said"),
    [
        ("nosuch.invalid", "--host 'nosuch.invalid' is no address this machine has a name for"),
        ("", "--host is empty"),
        ("192.0.2.1", "cannot listen on 192.0.2.1:"),  # TEST-NET-1: no address of this machine
    ],
)
def test_a_web_address_that_cannot_be_listened_on_is_one_line(
    delaysvc: Run, host: str, said: str
) -> None:
    stderr = _refused(delaysvc("web", "--host", host, "--port", "18089"), 2, said)
    assert stderr.count("\n") == 1, stderr


def test_a_cron_expression_with_seconds_is_refused(delaysvc: Run) -> None:
    """cronsim takes a sixth field (seconds); the documents and the API promise five."""
    result = delaysvc("schedules", "add", "s", "*/5 * * * * *", "--topic", "t.tick")
    _refused(result, 2, "is not a cron expression: it has 6 fields, not five")
    assert json.loads(delaysvc("schedules", "list", "--json").stdout)["schedules"] == []


def test_a_database_that_is_down_is_one_line_saying_what_was_not_done() -> None:
    """A cancel or a show said "nothing was stored"; the error spanned two lines."""
    down = {"DELAYSVC_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"}
    shown = _refused(run_delaysvc("show", "1", **down), 1, "the database is unavailable")
    assert "stored" not in shown
    cancelled = _refused(run_delaysvc("cancel", "1", **down), 1, "; nothing was cancelled")
    sent = _refused(run_delaysvc("send", "t", "{}", **down), 1, "; nothing was stored")
    for stderr in (shown, cancelled, sent):
        assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
            stderr.splitlines()[-1]
        ]
        assert "\t" not in stderr


def test_a_token_name_in_use_or_revoked_is_refused_in_one_line(delaysvc: Run) -> None:
    """It was a traceback of PostgreSQL's unique violation (api_token_name_key)."""
    assert delaysvc("create-token", "shop").returncode == 0
    _refused(delaysvc("create-token", "shop"), 2, "a token named 'shop' exists")
    assert delaysvc("revoke-token", "shop").returncode == 0
    _refused(delaysvc("create-token", "shop"), 2, "a revoked token keeps its name")


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("", "must be 1-100 characters"),
        ("   ", "must not start or end with a space"),
        (" ada", "must not start or end with a space"),
        ("ada\x1b[2J", "must not contain control characters"),
        ("a" * 101, "must be 1-100 characters"),
    ],
)
@pytest.mark.parametrize("command", ["create-user", "create-token"])
def test_a_user_or_token_name_no_one_could_tell_apart_or_type_is_refused(
    delaysvc: Run, engine: Engine, command: str, name: str, said: str
) -> None:
    """`create-user ""` made a user who could never log in; `" ada"` one a list shows as
    `ada`; a name with escape codes rewrote the terminal that listed it."""
    result = delaysvc(command, name, DELAYSVC_NEW_USER_PASSWORD="long enough password")
    _refused(result, 2, said)
    with engine.connect() as conn:
        users = conn.execute(text("SELECT count(*) FROM dashboard_user")).scalar_one()
        tokens = conn.execute(text("SELECT count(*) FROM api_token")).scalar_one()
    assert (users, tokens) == (0, 0)
