"""`send_one` as migrations 0017 and 0019 made it (five statements for a level: the level's
delay, the caps, the commit log, the level's queue, its count) beside two variants that run
fewer: its two checks as one `SELECT` ("checks_fused"), and that with the three inserts as one
statement of data-modifying CTEs, the lane's and the count's rows made from the commit log's
`RETURNING` ("fused"). Each in a database of its own as a function of its own; calls
autocommitted through one psycopg connection (prepared), the variants in turn round after
round: a level, the timer lane, a keyed send whose key is held (stores nothing), and the raw
one-row insert. Measured: the server process's CPU a call (/proc/PID/schedstat), so client and
disk are left out.

Run from the repository root, on the same machine as the server:
    PGOPTIONS="-c synchronous_commit=off" \
        python docs/benchmarks/send_one_fused.py [SERVER_URL] [ROUNDS]
(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds); it works in a database of its own.
"""

import sys
from collections.abc import Callable
from functools import partial
from importlib import import_module
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import raw_insert_on, scratch_database, send_one_call, server_and_rounds
from timing import alternate, per_call_us, print_spread, server_cpu_clock

from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds()
N = 3000
BEFORE = (
    import_module("delaysvc.migrations.versions.0017_send_function").SEND_ONE.replace(
        "RETURNS SETOF record", "RETURNS SETOF record ROWS 1", 1
    )  # as 0019
)


def _commit_log_row(offset: str) -> str:
    """The commit log's insert, as the CTE `c` each lane's statement starts with; `offset`: the
    expression of its queue offset."""
    return f"""c AS (INSERT INTO {{s}}.commit_log AS c (topic, key, tags, body, body_is_json,
                properties, delay_level, priority, lane, queue_offset, status, stored_at,
                deliver_ts, delivered_at)
            VALUES (p_topic, p_key, p_tags, p_body, p_body_is_json, p_properties,
                p_delay_level, p_priority, sent_lane, {offset},
                CASE WHEN sent_lane < 0 THEN 'ready' ELSE 'scheduled' END, statement_timestamp(),
                COALESCE(p_deliver_at,
                    statement_timestamp() + p_delay_ms * interval '1 millisecond'),
                CASE WHEN sent_lane < 0 THEN statement_timestamp() END)
            ON CONFLICT (topic, key) WHERE key IS NOT NULL AND finished_at IS NULL DO NOTHING
            RETURNING c.id, c.stored_at, c.deliver_ts, c.queue_offset)"""


