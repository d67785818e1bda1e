"""Each optional part missing, as a new user meets it: the command stops before any work starts,
with one line naming what to install and how, a non-zero exit and no traceback. The part is
made unavailable to the subprocess alone (PATH, JAVA_HOME, a setting pointing nowhere, an
import that fails). The database URL names a port nobody listens on, so a command that
started any work would end with another error."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from delaysvc.pipeline.requirements import missing_jdbc_driver
from tests.conftest import ROOT, outside_env
from tests.support.passes import first_pass_only

NO_DATABASE = "postgresql://nobody@127.0.0.1:1/nothing"
HIDE_PYSPARK = "import sys; sys.modules['pyspark'] = None; from delaysvc.cli import main; main()"
JAVA = "apt-get install openjdk-17-jre-headless (Spark needs Java 17 or later)"


def _env(**variables: str) -> dict[str, str]:
    env = outside_env()
    env.pop("JAVA_HOME", None)
    env.update(PYTHONPATH=str(ROOT), DELAYSVC_DATABASE_URL=NO_DATABASE, **variables)
    return env


def _assert_stops_with(command: list[str], env: dict[str, str], line: str) -> None:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert (result.returncode, result.stderr.splitlines()) == (1, [line]), result.stderr


def _delaysvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "delaysvc", *args]


def test_pipeline_without_pyspark_names_the_extra() -> None:
    _assert_stops_with(
        [sys.executable, "-c", HIDE_PYSPARK, "pipeline", "archive"],
        _env(),
        "error: pyspark not installed: pip install 'delaysvc[pipeline]'",
    )


def test_pipeline_without_java_names_the_package(tmp_path: Path) -> None:
    _assert_stops_with(
        _delaysvc("pipeline", "report"),
        _env(PATH=str(tmp_path)),  # an empty folder: no java on PATH
        f"error: no Java runtime (java is not on PATH and JAVA_HOME is unset): {JAVA}",
    )


def test_pipeline_with_java_home_pointing_nowhere_says_so(tmp_path: Path) -> None:
    rows = tmp_path / "jobs.csv"
    rows.write_text("topic,body\nshop.email,{}\n")
    _assert_stops_with(
        _delaysvc("pipeline", "bulk-schedule", str(rows)),
        _env(JAVA_HOME=str(tmp_path / "jdk")),
        f"error: JAVA_HOME={tmp_path / 'jdk'} has no bin/java: point it at a Java 17 or later",
    )


@pytest.mark.parametrize("job", ["archive", "report"])
def test_pipeline_reading_through_jdbc_without_the_driver_names_package_and_setting(
    tmp_path: Path, job: str
) -> None:
    jar = tmp_path / "postgresql.jar"
    _assert_stops_with(
        _delaysvc("pipeline", job),
        _env(DELAYSVC_JDBC_JAR=str(jar)),
        f"error: the PostgreSQL JDBC driver is not at {jar}: apt-get install "
        "libpostgresql-jdbc-java, or set DELAYSVC_JDBC_JAR to the driver's jar",
    )


def test_the_jdbc_driver_may_come_with_jars_instead(tmp_path: Path) -> None:
    """`--jars` (the option for more jars) may carry the driver: a jar holding its class."""
    driver, other = tmp_path / "pgjdbc-42.jar", tmp_path / "other.jar"
    with zipfile.ZipFile(driver, "w") as jar:
        jar.writestr("org/postgresql/Driver.class", b"\xca\xfe\xba\xbe")
    with zipfile.ZipFile(other, "w") as jar:
        jar.writestr("org/example/Thing.class", b"\xca\xfe\xba\xbe")
    absent = tmp_path / "postgresql.jar"
    assert missing_jdbc_driver(absent, ["", str(other), str(driver)]) is None
    assert missing_jdbc_driver(absent, ["", str(other), str(tmp_path / "gone.jar")]) == (
        f"the PostgreSQL JDBC driver is not at {absent}: apt-get install "
        "libpostgresql-jdbc-java, or set DELAYSVC_JDBC_JAR to the driver's jar"
    )


def test_bench_http_without_wrk_names_the_package(tmp_path: Path) -> None:
    _assert_stops_with(
        _delaysvc("bench", "http", "--quick", "--out", str(tmp_path / "out")),
        _env(PATH=str(tmp_path)),  # no wrk on PATH
        "error: bench http: wrk is not installed: apt-get install wrk",
    )
    assert not (tmp_path / "out").exists()


REQUIRED = "DELAYSVC_TEST_REQUIRE_PARTS"


@first_pass_only("~8 s; runs a browser test twice, and those run in the first pass (tests/browser)")
@pytest.mark.parametrize("required", [False, True], ids=["pip-only", "ci"])
def test_browser_tests_without_chromium_are_skipped_or_where_required_fail_with_one_line(
    tmp_path: Path, required: bool
) -> None:
    """On a machine with only pip the README's test command skips a browser test, naming what
    to install; CI installs Chromium and requires it (DELAYSVC_TEST_REQUIRE_PARTS): there a
    browser test without it fails, saying so in one line."""
    chromium = tmp_path / "chromium"
    test = "tests/browser/test_dashboard_browser.py::" + (
        "test_refused_without_login_then_log_in_lands_on_the_page_asked_for[wsgi]"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", REQUIRED)}
    env.update(PYTHONPATH=str(ROOT), DELAYSVC_TEST_CHROMIUM=str(chromium))
    if required:
        env[REQUIRED] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", test, "-p", "no:cacheprovider", "-q", "-rs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == (1 if required else 0), result.stdout
    line = (
        f"Chromium is not at {chromium}: apt-get install chromium "
        "(or set DELAYSVC_TEST_CHROMIUM to a Chromium elsewhere)"
    )
    (row,) = [row for row in result.stdout.splitlines() if line in row]
    if required:
        assert row == f"{line} (DELAYSVC_TEST_REQUIRE_PARTS: this machine must have it)"
    else:
        assert row.startswith("SKIPPED [1] tests/browser/test_dashboard_browser.py:"), row
        assert row.endswith(f": not on this machine: {line}"), row
    assert "Traceback" not in result.stdout and "playwright" not in result.stdout, result.stdout
