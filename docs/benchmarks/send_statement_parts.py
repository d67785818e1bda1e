"""A single send's statement against its parts, each its own autocommitted transaction through
one psycopg connection (prepared): the round trip (`SELECT 1`), a raw one-row insert, an empty
PL/pgSQL function taking `send_one`'s twelve parameters and returning its one row, and
`send_one` into a level. `send_one_costs.py` times the same body looped inside one transaction
(the server's CPU alone); the difference between the two is what each transaction of its own
adds (locks, commit, the function's setup).

Run from the repository root, with the disk's flush taken out if the machine's varies:
    PGOPTIONS="-c synchronous_commit=off" \
        python docs/benchmarks/send_statement_parts.py [SERVER_URL] [ROUNDS]
(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds); it works in a database of its own.
"""

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import raw_insert_on, scratch_database, send_one_call, server_and_rounds
from timing import alternate, per_call_us, print_spread

from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds()
N = 3000
EMPTY_ONE = """
CREATE FUNCTION delaysvc.empty_one(p_topic text, p_key text, p_tags text[], p_body bytea,
    p_body_is_json boolean, p_properties jsonb, p_delay_level smallint, p_priority smallint,
    p_lane integer, p_delay_ms bigint, p_deliver_at timestamptz, p_caps_held boolean,
    OUT sent_id bigint, OUT sent_at timestamptz, OUT due_at timestamptz, OUT sent_lane smallint)
RETURNS SETOF record LANGUAGE plpgsql AS $$
BEGIN
    sent_id := 1; sent_at := now(); due_at := now(); sent_lane := 1;
    RETURN NEXT;
END $$"""


def main() -> None:
    with scratch_database(SERVER, "delaysvc_send_statement_parts") as (engine, settings):
        new = Producer(settings, engine).prepare("t", {"n": 1}, delay_level=1)
        send_one, params = send_one_call(new)
        empty_one = send_one.replace("delaysvc.send_one(", "delaysvc.empty_one(")
        conn = psycopg.connect(libpq_url(settings.database_url), autocommit=True)
        raw_insert = raw_insert_on(conn)
        conn.execute(EMPTY_ONE)
        variants: dict[str, Callable[[], object]] = {
            "SELECT 1": lambda: conn.execute("SELECT 1", prepare=True).fetchone(),
            "raw one-row insert": raw_insert,
            "empty function, send_one's params": lambda: conn.execute(
                empty_one, params, prepare=True
            ).fetchone(),
            "send_one, a level": lambda: conn.execute(send_one, params, prepare=True).fetchone(),
        }
        times = alternate(
            {name: partial(per_call_us, call, N) for name, call in variants.items()}, ROUNDS
        )
        conn.close()
    print(f"{N:,} calls a variant a round, {ROUNDS} rounds; us a call")
    print_spread(times, "statement")


if __name__ == "__main__":
    main()
