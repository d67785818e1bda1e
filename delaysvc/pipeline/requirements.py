"""What the pipeline needs beyond delaysvc's own dependencies, checked before any work starts:
PySpark (with pyarrow and pandas: the `pipeline` extra), a Java runtime for Spark, and, for the
jobs that read PostgreSQL through Spark (archive, report), its JDBC driver. Each missing part
is one line naming what to install and how, instead of a Python or Java stack trace later."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from delaysvc.errors import MissingPart

PIPELINE_MODULES = ("pyspark", "pyarrow", "pandas")
JDBC_DRIVER_CLASS = "org/postgresql/Driver.class"


def missing_python_parts() -> str | None:
    absent = [name for name in PIPELINE_MODULES if importlib.util.find_spec(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed: pip install 'delaysvc[pipeline]'"
    return None


def missing_java() -> str | None:
    """Spark's launcher runs `$JAVA_HOME/bin/java` when JAVA_HOME is set, else `java`."""
    install = "apt-get install openjdk-17-jre-headless (Spark needs Java 17 or later)"
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        if not Path(java_home, "bin", "java").is_file():
            return f"JAVA_HOME={java_home} has no bin/java: point it at a Java 17 or later"
        return None
    if shutil.which("java") is None:
        return f"no Java runtime (java is not on PATH and JAVA_HOME is unset): {install}"
    return None


def missing_jdbc_driver(jdbc_jar: Path, more_jars: Iterable[str] = ()) -> str | None:
    """The driver is `jdbc_jar` (DELAYSVC_JDBC_JAR), or in one of the `--jars`."""
    if jdbc_jar.is_file() or any(_holds_driver(Path(jar)) for jar in more_jars):
        return None
    return (
        f"the PostgreSQL JDBC driver is not at {jdbc_jar}: apt-get install "
        "libpostgresql-jdbc-java, or set DELAYSVC_JDBC_JAR to the driver's jar"
    )


def unwritable(folder: Path) -> str | None:
    """Why this process cannot write into `folder` (made here, with its parents, if missing),
    or None: a file is made there and removed, before Spark starts."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder, prefix=".delaysvc-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _holds_driver(jar: Path) -> bool:
    try:
        with zipfile.ZipFile(jar) as archive:
            return JDBC_DRIVER_CLASS in archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def require(*, jdbc_jar: Path | None = None, more_jars: Iterable[str] = ()) -> None:
    """Raise MissingPart naming the first part missing; `jdbc_jar`: the job reads through
    JDBC. Under spark-submit, Spark's JVM runs already, with the jars spark-submit was given."""
    reason = missing_python_parts()
    if reason is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        reason = missing_java() or (
            missing_jdbc_driver(jdbc_jar, more_jars) if jdbc_jar is not None else None
        )
    if reason:
        raise MissingPart(reason)
