"""Dead letters: grouped by topic and error; redrive or purge one, a selection, or a group."""

from __future__ import annotations

import re
from typing import Any

from flask import redirect, render_template, request, url_for
from sqlalchemy import Engine

from delaysvc.config.validation import validate_topic
from delaysvc.errors import DelaysvcError, ValidationError
from delaysvc.producer.dead_letters import DeadLetters
from delaysvc.store import dashboard as dash
from delaysvc.web import params
from delaysvc.web.api import services
from delaysvc.web.ui import admin_required, done, safe_next, timeout_ms, ui
from delaysvc.web.ui_format import when

GROUP_ACTION_CAP = 10_000
"""At most this many letters per "all matching" click, so one request stays short."""
BATCH = 500


def _ids(values: list[str]) -> list[int]:
    return [params.whole_number("ids", v.strip(), 0) for v in values if v.strip()]


@ui.get("/dead")
def dead() -> Any:
    topic = request.args.get("topic") or None
    if topic is not None:
        validate_topic(topic)
    error = request.args.get("error")  # "" is a real (empty) error text; absent = any
    group = request.args.get("group")  # a group's error by its digest: the links' way
    if group is not None and not _DIGEST.fullmatch(group):
        raise ValidationError("group", "must be a group's 32 hex digits, as its Show link has")
    before = params.int_arg(request.args, "before", None, 0, blank=True)
    gone = False  # the group asked for has no letter left (all redriven or purged)
    with dash.bounded(services()["engine"], timeout_ms()) as conn:
        if group is not None and error is None:
            error = dash.error_named(conn, topic, group)
            gone = error is None
        groups = dash.dead_groups(conn, topic)
        letters: list[Any] = []
        older = None
        if not gone:  # else the topic's other letters were listed, Purge selected offered
            letters, older = dash.dead_letters_page(conn, topic, error, before)
    here = _here(topic, error)
    return render_template(
        "dead.html",
        groups=groups,
        letters=letters,
        topic=topic,
        error=error,
        selected=error is not None or gone,
        older_url=url_for("dashboard.ui.dead", **here, before=older) if older else None,
        back=url_for("dashboard.ui.dead", **here),
        window=dash.DEAD_GROUP_WINDOW,
        when=when,
        error_digest=dash.error_digest,
    )


def redrive_group(
    engine: Engine, topic: str | None, error: str | None, cap: int
) -> tuple[int, int]:
    """Redrive the group's letters, oldest first, up to `cap`. Letters whose key is held by a
    newer unfinished message stay dead. -> (redriven, left dead)."""
    letters, redriven, left, after = DeadLetters(engine), 0, 0, None
    while redriven + left < cap:
        with dash.bounded(engine, timeout_ms()) as conn:
            ids = dash.dead_ids_in_group(
                conn, topic, error, min(BATCH, cap - redriven - left), after
            )
        if not ids:
            break
        for message_id in ids:
            try:
                letters.redrive(message_id)
                redriven += 1
            except DelaysvcError:
                left += 1
        after = ids[-1]
    return redriven, left


def redrive_ids(engine: Engine, ids: list[int]) -> tuple[list[int], list[str]]:
    """-> (ids redriven, why the others were not)."""
    letters, redriven, problems = DeadLetters(engine), list[int](), list[str]()
    for message_id in ids:
        try:
            letters.redrive(message_id)
            redriven.append(message_id)
        except DelaysvcError as exc:
            problems.append(str(exc))
    return redriven, problems


def purge_group(engine: Engine, topic: str | None, error: str | None, cap: int) -> int:
    letters, purged = DeadLetters(engine), 0
    while purged < cap:
        with dash.bounded(engine, timeout_ms()) as conn:
            ids = dash.dead_ids_in_group(conn, topic, error, min(BATCH, cap - purged))
        if not ids:
            break
        purged += letters.purge(ids)
    return purged


def _back() -> Any:
    if request.form.get("next"):
        return redirect(safe_next(request.form["next"]))
    topic = request.form.get("topic") or None
    return redirect(url_for("dashboard.ui.dead", **_here(topic, request.form.get("error"))))


_DIGEST = re.compile("[0-9a-f]{32}")


def _here(topic: str | None, error: str | None) -> dict[str, Any]:
    """A link's arguments for the letters of `topic` (None: any) with `error` (None: any): the
    error by its digest (`dash.error_digest`), not in full (a link of a KBs long error was
    refused, 414, and the note of a group's redrive with it)."""
    here = {} if topic is None else {"topic": topic}
    return here | ({} if error is None else {"group": dash.error_digest(error)})


def _group() -> tuple[str | None, str | None]:
    return request.form.get("topic") or None, request.form.get("error")


@ui.post("/dead/redrive")
@admin_required
def redrive() -> Any:
    engine = services()["engine"]
    if request.form.get("scope") == "group":
        topic, error = _group()
        redriven, left = redrive_group(engine, topic, error, GROUP_ACTION_CAP)
        note = f"; {left} left dead (their key is taken by a newer message)" if left else ""
        more = "; more remain, press again" if redriven + left >= GROUP_ACTION_CAP else ""
        done(f"{redriven} redriven{note}{more}")
        return _back()
    ids = _ids(request.form.getlist("ids"))
    if not ids:
        done("nothing selected")
        return _back()
    done_ids, problems = redrive_ids(engine, ids)
    done(
        f"{len(done_ids)} redriven ({', '.join(map(str, done_ids)) or 'none'})"
        + (f"; not redriven: {'; '.join(problems)}" if problems else "")
    )
    return _back()


@ui.post("/dead/purge")
@admin_required
def purge() -> Any:
    engine = services()["engine"]
    if request.form.get("scope") == "group":
        topic, error = _group()
        purged = purge_group(engine, topic, error, GROUP_ACTION_CAP)
        more = "; more remain, press again" if purged >= GROUP_ACTION_CAP else ""
        done(f"{purged} purged{more}")
        return _back()
    ids = _ids(request.form.getlist("ids"))
    if not ids:
        done("nothing selected")
        return _back()
    purged = DeadLetters(engine).purge(ids)
    done(f"{purged} purged")
    return _back()
