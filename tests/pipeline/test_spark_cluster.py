"""The pipeline on a real Spark standalone cluster (a master and two one-core workers on
127.0.0.1, started from PySpark's own `spark-class`; tests/support/spark_cluster.py): `delaysvc
pipeline --master spark://...` and `spark-submit ... delaysvc/pipeline/cli.py` give what
`local[2]` gives, and executors killed in the middle of a bulk-schedule or an archive make
Spark run their tasks again on new ones, which store nothing twice and archive nothing twice.

Three JVMs and their executors on two cores: this runs in CI's second pass only (the first
runs the other heavy tests)."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from delaysvc.config.settings import DEBIAN_JDBC_JAR
from delaysvc.db.engines import sqlalchemy_url
from delaysvc.runtime.supervisor import die_with_parent
from tests.conftest import ROOT, TEST_LEVELS, TEST_SCHEMA, Server, outside_env
from tests.support.passes import second_pass_only
from tests.support.spark_cluster import Cluster, spark_home, standalone_cluster

pytestmark = [
    pytest.mark.timeout(900),  # JVMs on two cores
    second_pass_only("starts a Spark cluster (~1 min), the same JDBC reads on either server"),
]
FINISHED_AT = "2026-01-01 10:00:00+00"


@pytest.fixture(scope="module")
def cluster_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster"), workers=2) as running:
        yield running


@pytest.fixture
def cluster(cluster_up: Cluster) -> Iterator[Cluster]:
    """The cluster; the drivers a test started are ended with it, however it ends."""
    yield cluster_up
    for driver in cluster_up.drivers:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    cluster_up.drivers.clear()


@pytest.fixture
def other_database_url(pg_server: Server, template_db: str) -> Iterator[str]:
    name = f"delaysvc_other{os.getpid()}"
    with pg_server.janitor(name, template_dbname=template_db):
        yield pg_server.url(name)


def _engine(url: str) -> Engine:
    return create_engine(
        sqlalchemy_url(url), connect_args={"options": f"-c search_path={TEST_SCHEMA}"}
    )


def _pipeline(
    cluster: Cluster, url: str, master: str, *args: str, submit: bool = False
) -> subprocess.Popen[str]:
    env = (
        outside_env()
        | cluster.env()
        | {
            "DELAYSVC_DATABASE_URL": url,
            "DELAYSVC_DELAY_LEVELS": TEST_LEVELS,
            "DELAYSVC_SCHEMA": TEST_SCHEMA,
        }
    )
    if submit:
        command = [
            str(spark_home() / "bin" / "spark-submit"),
            "--master", master, "--jars", str(DEBIAN_JDBC_JAR),
            str(ROOT / "delaysvc" / "pipeline" / "cli.py"), *args,
        ]  # fmt: skip
    else:
        command = [sys.executable, "-m", "delaysvc", "pipeline", "--master", master, *args]
    driver = subprocess.Popen(
        command,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent(),  # and ended by `drivers` when the test fails
    )
    cluster.drivers.append(driver)
    return driver


def _ran(process: subprocess.Popen[str]) -> str:
    """The command's one summary line, once it ended well."""
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, f"{out}\n{err[-4000:]}"
    return re.sub(r", [\d.]+s", ", <s>", out.strip().splitlines()[-1])


def _write_jobs(path: Path, rows: int, bad: int = 0) -> None:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["topic", "body", "key"])
        for n in range(rows):
            out.writerow([f"cluster.t{n % 3}", f'{{"n": {n}}}', f"k{n}" if n % 2 else ""])
        for n in range(bad):
            out.writerow(["bad topic", "{}", f"bad{n}"])


def _finish_all(engine: Engine) -> None:
    """Every message ran and finished long ago (at the same moment in every database, with a
    lateness that depends on its body only), so archives and reports can be compared."""
    with engine.begin() as conn:
        for table in ("topic_queue", "consume_queue", "timer_queue"):
            conn.execute(text(f"DELETE FROM {table}"))
        conn.execute(
            text(
                "UPDATE commit_log SET status = 'succeeded', attempts = 1, deliver_ts = :at, "
                "delivered_at = CAST(:at AS timestamptz) + length(body) * interval '1 ms', "
                "started_at = CAST(:at AS timestamptz) + length(body) * interval '2 ms', "
                "finished_at = CAST(:at AS timestamptz) + length(body) * interval '3 ms'"
            ),
            {"at": FINISHED_AT},
        )


