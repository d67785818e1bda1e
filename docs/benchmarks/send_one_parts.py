"""What each part of `send_one` costs a send that is its own transaction: `send_one` into a
level against copies of it with one part taken out, each call autocommitted through one
psycopg connection (prepared), the variants in turn round after round. The parts: the check
that the level's delay is the database's (`schedule_offset`), the backlog caps' check
(`backlog_cap`: skipped as when the producer holds the caps' locks), the level's pending count
(`lane_count`), the queue row (`consume_queue`). A part taken out is not a design: it says what
the part costs, so what taking it out of the send's path would save.

Run from the repository root, with the disk's flush taken out if the machine's varies:
    PGOPTIONS="-c synchronous_commit=off" \
        python docs/benchmarks/send_one_parts.py [SERVER_URL] [ROUNDS] [server-cpu]
(default postgresql://root@127.0.0.1:5432/postgres, 5 rounds); it works in a database of its own.
Each call's wall time, or with `server-cpu` the server process's CPU a call
(`timing.server_cpu_clock`: the server on this machine), which leaves the client and the disk
out.
"""

import re
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, send_one_call, server_and_rounds
from timing import alternate, per_call_us, print_spread, server_cpu_clock

from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer

SERVER, ROUNDS = server_and_rounds()
SERVER_CPU = sys.argv[3:] == ["server-cpu"]
N = 3000
Call = Callable[[], object]

# a copy of send_one's body without a part: (the variant's name, the text taken out)
WITHOUT = {
    "without the delay check (schedule_offset)": re.compile(
        r"    IF sent_lane > 0 AND NOT EXISTS \(SELECT 1 FROM .*?END IF;\n", re.S
    ),
    "without the pending count (lane_count)": re.compile(
        r"        INSERT INTO \S+\.lane_count \(lane, delta\) VALUES \(sent_lane, 1\);\n"
    ),
    "without the queue row (consume_queue)": re.compile(
        r"        INSERT INTO \S+\.consume_queue .*?priority\);\n", re.S
    ),
    "without ON CONFLICT (the key is null)": re.compile(
        r"    ON CONFLICT \(topic, key\) WHERE key IS NOT NULL AND finished_at IS NULL DO NOTHING\n"
    ),
}


def main() -> None:
    with scratch_database(SERVER, "delaysvc_send_one_parts") as (engine, settings):
        new = Producer(settings, engine).prepare("t", {"n": 1}, delay_level=1)
        send_one, params = send_one_call(new)
        conn = psycopg.connect(libpq_url(str(settings.database_url)), autocommit=True)
        source = conn.execute("SELECT pg_get_functiondef('delaysvc.send_one'::regproc)").fetchone()
        assert source is not None
        variants: dict[str, Call] = {
            "send_one, a level": lambda: conn.execute(send_one, params, prepare=True).fetchone(),
            "without the caps' check (backlog_cap)": lambda: conn.execute(
                send_one, {**params, "caps_held": True}, prepare=True
            ).fetchone(),
        }

        def copy_without(parts: list[re.Pattern[str]], function: str, caps_held: bool) -> Call:
            """A copy of send_one named `function`, each of `parts` taken out: its call."""
            body = source[0]
            for part in parts:
                body, found = part.subn("", body)
                assert found == 1, part.pattern
            conn.execute(body.replace("delaysvc.send_one(", f"delaysvc.{function}(", 1))
            statement = send_one.replace("delaysvc.send_one(", f"delaysvc.{function}(")
            values = {**params, "caps_held": caps_held}
            return lambda: conn.execute(statement, values, prepare=True).fetchone()

        for number, (name, part) in enumerate(WITHOUT.items()):
            variants[name] = copy_without([part], f"send_one_part{number}", caps_held=False)
        variants["the commit log's insert alone (all of the above out)"] = copy_without(
            list(WITHOUT.values()), "send_one_bare", caps_held=True
        )
        clock = server_cpu_clock(conn.info.backend_pid) if SERVER_CPU else time.perf_counter
        times = alternate(
            {name: partial(per_call_us, call, N, clock=clock) for name, call in variants.items()},
            ROUNDS,
        )
        conn.close()
    what = "the server's CPU (us)" if SERVER_CPU else "us"
    print(f"{N:,} calls a variant a round, {ROUNDS} rounds; {what} a call, each a transaction")
    print_spread(times, "send_one")


if __name__ == "__main__":
    main()
