"""What a cap on each threaded gunicorn worker's connections costs when other clients keep
connections open: a proxy's pool of kept-alive connections, each used now and then.

    python docs/benchmarks/http_idle_clients.py postgresql://root@127.0.0.1:5432/SCRATCH \
        [SECONDS] [ROUNDS] [IDLE]

For each server, in turn, ROUNDS times (default 2; SECONDS of wrk, default 15): gunicorn -w 4
sync workers (as `delaysvc web` runs by default) and threaded workers of 16 threads with
`--worker-connections` 20 and 32, each started afresh, with no other clients and then with
IDLE (default 40) kept-alive clients beside wrk's 50 connections, each client asking for a page
once a second and, when the server has closed its connection, connecting again for the next
(as a proxy's pool does).
Each line: wrk's single sends a second, p99 and worst latency, its socket errors; the idle
clients' slowest answer and how often the server closed their connection; and how wrk's
connections (its own and the idle clients') were spread over the workers halfway through
(counted from /proc).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import send_token

from delaysvc.bench.http import run_wrk
from delaysvc.runtime.commands import web_command
from delaysvc.runtime.supervisor import free_port, wait_until_answering

PAGE = b"GET /no-such-page HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"  # a 404: Flask, no database


class IdleClients:
    """`count` kept-alive connections, each asking for a page once a second."""

    def __init__(self, port: int, count: int):
        self.port, self.count = port, count
        self.stop = threading.Event()
        self.slowest = 0.0
        self.reconnects = 0
        self.failures = 0
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(count)]

    def _client(self) -> None:
        sock: socket.socket | None = None
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                if sock is None:  # connect when there is something to ask, as a proxy does
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
                sock.sendall(PAGE)
                answer = sock.recv(65536)
                if not answer:
                    raise ConnectionError("closed")
                if b"connection: close" in answer.lower():
                    self.reconnects += 1
                    sock.close()
                    sock = None
            except OSError:
                self.failures += 1
                if sock is not None:
                    sock.close()
                sock = None
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.stop.wait(1.0)
        if sock is not None:
            sock.close()

    def __enter__(self) -> IdleClients:
        for thread in self.threads:
            thread.start()
        time.sleep(2)  # all connected and kept alive before wrk starts
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=40)


@contextmanager
def server(command: list[str], env: dict[str, str], port: int) -> Iterator[subprocess.Popen]:
    web = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    try:
        if not wait_until_answering(f"http://127.0.0.1:{port}/healthz"):
            raise RuntimeError("gunicorn did not answer within 60 s")
        yield web
    finally:
        web.terminate()
        web.wait(timeout=30)


def spread(web: subprocess.Popen, port: int) -> list[int]:
    """Established client connections on `port` each worker holds, most first."""
    counts = []
    for worker in psutil.Process(web.pid).children():
        held = worker.net_connections(kind="tcp")
        counts.append(sum(1 for c in held if c.status == "ESTABLISHED" and c.laddr.port == port))
    return sorted(counts, reverse=True)


def spread_into(held: list[int], web: subprocess.Popen, port: int) -> None:
    held.extend(spread(web, port))


def main(url: str, seconds: float, rounds: int, idle: int) -> None:
    token = send_token(url, "http-idle")
    env = dict(os.environ, DELAYSVC_DATABASE_URL=url)
    port = free_port()
    sync = list(web_command("127.0.0.1", port, 4, access_log=False))
    servers = {"sync -w 4": sync}
    for cap in (20, 32):
        threaded = list(web_command("127.0.0.1", port, 4, access_log=False, threads=16))
        servers[f"-w 4 --threads 16 --worker-connections {cap}"] = [
            *threaded,
            "--worker-connections",
            str(cap),
        ]
    print(f"wrk 50 connections, {seconds:g} s; idle clients: {idle}, one page a second each")
    for turn in range(1, rounds + 1):
        for name, command in servers.items():
            for others in (0, idle):
                with server(command, env, port) as web, IdleClients(port, others) as clients:
                    held: list[int] = []
                    midway = threading.Timer(seconds / 2, spread_into, (held, web, port))
                    midway.start()
                    result = run_wrk(f"http://127.0.0.1:{port}/api/v1/messages", token, 50, seconds)
                    midway.join()
                rate = result["requests"] / (result["duration_us"] / 1e6)
                failed = sum(result[k] for k in ("connect", "read", "write", "timeout"))
                line = (
                    f"turn {turn}, {name}, {others} idle: {rate:,.0f} req/s, "
                    f"p99 {result['p99_us'] / 1000:.0f} ms, max {result['max_us'] / 1000:.0f} ms, "
                    f"{failed} socket errors; connections a worker {held}"
                )
                if others:
                    line += (
                        f"; idle clients: slowest {clients.slowest * 1000:.0f} ms, "
                        f"{clients.reconnects} closed by the server, {clients.failures} failed"
                    )
                print(line, flush=True)


if __name__ == "__main__":
    main(
        sys.argv[1],
        float(sys.argv[2]) if len(sys.argv) > 2 else 15.0,
        int(sys.argv[3]) if len(sys.argv) > 3 else 2,
        int(sys.argv[4]) if len(sys.argv) > 4 else 40,
    )
