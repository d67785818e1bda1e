"""What a single send costs the database, statement by statement, against a raw one-row insert.

A single send is one call of the server-side function `send_one` (migration 0017), which runs
a handful of statements. Each statement pays the executor's setup again: it opens the table's
indexes and compiles their predicates and the table's CHECK constraints, work a COPY of many
rows does once. Here each variant runs N times inside one PL/pgSQL loop (one transaction, no
commit, no client round trip), so what is timed is the database's CPU alone, per statement:

- the raw one-row insert (a two-column table with a primary key), the service's statements
  one by one, and `send_one` into a level and into the timer lane;
- `send_one` as it is (the status rule on the domain `message_status`, migration 0018), with
  the rule as it was before 0018 (a CHECK on the commit log), with no status rule at all,
  with the commit log's three partial indexes that no new message enters dropped, and with no
  rule and no such index (each in a transaction rolled back: nothing is changed).

Each round measures every variant once, in turn; the figures are each variant's per-call
times over the rounds (this machine's speed varies from minute to minute).

Run from the repository root:
    python docs/benchmarks/send_one_costs.py [SERVER_URL] [ROUNDS]
(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds); it works in a database of its own.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds
from timing import alternate, print_spread

from delaysvc.db.engines import libpq_url

SERVER, ROUNDS = server_and_rounds()
N = 5000
RAW_TABLE = "CREATE TABLE raw_insert (id bigserial PRIMARY KEY, topic text, body bytea)"

LEVEL_SEND = (
    "PERFORM delaysvc.send_one('t', NULL, NULL, '\\x7b7d'::bytea, true, NULL, 1::smallint, "
    "0::smallint, 1, 1000, NULL, false)"
)
TIMER_SEND = (
    "PERFORM delaysvc.send_one('t', NULL, NULL, '\\x7b7d'::bytea, true, NULL, NULL::smallint, "
    "0::smallint, 0, 3600000, NULL, false)"
)
NO_RULE = "ALTER DOMAIN delaysvc.message_status DROP CONSTRAINT ck_message_status"
TABLE_CHECK = (
    "ALTER TABLE delaysvc.commit_log ADD CONSTRAINT ck_commit_log_status CHECK (status IN "
    "('scheduled', 'ready', 'running', 'retrying', 'succeeded', 'dead', 'cancelled')) NOT VALID"
)
DROP_LATER_INDEXES = (
    "DROP INDEX delaysvc.ix_commit_log_running_lease, delaysvc.ix_commit_log_retrying_topic, "
    "delaysvc.ix_commit_log_finished"
)

# name -> (statements run first in the transaction, the statement looped)
VARIANTS: dict[str, tuple[tuple[str, ...], str]] = {
    "raw one-row INSERT": ((), "INSERT INTO raw_insert (topic, body) VALUES ('t', '\\x7b7d')"),
    "  level's delay checked (schedule_offset)": (
        (),
        "PERFORM 1 WHERE EXISTS (SELECT 1 FROM delaysvc.schedule_offset so "
        "WHERE so.lane = 1 AND so.delay_ms = 1000)",
    ),
    "  caps looked for (backlog_cap)": (
        (),
        "PERFORM 1 WHERE EXISTS (SELECT 1 FROM delaysvc.backlog_cap bc WHERE "
        "(bc.scope = 'topic' AND bc.target = 't') OR (bc.scope = 'level' AND bc.target = '1'))",
    ),
    "  offset drawn (nextval of the level's sequence)": (
        (),
        "PERFORM nextval(format('delaysvc.consume_queue_%s_seq', 1)::regclass)",
    ),
    "  commit_log row (INSERT)": (
        (),
        "INSERT INTO delaysvc.commit_log (topic, body, body_is_json, delay_level, lane, "
        "queue_offset, status, deliver_ts) VALUES ('t', '\\x7b7d', true, 1, 1, i, 'scheduled', "
        "now())",
    ),
    "  level's queue row (consume_queue)": (
        (),
        "INSERT INTO delaysvc.consume_queue (level, queue_offset, message_id, topic, "
        "deliver_ts) VALUES (2, i, i, 't', now())",
    ),
    "  lane counted (lane_count)": (
        (),
        "INSERT INTO delaysvc.lane_count (lane, delta) VALUES (1, 1)",
    ),
    "send_one, a level": ((), LEVEL_SEND),
    "send_one, the timer lane": ((), TIMER_SEND),
    "send_one, a level, the rule a table CHECK (<0018)": ((NO_RULE, TABLE_CHECK), LEVEL_SEND),
    "send_one, a level, no status rule": ((NO_RULE,), LEVEL_SEND),
    "send_one, a level, without the 3 later indexes": ((DROP_LATER_INDEXES,), LEVEL_SEND),
    "send_one, a level, no rule, no such index": ((NO_RULE, DROP_LATER_INDEXES), LEVEL_SEND),
}


def looped_us(conn: psycopg.Connection, setup: tuple[str, ...], statement: str) -> float:
    """`statement` run N times in one PL/pgSQL loop, in a transaction rolled back after."""
    with conn.transaction(force_rollback=True):
        for each in setup:
            conn.execute(each)
        started = time.perf_counter()
        conn.execute(f"DO $$ BEGIN FOR i IN 1..{N} LOOP {statement}; END LOOP; END $$")
        return (time.perf_counter() - started) / N * 1e6


def main() -> None:
    with scratch_database(SERVER, "delaysvc_send_one_costs") as (_, settings):
        conn = psycopg.connect(libpq_url(settings.database_url), autocommit=True)
        with conn:
            conn.execute(RAW_TABLE)
            for _, statement in VARIANTS.values():  # warm: plans cached, pages in memory
                looped_us(conn, (), statement)
            times = alternate(
                {name: partial(looped_us, conn, *variant) for name, variant in VARIANTS.items()},
                ROUNDS,
            )
    print(f"{N:,} calls in one PL/pgSQL loop, {ROUNDS} rounds; us a call")
    print_spread(times, "statement")


if __name__ == "__main__":
    main()
