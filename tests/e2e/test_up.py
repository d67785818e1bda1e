"""`delaysvc up` as a new user runs it: in an empty folder, no database or broker configured.
It starts its embedded PostgreSQL, migrates, serves the API, delivers a level-2 message after
its 5 s, runs the README's order-cancellation example, and stops cleanly on SIGTERM. Its
output is one readable stream, the other commands run beside it print nothing on stderr, and
when it has stopped the folder holds `var/` alone."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine, start_embedded
from delaysvc.runtime.supervisor import die_with_parent, free_port, wait_until_answering
from tests.conftest import ROOT, outside_env
from tests.e2e.conftest import Service, assert_check_clean, wait_for
from tests.support.passes import first_pass_only, second_pass_only

pytestmark = pytest.mark.e2e
FIRST_PASS_ONLY = first_pass_only(
    "~30 s; `delaysvc up` runs its own embedded PostgreSQL and broker in either pass"
)
SECOND_PASS_ONLY = second_pass_only(
    "~22 s; `delaysvc up` runs its own embedded PostgreSQL and broker in either pass, with "
    "the tests' schema name: this one in schema jobs, the other long ones in schema delaysvc"
)


def _http(method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, json.loads(response.read())


def _processes_in(folder: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")) == folder:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def start_up(folder: Path, env: dict[str, str], port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "delaysvc", "up", "--port", str(port)],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )


class Output:
    """The lines a process writes, read as it writes them."""

    def __init__(self, process: subprocess.Popen[str]):
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line)
            self._queue.put(line)

    def wait_for(self, text: str, timeout: float = 120) -> str:
        """The next line containing `text`; fails after `timeout` seconds, also while other
        lines keep coming."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._queue.get(timeout=max(0.0, left))
            except queue.Empty:
                line = ""
            if text in line and line:
                return line
            if left <= 0:
                pytest.fail(f"no line with {text!r} within {timeout:g} s; last:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "".join(self.lines[-lines:])


def delaysvc_in(folder: Path, env: dict[str, str]) -> Callable[..., str]:
    """A function running other `delaysvc` commands in `folder`."""

    def delaysvc(*args: str) -> str:
        """A command that succeeds and, as it does, says nothing on stderr."""
        result = subprocess.run(
            [sys.executable, "-m", "delaysvc", *args],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
        return result.stdout

    return delaysvc


@contextmanager
def running_up(
    folder: Path, env: dict[str, str]
) -> Iterator[tuple[int, Callable[..., str], list[str]]]:
    """`delaysvc up` started in `folder` until it prints `ready`; -> (port, a function running
    other `delaysvc` commands in the same folder, the lines `up` printed so far). At the end,
    `delaysvc check` is clean on its database (while it runs: the check is safe under load),
    then SIGTERM, which must end every child cleanly."""
    port = free_port()
    up = start_up(folder, env, port)
    output = Output(up)
    try:
        line = output.wait_for("delaysvc ready:")
        assert f"http://127.0.0.1:{port}/" in line
        yield port, delaysvc_in(folder, env), output.lines
        assert_check_clean(start_embedded(folder / "var"))
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=90)
    assert code == 0, output.tail()
    wait_for(lambda: _processes_in(folder) == [], 30, "every child of up to exit")
    _assert_one_readable_stream(output.lines, port)
    assert [path.name for path in folder.iterdir()] == ["var"]  # nothing written elsewhere


PREFIXED = re.compile(r"(delaysvc|web|delivery|consume|beat) +\| ")


def _assert_one_readable_stream(lines: list[str], port: int) -> None:
    """Every line prefixed by the process that wrote it, but the ready line, which stands
    alone after every process has started; no Celery banner, no access log, no warning about
    the runtime dir that nobody can act on."""
    text = "".join(lines)
    ready = f"delaysvc ready: dashboard at http://127.0.0.1:{port}/  (Ctrl-C stops everything)\n"
    assert [line for line in lines if line.strip() and not PREFIXED.match(line)] == [ready], text
    starting = "delaysvc | starting web, delivery, consume, beat\n"
    assert lines.index(starting) < lines.index(ready), text
    for noise in ("RuntimeDirWarning", "celery beat v", "[queues]", '"GET /'):
        assert noise not in text, text


def _clean_env(**extra: str) -> dict[str, str]:
    env = outside_env()
    env.pop("XDG_RUNTIME_DIR", None)  # as in a container: the wheel's runtime dir falls back
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


@SECOND_PASS_ONLY
def test_up_runs_everything_from_an_empty_folder_and_stops_cleanly(tmp_path: Path) -> None:
    env = _clean_env(DELAYSVC_HANDLERS="examples.shop,tests.e2e.handlers", SHOP_CANCEL_AFTER="3s")
    with running_up(tmp_path, env) as (port, delaysvc, lines):
        # `ready` means ready: a level-1 message sent now runs on time (lanes started with
        # the delivery worker, not at beat's first interval; consumers warm)
        late_ms = _level_1_handler_started_late_ms(start_embedded(tmp_path / "var"))
        assert late_ms <= 100, f"sent at ready, its handler started {late_ms:.0f} ms late"
        token = delaysvc("create-token", "tester", "--scope", "admin").strip().splitlines()[-1]
        assert delaysvc("send", "sms.send", '"hi"', "--delay", "45m").startswith("sent: id=")
        assert delaysvc("levels").splitlines()[-1].split() == ["timer", "any", "1"]
        lanes = [line.split()[:3] for line in delaysvc("stats").splitlines()]
        assert ["timer", "any", "1"] in lanes
        # the README's order-cancellation example against the same embedded database
        url = start_embedded(tmp_path / "var")
        shop_env = dict(env, DELAYSVC_DATABASE_URL=url)
        subprocess.run(
            [sys.executable, "-m", "examples.shop"],
            cwd=tmp_path,
            env=shop_env,
            check=True,
            timeout=60,
        )
        base = f"http://127.0.0.1:{port}/api/v1"
        status, sent = _http(
            "POST",
            base + "/messages",
            token,
            {"topic": "order.cancel", "body": {"order_id": 0}, "delay_level": 2},
        )
        assert (status, sent["status"], sent["delay_level"]) == (201, "scheduled", 2)

        def finished() -> dict[str, Any] | None:
            message = _http("GET", f"{base}/messages/{sent['id']}", token)[1]
            return message if message["status"] == "succeeded" else None

        done = wait_for(finished, 60, "the level-2 message to run")
        assert _seconds(done["delivered_at"]) >= _seconds(done["deliver_at"])  # never early
        stored_to_due = _seconds(done["deliver_at"]) - _seconds(done["stored_at"])
        assert stored_to_due == 5.0  # level 2 of the default levels

        engine = make_engine(Settings(), url)

        def statuses(sql: str) -> dict[str, str]:
            with engine.connect() as conn:
                return dict(conn.execute(text(sql)).all())

        orders = "SELECT item, status FROM shop_order"
        wait_for(lambda: statuses(orders).get("book") == "cancelled", 60, "the unpaid order")
        assert statuses(orders) == {"book": "cancelled", "lamp": "paid"}
        wait_for(
            lambda: any("cancelled, unpaid" in line for line in lines), 10, "its handler's line"
        )
        assert any(
            line.rstrip().endswith(
                "handlers: from examples.shop, tests.e2e.handlers (DELAYSVC_HANDLERS)"
            )
            for line in lines
        ), lines
        timers = statuses("SELECT key, status FROM message WHERE key LIKE 'order-%'")
        # beat samples every lane for the dashboard's charts and moved/s
        sampled = "SELECT CAST(lane AS text), count(*) FROM stats_sample GROUP BY lane"
        wait_for(lambda: len(statuses(sampled)) == 19, 60, "a stats sample of all 19 lanes")
        engine.dispose()
        assert sorted(timers.values()) == ["cancelled", "succeeded"]


def _level_1_handler_started_late_ms(url: str) -> float:
    """Send a level-1 message now; -> how late its handler started, once it succeeded."""
    from delaysvc.producer.sending import Producer

    settings = Settings(database_url=url)
    engine = make_engine(settings, url)
    try:
        sent = Producer(settings, engine).send("e2e.noop", {}, delay_level=1)

        def started_late_ms() -> float | None:
            with engine.connect() as conn:
                return conn.execute(
                    text(
                        "SELECT extract(epoch FROM started_at - deliver_ts) * 1000 "
                        "FROM message WHERE id = :id AND status = 'succeeded'"
                    ),
                    {"id": sent.id},
                ).scalar()

        return float(wait_for(started_late_ms, 60, "a level-1 message to run"))
    finally:
        engine.dispose()


def _seconds(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


@FIRST_PASS_ONLY
def test_up_dashboard_charts_move_live_while_a_load_runs(tmp_path: Path) -> None:
    """The issue's "done when": the dashboard at the URL `up` prints shows live charts while a
    load runs through the real worker and beat, without a reload."""
    from playwright.sync_api import expect, sync_playwright

    from tests.browser.test_dashboard_browser import SCREENSHOTS, launch_chromium

    with running_up(tmp_path, _clean_env()) as (port, delaysvc, lines):
        # no DELAYSVC_HANDLERS: the demo's handlers run, and `up` says so
        assert any("handlers: the demo's, for greet, order.cancel, load.demo" in x for x in lines)
        delaysvc("send", "greet", '{"name": "Ada"}')
        # no handler anywhere: it waits, and the overview says so
        sent = delaysvc("send", "nobody.home", "{}")
        waiting_id = re.search(r"id=(\d+)", sent).group(1)  # type: ignore[union-attr]
        wait_for(
            lambda: any("demo handler: hello, Ada" in line for line in lines),
            30,
            "the demo handler's line for the first send",
        )
        # the first `up` on a new embedded database made an admin and showed its password once
        (login,) = [line for line in lines if "dashboard login:" in line]
        found = re.search(r"dashboard login: (\S+) / (\S+)", login)
        assert found is not None, login
        name, password = found.groups()
        load = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "delaysvc",
                "load",
                "--rate",
                "300",
                "--seconds",
                "40",
                "--levels",
                "1,2",
                "--topic",
                "load.demo",
            ],
            cwd=tmp_path,
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=die_with_parent(),
        )
        try:
            with sync_playwright() as playwright:
                browser = launch_chromium(playwright)
                page = browser.new_page(viewport={"width": 1366, "height": 768})
                page.goto(f"http://127.0.0.1:{port}/login")
                page.fill("input[name=name]", name)
                page.fill("input[name=password]", password)
                page.click("button[type=submit]")
                expect(page.locator("#user")).to_have_text("admin (admin)", timeout=30_000)
                page.evaluate("window.sameDocument = true")

                def deliveries() -> int:
                    summary = page.locator("#lateness-chart-summary").inner_text()
                    return int(summary.split()[0]) if summary[0].isdigit() else 0

                first = wait_for(deliveries, 60, "the lateness chart to count deliveries")
                wait_for(lambda: deliveries() > first + 300, 60, "more deliveries, live")
                level1 = page.locator('#lanes tr[data-key="level-1"] [data-field="rate"]')
                wait_for(lambda: level1.inner_text().endswith("/s"), 60, "level 1's moved/s")
                # beat samples every 10 s: the backlog chart gains points as the load runs
                legend = page.locator('#backlog-chart-legend li[data-key="level-1"]')
                expect(legend).to_have_count(1, timeout=60_000)
                drawn = page.locator('#lateness-chart rect.bar:not([data-count="0"])')
                wait_for(lambda: drawn.count() > 0, 30, "lateness bars with deliveries")
                warning = page.locator("#warnings")
                expect(warning).to_be_visible()
                expect(warning).to_contain_text(
                    "1 ready message of nobody.home wait: no live worker has a handler"
                )
                expect(warning).not_to_contain_text("load.demo")  # the demo's handler runs it
                SCREENSHOTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(SCREENSHOTS / "overview-under-load.png"), full_page=True)
                assert page.evaluate("window.sameDocument") is True  # updated, never reloaded
                # the overview's warning goes when the messages do, without a reload
                delaysvc("cancel", waiting_id)
                expect(warning).to_be_hidden(timeout=30_000)
                assert page.evaluate("window.sameDocument") is True
                page.goto(f"http://127.0.0.1:{port}/topics")
                for topic, shown in (("load.demo", "yes"), ("greet", "yes")):
                    cell = page.locator(f'#topics tr[data-key="{topic}"] [data-field="handler"]')
                    expect(cell).to_have_text(shown)
                browser.close()
        finally:
            load.terminate()
            load.wait(timeout=30)


