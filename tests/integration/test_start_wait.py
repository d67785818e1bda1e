"""A service command started before its database answers (a host and its PostgreSQL booting
together) waits for it, `DELAYSVC_START_WAIT_SECONDS`, saying so; it stopped at once before."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from urllib.parse import urlsplit, urlunsplit

import pytest
from sqlalchemy.exc import OperationalError

from delaysvc.bench.pgbouncer import Server
from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine, wait_for_database
from delaysvc.runtime.supervisor import free_port
from tests.support.commands import run_delaysvc


def on_port(url: str, port: int) -> str:
    """`url`'s database, reached on 127.0.0.1:`port`."""
    parts = urlsplit(url)
    netloc = f"{parts.username or 'root'}@127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc, query=""))


def server_address(url: str) -> str | tuple[str, int]:
    """Where `url`'s server listens: (host, port), or the path of its Unix socket (the embedded
    server's `?host=/folder&port=N`)."""
    where = Server.of(url)
    if where.host.startswith("/"):
        return f"{where.host}/.s.PGSQL.{where.port}"
    return (where.host, where.port)


@contextmanager
def answering_after(seconds: float, target: str | tuple[str, int]) -> Iterator[int]:
    """A port that refuses connections for `seconds`, then forwards each to `target`."""
    port = free_port()
    stop = threading.Event()
    sockets: list[socket.socket] = []

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        with suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def serve() -> None:
        if stop.wait(seconds):
            return
        listener = socket.create_server(("127.0.0.1", port))
        listener.settimeout(0.2)
        sockets.append(listener)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            if isinstance(target, str):
                server = socket.socket(socket.AF_UNIX)
                server.connect(target)
            else:
                server = socket.create_connection(target)
            sockets.extend((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join(timeout=5)
        for each in sockets:
            with suppress(OSError):
                each.close()


def test_a_database_that_answers_after_a_while_is_waited_for(database_url: str) -> None:
    said: list[str] = []
    with answering_after(1.5, server_address(database_url)) as port:
        engine = make_engine(Settings(), on_port(database_url, port))
        started = time.monotonic()
        wait_for_database(engine, 30, said.append)
        waited = time.monotonic() - started
        engine.dispose()
    assert 1.0 <= waited < 10
    assert len(said) == 1 and said[0].startswith("waiting up to 30 s for the database: ")


def test_a_wrong_database_name_is_not_waited_for(database_url: str) -> None:
    parts = urlsplit(database_url)
    engine = make_engine(Settings(), urlunsplit(parts._replace(path="/no_such_database")))
    started = time.monotonic()
    with pytest.raises(OperationalError, match="no_such_database"):
        wait_for_database(engine, 30, print)
    assert time.monotonic() - started < 5
    engine.dispose()


def test_a_service_command_waits_then_stops_naming_the_database(database_url: str) -> None:
    closed = on_port(database_url, free_port())  # nothing listens there
    started = time.monotonic()
    result = run_delaysvc("beat", DELAYSVC_DATABASE_URL=closed, DELAYSVC_START_WAIT_SECONDS="2")
    assert time.monotonic() - started >= 2
    assert result.returncode == 1, result.stderr
    first, last = result.stderr.strip().splitlines()
    assert first.startswith("waiting up to 2 s for the database: "), result.stderr
    assert last.startswith("error: database: connection failed: "), result.stderr
