"""How near the single-send target the design's least write comes: each a call's wall time
beside the raw one-row insert's, measured in turn (issue 36: a single send at >= 60% of the
raw insert's rate at 1 client).

- the raw one-row insert (a two-column table with a primary key);
- the least a send of this design writes: a commit-log row (primary key, the key's unique
  index) and its row in a level's consume queue (primary key level + offset, the offset from
  the level's sequence), one statement;
- the service's commit-log row alone, into `delaysvc.commit_log` with all its indexes;
- `send_one`, the service's statement, alone;
- `Producer.send`.

All psycopg 3, prepared, each call its own autocommitted transaction on one held connection
(`Producer.send` on its pool).

    python docs/benchmarks/send_floor.py [SERVER_URL] [ROUNDS]

(`PGOPTIONS="-c synchronous_commit=off"` before it takes the disk's flush out of every call)

(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds); it works in a database of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import raw_insert_on, scratch_database, send_one_call, server_and_rounds
from timing import alternate, per_call_us

from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds()
N = 3000
BODY = {"order": 42}

LEAST = """
CREATE TABLE least_log (
    id bigserial PRIMARY KEY, topic text NOT NULL, key text, body bytea NOT NULL,
    lane smallint NOT NULL, queue_offset bigint, deliver_ts timestamptz NOT NULL,
    finished_at timestamptz
);
CREATE UNIQUE INDEX ON least_log (topic, key) WHERE key IS NOT NULL AND finished_at IS NULL;
CREATE TABLE least_queue (
    level smallint, queue_offset bigint, message_id bigint NOT NULL, deliver_ts timestamptz,
    PRIMARY KEY (level, queue_offset)
);
CREATE SEQUENCE least_queue_seq;
"""
LEAST_SEND = """
WITH m AS (
    INSERT INTO least_log (topic, key, body, lane, queue_offset, deliver_ts)
    VALUES (%s, NULL, %s, 1, nextval('least_queue_seq'), now() + interval '1 hour')
    RETURNING id, queue_offset, deliver_ts
)
INSERT INTO least_queue SELECT 1, queue_offset, id, deliver_ts FROM m RETURNING message_id
"""
LOG_ROW = """
INSERT INTO delaysvc.commit_log (topic, body, body_is_json, lane, queue_offset, status,
    deliver_ts)
VALUES (%s, %s, true, 0, NULL, 'scheduled', %s) RETURNING id
"""


def main() -> None:
    with scratch_database(SERVER, "delaysvc_send_floor") as (engine, settings):
        producer = Producer(settings, engine)
        send_one, params = send_one_call(producer.prepare("t", BODY, delay_level=1))
        conn = psycopg.connect(libpq_url(settings.database_url), autocommit=True)
        raw_insert = raw_insert_on(conn)
        conn.execute(LEAST)
        due = datetime.now().astimezone() + timedelta(days=400)  # never delivered here
        calls: dict[str, Callable[[], object]] = {
            "raw one-row insert": raw_insert,
            "least send: log row + queue row": lambda: conn.execute(
                LEAST_SEND, ("t", b"{}"), prepare=True
            ).fetchone(),
            "commit_log row alone": lambda: conn.execute(
                LOG_ROW, ("t", b"{}", due), prepare=True
            ).fetchone(),
            "send_one statement alone": lambda: conn.execute(
                send_one, params, prepare=True
            ).fetchone(),
            "Producer.send": lambda: producer.send("t", BODY, delay_level=1),
        }
        flush = conn.execute("SHOW synchronous_commit").fetchone()[0]  # PGOPTIONS may set it
        times = alternate(
            {name: partial(per_call_us, call, N) for name, call in calls.items()}, ROUNDS
        )
        conn.close()
    raw = times["raw one-row insert"]
    print(f"{N:,} calls a variant a round, {ROUNDS} rounds, synchronous_commit={flush}")
    print(f"{'call':34} {'us median':>9} {'min':>7} {'max':>7}  share of the raw insert's rate")
    for name, values in times.items():
        shares = sorted(r / v for r, v in zip(raw, values, strict=True))
        ordered = sorted(values)
        print(
            f"{name:34} {ordered[len(ordered) // 2]:9.1f} {ordered[0]:7.1f} {ordered[-1]:7.1f}  "
            f"{shares[len(shares) // 2]:.0%} ({shares[0]:.0%}-{shares[-1]:.0%})"
        )


if __name__ == "__main__":
    main()
