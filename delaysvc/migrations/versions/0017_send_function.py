"""one function for a single send, `send_one`: its statements' plans are cached by PostgreSQL
per server connection, so a send through a transaction-pooling PgBouncer (no prepared
statements) runs planned statements too

Revision ID: 0017
Revises: 0016

A single send was one statement per kind of lane, prepared by psycopg on each connection.
Through PgBouncer in transaction mode nothing is prepared, and that statement was parsed and
planned on every send: a send there ran at 36% of a direct one. PL/pgSQL caches the plan of
every statement in a function for the server connection's life, whoever's client uses it; the
client's own statement, `SELECT * FROM send_one(...)`, costs little to plan.

The function does what the statements did, in this order: a level is used only while the
database gives it the delay the producer computed (`schedule_offset`; else the timer lane, due
as computed), a backlog cap covering the topic or the level stores nothing and returns one row
of NULLs (unless the caller holds the caps' locks), a key held by an unfinished message of the
topic stores nothing and returns no row, and otherwise the message goes into the commit log and
its lane (a level's FIFO queue, the timer lane or, due now, its topic's queue) and is counted
in its lane. Its names are qualified with the schema it is made in.
"""

from alembic import op
from sqlalchemy import text

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

SEND_ONE = """
CREATE OR REPLACE FUNCTION {s}.send_one(
    p_topic text, p_key text, p_tags text[], p_body bytea, p_body_is_json boolean,
    p_properties jsonb, p_delay_level smallint, p_priority smallint, p_lane integer,
    p_delay_ms bigint, p_deliver_at timestamptz, p_caps_held boolean,
    OUT sent_id bigint, OUT sent_at timestamptz, OUT due_at timestamptz, OUT sent_lane smallint)
RETURNS SETOF record LANGUAGE plpgsql AS $fn$
DECLARE
    v_offset bigint;
BEGIN
    sent_lane := p_lane;
    IF sent_lane > 0 AND NOT EXISTS (SELECT 1 FROM {s}.schedule_offset so
            WHERE so.lane = sent_lane AND so.delay_ms = p_delay_ms) THEN
        sent_lane := 0;  -- the database's level has another delay, or is gone
    END IF;
    IF sent_lane >= 0 AND NOT p_caps_held AND EXISTS (SELECT 1 FROM {s}.backlog_cap bc
            WHERE (bc.scope = 'topic' AND bc.target = p_topic)
               OR (bc.scope = 'level' AND sent_lane > 0 AND bc.target = sent_lane::text)) THEN
        sent_lane := NULL;
        RETURN NEXT;  -- a cap covers it: the producer stores it under the caps' locks
        RETURN;
    END IF;
    IF sent_lane > 0 THEN
        v_offset := nextval(format('{s}.consume_queue_%s_seq', sent_lane)::regclass);
    ELSIF sent_lane = 0 THEN
        v_offset := nextval('{s}.timer_queue_seq');
    END IF;
    INSERT INTO {s}.commit_log AS c (topic, key, tags, body, body_is_json, properties,
        delay_level, priority, lane, queue_offset, status, stored_at, deliver_ts, delivered_at)
    VALUES (p_topic, p_key, p_tags, p_body, p_body_is_json, p_properties, p_delay_level,
        p_priority, sent_lane, v_offset,
        CASE WHEN sent_lane < 0 THEN 'ready' ELSE 'scheduled' END, statement_timestamp(),
        COALESCE(p_deliver_at, statement_timestamp() + p_delay_ms * interval '1 millisecond'),
        CASE WHEN sent_lane < 0 THEN statement_timestamp() END)
    ON CONFLICT (topic, key) WHERE key IS NOT NULL AND finished_at IS NULL DO NOTHING
    RETURNING c.id, c.stored_at, c.deliver_ts INTO sent_id, sent_at, due_at;
    IF sent_id IS NULL THEN
        RETURN;  -- the key is held by an unfinished message of the topic: no row
    END IF;
    IF sent_lane > 0 THEN
        INSERT INTO {s}.consume_queue (level, queue_offset, message_id, topic, deliver_ts,
            priority)
        VALUES (sent_lane, v_offset, sent_id, p_topic, due_at, p_priority);
        INSERT INTO {s}.lane_count (lane, delta) VALUES (sent_lane, 1);
    ELSIF sent_lane = 0 THEN
        INSERT INTO {s}.timer_queue (deliver_ts, queue_offset, message_id, topic, priority)
        VALUES (due_at, v_offset, sent_id, p_topic, p_priority);
        INSERT INTO {s}.lane_count (lane, delta) VALUES (0, 1);
    ELSE
        INSERT INTO {s}.topic_queue (message_id, topic, deliver_ts, priority)
        VALUES (sent_id, p_topic, due_at, p_priority);
    END IF;
    RETURN NEXT;
END
$fn$
"""


def _schema() -> str:
    """The schema being migrated (env.py sets the search_path to it for the revision)."""
    name = op.get_bind().execute(text("SELECT current_schema()")).scalar_one()
    return '"' + name.replace('"', '""') + '"'


def upgrade() -> None:
    op.execute(SEND_ONE.format(s=_schema()))


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {_schema()}.send_one")
