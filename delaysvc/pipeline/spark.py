"""One SparkSession for the pipeline's jobs.

The jobs read PostgreSQL from inside Spark tasks, each task querying its own id slice through
the service's store (psycopg), rather than through Spark's JDBC source: the embedded
PostgreSQL of `delaysvc up` listens on a Unix socket only, which JDBC cannot reach, and the
same code then serves both. `--jars` still adds jars (a JDBC driver for your own jobs, say).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def session(master: str = "local[*]", jars: str | None = None) -> SparkSession:
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName("delaysvc-pipeline")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if jars:
        builder = builder.config("spark.jars", jars)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