def _stored(engine: Engine) -> Counter[tuple[str, str | None, bytes]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT topic, key, body FROM commit_log"))
        return Counter((r.topic, r.key, bytes(r.body)) for r in rows)


def _archived(folder: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(folder).to_pylist()


def _report(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT hour, topic, level, messages, lateness_p50_ms, lateness_p99_ms, "
                "duration_p50_ms, retried, dead FROM report_hourly ORDER BY hour, topic, level"
            )
        )
        return [tuple(r) for r in rows]


def test_on_the_cluster_and_under_spark_submit_the_pipeline_gives_what_local_gives(
    cluster: Cluster, database_url: str, other_database_url: str, tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs.csv"
    _write_jobs(jobs, 3000, bad=4)
    found: dict[str, dict[str, Any]] = {}
    runs = {
        "local": (database_url, "local[2]", False),
        "cluster": (other_database_url, cluster.master_url, True),
    }
    for name, (url, master, submit) in runs.items():
        engine = _engine(url)
        rejects = tmp_path / f"{name}.rejects.csv"
        bulk = _ran(
            _pipeline(
                cluster, url, master, "bulk-schedule", str(jobs), "--rejects", str(rejects),
                submit=submit,  # the cluster's bulk-schedule goes through spark-submit
            )
        )  # fmt: skip
        stored = _stored(engine)
        _finish_all(engine)
        archive_dir = tmp_path / name / "archive"
        archived = _ran(
            _pipeline(
                cluster, url, master, "archive", "--older-than", "30d", "--out", str(archive_dir)
            )
        )
        reported = _ran(
            _pipeline(cluster, url, master, "report", "--out", str(tmp_path / name / "report"))
        )
        rows = _archived(archive_dir)
        found[name] = {
            "bulk": bulk.replace(str(rejects), "<rejects>"),
            "rejects": rejects.read_text(),
            "stored": stored,
            "archive": re.sub(r"-> .*", "", archived),
            "archived": Counter((r["topic"], r["key"], r["body"]) for r in rows),
            "archived_ids": len({r["id"] for r in rows}),
            "report": _report(engine),
            "reported": reported.split(" -> ")[0],
            "left": _stored(engine),
        }
        engine.dispose()
    local, on_cluster = found["local"], found["cluster"]
    assert local["bulk"].startswith("bulk-schedule: read 3004, written 3000, rejected 4")
    assert sum(local["stored"].values()) == 3000
    assert local["archived_ids"] == 3000 and not local["left"]
    assert len(local["report"]) == 3  # one hour, three topics, level 0
    for part in ("bulk", "rejects", "stored", "archive", "archived_ids", "report", "reported"):
        assert on_cluster[part] == local[part], part
    assert on_cluster["archived"] == local["archived"]
    assert not on_cluster["left"]


def _kill_the_executors_when(
    cluster: Cluster, process: subprocess.Popen[str], ready: Any, what: str
) -> None:
    deadline = time.monotonic() + 300
    while not ready():
        assert process.poll() is None, f"the job ended before {what}: {process.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    executors = cluster.executors()
    assert executors, "no executor to kill"
    for executor in executors:  # every one: the task that stored a batch is certainly lost
        executor.kill()


def test_executors_killed_mid_run_schedule_nothing_twice_and_archive_nothing_twice(
    cluster: Cluster, database_url: str, tmp_path: Path
) -> None:
    rows = 200_000
    jobs = tmp_path / "many.csv"
    _write_jobs(jobs, rows)  # half of them keyless: no key rule would catch a second store
    engine = _engine(database_url)

    def stored() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM commit_log")).scalar_one())

    bulk = _pipeline(cluster, database_url, cluster.master_url, "bulk-schedule", str(jobs))
    _kill_the_executors_when(
        cluster, bulk, lambda: 0 < stored() < rows, "a first batch stored, not all"
    )
    assert _ran(bulk).startswith(f"bulk-schedule: read {rows}, written {rows}, rejected 0")
    assert stored() == rows
    assert sum(n - 1 for n in _stored(engine).values()) == 0  # no body stored twice

    _finish_all(engine)
    out = tmp_path / "archive"
    archive = _pipeline(
        cluster,
        database_url,
        cluster.master_url,
        "archive",
        "--older-than",
        "30d",
        "--out",
        str(out),
    )
    _kill_the_executors_when(
        cluster, archive, lambda: any(out.glob("**/_temporary")), "the Parquet write to start"
    )
    assert _ran(archive).startswith(f"archive: read {rows}, written {rows}")
    archived = _archived(out)
    assert len(archived) == rows
    assert len({r["id"] for r in archived}) == rows  # none twice
    assert stored() == 0
    engine.dispose()
