"""What the commit log's indexes cost a single send's insert, by the server's CPU: one
commit-log row (a level's message, no key, as `send_one` writes it) inserted by a prepared
statement, each its own autocommitted transaction, into copies of `commit_log` with some of
its indexes (`CREATE TABLE ... (LIKE delaysvc.commit_log INCLUDING ALL EXCLUDING INDEXES)`
and then the indexes named), beside the raw one-row insert the single-send target is a share
of, and the insert into `commit_log` as it is run inside a PL/pgSQL function as `send_one` runs
it. Variants in turn round after round; the server process's CPU a call
(`timing.server_cpu_clock`: the server on this machine).

Run from the repository root, the disk's flush taken out (it is not what is measured):
    PGOPTIONS="-c synchronous_commit=off" \\
        python docs/benchmarks/single_insert_indexes.py [SERVER_URL] [ROUNDS]
(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds); it works in a database of its own.
"""

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import raw_insert_on, scratch_database, server_and_rounds
from timing import alternate, per_call_us, print_spread, server_cpu_clock

from delaysvc.db.engines import libpq_url

SERVER, ROUNDS = server_and_rounds()
N = 3000
INSERT = """INSERT INTO {table} (topic, key, tags, body, body_is_json, properties,
    delay_level, priority, lane, queue_offset, status, stored_at, deliver_ts, delivered_at)
VALUES (%s, NULL, NULL, %s, true, NULL, 1, 0, 1, %s, 'scheduled', statement_timestamp(),
    statement_timestamp() + interval '1 hour', NULL)
RETURNING id, stored_at, deliver_ts"""


# the insert as `send_one` runs it: in a PL/pgSQL function returning its row
WRAPPED = """CREATE FUNCTION delaysvc.wrapped(p_topic text, p_body bytea, p_offset bigint,
    OUT sent_id bigint, OUT sent_at timestamptz, OUT due_at timestamptz)
RETURNS SETOF record LANGUAGE plpgsql ROWS 1 AS $fn$
BEGIN
    {insert} INTO sent_id, sent_at, due_at;
    RETURN NEXT;
END
$fn$"""


def _insert(conn: psycopg.Connection[Any], statement: str) -> Callable[[], object]:
    """A call of `statement` (prepared) with a message's topic, body and next queue offset."""
    offsets = iter(range(1, 10**9))
    return lambda: conn.execute(
        statement, ("bench.noop", b'{"order_id": 42}', next(offsets)), prepare=True
    ).fetchone()


def main() -> None:
    with scratch_database(SERVER, "delaysvc_single_insert_indexes") as (_engine, settings):
        conn = psycopg.connect(libpq_url(str(settings.database_url)), autocommit=True)
        indexes: dict[str, str] = dict(
            conn.execute(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'delaysvc' "
                "AND tablename = 'commit_log' ORDER BY indexname"
            ).fetchall()
        )
        partial_ones = [name for name in indexes if name != "commit_log_pkey"]
        keep = {
            "commit_log as it is": list(indexes),
            "its primary key alone": ["commit_log_pkey"],
            "its primary key and the key's unique index": [
                "commit_log_pkey",
                "uq_commit_log_topic_key",
            ],
            **{
                f"without {name}": [other for other in indexes if other != name]
                for name in partial_ones
            },
            "no index": [],
        }
        clock = server_cpu_clock(conn.info.backend_pid)
        variants = {}
        for number, (variant, names) in enumerate(keep.items()):
            table = f"delaysvc.v{number}"
            conn.execute(
                f"CREATE TABLE {table} (LIKE delaysvc.commit_log INCLUDING ALL EXCLUDING INDEXES)"
            )
            for name in names:
                made = indexes[name].replace("delaysvc.commit_log", table)
                conn.execute(made.replace(f"INDEX {name} ", f"INDEX v{number}_{name} "))
            variants[variant] = partial(per_call_us, _insert(conn, INSERT.format(table=table)), N,
                                        clock=clock)  # fmt: skip
        inside = INSERT.format(table="delaysvc.v0")  # as it is, its values the arguments
        for argument in ("p_topic", "p_body", "p_offset"):
            inside = inside.replace("%s", argument, 1)
        conn.execute(WRAPPED.format(insert=inside))
        variants["commit_log as it is, in a PL/pgSQL function"] = partial(
            per_call_us, _insert(conn, "SELECT * FROM delaysvc.wrapped(%s, %s, %s)"), N, clock=clock
        )
        variants["raw one-row insert"] = partial(per_call_us, raw_insert_on(conn), N, clock=clock)
        times = alternate(variants, ROUNDS)
        conn.close()
    print(f"{N:,} calls a variant a round, {ROUNDS} rounds; the server's CPU (us) a call")
    print_spread(times, "insert")


if __name__ == "__main__":
    main()
