"""The `dashboard` suite: is the dashboard still quick with `--dashboard-rows` messages (10M at
full size) in the tables?

Half of them wait in the lanes (written as the `scale` suite writes its backlog), half are
finished (94% succeeded, 5% cancelled, 1% dead with their dead letters) over ten topics,
written into `commit_log` and moved into the history by the sweep, as beat would. Then every
page and JSON endpoint an operator or a probe uses is requested through the real Flask app
(logged in as an admin) and timed, including message searches that walk the ids deep into
the tables."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from delaysvc import auth
from delaysvc.bench.progress import Progress, step
from delaysvc.bench.scale import FILL_CHUNK, LONG_LEVEL_MS, _fill_backlog
from delaysvc.bench.suites import Figures
from delaysvc.db.names import sql
from delaysvc.maintenance import history
from delaysvc.store import dashboard as dash

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext

TOPICS = 10
REQUESTS = 15
USER = ("bench", "bench-password-1")


def dashboard_suite(ctx: BenchContext) -> Figures:
    rows = ctx.size("dashboard_rows")
    levels = [
        n
        for n in range(1, ctx.settings.levels.max_level + 1)
        if ctx.settings.levels.delay_ms(n) >= LONG_LEVEL_MS
    ]
    step(f"dashboard: writing {rows // 2:,} pending and {rows - rows // 2:,} finished messages")
    _fill_backlog(ctx.engine, rows // 2, levels, ctx.settings)
    _fill_finished(ctx.engine, rows - rows // 2)
    history.move_all(ctx.engine)
    with ctx.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sql("VACUUM ANALYZE"))
    for _ in range(3):
        dash.sample_stats(ctx.engine)
    with ctx.engine.connect() as conn:
        newest, table_bytes = conn.execute(
            sql(
                "SELECT max(id), pg_total_relation_size('delaysvc.commit_log') FROM "
                "delaysvc.message"
            )
        ).one()
    pages = [
        "/",
        "/ui/overview.json",
        "/topics",
        "/ui/topics.json",
        "/messages",
        f"/messages?before={newest // 2}",
        "/messages?topic=bench.dash.3",
        "/messages?status=dead",
        f"/messages/{newest // 3}",
        "/dead",
        "/dead?topic=bench.dash.1",
        "/history",
        "/metrics",
        "/healthz",
        "/api/v1/topics",
        "/api/v1/levels",
    ]
    step(f"dashboard: {len(pages)} pages, {REQUESTS} requests each")
    timings = _time_pages(ctx, pages)
    worst = max(t["p95"] for t in timings.values())
    return Figures(
        results={
            "dashboard": {
                "rows": rows,
                "commit_log_bytes": int(table_bytes),
                "requests_per_page": REQUESTS,
                "pages_ms": timings,
                "worst_p95_ms": worst,
            }
        }
    )


def _fill_finished(engine: Engine, count: int) -> None:
    """`count` finished messages (and the dead letters of the dead ones), set-based."""
    progress = Progress("finished", count)
    for chunk in range(0, count, FILL_CHUNK):
        size = min(FILL_CHUNK, count - chunk)
        with engine.begin() as conn:
            conn.execute(
                sql(
                    """
WITH m AS (
    INSERT INTO delaysvc.commit_log (topic, key, body, body_is_json, delay_level, lane, status,
        stored_at, deliver_ts, delivered_at, started_at, finished_at, attempts, duration_ms,
        last_error)
    SELECT 'bench.dash.' || (g % :topics), 'order-' || (:start + g), :body, true, 3, 3,
        CASE WHEN g % 100 < 94 THEN 'succeeded' WHEN g % 100 < 99 THEN 'cancelled'
             ELSE 'dead' END,
        t - interval '10 s', t, t + interval '3 ms', t + interval '5 ms',
        t + interval '9 ms', CASE WHEN g % 100 < 94 THEN 1 ELSE 0 END, 4,
        CASE WHEN g % 100 >= 99 THEN 'ConnectionError: billing API unreachable' END
    FROM generate_series(1, :size) g,
         LATERAL (SELECT now() - interval '7 days' + (:start + g) * interval '50 ms') AS x(t)
    RETURNING id, topic, status, finished_at
)
INSERT INTO delaysvc.dead_letter (message_id, topic, died_at, reason, attempts, error)
SELECT id, topic, finished_at, 'retries exhausted', 17,
    'ConnectionError: billing API unreachable' FROM m WHERE status = 'dead'
"""
                ),
                {"topics": TOPICS, "start": chunk, "size": size, "body": b'{"order_id": 42}'},
            )
        progress.update(chunk + size)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sql("VACUUM ANALYZE"))
    progress.done()


def _time_pages(ctx: BenchContext, pages: list[str]) -> dict[str, dict[str, Any]]:
    from delaysvc.web import create_app

    auth.create_user(ctx.engine, *USER, role="admin")
    token = auth.create_token(ctx.engine, "bench-dashboard", scope="admin")
    app = create_app(ctx.settings.model_copy(update={"var_dir": Path("var")}))
    client = app.test_client()
    form = client.get("/login").text
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', form)
    assert csrf is not None
    client.post("/login", data={"name": USER[0], "password": USER[1], "csrf_token": csrf.group(1)})
    timings = {}
    try:
        for page in pages:
            headers = {"Authorization": f"Bearer {token}"} if page.startswith("/api/") else {}
            spent, status = [], 0
            for _ in range(REQUESTS):
                began = time.perf_counter()
                status = client.get(page, headers=headers).status_code
                spent.append((time.perf_counter() - began) * 1000)
            ordered = sorted(spent)
            timings[page] = {
                "status": status,
                "p50": round(statistics.median(ordered), 1),
                "p95": round(ordered[int(0.95 * (len(ordered) - 1))], 1),
                "max": round(ordered[-1], 1),
            }
    finally:
        app.extensions["delaysvc"]["engine"].dispose()
    return timings
