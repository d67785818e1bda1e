"""What a single send's statement pays when it is not prepared, as through a transaction-pooling
PgBouncer (issue 36: "a single send through PgBouncer >= 80% of direct").

    PGOPTIONS="-c synchronous_commit=off" \
        python docs/benchmarks/send_one_unprepared.py [SERVER_URL] [ROUNDS]

(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds; it works in a database of its
own.) On one direct psycopg connection in autocommit, each call's wall time, prepared (as a
direct send runs it) and unprepared (parsed, analysed and planned every time, as through
PgBouncer 1.18), for

- `send_one` as migration 0017 made it (six statements inside: two probes, a sequence, three
  inserts), a send to level 1;
- functions of the same signature doing nothing, one probe of `schedule_offset`, one insert:
  what the client's statement itself costs unprepared, and what each statement inside adds;
- `send_one` rewritten with its two probes as one statement and its inserts as one statement
  per lane (data-modifying WITH): whether fewer statements inside pay less.

Variants in turn, round after round; prints each one's median, min and max.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import psycopg
from scratch import scratch_database, send_one_call, server_and_rounds
from timing import alternate, per_call_us, print_spread

from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds()
N = 2000

SIGNATURE = """(
    p_topic text, p_key text, p_tags text[], p_body bytea, p_body_is_json boolean,
    p_properties jsonb, p_delay_level smallint, p_priority smallint, p_lane integer,
    p_delay_ms bigint, p_deliver_at timestamptz, p_caps_held boolean,
    OUT sent_id bigint, OUT sent_at timestamptz, OUT due_at timestamptz, OUT sent_lane smallint)
RETURNS SETOF record LANGUAGE plpgsql ROWS 1"""

PARTS = {
    "nothing": "sent_id := 1; RETURN NEXT;",
    "one probe": """IF NOT EXISTS (SELECT 1 FROM delaysvc.schedule_offset so
        WHERE so.lane = p_lane AND so.delay_ms = p_delay_ms) THEN sent_lane := 0; END IF;
        sent_id := 1; RETURN NEXT;""",
    "one insert": """INSERT INTO delaysvc.lane_count (lane, delta) VALUES (1, 0);
        sent_id := 1; RETURN NEXT;""",
}

# send_one's level path with fewer statements: the lane and the caps in one, the commit log,
# the level's queue and its count in another (the other lanes are not sent to here)
MERGED = """
DECLARE
    v_capped boolean;
BEGIN
    SELECT placed.lane, placed.lane >= 0 AND NOT p_caps_held AND EXISTS (
               SELECT 1 FROM delaysvc.backlog_cap bc
               WHERE (bc.scope = 'topic' AND bc.target = p_topic)
                  OR (bc.scope = 'level' AND placed.lane > 0 AND bc.target = placed.lane::text))
    FROM (SELECT CAST(CASE WHEN p_lane > 0 AND NOT EXISTS (
              SELECT 1 FROM delaysvc.schedule_offset so
              WHERE so.lane = p_lane AND so.delay_ms = p_delay_ms) THEN 0 ELSE p_lane END
          AS smallint) AS lane) placed
    INTO sent_lane, v_capped;
    IF v_capped THEN
        sent_lane := NULL;
        RETURN NEXT;
        RETURN;
    END IF;
    WITH c AS (
        INSERT INTO delaysvc.commit_log AS c (topic, key, tags, body, body_is_json, properties,
            delay_level, priority, lane, queue_offset, status, stored_at, deliver_ts)
        VALUES (p_topic, p_key, p_tags, p_body, p_body_is_json, p_properties, p_delay_level,
            p_priority, sent_lane,
            nextval(format('delaysvc.consume_queue_%s_seq', sent_lane)::regclass), 'scheduled',
            statement_timestamp(),
            COALESCE(p_deliver_at, statement_timestamp() + p_delay_ms * interval '1 millisecond'))
        ON CONFLICT (topic, key) WHERE key IS NOT NULL AND finished_at IS NULL DO NOTHING
        RETURNING c.id, c.stored_at, c.deliver_ts, c.queue_offset
    ), q AS (
        INSERT INTO delaysvc.consume_queue (level, queue_offset, message_id, topic, deliver_ts,
            priority)
        SELECT sent_lane, c.queue_offset, c.id, p_topic, c.deliver_ts, p_priority FROM c
    ), n AS (
        INSERT INTO delaysvc.lane_count (lane, delta) SELECT sent_lane, 1 FROM c
    )
    SELECT c.id, c.stored_at, c.deliver_ts FROM c INTO sent_id, sent_at, due_at;
    IF sent_id IS NOT NULL THEN
        RETURN NEXT;
    END IF;
END"""


def main() -> None:
    with scratch_database(SERVER, "delaysvc_send_one_unprepared") as (engine, settings):
        producer = Producer(settings, engine)
        statement, params = send_one_call(producer.prepare("t", {"order": 42}, delay_level=1))
        conn = psycopg.connect(libpq_url(settings.database_url), autocommit=True)
        functions = {"send_one": "send_one", "send_one, fewer statements": "send_one_merged"}
        conn.execute(f"CREATE FUNCTION delaysvc.send_one_merged{SIGNATURE} AS $fn${MERGED}$fn$")
        for number, (name, body) in enumerate(PARTS.items()):
            conn.execute(
                f"CREATE FUNCTION delaysvc.part_{number}{SIGNATURE} AS $fn$ BEGIN {body} END $fn$"
            )
            functions[f"a function doing {name}"] = f"part_{number}"
        measures: dict[str, Callable[[], float]] = {}
        for name, function in functions.items():
            called = statement.replace("delaysvc.send_one(", f"delaysvc.{function}(")
            for prepared in (True, False):

                def call(called: str = called, prepared: bool = prepared) -> object:
                    return conn.execute(called, params, prepare=prepared).fetchone()

                way = "prepared" if prepared else "unprepared"
                measures[f"{name}, {way}"] = partial(per_call_us, call, N)
        print_spread(alternate(measures, ROUNDS), f"{N:,} calls a measure; us a call")


if __name__ == "__main__":
    main()