def _children_of(pid: int) -> dict[int, str]:
    """pid -> command line of the processes whose parent is `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found[int(entry.name)] = (entry / "cmdline").read_text().replace("\0", " ")
        except (OSError, IndexError, ValueError):
            continue
    return found


def _command_line(pid: int) -> str | None:
    """The process's command line, None once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return None


def _running(pid: int) -> bool:
    """The process exists and is no zombie (gone, but not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _postmaster(folder: Path) -> int | None:
    """The pid of the embedded PostgreSQL serving `folder`'s var/pg, while it runs."""
    try:
        pid = int((folder / "var" / "pg" / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if _running(pid) else None


def _not_postgres(pids: list[int]) -> list[int]:
    """Leaves out the embedded PostgreSQL, which outlives a killed `up` by design (the next
    `up` attaches to it; the last process attached stops it), and the processes gone."""
    return [pid for pid in pids if "postgres" not in (_command_line(pid) or "postgres")]


@SECOND_PASS_ONLY
def test_up_leaves_no_embedded_postgres_however_it_stops_and_starts_again_one_that_died(
    tmp_path: Path,
) -> None:
    """The embedded PostgreSQL is one of up's parts: killed while up runs, it is started again
    (it stayed down, the workers writing tracebacks, until another command happened to start
    it); and it stops with up when up is killed with SIGKILL or stopped by SIGTERM while it
    starts (it ran on, counted as used by the dead up)."""
    env = _clean_env(DELAYSVC_HANDLERS="tests.e2e.handlers")
    up = start_up(tmp_path, env, free_port())
    output = Output(up)
    try:
        output.wait_for("delaysvc ready:")
        postmaster = _postmaster(tmp_path)
        assert postmaster is not None
        os.kill(postmaster, signal.SIGKILL)
        output.wait_for("had stopped: started it again", 60)
        assert _postmaster(tmp_path) not in (None, postmaster)

        os.kill(up.pid, signal.SIGKILL)  # nothing else uses the server
        up.wait(timeout=10)
        wait_for(
            lambda: _postmaster(tmp_path) is None and not _processes_in(tmp_path),
            60,
            "the server and every child of the killed up to stop",
            explain=lambda: (
                f"postmaster {_postmaster(tmp_path)}, children {_processes_in(tmp_path)}, "
                f"users {(tmp_path / 'var' / 'pg' / '.handle_pids.json').read_text()}"
            ),
        )
    finally:
        if up.poll() is None:
            up.kill()

    # SIGTERM while up starts, after it started the server, before it runs its parts
    up = start_up(tmp_path, env, free_port())
    try:
        wait_for(lambda: _postmaster(tmp_path), 120, "up to start the embedded server")
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=90)
        wait_for(
            lambda: _postmaster(tmp_path) is None and not _processes_in(tmp_path),
            60,
            "the server up started to stop",
        )
    finally:
        if up.poll() is None:
            up.kill()
        for pid in _processes_in(tmp_path):
            os.kill(pid, signal.SIGKILL)


@FIRST_PASS_ONLY
def test_up_restarts_a_child_that_dies_and_takes_every_child_with_it_when_killed(
    tmp_path: Path,
) -> None:
    """The edges of a deployment's life: a consumer killed by the OOM killer is restarted
    while the rest runs on; SIGHUP reloads every part without stopping; a second `up` on the
    same var/ is refused; `up` itself killed with
    SIGKILL (the OOM killer, a closed terminal) leaves no child running, and the next `up`
    starts clean on the same folder."""
    env = _clean_env(DELAYSVC_HANDLERS="tests.e2e.handlers")
    port = free_port()
    up = start_up(tmp_path, env, port)
    output = Output(up)
    try:
        output.wait_for("delaysvc ready:")
        url = start_embedded(tmp_path / "var")

        second = subprocess.run(
            [sys.executable, "-m", "delaysvc", "up", "--port", str(free_port())],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1, second.stdout + second.stderr
        assert (
            f"delaysvc up is already running on {tmp_path / 'var'} (pid {up.pid}); "
            f"stop it first (Ctrl-C in its terminal, or kill {up.pid})"
        ) in second.stderr

        (consume,) = [pid for pid, cmd in _children_of(up.pid).items() if "consume@" in cmd]
        os.kill(consume, signal.SIGKILL)
        output.wait_for("consume exited with -9; restarting it in 1 s", 30)
        output.wait_for("restarting consume", 30)

        # the web server's master killed: its workers go with it (uvicorn's kept the port, and
        # every restart of the web failed until up gave up), and the restarted web answers
        (web,) = [pid for pid, cmd in _children_of(up.pid).items() if "gunicorn" in cmd]
        web_workers = list(_children_of(web))
        assert web_workers, "gunicorn's workers"
        os.kill(web, signal.SIGKILL)
        output.wait_for("web exited with -9; restarting it in 1 s", 30)
        wait_for(
            lambda: not any(_running(pid) for pid in web_workers),
            15,
            "the killed master's workers to exit",
            explain=lambda: str({pid: _command_line(pid) for pid in web_workers}),
        )
        output.wait_for("restarting web", 30)
        assert wait_until_answering(f"http://127.0.0.1:{port}/healthz", 60)
        # the restarted consumer runs it, once booted (a second after its death, then
        # Celery's start: a few seconds here)
        late_ms = _level_1_handler_started_late_ms(url)
        assert late_ms < 20_000, f"the restarted consumer started it {late_ms:.0f} ms late"

        # SIGHUP reloads, as gunicorn's does: gunicorn starts new workers under the same
        # master; each Celery child is replaced by a new one, the old one finishing first
        before = _children_of(up.pid)
        (web,) = [pid for pid, cmd in before.items() if "gunicorn" in cmd]
        (reaper,) = [pid for pid, cmd in before.items() if "runtime.reaper" in cmd]
        web_workers = set(_children_of(web))
        os.kill(up.pid, signal.SIGHUP)
        output.wait_for("reloading web (it starts new workers itself)", 30)
        for name in ("delivery", "consume", "beat", "database"):
            output.wait_for(f"reloading {name}: a new one starts, the old one finishes", 30)
        wait_for(
            lambda: (
                len(_children_of(up.pid)) == 6
                and not set(before) - {web, reaper} & set(_children_of(up.pid))
            ),
            60,
            "the replaced children to exit, their successors running",
        )
        wait_for(lambda: not web_workers & set(_children_of(web)), 60, "new gunicorn workers")
        assert up.poll() is None  # a reload stops nothing
        late_ms = _level_1_handler_started_late_ms(url)
        assert late_ms < 20_000, f"after the reload it started {late_ms:.0f} ms late"

        assert_check_clean(url)
        children = list(_children_of(up.pid))
        # web, delivery, consume, beat, the embedded database's keeper, and the reaper of
        # children that outlive a killed up (delaysvc.runtime.reaper)
        assert len(children) == 6, _children_of(up.pid)
        os.kill(up.pid, signal.SIGKILL)
        up.wait(timeout=10)
        # each child gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and stops as it would on
        # Ctrl-C, in seconds (nothing runs now). A delivery worker once never stopped: a
        # second SIGTERM's handler waited on the first's lock (tests/unit/test_worker_stopping)
        killed = time.monotonic()
        wait_for(
            lambda: not _not_postgres(_processes_in(tmp_path)),
            30,
            "every child of the killed up to exit",
            explain=lambda: (
                "still running: "
                + str({pid: _command_line(pid) for pid in _not_postgres(_processes_in(tmp_path))})
            ),
        )
        print(f"every child gone {time.monotonic() - killed:.1f} s after up was killed")
    finally:
        if up.poll() is None:
            up.kill()
        for pid in _not_postgres(_processes_in(tmp_path)):
            os.kill(pid, signal.SIGKILL)

    with running_up(tmp_path, env) as (_, delaysvc, _):
        assert delaysvc("send", "e2e.noop", "{}", "--level", "1").startswith("sent: id=")


def test_worker_says_ready_once_its_lanes_and_consumers_run(service: Service) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-m", "delaysvc", "worker", "-c", "1"],
        cwd=ROOT,
        env=service.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    output = Output(worker)
    try:
        output.wait_for("delaysvc worker ready: delivery and consumer running", 90)
        lanes = service.scalar(
            "SELECT count(*) FROM heartbeat WHERE component LIKE 'lane %' "
            "AND seen_at > now() - interval '10 s'"
        )
        assert lanes == service.settings.levels.max_level + 1
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
    assert code == 0, output.tail()


@first_pass_only("~11 s, which modules an import finds, the same on either server and broker")
def test_an_applications_own_tasks_web_and_migrations_never_shadow_delaysvcs(
    service: Service, tmp_path: Path
) -> None:
    """Started in a web application's root, which has its own `tasks.py` (Celery's tutorial),
    `web/` and `migrations/` (Flask-Migrate): migrate, the worker and the web server load
    delaysvc's own (`delaysvc.tasks`, `delaysvc.web`, `delaysvc.migrations`)."""
    for name in ("tasks.py", "web/__init__.py", "migrations/__init__.py"):
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text("raise RuntimeError('the application's own module was imported')\n")
    env = dict(service.env, PYTHONPATH=f"{tmp_path}:{ROOT}")  # as Celery and gunicorn put it
    migrated = subprocess.run(
        [sys.executable, "-m", "delaysvc", "migrate"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert migrated.returncode == 0, migrated.stderr
    port = free_port()
    parts = [
        subprocess.Popen(
            [sys.executable, "-m", "delaysvc", *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        for args in (["worker", "-c", "1"], ["web", "--port", str(port)])
    ]
    worker = Output(parts[0])
    try:
        worker.wait_for("delaysvc worker ready", 90)
        assert wait_until_answering(f"http://127.0.0.1:{port}/healthz")
    finally:
        for part in parts:
            part.send_signal(signal.SIGTERM)
        codes = [part.wait(timeout=60) for part in parts]
    assert codes == [0, 0], worker.tail()
    assert "the application's own module" not in "".join(worker.lines)