FUSED = f"""
CREATE OR REPLACE FUNCTION {{s}}.send_one(
    p_topic text, p_key text, p_tags text[], p_body bytea, p_body_is_json boolean,
    p_properties jsonb, p_delay_level smallint, p_priority smallint, p_lane integer,
    p_delay_ms bigint, p_deliver_at timestamptz, p_caps_held boolean,
    OUT sent_id bigint, OUT sent_at timestamptz, OUT due_at timestamptz, OUT sent_lane smallint)
RETURNS SETOF record LANGUAGE plpgsql ROWS 1 AS $fn$
DECLARE
    v_capped boolean;
BEGIN
    -- a level only while the database gives it the producer's delay (else the timer lane);
    -- a backlog cap covering the topic or the lane's level: the producer stores the message
    -- under the caps' locks (one row of NULLs), unless it holds them already
    SELECT placed.lane, placed.lane >= 0 AND NOT p_caps_held AND (
            EXISTS (SELECT 1 FROM {{s}}.backlog_cap bc
                    WHERE bc.scope = 'topic' AND bc.target = p_topic)
            OR placed.lane > 0 AND EXISTS (SELECT 1 FROM {{s}}.backlog_cap bc
                    WHERE bc.scope = 'level' AND bc.target = placed.lane::text))
    INTO sent_lane, v_capped
    FROM (SELECT CASE WHEN p_lane > 0 AND NOT EXISTS (SELECT 1 FROM {{s}}.schedule_offset so
                        WHERE so.lane = p_lane AND so.delay_ms = p_delay_ms)
                      THEN 0 ELSE p_lane END AS lane) placed;
    IF v_capped THEN
        sent_lane := NULL;
        RETURN NEXT;
        RETURN;
    END IF;
    -- the commit log's row, then its lane's and its count from what it returned (none: the
    -- key is held by an unfinished message of the topic, and the function returns no row)
    IF sent_lane > 0 THEN
        WITH {_commit_log_row("nextval(format('{s}.consume_queue_%s_seq', sent_lane)::regclass)")},
            q AS (INSERT INTO {{s}}.consume_queue (level, queue_offset, message_id, topic,
                    deliver_ts, priority)
                SELECT sent_lane, c.queue_offset, c.id, p_topic, c.deliver_ts, p_priority FROM c),
            n AS (INSERT INTO {{s}}.lane_count (lane, delta) SELECT sent_lane, 1 FROM c)
        SELECT c.id, c.stored_at, c.deliver_ts INTO sent_id, sent_at, due_at FROM c;
    ELSIF sent_lane = 0 THEN
        WITH {_commit_log_row("nextval('{s}.timer_queue_seq')")},
            q AS (INSERT INTO {{s}}.timer_queue (deliver_ts, queue_offset, message_id, topic,
                    priority)
                SELECT c.deliver_ts, c.queue_offset, c.id, p_topic, p_priority FROM c),
            n AS (INSERT INTO {{s}}.lane_count (lane, delta) SELECT 0, 1 FROM c)
        SELECT c.id, c.stored_at, c.deliver_ts INTO sent_id, sent_at, due_at FROM c;
    ELSE
        WITH {_commit_log_row("NULL")},
            q AS (INSERT INTO {{s}}.topic_queue (message_id, topic, deliver_ts, priority)
                SELECT c.id, p_topic, c.deliver_ts, p_priority FROM c)
        SELECT c.id, c.stored_at, c.deliver_ts INTO sent_id, sent_at, due_at FROM c;
    END IF;
    IF sent_id IS NOT NULL THEN
        RETURN NEXT;
    END IF;
END
$fn$
"""


def _checks_fused() -> str:
    """`BEFORE` with its two checks made FUSED's one `SELECT`, its inserts as they were."""
    checks = FUSED[FUSED.index("BEGIN\n") : FUSED.index("    -- the commit log's row")]
    inserts = BEFORE[BEFORE.index("    IF sent_lane > 0 THEN\n        v_offset") :]
    head = BEFORE[: BEFORE.index("BEGIN\n")].replace(
        "v_offset bigint;", "v_offset bigint;\n    v_capped boolean;"
    )
    return head + checks + inserts


FUNCTIONS = {  # each variant's CREATE FUNCTION, its schema `{s}`
    "before": BEFORE,
    "checks_fused": _checks_fused(),
    "fused": FUSED,
}


def main() -> None:
    with scratch_database(SERVER, "delaysvc_send_one_fused") as (engine, settings):
        producer = Producer(settings, engine)
        producer.send("t", {"n": 0}, key="held", delay="1h")
        sends = {
            "a level": producer.prepare("t", {"n": 1}, delay_level=1),
            "the timer lane": producer.prepare("t", {"n": 1}, delay="7s"),
            "a held key": producer.prepare("t", {"n": 1}, key="held", delay="1h"),
        }
        conn = psycopg.connect(libpq_url(str(settings.database_url)), autocommit=True)
        for name, text in FUNCTIONS.items():
            conn.execute(text.format(s="delaysvc").replace("send_one(", f"send_one_{name}(", 1))
        clock = server_cpu_clock(conn.info.backend_pid)
        variants: dict[str, Callable[[], float]] = {}
        for send, new in sends.items():
            statement, params = send_one_call(new)
            for name in FUNCTIONS:
                call = _call(conn, statement.replace("send_one(", f"send_one_{name}("), params)
                variants[f"{send}, {name}"] = partial(per_call_us, call, N, clock=clock)
        variants["raw one-row insert"] = partial(per_call_us, raw_insert_on(conn), N, clock=clock)
        times = alternate(variants, ROUNDS)
        conn.close()
    print(f"{N:,} calls a variant a round, {ROUNDS} rounds; the server's CPU a call (us), each")
    print("call its own transaction")
    print_spread(times, "send_one")


def _call(
    conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]
) -> Callable[[], object]:
    return lambda: conn.execute(statement, params, prepare=True).fetchall()


if __name__ == "__main__":
    main()
