"""How long migration 0018 (the status rule as a domain) holds the commit log locked, with N
waiting messages in it.

A database of its own is migrated to 0017, N messages are written into the commit log in one
statement (1% running, 1% retrying, the rest waiting in level 1, due one millisecond apart, 50
topics), and the upgrade to the head is timed: the three partial indexes naming `status` are
built again inside it, while the commit log is locked.

Run from the repository root:
    python docs/benchmarks/2026-11-28-status-domain/lock_time.py N [SERVER_URL]
(default postgresql://root@127.0.0.1:5432/postgres).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scratch import scratch_database

from delaysvc.schema.migrate import upgrade

N = int(sys.argv[1])
SERVER = sys.argv[2] if len(sys.argv) > 2 else "postgresql://root@127.0.0.1:5432/postgres"

WAITING = """
INSERT INTO delaysvc.commit_log (topic, body, body_is_json, delay_level, lane, queue_offset,
    status, deliver_ts)
SELECT 'topic.' || (g % 50), '\\x7b7d', true, 1, 1, g,
    CASE g % 100 WHEN 0 THEN 'running' WHEN 1 THEN 'retrying' ELSE 'scheduled' END,
    now() + g * interval '1 millisecond'
FROM generate_series(1, :n) g
"""


def main() -> None:
    with scratch_database(SERVER, "delaysvc_lock_time", revision="0017") as (engine, settings):
        with engine.begin() as conn:
            conn.execute(text(WAITING), {"n": N})
        started = time.perf_counter()
        upgrade(engine, settings.levels)
        took = time.perf_counter() - started
    print(f"{N:,} messages in the commit log: the upgrade 0017 -> head took {took:.2f} s")


if __name__ == "__main__":
    main()
