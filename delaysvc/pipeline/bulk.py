"""bulk-schedule: CSV, JSON Lines or Parquet rows (topic, body, delay | delay_ms |
delay_level | deliver_at, key, tags, properties) -> validated by the producer's own rules ->
stored in parallel partitions; bad rows go to a rejects file of the same format family with
a `reason` column, and do not hold back the good ones.

Each Spark task turns its rows into send options (`to_options`), validates each with
`Producer.prepare` (the producer's code, not a copy) and stores the good ones BATCH at a time,
each batch in its own transaction, through `store.insert_staged`: COPY into a staging table,
then the service's insert with deliver_ts from the database clock. Rows with a key are
deduplicated by the service's key rule, so running the same file again adds nothing; keyless
rows are not, unless `key_from_row` gives each a key derived from its content.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from delaysvc.db import make_engine
from delaysvc.errors import BacklogFull, ValidationError
from delaysvc.pipeline import store
from delaysvc.producer import Producer
from delaysvc.settings import Settings
from delaysvc.store import NewMessage

log = logging.getLogger(__name__)
FORMATS = ("csv", "jsonl", "parquet")
FIELDS = (
    "topic",
    "body",
    "delay",
    "delay_ms",
    "delay_level",
    "deliver_at",
    "key",
    "tags",
    "properties",
)
BATCH = 5_000
REJECT, COUNTS = "reject", "counts"


@dataclass
class BulkResult:
    read: int
    written: int
    duplicates: int
    rejected: int
    seconds: float
    rejects: Path | None


def detect_format(path: Path, fmt: str | None) -> str:
    """The --format given, else from the file name; a folder is Parquet (Spark writes those)."""
    if fmt is None:
        suffix = path.suffix.lower()
        fmt = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(
            suffix, "parquet" if path.is_dir() else suffix.lstrip(".") or "(none)"
        )
    if fmt not in FORMATS:
        raise ValidationError("format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


def default_rejects(path: Path, fmt: str) -> Path:
    suffix = {"csv": ".csv", "jsonl": ".jsonl", "parquet": ".parquet"}[fmt]
    return path.with_name(path.name.removesuffix(path.suffix) + ".rejects" + suffix)


# ---------------------------------------------------------------- extract


def extract(spark: Any, path: Path, fmt: str) -> Any:
    """One row per input record; JSON Lines stay raw text, parsed (and refused) per row."""
    if not path.exists():
        raise ValidationError("path", f"{path} does not exist")
    if fmt == "csv":
        # RFC 4180 quoting (a quote inside a quoted cell is doubled), as Python's csv writes
        reader = spark.read.option("header", True).option("multiLine", True)
        return reader.option("escape", '"').csv(str(path))
    if fmt == "jsonl":
        return spark.read.text(str(path))
    return spark.read.parquet(str(path))


# ---------------------------------------------------------------- transform


def to_options(record: dict[str, Any], key_from_row: bool) -> dict[str, Any]:
    """Pure: a record's send options. Empty cells are absent; a body (or tags, properties)
    that is JSON text is decoded; a level or delay_ms is a whole number; deliver_at is ISO
    8601. Raises ValidationError; the producer checks everything else."""
    unknown = sorted(k for k in record if k not in FIELDS and record[k] not in (None, ""))
    if unknown:
        raise ValidationError(unknown[0], f"unknown column; allowed: {', '.join(FIELDS)}")
    options = {k: _plain(v) for k, v in record.items() if k in FIELDS and v not in (None, "")}
    for name in ("topic", "body"):
        if name not in options:
            raise ValidationError(name, "is required")
    if isinstance(options["body"], str):
        with contextlib.suppress(ValueError):  # plain text is a body too
            options["body"] = json.loads(options["body"])
    for name in ("tags", "properties"):
        if isinstance(options.get(name), str):
            try:
                options[name] = json.loads(options[name])
            except ValueError:
                raise ValidationError(name, "is not JSON") from None
    for name in ("delay_level", "delay_ms"):
        if isinstance(options.get(name), str):
            if not options[name].strip().lstrip("-").isdigit():
                raise ValidationError(name, f"{options[name]!r} is not a whole number")
            options[name] = int(options[name])
    options["deliver_at"] = _instant(options.get("deliver_at"))
    if options["deliver_at"] is None:
        del options["deliver_at"]
    if key_from_row and "key" not in options:
        options["key"] = row_key(record)
    return options


def row_key(record: dict[str, Any]) -> str:
    """A keyless row's stable key: the same content gives the same key on every run."""
    content = {k: v for k, v in record.items() if v not in (None, "")}
    canonical = json.dumps(content, sort_keys=True, default=str)
    return "row-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _plain(value: Any) -> Any:
    """Spark structs and maps as dicts, binary as bytes."""
    if hasattr(value, "asDict"):
        return value.asDict(recursive=True)
    if isinstance(value, bytearray):
        return bytes(value)
    return value


