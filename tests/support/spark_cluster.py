"""A Spark standalone cluster on 127.0.0.1 for the tests: a master and workers started from
PySpark's own `bin/spark-class` (`org.apache.spark.deploy.master.Master`, `...worker.Worker`),
each worker offering one core, as separate JVMs with folders of their own. Every process is
in its own process group and is killed on leaving, however the test ends; the JVMs die with
the test process too (`PR_SET_PDEATHSIG` on the launcher shell's exec)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from delaysvc.runtime.supervisor import die_with_parent, free_port


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


@dataclass
class Cluster:
    master_url: str
    web_port: int
    processes: list[subprocess.Popen[bytes]]
    folder: Path
    drivers: list[subprocess.Popen[str]] = field(default_factory=list)
    """Applications started against it (the tests end them)."""

    def env(self) -> dict[str, str]:
        """What a driver started against this cluster needs in its environment."""
        return cluster_env(self.folder)

    def alive_workers(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/json/", timeout=5) as r:
            return int(json.load(r).get("aliveworkers", 0))

    def executors(self) -> list[psutil.Process]:
        """The executor JVMs the workers started (their children) for the running application."""
        found = []
        for started in self.processes:
            try:
                children = psutil.Process(started.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for child in children:
                try:
                    if any("CoarseGrainedExecutorBackend" in part for part in child.cmdline()):
                        found.append(child)
                except psutil.NoSuchProcess:
                    pass
        return found


def cluster_env(folder: Path) -> dict[str, str]:
    return dict(
        os.environ,
        SPARK_HOME=str(spark_home()),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(folder / "logs"),
        SPARK_PID_DIR=str(folder),
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
        PYSPARK_PYTHON=os.environ.get("PYSPARK_PYTHON", sys.executable),
    )


@contextmanager
def standalone_cluster(folder: Path, workers: int = 2) -> Iterator[Cluster]:
    folder.mkdir(parents=True, exist_ok=True)
    env = cluster_env(folder)
    spark_class = str(spark_home() / "bin" / "spark-class")
    port, web = free_port(), free_port()
    master = f"spark://127.0.0.1:{port}"
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> None:
        log = open(folder / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        processes.append(
            subprocess.Popen(
                [spark_class, *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        )
        log.close()

    cluster = Cluster(master, web, processes, folder)
    try:
        start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(web),
        )  # fmt: skip
        _wait(lambda: _answers(web), 90, "the Spark master", folder)
        for n in range(workers):
            start(
                f"worker{n}",
                "org.apache.spark.deploy.worker.Worker",
                master,
                "--host", "127.0.0.1", "--cores", "1", "--memory", "1536m",
                "--webui-port", str(free_port()), "--work-dir", str(folder / f"work{n}"),
            )  # fmt: skip
        _wait(lambda: cluster.alive_workers() == workers, 90, f"{workers} workers", folder)
        yield cluster
    finally:
        for executor in cluster.executors():  # found as the workers' children: first
            executor.kill()
        for process in processes:  # the whole group: spark-class's shell and its JVM
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/", timeout=2):
            return True
    except OSError:
        return False


def _wait(condition: Callable[[], bool], timeout: float, what: str, folder: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except OSError:
            pass
        time.sleep(0.5)
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in folder.glob("*.log")
    )
    raise RuntimeError(f"{what} not up within {timeout:g} s\n{logs}")
