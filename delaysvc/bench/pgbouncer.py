"""A PgBouncer in front of a PostgreSQL, started on a free port, for the bench and the tests.

`PgBouncer` is Debian's `pgbouncer` (`apt-get install pgbouncer`), or another build given by
path, configured as web applications run it: transaction pooling (each transaction on whichever
server connection is free), a small server pool shared by more clients, and where asked (1.21
or later) the prepared statements of its clients kept (`max_prepared_statements`). It refuses
to run as root; as root it runs as the user that can reach the server (the owner of its socket
folder, else `nobody`). It dies with the process that started it.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from sqlalchemy import Engine

from delaysvc.bench.progress import step
from delaysvc.bench.suites import Figures
from delaysvc.db.engines import libpq_url
from delaysvc.db.names import sql
from delaysvc.errors import MissingPart
from delaysvc.runtime.supervisor import die_with_parent, free_port

if TYPE_CHECKING:
    from delaysvc.bench import BenchContext
    from delaysvc.config.settings import Settings

INSTALL = "PgBouncer is not installed: apt-get install pgbouncer (or your system's package)"


PREPARED_SINCE = (1, 22)
"""The first PgBouncer `database_pooling=transaction-prepared` is for: 1.21 began keeping its
clients' prepared statements (`max_prepared_statements`), 1.22 also takes `DEALLOCATE ALL` and
`DISCARD ALL` from them (PgBouncer's changelog)."""


def missing() -> str | None:
    return None if shutil.which("pgbouncer") else INSTALL


def version_line(binary: str = "pgbouncer") -> str:
    """What the PgBouncer `binary` (a name on PATH or a path) says it is ("PgBouncer 1.18.0")."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[0] if done.stdout else "unknown"


def version(binary: str = "pgbouncer") -> tuple[int, int]:
    """(major, minor) of the PgBouncer `binary`; (0, 0) if it says none."""
    found = re.match(r"PgBouncer (\d+)\.(\d+)", version_line(binary))
    return (int(found[1]), int(found[2])) if found else (0, 0)


@dataclass(frozen=True)
class Server:
    """Where the PostgreSQL behind the PgBouncer is, read off its URL."""

    host: str
    port: int
    user: str

    @classmethod
    def of(cls, url: str) -> Server:
        parts = urlsplit(libpq_url(url))
        query = parse_qs(parts.query)
        host = query.get("host", [parts.hostname or "127.0.0.1"])[0]
        port = int(query.get("port", [parts.port or 5432])[0])
        return cls(host, port, parts.username or "postgres")


@dataclass(frozen=True)
class Bouncer:
    port: int
    log: Path
    pid: int

    def url(self, direct_url: str) -> str:
        """`direct_url`'s database and user, through this PgBouncer."""
        parts = urlsplit(libpq_url(direct_url))
        user = parts.username or "postgres"
        return f"postgresql://{user}@127.0.0.1:{self.port}{parts.path}"

    def pooled(self, settings: Settings, direct_url: str, pooling: str) -> Settings:
        """`settings` with their database (`direct_url`) reached through this PgBouncer,
        `pooling` (`transaction` or `transaction-prepared`) as `database_pooling`, and
        `direct_url` kept for what needs a session."""
        return settings.model_copy(
            update={
                "database_url": self.url(direct_url),
                "database_pooling": pooling,
                "direct_database_url": direct_url,
            }
        )


@contextmanager
def pgbouncer(
    direct_url: str,
    pool_mode: str = "transaction",
    pool_size: int = 2,
    binary: str = "pgbouncer",
    max_prepared_statements: int = 0,
) -> Iterator[Bouncer]:
    """A PgBouncer (`binary`: a name on PATH or a path) in front of `direct_url`'s server (any
    of its databases, `pool_size` server connections per database and user), keeping up to
    `max_prepared_statements` of each client's prepared statements (0: none, as before 1.21),
    stopped on leaving."""
    if binary == "pgbouncer" and missing():
        raise MissingPart(INSTALL)
    server = Server.of(direct_url)
    folder = Path(tempfile.mkdtemp(prefix="delaysvc-pgbouncer-"))
    folder.chmod(0o755)
    port = free_port()
    host = f"host={server.host} port={server.port}"
    config = folder / "pgbouncer.ini"
    kept = f"max_prepared_statements = {max_prepared_statements}\n" * bool(max_prepared_statements)
    config.write_text(
        f"[databases]\n* = {host}\n\n[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
        f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 500\n"
        f"{kept}"
        # libpq's PGOPTIONS and pgjdbc's extra_float_digits: not kept per client in this mode
        "ignore_startup_parameters = extra_float_digits,options\n"
        "logfile =\npidfile =\n"
    )
    (folder / "users.txt").write_text(f'"{server.user}" ""\n')
    for path in folder.iterdir():
        path.chmod(0o644)
    log = folder / "pgbouncer.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [binary, str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            user=_run_as(server),
            preexec_fn=die_with_parent(),  # runs after the user change, so the signal stays
        )
    try:
        _wait_listening(port, process, log)
        yield Bouncer(port, log, process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _run_as(server: Server) -> str | None:
    """Not root (PgBouncer refuses it): the owner of the server's socket folder, or nobody."""
    if os.geteuid() != 0:
        return None
    if server.host.startswith("/"):
        owner = pwd.getpwuid(Path(server.host).stat().st_uid).pw_name
        if owner != "root":
            return owner
    return "nobody"


def _wait_listening(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited at start: {log.read_text(errors='replace')}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"pgbouncer did not listen on {port} within 15 s")


def pgbouncer_suite(ctx: BenchContext) -> Figures:
    """Single sends/s straight to PostgreSQL (with and without prepared statements) and
    through a transaction-pooling PgBouncer (four server connections), same run, for 1, 4
    and 16 clients; and batches of 1,000. A PgBouncer that keeps prepared statements (1.22 or
    later) keeps them here, and is measured both ways: without (`transaction`) and with
    (`transaction-prepared`, the way "pgbouncer_prepared")."""
    from delaysvc.bench.suites import NOOP_TOPIC, _send_single, reset_tables
    from delaysvc.db.engines import make_engine
    from delaysvc.producer.sending import Producer

    figures = Figures()
    seconds = ctx.seconds("seconds")
    keeps = version() >= PREPARED_SINCE
    with pgbouncer(ctx.url, pool_size=POOL_SIZE, max_prepared_statements=200 * keeps) as bouncer:
        # straight to PostgreSQL without prepared statements too: what of the difference is
        # the statement parsed and planned each time, and what the extra hop
        unprepared = ctx.settings.model_copy(update={"database_pooling": "transaction"})
        ways = {
            "direct": ctx.settings,
            "direct_unprepared": unprepared,
            "pgbouncer": bouncer.pooled(ctx.settings, ctx.url, "transaction"),
        }
        if keeps:
            ways["pgbouncer_prepared"] = bouncer.pooled(
                ctx.settings, ctx.url, "transaction-prepared"
            )
        engines = {way: make_engine(s, pool_size=16) for way, s in ways.items()}
        producers = {way: Producer(ways[way], engine) for way, engine in engines.items()}
        try:
            for clients in (1, 4, 16):
                rates, stored = {}, {}
                for way, producer in producers.items():
                    step(f"pgbouncer: Producer.send {way}, {clients} clients, {seconds:g}s")
                    reset_tables(ctx.engine)
                    rates[way] = _send_single(producer, clients, seconds)
                    stored[way] = _stored(ctx.engine)
                figures.results[f"pgbouncer_send_c{clients}"] = _compared(rates, stored)
            batches, stored = {}, {}
            for way, producer in producers.items():
                step(f"pgbouncer: send_batch of 1,000 {way}, 20 batches")
                reset_tables(ctx.engine)
                started = time.perf_counter()
                for _ in range(20):
                    producer.send_batch([{"topic": NOOP_TOPIC, "body": {}, "delay": "1h"}] * 1000)
                batches[way] = 20_000 / (time.perf_counter() - started)
                stored[way] = _stored(ctx.engine)
            figures.results["pgbouncer_send_batch_1000"] = _compared(batches, stored)
        finally:
            for engine in engines.values():
                engine.dispose()
    figures.results["pgbouncer_setup"] = {"pgbouncer_version": version_line()}
    return figures


POOL_SIZE = 4


def _stored(engine: Engine) -> int:
    """Messages in the commit log: what a way's run stored (the tables are emptied before)."""
    with engine.connect() as conn:
        return int(conn.execute(sql("SELECT count(*) FROM delaysvc.commit_log")).scalar_one())


def _compared(rates: dict[str, float], stored: dict[str, int]) -> dict[str, Any]:
    """msgs/s of each way, the messages each stored, and PgBouncer's share of the direct
    rate."""
    kept = {}
    if "pgbouncer_prepared" in rates:
        kept["ratio_prepared"] = round(rates["pgbouncer_prepared"] / rates["direct"], 3)
    return (
        {f"{way}_msgs_per_s": round(rate) for way, rate in rates.items()}
        | {f"{way}_stored": count for way, count in stored.items()}
        | {
            "ratio": round(rates["pgbouncer"] / rates["direct"], 3),
            "server_connections": POOL_SIZE,
        }
        | kept
    )
