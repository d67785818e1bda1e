"""Messages: search (keyset pages by id), one message with its timeline and body, cancel."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from flask import jsonify, redirect, render_template, request, url_for
from werkzeug.datastructures import MultiDict

from delaysvc.config.validation import validate_topic
from delaysvc.errors import DelaysvcError, ValidationError
from delaysvc.schema.tables import STATUSES
from delaysvc.store import dashboard as dash
from delaysvc.web import params
from delaysvc.web.api import services
from delaysvc.web.ui import admin_required, done, timeout_ms, ui
from delaysvc.web.ui_format import body_text, message_cells, message_view, when

SEARCH_FIELDS = ("id", "topic", "key", "status", "from", "to", "limit")
PAGE_SIZES = (20, 50, 100, 200)


def _int(args: MultiDict[str, str], name: str) -> int | None:
    """A message id or a page size; an empty field is none."""
    return params.int_arg(args, name, None, 0, blank=True)


def _time(args: MultiDict[str, str], name: str) -> datetime | None:
    """`2026-11-23T07:16` (a datetime-local field, read as UTC) or ISO 8601 with an offset."""
    value = args.get(name, "").strip()
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValidationError(name, f"{value!r} is not a time like 2026-11-23T07:16") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def parse_search(args: MultiDict[str, str]) -> dash.MessageSearch:
    status = args.get("status", "").strip() or None
    if status is not None and status not in STATUSES:
        raise ValidationError("status", f"{status!r} is not one of {', '.join(STATUSES)}")
    limit = _int(args, "limit") or 50
    topic = args.get("topic", "").strip() or None
    return dash.MessageSearch(
        id=_int(args, "id"),
        topic=None if topic is None else validate_topic(topic),
        key=args.get("key", "").strip() or None,
        status=status,
        stored_from=_time(args, "from"),
        stored_to=_time(args, "to"),
        before=_int(args, "before"),
        after=_int(args, "after"),
        limit=min(limit, dash.MAX_PAGE),
    )


@ui.get("/messages")
def messages() -> Any:
    filters = {name: request.args.get(name, "") for name in SEARCH_FIELDS}
    try:
        search = parse_search(request.args)
    except ValidationError as exc:
        return render_template(
            "messages.html",
            filters=filters,
            error=str(exc),
            rows=[],
            page=None,
            statuses=STATUSES,
            page_sizes=PAGE_SIZES,
        ), 400
    with dash.bounded(services()["engine"], timeout_ms()) as conn:
        page = dash.search_messages(conn, search)
    kept: dict[str, Any] = {name: value for name, value in filters.items() if value}
    return render_template(
        "messages.html",
        filters=filters,
        error=None,
        rows=[message_cells(row) for row in page.rows],
        page=page,
        older_url=url_for("dashboard.ui.messages", **kept, before=page.older)
        if page.older
        else None,
        newer_url=url_for("dashboard.ui.messages", **kept, after=page.newer)
        if page.newer
        else None,
        newest_url=url_for("dashboard.ui.messages", **kept),
        statuses=STATUSES,
        page_sizes=PAGE_SIZES,
    )


@ui.get("/messages/<int:message_id>")
def message(message_id: int) -> Any:
    found = services()["producer"].get(message_id)
    return render_template(
        "message.html",
        message=found,
        view=message_view(found),
        body=body_text(found),
        when=when,
    )


@ui.get("/ui/messages/<int:message_id>.json")
def message_json(message_id: int) -> Any:
    return jsonify(message_view(services()["producer"].get(message_id)))


@ui.post("/messages/<int:message_id>/cancel")
@admin_required
def cancel(message_id: int) -> Any:
    try:
        services()["producer"].cancel(message_id)
    except DelaysvcError as exc:
        done(f"not cancelled: {exc}")
    else:
        done(f"message {message_id} cancelled")
    return redirect(url_for("dashboard.ui.message", message_id=message_id))
