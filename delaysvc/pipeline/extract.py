"""bulk-schedule's input read by Spark (`delaysvc.pipeline.bulk`): one row per record of a CSV,
JSON Lines or Parquet file or folder, and a local Parquet input looked at before Spark reads
it (`check_parquet`), so that a file that is not one is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from delaysvc.errors import ValidationError

# a CSV row's whole text when its cells are not as many as the header's (Spark's corrupt
# record column): the row takes the producer's path, which counts its cells
CELLS = "_delaysvc_row_text"


def extract(spark: Any, path: Path, fmt: str) -> Any:
    """One row per input record; JSON Lines stay raw text, parsed (and refused) per row."""
    if not path.exists():
        raise ValidationError("path", f"{path} does not exist")
    if fmt == "csv":
        from pyspark.sql.types import StringType, StructField, StructType

        # RFC 4180 quoting (a quote inside a quoted cell is doubled), as Python's csv writes
        reader = spark.read.option("header", True).option("multiLine", True).option("escape", '"')
        if _rows_end_in_crlf(path):  # else Spark turns a CR LF inside a quoted cell into LF
            reader = reader.option("lineSep", "\r\n")
        header = reader.csv(str(path)).schema  # every column as text
        if not header.fields:  # an empty file: no rows (Spark refuses a corrupt column alone)
            return reader.csv(str(path))
        # a row of more (or fewer) cells than the header keeps its text in CELLS: Spark would
        # drop the extra cells silently (an unquoted comma in a body shifts the row's cells)
        schema = StructType([*header.fields, StructField(CELLS, StringType())])
        reader = reader.schema(schema).option("columnNameOfCorruptRecord", CELLS)
        return reader.option("mode", "PERMISSIVE").csv(str(path))
    if fmt == "jsonl":  # a blank line is no record (it was a reject: "not JSON")
        from pyspark.sql import functions as F

        return spark.read.text(str(path)).where(~F.col("value").rlike(r"^\s*$"))
    return _parquet(spark, path)


PARQUET_MAGIC = b"PAR1"


def _parquet(spark: Any, path: Path) -> Any:
    """A Parquet file or folder, its schema read now: a file that is not Parquet, or a folder
    holding none, is refused in one line (it was a page of Java). It is looked at first
    (Spark logged its failure in ~40 lines of Java before the one line); Spark's failure is
    the fallback."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    check_parquet(path)
    try:
        frame = spark.read.parquet(str(path))  # reads a footer: one that is not fails here
    except (PySparkException, Py4JJavaError) as exc:
        what = "holds no Parquet files" if path.is_dir() else "is not a Parquet file"
        java = getattr(exc, "java_exception", None)  # Py4JJavaError's: the JVM's own words
        words = str(java.getMessage()) if java is not None else str(exc)
        cause = words.strip().split("\n", 1)[0][:200]
        raise ValidationError(
            "path", f"{path} {what} ({cause}); give --format csv or jsonl for other files"
        ) from None
    return frame


def check_parquet(path: Path) -> None:
    """Refuse, in one line, a local file or folder that Spark would not read as Parquet (the
    CLI asks before Spark starts: its start and its failure printed lines of their own)."""
    problem = _not_parquet(path)
    if problem is not None:
        raise ValidationError(
            "path", f"{path} {problem}; give --format csv or jsonl for other files"
        )


def _not_parquet(path: Path) -> str | None:
    """What keeps a local file, or folder, from being Parquet as Spark reads it, or None. A
    folder's files are those Spark reads (`_spark_reads`)."""
    if path.is_file():
        if _is_parquet(path):
            return None
        return "is not a Parquet file (it does not begin and end with PAR1)"
    if not path.is_dir():
        return None
    files = [f for f in sorted(path.rglob("*")) if _spark_reads(f, path)]
    if not files:
        return "holds no Parquet files (none but hidden or empty ones)"
    stray = next((f for f in files if not _is_parquet(f)), None)
    if stray is not None:
        return f"holds a file that is not Parquet ({stray.relative_to(path)})"
    return None


def _spark_reads(file: Path, folder: Path) -> bool:
    """Whether Spark reads this file of the folder as data, as its listing filters them: not
    an empty one, nor under a name starting with `.`, or with `_` but for a partition's
    (`_src=a`) and Parquet's summary files, nor one ending in `._COPYING_` (an upload under
    way)."""
    if not file.is_file() or file.stat().st_size == 0:
        return False
    for name in file.relative_to(folder).parts:
        hidden = name.startswith(".") or (name.startswith("_") and "=" not in name)
        summary = name.startswith(("_metadata", "_common_metadata"))
        if (hidden and not summary) or name.endswith("._COPYING_"):
            return False
    return True


def _is_parquet(path: Path) -> bool:
    """Whether the file begins and ends with Parquet's magic bytes."""
    magic = len(PARQUET_MAGIC)
    with path.open("rb") as f:
        head = f.read(magic)
        if f.seek(0, 2) < 2 * magic:
            return False
        f.seek(-magic, 2)
        return head == PARQUET_MAGIC and f.read(magic) == PARQUET_MAGIC


def _rows_end_in_crlf(path: Path) -> bool:
    """Whether a CSV file's first row (its header) ends in CR LF, as RFC 4180's rows do."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        start = f.read(1 << 16)
    end = start.find(b"\n")
    return end > 0 and start[end - 1 : end] == b"\r"
