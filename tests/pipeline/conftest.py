"""The pipeline tests' one SparkSession (local[2]), for the whole test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if os.environ.get("DELAYSVC_TEST_DATABASE_URL"):
        pytest.skip(
            "local Spark runs in CI's first pass (embedded PostgreSQL); the second runs the "
            "pipeline on a Spark cluster and on local[2] through the CLI (test_spark_cluster.py)"
        )
    from delaysvc.config.settings import DEBIAN_JDBC_JAR
    from delaysvc.pipeline.requirements import require
    from delaysvc.pipeline.spark import session

    require(jdbc_jar=DEBIAN_JDBC_JAR)  # Java and the JDBC driver: MissingPart (skipped, or failed)
    spark = session("local[2]")
    yield spark
    spark.stop()
