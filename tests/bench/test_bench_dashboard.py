"""The dashboard suite at a toy size: the set-based fill is shaped as the service stores
messages (pages render it), and every timed page answers 200. Its full size (10M rows) is
`delaysvc bench dashboard`; figures in docs/reliability.md."""

from __future__ import annotations

from sqlalchemy import Engine, text

from delaysvc.bench import BenchContext
from delaysvc.bench.dashboard import dashboard_suite
from delaysvc.config.settings import Settings
from delaysvc.schema.migrate import upgrade


def test_dashboard_suite_times_every_page_over_a_filled_database(
    settings: Settings, engine: Engine, database_url: str
) -> None:
    settings = settings.model_copy(update={"delay_levels": "1s 10m 1h"})
    upgrade(engine, settings.levels)  # the test database has 5 short levels: add long ones
    ctx = BenchContext(settings, engine, database_url, {"dashboard_rows": 4_000})
    result = dashboard_suite(ctx).results["dashboard"]
    assert {page: t["status"] for page, t in result["pages_ms"].items()} == {
        page: 200 for page in result["pages_ms"]
    }
    assert len(result["pages_ms"]) == 16
    with engine.connect() as conn:
        statuses = dict(conn.execute(text("SELECT status, count(*) FROM message GROUP BY 1")).all())
        dead_letters = conn.execute(text("SELECT count(*) FROM dead_letter")).scalar_one()
    assert statuses == {"scheduled": 2_000, "succeeded": 1_880, "cancelled": 100, "dead": 20}
    assert dead_letters == 20
