"""Overview (lanes and charts), topics, periodic schedules and history: pages, the JSON they
poll, and their actions."""

from __future__ import annotations

from typing import Any

from flask import jsonify, redirect, render_template, request, url_for

from delaysvc import store
from delaysvc.config.validation import validate_topic
from delaysvc.errors import DelaysvcError, ValidationError
from delaysvc.maintenance.periodic import Schedules
from delaysvc.producer.caps import MAX_WAITING, all_caps, parse_target, set_cap
from delaysvc.serialize import topic_json
from delaysvc.store import dashboard as dash
from delaysvc.web import params
from delaysvc.web.api import services
from delaysvc.web.ui import admin_required, done, timeout_ms, ui
from delaysvc.web.ui_format import (
    backlog_chart,
    history_view,
    lane_row,
    lateness_chart,
    relative,
    schedule_row,
    topic_row,
    when,
)
from delaysvc.worker.limits import all_limits, set_limits


def overview_data() -> dict[str, Any]:
    with dash.bounded(services()["engine"], timeout_ms()) as conn:
        lanes = store.lane_stats(conn)
        rates = dash.lane_rates(conn)
        now = lanes[0].now if lanes else store.clock_now(conn)
        samples = dash.backlog_series(conn, now=now)
        lateness = dash.lateness_distribution(conn, now=now)
        unhandled = store.unhandled_ready(conn)
    return {
        "warnings": [
            f"{ready:,} ready message{'s' if ready != 1 else ''} of {topic} wait: no live "
            "worker has a handler for this topic"
            for topic, ready in unhandled
        ],
        "lanes": [lane_row(lane, rates.get(lane.lane)) for lane in lanes],
        "backlog": backlog_chart(samples, now, dash.CHART_WINDOW),
        "lateness": lateness_chart(lateness),
    }


@ui.get("/")
def overview() -> Any:
    return render_template("overview.html", data=overview_data())


@ui.get("/ui/overview.json")
def overview_json() -> Any:
    return jsonify(overview_data())


@ui.post("/lanes/<int:lane>/skip-head")
@admin_required
def skip_head(lane: int) -> Any:
    try:
        with dash.bounded(services()["engine"], timeout_ms()) as conn:
            skipped = store.skip_stuck_head(conn, lane)
    except DelaysvcError as exc:
        done(f"not skipped: {exc}")
    else:
        name = "the timer lane" if lane == 0 else f"level {lane}"
        done(f"message {skipped} moved from {name} to the dead letters")
    return redirect(url_for("dashboard.ui.overview"))


def topics_data() -> dict[str, Any]:
    with dash.bounded(services()["engine"], timeout_ms()) as conn:
        rows = store.topic_stats(conn)
        durations = store.recent_durations(conn)
    return {"topics": [topic_row(topic_json(row, durations.get(row.topic))) for row in rows]}


@ui.get("/topics")
def topics() -> Any:
    engine = services()["engine"]
    found = all_limits(engine)
    return render_template("topics.html", data=topics_data(), limits=found, caps=all_caps(engine))


@ui.post("/topics/caps")
@admin_required
def set_backlog_cap() -> Any:
    form = request.form
    try:
        scope, target = parse_target(form.get("target", "").strip())
        limit = params.int_arg(form, "max_waiting", None, 1, MAX_WAITING, blank=True)
        policy = form.get("policy", "").strip() or None
        found = set_cap(services()["engine"], scope, target, limit, policy if limit else None)
    except ValidationError as exc:
        done(f"not changed: {exc}")
    else:
        what = f"at most {found.limit} waiting, {found.policy}" if found else "no cap"
        done(f"{scope}:{target}: {what}")
    return redirect(url_for("dashboard.ui.topics"))


@ui.post("/topics/limits")
@admin_required
def set_topic_limits() -> Any:
    form = request.form
    try:
        running = params.int_arg(form, "max_running", None, 1, 100_000, blank=True)
        found = set_limits(
            services()["engine"],
            form.get("topic", "").strip(),
            max_running=running,
            rate=form.get("rate", "").strip() or None,
        )
    except ValidationError as exc:
        done(f"not changed: {exc}")
    else:
        running_text = f"at most {found.max_running} running" if found.max_running else "any"
        rate_text = f"{found.rate_per_s:g} starts/s" if found.rate_per_s else "no rate limit"
        done(f"{found.topic}: {running_text}, {rate_text}")
    return redirect(url_for("dashboard.ui.topics"))


@ui.get("/ui/topics.json")
def topics_json() -> Any:
    return jsonify(topics_data())


def _set_paused(topic: str, paused: bool) -> Any:
    validate_topic(topic)
    with dash.bounded(services()["engine"], timeout_ms()) as conn:
        store.set_topic_paused(conn, topic, paused)
    done(f"{topic} {'paused: workers take no new jobs of it' if paused else 'resumed'}")
    return redirect(url_for("dashboard.ui.topics"))


@ui.post("/topics/<topic>/pause")
@admin_required
def pause_topic(topic: str) -> Any:
    return _set_paused(topic, True)


@ui.post("/topics/<topic>/resume")
@admin_required
def resume_topic(topic: str) -> Any:
    return _set_paused(topic, False)


@ui.get("/schedules")
def schedules() -> Any:
    with dash.bounded(services()["engine"], timeout_ms()) as conn:
        now = store.clock_now(conn)
    rows = [schedule_row(row, now) for row in Schedules(services()["engine"]).list()]
    return render_template("schedules.html", schedules=rows, when=when, relative=relative, now=now)


def _pause_schedule(name: str, paused: bool) -> Any:
    schedules = Schedules(services()["engine"])
    try:
        row = schedules.pause(name) if paused else schedules.resume(name)
    except DelaysvcError as exc:
        done(f"not changed: {exc}")
    else:
        done(f"{name} paused" if paused else f"{name} resumed: next run {when(row.next_tick)} UTC")
    return redirect(url_for("dashboard.ui.schedules"))


@ui.post("/schedules/<name>/pause")
@admin_required
def pause_schedule(name: str) -> Any:
    return _pause_schedule(name, True)


@ui.post("/schedules/<name>/resume")
@admin_required
def resume_schedule(name: str) -> Any:
    return _pause_schedule(name, False)


def history_args() -> tuple[int, str | None]:
    """?days= one of HISTORY_DAYS (default 7), ?topic= a topic name or empty."""
    days = params.choice_arg(request.args, "days", 7, dash.HISTORY_DAYS)
    topic = request.args.get("topic", "").strip() or None
    if topic is not None:
        validate_topic(topic)
    return days, topic


def history_data(days: int, topic: str | None) -> dict[str, Any]:
    with dash.bounded(services()["engine"], timeout_ms()) as conn:
        rows = dash.report_history(conn, days, topic)
        now = store.clock_now(conn)
    return history_view(rows, now, days)


@ui.get("/history")
def history() -> Any:
    days, topic = history_args()
    return render_template(
        "history.html",
        data=history_data(days, topic),
        days=days,
        topic=topic or "",
        choices=dash.HISTORY_DAYS,
        poll=url_for("dashboard.ui.history_json", days=days, topic=topic),
    )


@ui.get("/ui/history.json")
def history_json() -> Any:
    return jsonify(history_data(*history_args()))
