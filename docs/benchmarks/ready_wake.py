"""How soon a send due at once runs: from its store to its handler's start, through a real
delivery worker, consume worker and beat (the `delaysvc up` commands), for this tree and
another (a checkout of an earlier commit), in turn, round after round, on one database.

A send due at once (no delay) goes straight to its topic's queue: no lane moves it, so no
lane's move wakes its consumer. Before 2c63aac only beat's consume sweep (every second, a task
behind the consume tasks) did; since, the timer lane's runner looks every idle poll (100 ms).
Each round sends MESSAGES such sends, SPACING seconds apart (each lands in an empty topic
queue), to a no-op handler, and reads `started_at - stored_at` of each from the database
(both the database's clock). Beside them, on a topic of their own, the same number into level 1
(1 s), whose moves wake their consumers, from due time (`deliver_ts`) to start. (What the
look does not wake, and so the sweep does as before: `LaneRunner._watch_ready`.)

Run from the repository root, with the other tree checked out beside:
    git worktree add /tmp/ref-ready 2c63aac~1
    python docs/benchmarks/ready_wake.py [SERVER_URL] [ROUNDS] /tmp/ref-ready
(default the local PostgreSQL, 3 rounds; Redis db 12 as the broker; a database of its own).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import scratch_database, server_and_rounds

from delaysvc.bench.peer_handlers import SOAK_TOPIC
from delaysvc.db.names import sql
from delaysvc.producer.sending import Producer
from delaysvc.runtime.commands import beat_command, worker_commands
from delaysvc.runtime.supervisor import die_with_parent

SERVER, ROUNDS = server_and_rounds(3)
TREES = {"tree": Path(__file__).resolve().parents[2], "other": Path(sys.argv[3]).resolve()}
BROKER = "redis://127.0.0.1:6379/12"
MESSAGES = int(os.environ.get("READY_WAKE_MESSAGES", "40"))
SPACING = 0.3
NAME = "delaysvc_ready_wake"
LEVEL_TOPIC = "load.demo"  # the demo's no-op (`delaysvc.runtime.demo`)


def start(tree: Path, url: str) -> list[subprocess.Popen[bytes]]:
    """A delivery worker, a consume worker and beat running `tree`'s code."""
    from delaysvc.config.settings import Settings

    settings = Settings(database_url=url, broker_url=BROKER)
    commands = [*worker_commands(settings, concurrency=1), beat_command(settings)]
    env = dict(
        os.environ,
        PYTHONPATH=str(tree),
        DELAYSVC_DATABASE_URL=url,
        DELAYSVC_BROKER_URL=BROKER,
        DELAYSVC_HANDLERS="delaysvc.bench.peer_handlers,delaysvc.runtime.demo",
        DELAYSVC_SECRET_KEY="x" * 40,
    )
    return [
        subprocess.Popen(
            command,
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        for command in commands
    ]


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def waits(engine, ids: list[int], since: str) -> list[float]:  # type: ignore[no-untyped-def]
    """Seconds from `since` (a column) to the handler's start of each of `ids`, once all ran."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            rows = conn.execute(
                sql(
                    f"SELECT extract(epoch FROM started_at - {since}) AS s FROM delaysvc.message "
                    "WHERE id = ANY(:ids) AND started_at IS NOT NULL"
                ),
                {"ids": ids},
            ).all()
        if len(rows) == len(ids):
            return sorted(float(r.s) for r in rows)
        time.sleep(0.2)
    raise RuntimeError(f"{len(ids) - len(rows)} of {len(ids)} messages did not run within 60 s")


def one_run(engine, settings, tree: Path) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    producer = Producer(settings, engine)
    processes = start(tree, settings.database_url)
    try:
        warm = producer.send(SOAK_TOPIC, {}, delay_level=1)
        waits(engine, [warm.id], "stored_at")  # the lanes and the consumer are up
        at_once, level = [], []
        for _ in range(MESSAGES):
            at_once.append(producer.send(SOAK_TOPIC, {}).id)
            time.sleep(SPACING / 2)
            level.append(producer.send(LEVEL_TOPIC, {}, delay_level=1).id)
            time.sleep(SPACING / 2)
        return {
            "due at once": waits(engine, at_once, "stored_at"),
            "level 1": waits(engine, level, "deliver_ts"),
        }
    finally:
        stop(processes)


def spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return f"p50 {q[49] * 1000:7.1f}  p90 {q[89] * 1000:7.1f}  max {max(values) * 1000:7.1f} ms"


def main() -> None:
    with scratch_database(SERVER, NAME, broker_url=BROKER) as (engine, settings):
        found: dict[str, dict[str, list[float]]] = {}
        for round_ in range(1, ROUNDS + 1):
            for name, tree in TREES.items():
                got = one_run(engine, settings, tree)
                for kind, values in got.items():
                    print(f"round {round_} {name:5} {kind:11}: {spread(values)}", flush=True)
                    found.setdefault(f"{name} {kind}", []).extend(values)
        print(f"\nall rounds, {MESSAGES} messages a kind a round:")
        for key, values in found.items():
            print(f"{key:17}: {spread(values)}")


if __name__ == "__main__":
    main()