def _instant(value: Any) -> datetime | None:
    if value is None or (isinstance(value, datetime) and value.tzinfo is not None):
        return value
    if isinstance(value, datetime):
        # Parquet timestamps arrive from Spark as naive local times of this process
        return value.astimezone()
    try:
        return datetime.fromisoformat(str(value))  # a naive time is refused by the producer
    except ValueError:
        raise ValidationError("deliver_at", f"{value!r} is not an ISO 8601 time") from None


def _record(row: Any, fmt: str) -> dict[str, Any]:
    if fmt != "jsonl":
        return dict(row.asDict())
    try:
        value = json.loads(row["value"])
    except ValueError as exc:
        raise ValidationError("line", f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValidationError("line", "must be a JSON object")
    return value


# ---------------------------------------------------------------- load


def store_partition(
    rows: Iterable[Any], settings: Settings, fmt: str, key_from_row: bool
) -> Iterator[tuple[str, str, str]]:
    """Validate and store one partition. Yields (REJECT, reason, row as JSON) per refused row,
    then one (COUNTS, created, duplicates)."""
    engine = make_engine(settings, pool_size=1)
    producer = Producer(settings, engine)
    created = duplicates = 0
    try:
        for batch in _batches(rows, BATCH):
            now = datetime.now().astimezone()
            good: list[tuple[NewMessage, Any]] = []
            for row in batch:
                try:
                    options = to_options(_record(row, fmt), key_from_row)
                    good.append((producer.prepare(**options, now=now), row))
                except ValidationError as exc:
                    yield (REJECT, str(exc), _raw(row, fmt))
            try:
                stored = _store_batch(engine, settings, [m for m, _ in good])
            except BacklogFull as exc:
                for _, row in good:
                    yield (REJECT, f"backlog_full: {exc}", _raw(row, fmt))
                continue
            created += stored
            duplicates += len(good) - stored
    finally:
        engine.dispose()
    yield (COUNTS, str(created), str(duplicates))


def _store_batch(engine: Any, settings: Settings, messages: list[NewMessage]) -> int:
    """One transaction; the backlog caps apply as they do to the producer's sends."""
    if not messages:
        return 0
    from delaysvc import caps

    with engine.begin() as conn:
        if settings.caps:
            caps.before_insert(conn, settings.caps, messages)
        created = store.insert_staged(conn, messages)
        if settings.caps:
            caps.after_insert(conn, settings.caps, messages)
    return created


def _batches(rows: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _raw(row: Any, fmt: str) -> str:
    if fmt == "jsonl":
        return str(row["value"])
    return json.dumps({k: _text(v) for k, v in row.asDict(recursive=True).items()})


def _text(value: Any) -> str | None:
    """A rejected cell as text (rejects keep every input column as a string)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return str(value)


# ---------------------------------------------------------------- rejects


def write_rejects(
    spark: Any, rejected: list[tuple[str, str]], columns: list[str], fmt: str, path: Path
) -> None:
    """The refused rows with a `reason` column, in the input's format family: CSV -> CSV,
    JSON Lines -> JSON Lines, Parquet -> a Parquet folder (every column as text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with path.open("w") as f:
            for reason, raw in rejected:
                f.write(json.dumps(_jsonl_reject(raw, reason)) + "\n")
        return
    records = [{**json.loads(raw), "reason": reason} for reason, raw in rejected]
    names = [*columns, "reason"]
    if fmt == "csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=names)
            writer.writeheader()
            writer.writerows(records)
        return
    schema = ", ".join(f"`{n}` string" for n in names)
    rows = [tuple(r.get(n) for n in names) for r in records]
    spark.createDataFrame(rows, schema).coalesce(1).write.mode("overwrite").parquet(str(path))


def _jsonl_reject(raw: str, reason: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return {**value, "reason": reason}
    return {"line": raw, "reason": reason}


# ---------------------------------------------------------------- the run


def run(
    spark: Any,
    settings: Settings,
    path: Path,
    fmt: str | None = None,
    rejects: Path | None = None,
    key_from_row: bool = False,
    partitions: int | None = None,
) -> BulkResult:
    started = time.monotonic()
    fmt = detect_format(path, fmt)
    rejects = rejects or default_rejects(path, fmt)
    frame = extract(spark, path, fmt)
    if partitions:
        frame = frame.repartition(partitions)
    # collect() runs the stores exactly once (a second action would store again)
    out = frame.rdd.mapPartitions(
        lambda rows: store_partition(rows, settings, fmt, key_from_row)
    ).collect()
    written = sum(int(a) for tag, a, _ in out if tag == COUNTS)
    duplicates = sum(int(b) for tag, _, b in out if tag == COUNTS)
    refused = [(reason, raw) for tag, reason, raw in out if tag == REJECT]
    write_rejects(spark, refused, list(frame.columns), fmt, rejects)
    read = written + duplicates + len(refused)
    log.info("bulk.done", extra={"read": read, "written": written, "rejected": len(refused)})
    return BulkResult(read, written, duplicates, len(refused), time.monotonic() - started, rejects)
