"""Where a send_batch of 10,000 spends Python's time, without a database: the client CPU of each
step of `delaysvc.producer.batching`, Python's cyclic GC off (it is measured beside, in
`side_by_side.py --gc-off`), the best of 7 runs each.

    python docs/benchmarks/2026-11-27-send-batch-copy/python_costs.py

- check: `batching.prepare`, every item but its body;
- encode: the bodies encoded (`config.validation.encode_body`, a JSON encoder made per body);
- rows: the COPY loop's own work, the rows built and handed to a COPY that drops them (the
  statements stubbed out: what psycopg's `write_row` costs is timed apart, on a real COPY);
- messages: the Messages returned (`Message.sent`; `sent_in_batch` when this was run).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from delaysvc.config.settings import Settings
from delaysvc.config.validation import encode_body
from delaysvc.producer import batching
from delaysvc.store.batches import Reserved

SIZE = 10_000


def best_ms(step: Callable[[], object]) -> float:
    runs = []
    for _ in range(7):
        started = time.process_time()
        step()
        runs.append(time.process_time() - started)
    return round(min(runs) * 1000, 1)


class _Dropped:
    def write_row(self, row: Any) -> None:
        pass


@contextlib.contextmanager
def _dropping(cursor: Any, table: str, row: Any) -> Iterator[_Dropped]:
    yield _Dropped()


def main() -> None:
    settings = Settings(database_url="postgresql://unused@localhost/unused")
    now = datetime.now(UTC)
    given = [
        {"topic": "bench.noop", "body": {"order_id": n, "action": "cancel"}, "delay": "1h"}
        for n in range(SIZE)
    ]
    gc.disable()
    items = batching.prepare(given, settings, now)
    plan = batching._Plan(list(range(SIZE)), {}, {}, {items[0].lane: SIZE})
    ids = list(range(SIZE))
    costs = {
        "check": best_ms(lambda: batching.prepare(given, settings, now)),
        "encode": best_ms(lambda: [encode_body(i.body, settings.max_body_bytes) for i in items]),
        "messages": best_ms(lambda: batching._made(items, plan, ids, now, [now] * SIZE)),
    }
    batching.batches.copying = _dropping  # type: ignore[assignment]
    batching.batches.copy_rows = lambda cursor, table, row, rows: [None for _ in rows]  # type: ignore[assignment]
    batching.batches.reserve = lambda cursor, count, lanes: Reserved(now, ids, ids)  # type: ignore[assignment]
    batching.batches.count_into_lanes = lambda cursor, counts: None  # type: ignore[assignment]
    whole = best_ms(lambda: batching._copied(None, items, plan, settings.max_body_bytes))  # type: ignore[arg-type]
    costs["rows"] = round(whole - costs["encode"] - costs["messages"], 1)
    print(json.dumps({"ms_per_10000": costs, "us_per_message": {
        k: round(v * 1000 / SIZE, 2) for k, v in costs.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
