"""The dashboard in a real headless Chromium (Playwright, Debian's /usr/bin/chromium) against
a real server (werkzeug, threaded) and a real database: refused without login, log in, watch
the backlog grow without a reload, pause a topic, cancel a message, redrive a dead letter.
Each test saves screenshots of the pages it visits in a temporary folder;
`DELAYSVC_TEST_SCREENSHOTS=docs/screenshots` saves them where the README shows them.
Waits are on the DOM (Playwright's `expect`), never on sleeps."""

from __future__ import annotations

import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from playwright.sync_api import Browser, Page, Playwright, expect, sync_playwright
from sqlalchemy import Engine, text
from werkzeug.serving import make_server

from delaysvc import auth, store
from delaysvc.config.settings import Settings
from delaysvc.errors import MissingPart
from delaysvc.producer.aio import AsyncSends
from delaysvc.producer.sending import Producer
from delaysvc.runtime.supervisor import free_port, wait_until_answering
from delaysvc.store import dashboard as dash
from delaysvc.web import create_app
from delaysvc.web.asgi import AsgiApp
from delaysvc.worker.consumer import Consumer, handler
from tests.support.passes import first_pass_only

SCREENSHOTS = Path(
    os.environ.get("DELAYSVC_TEST_SCREENSHOTS")
    or Path(tempfile.gettempdir()) / "delaysvc-screenshots"
)
CHROMIUM = Path(os.environ.get("DELAYSVC_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]
ADMIN = ("ada", "admin-password-1")
REFRESH_MS = 400

expect.set_options(timeout=10_000)
pytestmark = first_pass_only(
    "~18 s, the pages' scripts in Chromium, the same on either server (their queries run on "
    "both in tests/integration/dashboard)"
)


@handler("shop.invoice", max_retries=0)
def _invoice(message: Any) -> None:
    raise ConnectionError(f"billing API unreachable ({message.body['host']})")


def launch_chromium(playwright: Playwright) -> Browser:
    """Debian's Chromium, headless. Without it the browser tests are skipped, or fail where
    the machine's parts are required (CI installs it: tests/support/machine.py), with one line
    saying what to install (not Playwright's stack trace)."""
    if not CHROMIUM.is_file():
        raise MissingPart(
            f"Chromium is not at {CHROMIUM}: apt-get install chromium "
            "(or set DELAYSVC_TEST_CHROMIUM to a Chromium elsewhere)"
        )
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


@pytest.fixture(params=["wsgi", "asgi"])
def server(
    request: pytest.FixtureRequest, settings: Settings, engine: Engine, tmp_path: Path
) -> Iterator[str]:
    """The app served as `delaysvc web` serves it: its WSGI app (werkzeug's threaded server
    here), or, as `--server asgi` does, the ASGI app on an event loop (uvicorn here), the
    dashboard's pages answered through a2wsgi's adapter."""
    auth.create_user(engine, *ADMIN, role="admin")
    app = create_app(settings.model_copy(update={"var_dir": tmp_path / "var"}))
    app.config["DASHBOARD_REFRESH_MS"] = REFRESH_MS
    app.config["DASHBOARD_HISTORY_REFRESH_MS"] = REFRESH_MS
    if request.param == "wsgi":
        http = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=http.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{http.server_port}"
        http.shutdown()
        thread.join()
    else:
        services = app.extensions["delaysvc"]
        asgi = AsgiApp(app, AsyncSends(services["producer"]), services["engine"])
        port = free_port()
        loop = uvicorn.Server(
            uvicorn.Config(asgi, host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=loop.run, daemon=True)
        thread.start()
        assert wait_until_answering(f"http://127.0.0.1:{port}/healthz")
        yield f"http://127.0.0.1:{port}"
        loop.should_exit = True
        thread.join()
    app.extensions["delaysvc"]["engine"].dispose()


@pytest.fixture
def page(browser: Browser, server: str) -> Iterator[Page]:
    """A fresh browser context; it closes before the server stops."""
    context = browser.new_context(viewport={"width": 1366, "height": 768})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on(
        "console",
        lambda msg: (
            problems.append(f"console {msg.type}: {msg.text}")
            # a 401 answer to a wrong password is logged as a failed load, not a script error
            if msg.type == "error" and not msg.text.startswith("Failed to load resource")
            else None
        ),
    )
    yield page
    context.close()
    assert problems == []  # no script errors, no CSP violations


def log_in(page: Page, base: str, user: tuple[str, str] = ADMIN) -> None:
    page.goto(base + "/login")
    page.fill("input[name=name]", user[0])
    page.fill("input[name=password]", user[1])
    page.click("button[type=submit]")
    expect(page.locator("#user")).to_have_text(f"{user[0]} (admin)")


def shot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def line_pieces_inside_the_plot(page: Page, chart: str) -> list[int]:
    """Each line of the chart `chart` (an svg id): straight segments only (`M x y L x y ...`,
    no curve that could swing past its samples), every vertex inside the plot area, whose
    value range the grid spans (a line at 0, the lowest, to one at the axis's maximum);
    -> how many pieces each line is in (a gap between samples starts a new one)."""
    grid = page.locator(f"#{chart} line.grid").evaluate_all(
        "lines => lines.map(l => [l.x1.baseVal.value, l.x2.baseVal.value, l.y1.baseVal.value])"
    )
    left, right = min(g[0] for g in grid), max(g[1] for g in grid)
    top, bottom = min(g[2] for g in grid), max(g[2] for g in grid)
    assert (right - left, bottom - top) == (570, 200)  # the whole plot area, axis 0 to max
    pieces = []
    for d in page.locator(f"#{chart} path.series").evaluate_all(
        "paths => paths.map(p => p.getAttribute('d'))"
    ):
        commands = re.findall(r"([A-Za-z])\s*([^A-Za-z]*)", d)
        assert {letter for letter, _ in commands} <= {"M", "L"}, d
        assert commands[0][0] == "M", d
        for _, numbers in commands:
            x, y = (float(n) for n in numbers.split())
            assert left <= x <= right and top <= y <= bottom, (chart, d, (x, y))
        pieces.append(sum(letter == "M" for letter, _ in commands))
    return pieces


def test_refused_without_login_then_log_in_lands_on_the_page_asked_for(
    page: Page, server: str
) -> None:
    page.goto(server + "/dead")
    assert page.url == server + "/login?next=/dead"
    expect(page.locator("h1")).to_have_text("Log in")
    assert page.request.get(server + "/ui/overview.json").status == 401
    shot(page, "login")
    page.fill("input[name=name]", ADMIN[0])
    page.fill("input[name=password]", "not-the-password")
    page.click("button[type=submit]")
    expect(page.locator("#login-error")).to_have_text(
        "wrong name or password (or the account is locked for a few minutes)"
    )
    page.fill("input[name=name]", ADMIN[0])
    page.fill("input[name=password]", ADMIN[1])
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Dead letters")
    assert page.url == server + "/dead"
    page.click("text=Log out")
    expect(page.locator("#flash")).to_have_text("logged out")
    page.goto(server + "/")
    assert page.url == server + "/login?next=/"


def _seed_history(engine: Engine) -> None:
    """An hour of samples every 10 s, as beat takes them, but for the five minutes beat was
    down, and of lateness minutes, so the charts have something to draw. Each lane's backlog
    falls to 0 at the end: a line curving between samples would swing below it."""
    with engine.begin() as conn:
        now = store.clock_now(conn)
        samples = []
        for seconds in range(3600, 110, -10):
            if 1500 < seconds < 1800:
                continue  # beat was down
            at, minute = now - timedelta(seconds=seconds), seconds / 60
            level1 = 20 + (60 - minute) * 5 if minute > 20 else (minute - 2) * 10
            level3 = 80 + seconds // 60 % 7 if minute > 12 else (minute - 2) * 8
            for lane, pending in ((1, level1), (3, level3), (0, 12)):
                samples.append({"at": at, "lane": lane, "pending": round(pending)})
        conn.execute(
            text(
                "INSERT INTO stats_sample (sampled_at, lane, pending, moved_total, early_total) "
                "VALUES (:at, :lane, :pending, 0, 0)"
            ),
            samples,
        )
        for minute in range(60, 0, -2):
            at = now - timedelta(minutes=minute)
            conn.execute(
                text(
                    "INSERT INTO lateness_histogram (minute, lane, counts, max_ms) "
                    "VALUES (:at, 1, :counts, 240)"
                ),
                {"at": at, "counts": [30, 50, 12, 5, 2, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0]},
            )


def test_overview_shows_the_backlog_grow_without_a_reload(
    page: Page, server: str, producer: Producer, engine: Engine
) -> None:
    _seed_history(engine)
    log_in(page, server)
    level2 = page.locator('#lanes tr[data-key="level-2"]')
    expect(level2.locator('[data-field="pending"]')).to_have_text("0")
    expect(page.locator("#backlog-chart-legend li")).to_have_text(
        ["level-1: 0", "level-3: 0", "timer: 12"]
    )
    expect(page.locator("#lateness-chart-summary")).to_have_text(
        "2929 deliveries; p50 ≤ 2 ms, p99 ≤ 50 ms, max 240 ms"
    )
    expect(page.locator("#backlog-chart path.series")).to_have_count(3)
    # straight lines inside the plot, each broken where beat was down
    assert line_pieces_inside_the_plot(page, "backlog-chart") == [2, 2, 2]
    expect(page.locator("#lateness-chart rect.bar")).to_have_count(15)
    page.evaluate("window.sameDocument = true")

    for n in range(3):
        producer.send("shop.email", {"n": n}, delay_level=2)
    producer.send("shop.email", {"n": 9}, delay="1h")
    expect(level2.locator('[data-field="pending"]')).to_have_text("3")
    expect(level2.locator('[data-field="offset"]')).to_have_text("0 / 3")
    expect(level2.locator('[data-field="next_due"]')).to_contain_text("in ")
    dash.sample_stats(engine)
    expect(page.locator('#backlog-chart-legend li[data-key="level-2"]')).to_have_text("level-2: 3")
    expect(page.locator("#backlog-chart path.series")).to_have_count(6)
    # the new sample comes 2 minutes after the seeded ones: a piece (a dot) of its own
    assert line_pieces_inside_the_plot(page, "backlog-chart") == [3, 1, 3, 1, 1, 3]
    expect(page.locator("#backlog-chart circle.lone")).to_have_count(6)
    assert page.evaluate("window.sameDocument") is True  # updated in place, never reloaded

    with engine.begin() as conn:
        store.mark_stuck(conn, 5, None, "DataError: value too long for type character varying")
    level5 = page.locator('#lanes tr[data-key="level-5"]')
    expect(level5.locator('[data-field="state"]')).to_have_text("STUCK")
    expect(level5.locator('[data-field="stuck_error"]')).to_have_text(
        "DataError: value too long for type character varying"
    )
    expect(level5.locator("button", has_text="Skip head to dead letters")).to_be_visible()
    expect(level2.locator("button", has_text="Skip head to dead letters")).to_be_hidden()
    shot(page, "overview")


def test_topic_appears_live_and_admin_pauses_it(
    page: Page, server: str, producer: Producer
) -> None:
    log_in(page, server)
    page.click("nav >> text=Topics")
    expect(page.locator("#no-topics")).to_be_visible()
    producer.send("shop.email", {"to": "a@example.com"})
    producer.send("shop.email", {"to": "b@example.com"})
    producer.send("shop.sms", {"to": "+441234"})
    row = page.locator('#topics tr[data-key="shop.email"]')
    expect(row.locator('[data-field="ready"]')).to_have_text("2")
    expect(page.locator("#topics tbody tr")).to_have_count(2)
    expect(page.locator("#no-topics")).to_be_hidden()
    row.locator("button", has_text="Pause").click()
    expect(page.locator("#flash")).to_have_text("shop.email paused: workers take no new jobs of it")
    expect(row.locator('[data-field="state"]')).to_have_text("paused")
    expect(row.locator("button", has_text="Resume")).to_be_visible()
    expect(row.locator("button", has_text="Pause")).to_be_hidden()
    shot(page, "topics")


def test_a_schedule_shows_its_runs_live_and_admin_pauses_it(
    page: Page, server: str, engine: Engine
) -> None:
    from delaysvc.maintenance.periodic import Schedules, fire_due, schedule

    schedules = Schedules(engine)
    schedules.put(schedule("shop.digest", "0 8 * * *", topic="shop.email", timezone="Europe/Paris"))
    log_in(page, server)
    page.click("nav >> text=Schedules")
    row = page.locator('#schedules tr[data-name="shop.digest"]')
    expect(row.locator(".last-run")).to_have_text("-")
    expect(row.locator(".next-run")).to_contain_text("(in ")
    fire_due(engine, now=schedules.get("shop.digest").next_tick)  # as beat would at 08:00
    expect(row.locator(".last-run a")).to_be_visible()  # the page refreshed in place
    row.locator("button", has_text="Pause").click()
    expect(page.locator("#flash")).to_have_text("shop.digest paused")
    expect(row.locator(".next-run")).to_have_text("paused")
    expect(row.locator("button", has_text="Resume")).to_be_visible()
    shot(page, "schedules")


def test_find_a_message_and_cancel_it(page: Page, server: str, producer: Producer) -> None:
    sent = [
        producer.send("shop.order.cancel", {"order": n}, delay="30m", key=f"order-{n}")
        for n in range(40, 45)
    ]
    log_in(page, server)
    page.click("nav >> text=Messages")
    page.fill("input[name=topic]", "shop.order.cancel")
    page.fill("input[name=key]", "order-42")
    page.click("#search button[type=submit]")
    expect(page.locator("#messages tbody tr")).to_have_count(1)
    page.fill("input[name=key]", "")
    page.click("#search button[type=submit]")
    expect(page.locator("#messages tbody tr")).to_have_count(5)
    shot(page, "messages")
    page.evaluate("window.sameDocument = true")
    newest = producer.send("shop.order.cancel", {"order": 45}, delay="30m", key="order-45")
    expect(page.locator("#messages tbody tr").first).to_have_attribute("data-key", str(newest.id))
    expect(page.locator("#messages tbody tr")).to_have_count(6)
    producer.cancel(newest.id)
    expect(page.locator(f'#messages tr[data-key="{newest.id}"] .status')).to_have_text("cancelled")
    assert page.evaluate("window.sameDocument") is True  # refreshed in place, never reloaded
    page.click(f'#messages a:text-is("{sent[2].id}")')
    expect(page.locator("h1")).to_have_text(f"Message {sent[2].id}")
    expect(page.locator('[data-field="status"]')).to_have_text("scheduled")
    page.click("#cancel")
    expect(page.locator("#flash")).to_have_text(f"message {sent[2].id} cancelled")
    expect(page.locator('[data-field="status"]')).to_have_text("cancelled")
    expect(page.locator("#cancel")).to_be_hidden()
    expect(page.locator("#timeline li strong")).to_have_text(["stored", "cancelled", "due"])
    assert producer.get(sent[2].id).status == "cancelled"
    assert [producer.get(m.id).status for m in sent] == ["scheduled"] * 2 + ["cancelled"] + [
        "scheduled"
    ] * 2


def test_a_key_of_256_characters_wraps_inside_the_message_page(
    page: Page, server: str, producer: Producer
) -> None:
    """A key of the most characters allowed, with no place to break, widened the message page
    to 2,054 px in a 1,400 px window (found by a reviewer)."""
    sent = producer.send("shop.order.cancel", {}, delay="30m", key="K" * 256)
    page.set_viewport_size({"width": 1400, "height": 900})
    log_in(page, server)
    page.goto(server + f"/messages/{sent.id}")
    expect(page.locator('[data-field="key"]')).to_have_text("K" * 256)
    assert page.evaluate("document.documentElement.scrollWidth") <= 1400


def test_redrive_a_dead_letter(
    page: Page, server: str, producer: Producer, engine: Engine, settings: Settings
) -> None:
    ids = [producer.send("shop.invoice", {"host": h}).id for h in ("eu-1", "eu-1", "us-2")]
    Consumer(settings, engine).run_once("shop.invoice")
    log_in(page, server)
    page.goto(server + f"/messages/{ids[0]}")
    expect(page.locator("#timeline li strong")).to_have_text(
        ["stored", "due", "delivered", "attempt 1 started", "attempt 1 failed", "dead"]
    )
    shot(page, "message")
    page.click("nav >> text=Dead letters")
    groups = page.locator("#dead-groups tbody tr")
    expect(groups).to_have_count(2)
    expect(groups.nth(0).locator("td.clip")).to_have_text(
        "ConnectionError: billing API unreachable (eu-1)"
    )
    expect(groups.nth(0).locator("td.num")).to_have_text("2")
    shot(page, "dead-letters")
    page.evaluate("window.sameDocument = true")
    page.check(f'#dead-letters input[type=checkbox][value="{ids[2]}"]')
    later = producer.send("shop.invoice", {"host": "ap-3"}).id
    Consumer(settings, engine).run_once("shop.invoice")
    expect(groups).to_have_count(3)  # a new letter and its group appear without a reload
    expect(page.locator(f'#dead-letters tr[data-key="{later}"]')).to_have_count(1)
    expect(page.locator(f'#dead-letters input[type=checkbox][value="{ids[2]}"]')).to_be_checked()
    expect(page.locator(f'#dead-letters input[type=checkbox][value="{later}"]')).not_to_be_checked()
    assert page.evaluate("window.sameDocument") is True
    groups.nth(0).locator("a", has_text="Show").click()
    expect(page.locator("#dead-letters tbody tr")).to_have_count(2)
    page.locator(f'#dead-letters tr[data-key="{ids[1]}"] button.redrive-one').click()
    expect(page.locator("#flash")).to_have_text(f"1 redriven ({ids[1]})")
    expect(page.locator("#dead-letters tbody tr")).to_have_count(1)
    expect(page.locator("#dead-groups tr.selected td.num")).to_have_text("1")
    assert [producer.get(i).status for i in ids] == ["dead", "ready", "dead"]


def test_a_ticked_dead_letter_pushed_off_the_page_stays_ticked_and_is_redriven(
    page: Page, server: str, producer: Producer, engine: Engine, settings: Settings
) -> None:
    """The page shows the newest 50 letters, refreshed in place keeping the boxes ticked: a
    ticked letter pushed off the page by newer ones lost its tick at the next refresh, and
    "Redrive selected" then said "nothing selected" (found by a reviewer, letters arriving at
    20 a second). It stays on the page, ticked, until it is acted on."""
    first = producer.send("shop.invoice", {"host": "eu-1"}).id
    Consumer(settings, engine).run_once("shop.invoice")
    log_in(page, server)
    page.goto(server + "/dead")
    page.evaluate("window.sameDocument = true")
    box = f'#dead-letters input[type=checkbox][value="{first}"]'
    page.check(box)
    newer = [producer.send("shop.invoice", {"host": "eu-1"}).id for _ in range(55)]
    Consumer(settings, engine).run_once("shop.invoice")
    expect(page.locator(f'#dead-letters tr[data-key="{newer[-1]}"]')).to_have_count(1)
    refreshed = _refreshes(page)
    deadline = time.monotonic() + 10
    while _refreshes(page) < refreshed + 2:  # refreshed since the letter left the first page
        assert time.monotonic() < deadline, "the page stopped refreshing"
        time.sleep(0.1)
    expect(page.locator(box)).to_be_checked()
    assert page.evaluate("window.sameDocument") is True
    page.click("#redrive-selected")
    expect(page.locator("#flash")).to_have_text(f"1 redriven ({first})")
    assert producer.get(first).status == "ready"
    assert {producer.get(i).status for i in newer} == {"dead"}


def _refreshes(page: Page) -> int:
    return int(page.evaluate("document.body.dataset.refreshes || '0'"))


def _report_row(engine: Engine, hours_ago: int, topic: str, level: int, messages: int) -> None:
    with engine.begin() as conn:
        hour = store.clock_now(conn).replace(minute=0, second=0, microsecond=0)
        conn.execute(
            text(
                "INSERT INTO report_hourly (hour, topic, level, messages, lateness_p50_ms, "
                "lateness_p95_ms, lateness_p99_ms, lateness_max_ms, duration_p50_ms, "
                "duration_p95_ms, duration_p99_ms, retried, dead) VALUES (:hour, :topic, "
                ":level, :messages, 3, 8, :p99, :p99, 20, 35, :run, :messages / 20, 0)"
            ),
            {
                "hour": hour - timedelta(hours=hours_ago),
                "topic": topic,
                "level": level,
                "messages": messages,
                "p99": round(12 + level * 2 + 8 * math.sin(hours_ago / 5 + level), 1),
                "run": round(40 + level * 9 + 25 * math.cos(hours_ago / 7 + level), 1),
            },
        )


def test_history_page_draws_the_report_and_shows_a_new_report_without_a_reload(
    page: Page, server: str, engine: Engine
) -> None:
    for hours_ago in range(36, 0, -1):
        daily = math.sin(2 * math.pi * hours_ago / 24)
        _report_row(engine, hours_ago, "shop.email", 2, round(600 + 300 * daily))
        if not 17 <= hours_ago <= 20:  # no report rows for these hours: a gap, not a line
            _report_row(engine, hours_ago, "shop.order.cancel", 6, round(150 + 60 * daily))
    log_in(page, server)
    page.click("nav >> text=History")
    expect(page.locator("h1")).to_have_text("History")
    for chart in ("messages", "late-p99", "duration"):
        expect(page.locator(f"#{chart}-chart path.series")).to_have_count(2)
        assert line_pieces_inside_the_plot(page, f"{chart}-chart") == [1, 2]
    expect(page.locator("#messages-chart-legend li")).to_have_text(
        ["shop.email: 678", "shop.order.cancel: 166"]
    )
    expect(page.locator("#history tbody tr")).to_have_count(68)
    shot(page, "history")
    page.evaluate("window.sameDocument = true")
    _report_row(engine, 0, "shop.sms", 1, 9)  # the report ran again
    expect(page.locator("#history tbody tr").first.locator('[data-field="topic"]')).to_have_text(
        "shop.sms"
    )
    expect(page.locator("#messages-chart path.series")).to_have_count(3)
    assert page.evaluate("window.sameDocument") is True
    page.select_option("select[name=days]", "1")
    page.fill("input[name=topic]", "shop.email")
    page.click("#history-filter button[type=submit]")
    expect(page.locator("h1")).to_have_text("History of shop.email")
    expect(page.locator("#history tbody tr")).to_have_count(23)  # hours 1-23 ago
    expect(page.locator("#messages-chart path.series")).to_have_count(1)
