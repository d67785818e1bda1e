"""bulk-schedule: CSV, JSON Lines or Parquet rows (topic, body, delay | delay_level |
deliver_at, key) -> validated exactly as the producer validates -> stored in parallel
partitions; bad rows go to a rejects file (JSON Lines: the row and the reason) without holding
back the good ones.

Each Spark task validates its rows with `Producer.prepare` and stores the good ones with
`Producer.send_batch` in batches of BATCH (deliver times come from the database clock). Rows
with a key are deduplicated by the service's key rule, so running the same file again adds
nothing; `key_from_row` gives keyless rows a key derived from their content, so they are too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from delaysvc.db import make_engine
from delaysvc.errors import ValidationError
from delaysvc.producer import Producer
from delaysvc.settings import Settings

FORMATS = ("csv", "jsonl", "parquet")
FIELDS = ("topic", "body", "delay", "delay_ms", "delay_level", "deliver_at", "key")
BATCH = 5_000
WRITTEN, DUPLICATE = "__written__", "__duplicate__"


@dataclass
class BulkResult:
    read: int
    written: int
    duplicates: int
    rejected: int
    seconds: float


# ---------------------------------------------------------------- extract


def extract(spark: Any, path: Path, fmt: str) -> Any:
    """One row per input record; JSON Lines stay raw text, parsed (and refused) per row."""
    if fmt not in FORMATS:
        raise ValidationError("format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
    if not path.exists():
        raise ValidationError("path", f"{path} does not exist")
    if fmt == "csv":
        return spark.read.option("header", True).option("multiLine", True).csv(str(path))
    if fmt == "jsonl":
        return spark.read.text(str(path))
    return spark.read.parquet(str(path))


# ---------------------------------------------------------------- transform


def to_options(record: dict[str, Any], key_from_row: bool) -> dict[str, Any]:
    """A record's send options: empty cells are absent, a body that is JSON is decoded, a
    level is a whole number, deliver_at is ISO 8601. Raises ValidationError."""
    unknown = sorted(k for k in record if k not in FIELDS and record[k] not in (None, ""))
    if unknown:
        raise ValidationError(unknown[0], f"unknown column; allowed: {', '.join(FIELDS)}")
    options = {k: v for k, v in record.items() if k in FIELDS and v not in (None, "")}
    if "topic" not in options or "body" not in options:
        raise ValidationError("topic" if "topic" not in options else "body", "is required")
    if isinstance(options["body"], str):
        with contextlib.suppress(ValueError):  # plain text is a body too
            options["body"] = json.loads(options["body"])
    for name in ("delay_level", "delay_ms"):
        if isinstance(options.get(name), str):
            if not options[name].lstrip("-").isdigit():
                raise ValidationError(name, f"{options[name]!r} is not a whole number")
            options[name] = int(options[name])
    if isinstance(options.get("deliver_at"), str):
        try:
            options["deliver_at"] = datetime.fromisoformat(options["deliver_at"])
        except ValueError:
            raise ValidationError("deliver_at", "is not an ISO 8601 time") from None
    if key_from_row and "key" not in options:
        canonical = json.dumps(record, sort_keys=True, default=str)
        options["key"] = "row-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]
    return options


def _record(row: Any, fmt: str) -> dict[str, Any]:
    if fmt == "jsonl":
        try:
            value = json.loads(row["value"])
        except ValueError as exc:
            raise ValidationError("line", f"not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValidationError("line", "must be a JSON object")
        return value
    return row.asDict()


# ---------------------------------------------------------------- load


def store_partition(
    rows: Iterator[Any], settings: Settings, fmt: str, key_from_row: bool
) -> Iterator[tuple[str, str]]:
    """Validate and store one partition. Yields (reason, row as JSON) per rejected row and
    one (WRITTEN, n) and (DUPLICATE, n) at the end."""
    engine = make_engine(settings, pool_size=1)
    producer = Producer(settings, engine)
    good: list[dict[str, Any]] = []
    written = duplicates = 0

    def flush() -> None:
        nonlocal written, duplicates
        if good:
            messages = producer.send_batch(good)
            created = sum(1 for m in messages if m.created)
            written += created
            duplicates += len(messages) - created
            good.clear()

    try:
        for row in rows:
            try:
                options = to_options(_record(row, fmt), key_from_row)
                producer.prepare(**options)  # the producer's own rules, nothing written
            except ValidationError as exc:
                raw = row["value"] if fmt == "jsonl" else json.dumps(row.asDict(), default=str)
                yield (f"{exc.field}: {exc.detail}", raw)
                continue
            good.append(options)
            if len(good) >= BATCH:
                flush()
        flush()
    finally:
        engine.dispose()
    yield (WRITTEN, str(written))
    yield (DUPLICATE, str(duplicates))


def run(
    spark: Any,
    settings: Settings,
    path: Path,
    fmt: str,
    rejects: Path,
    key_from_row: bool = False,
    partitions: int | None = None,
) -> BulkResult:
    started = time.monotonic()
    frame = extract(spark, path, fmt)
    if partitions:
        frame = frame.repartition(partitions)
    out = frame.rdd.mapPartitions(
        lambda rows: store_partition(rows, settings, fmt, key_from_row)
    ).collect()
    written = sum(int(n) for tag, n in out if tag == WRITTEN)
    duplicates = sum(int(n) for tag, n in out if tag == DUPLICATE)
    refused = [(reason, raw) for reason, raw in out if reason not in (WRITTEN, DUPLICATE)]
    rejects.parent.mkdir(parents=True, exist_ok=True)
    with rejects.open("w") as f:
        for reason, raw in refused:
            f.write(json.dumps({"reason": reason, "row": raw}) + "\n")
    read = written + duplicates + len(refused)
    return BulkResult(read, written, duplicates, len(refused), time.monotonic() - started)
