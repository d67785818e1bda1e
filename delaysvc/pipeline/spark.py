"""The pipeline's SparkSession and its JDBC connection to the service's PostgreSQL.

`session()` builds one SparkSession: `local[*]` unless a master is given (or `spark-submit`
chose one), the PostgreSQL JDBC driver (`DELAYSVC_JDBC_JAR`, by default from Debian's
`libpostgresql-jdbc-java`) plus any `--jars`, Spark's own logs at ERROR and its console
progress bar on. What it needs installed is checked first (`delaysvc.pipeline.requirements`).

`jdbc_target()` turns the service's database URL into a JDBC URL. The embedded PostgreSQL of
`delaysvc up` listens on a Unix socket only, which JDBC cannot reach, so for a socket URL it
starts a loopback TCP forwarder to that socket for the duration of the job (local masters
only: executors elsewhere could not reach it either way).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from sqlalchemy.engine import make_url

from delaysvc.config.settings import DEBIAN_JDBC_JAR

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)
DEFAULT_MASTER = "local[*]"


def session(
    master: str | None = None, jars: str | None = None, jdbc_jar: Path = DEBIAN_JDBC_JAR
) -> SparkSession:
    """The pipeline's SparkSession (one per process: getOrCreate)."""
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.appName("delaysvc-pipeline")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "true")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.session.timeZone", "UTC")
        # a file is split by size, into as many even parts as there are cores (the default
        # counts 4 MB more per file, which split a 14 MB Parquet file 2:1 across local[2]'s
        # two tasks: one core idle for a third of a bulk-schedule). One byte, not zero: with
        # zero, a file of an odd size got a third, empty, split (a task and a tail wait)
        .config("spark.sql.files.openCostInBytes", "1")
        # a JVM this process starts (local masters' only JVM) collects garbage by throughput,
        # as a batch job wants: G1's concurrent work took a share of two cores (1M rows of
        # bulk-schedule, 12.8 -> 12.3 s); spark-submit's JVM is already running and keeps its own
        .config("spark.driver.extraJavaOptions", "-XX:+UseParallelGC")
    )
    chosen = master or (None if _under_spark_submit() else DEFAULT_MASTER)
    if chosen:
        builder = builder.master(chosen)
    all_jars = [str(jdbc_jar)] if jdbc_jar.exists() else []
    all_jars += [j for j in (jars or "").split(",") if j]
    if all_jars:
        builder = builder.config("spark.jars", ",".join(all_jars))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    log.info("spark.session", extra={"master": spark.sparkContext.master, "jars": all_jars})
    return spark


def _under_spark_submit() -> bool:
    # spark-submit starts the JVM first and hands its gateway to Python in this variable;
    # its --master must win over our default
    return "PYSPARK_GATEWAY_PORT" in os.environ


@dataclass(frozen=True)
class JdbcTarget:
    url: str
    properties: dict[str, str] = field(default_factory=dict)


@contextmanager
def jdbc_target(database_url: str) -> Iterator[JdbcTarget]:
    """The JDBC URL and connection properties for a `postgresql://` URL."""
    url = make_url(database_url)
    socket_dir = url.query.get("host") if not url.host else None
    if isinstance(socket_dir, tuple):
        socket_dir = socket_dir[0]
    props = {"driver": "org.postgresql.Driver"}
    if url.password:
        props["password"] = url.password
    user = quote(url.username or "postgres")
    database = quote(url.database or "postgres")
    if socket_dir is None:
        address = f"{url.host}:{url.port or 5432}"
        yield JdbcTarget(f"jdbc:postgresql://{address}/{database}?user={user}", props)
        return
    path = Path(socket_dir) / f".s.PGSQL.{url.query.get('port') or url.port or 5432}"
    with _forward_to_socket(path) as port:
        yield JdbcTarget(f"jdbc:postgresql://127.0.0.1:{port}/{database}?user={user}", props)


@contextmanager
def _forward_to_socket(path: Path) -> Iterator[int]:
    """A loopback TCP port forwarding each connection to the Unix socket `path`."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    thread = threading.Thread(target=_accept, args=(server, path), daemon=True)
    thread.start()
    log.info("jdbc.forwarder_started", extra={"port": port, "socket": str(path)})
    try:
        yield port
    finally:
        server.close()


def _accept(server: socket.socket, path: Path) -> None:
    while True:
        try:
            client, _ = server.accept()
        except OSError:
            return  # closed: the job is over
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(str(path))
        except OSError:
            client.close()
            upstream.close()
            continue
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        src.close()
