"""bulk-schedule: CSV, JSON Lines or Parquet rows (topic, body, delay | delay_ms | delay_level |
deliver_at, key, tags, properties) -> validated by the producer's rules -> stored in parallel
partitions; bad rows go to a rejects file of the same format family with a `reason` column, and
do not hold back the good ones.

Validation has two paths with one outcome (tests/pipeline/ runs generated rows
through both and `Producer.prepare` and compares decisions and stored values):

- the fast path (`rules.prepare`): Spark column expressions, evaluated in the JVM, check every
  rule and build each row's COPY text line, body included; for a body the JVM cannot encode
  exactly as the producer would (nested JSON, plain text, escapes), the Python task encodes it
  with the producer's own `encode_body`;
- the producer's path: every row the JVM does not accept (a bad row, or an unusual spelling)
  is turned into send options (`to_options`) and validated by `Producer.prepare` itself,
  which gives the exact reason for a reject.

A run is one pass over the input for the fast path (`store_fast`: the rows reach Python as
Arrow batches, so a row the JVM encoded costs Python no work but joining its line), then,
only if the JVM left rows to the producer's path, a second pass over just those rows (by row
id) through `store_partition`. JSON Lines rows always take the producer's path.

Each Spark task stores its good rows BATCH at a time, each batch in its own transaction,
through `store.insert_copy_text`: COPY into a staging table, then one set-based insert with
the service's lanes, offsets, key rule and database-clock deliver_ts. The same transaction
records the batch (the run, its first and last row id: `store.claim_bulk_batch`), and a task
run again (its executor lost, or a speculative copy) makes the same batches from the same
rows (in row id order after a shuffle) and skips each one an earlier attempt committed: a
retried task stores nothing twice, keyless rows included. Rows with a key are
deduplicated by the service's key rule, so running the same file again adds nothing; keyless
rows are not, unless `key_from_row` gives each a key derived from its content. Rejects are
reported by row id and their original cells read back in a further pass (only when there are
any), so good rows carry nothing extra.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.pool import NullPool

from delaysvc.config.settings import Settings
from delaysvc.config.validation import MAX_WHOLE_FLOAT, WHOLE_FIELDS, encode_body, not_json
from delaysvc.config.validation import MESSAGE_FIELDS as FIELDS
from delaysvc.db.engines import make_engine
from delaysvc.errors import BacklogFull, DatabaseUnavailable, ValidationError, one_line
from delaysvc.pipeline import store
from delaysvc.pipeline.extract import CELLS, extract
from delaysvc.pipeline.rejects import check_rejects, write_rejects
from delaysvc.producer.sending import Producer
from delaysvc.schema.migrate import check_schema
from delaysvc.store import (
    NewMessage,
    find_unfinished_by_keys,
    not_migrated,
    rolled_back,
)

log = logging.getLogger(__name__)
FORMATS = ("csv", "jsonl", "parquet")
BATCH = 20_000
ROLLED_BACK_TRIES = 5  # a batch PostgreSQL rolled back (a deadlock) is stored again so often
REJECT, COUNTS, SLOW = "reject", "counts", "slow"
# what a Spark task reports: (tag, a, b, reason): (REJECT, row id, -, reason), (COUNTS,
# created, duplicates, -), (SLOW, row id, -, -) for a row left to the producer's path
REPORT = "tag string, a long, b long, reason string"
RID = "_rid"
FAST_COLUMNS = (RID, "_fast", "_line", "_head", "_body", "_topic_key")
NULL = "\\N"  # COPY text's NULL
REPLACED = "\ufffd"  # what Spark's text readers put where the input's bytes are not UTF-8
NOT_UTF8 = (
    "holds U+FFFD, put where the input's bytes are not UTF-8: CSV and JSON Lines are read as "
    "UTF-8 (convert the file, e.g. `iconv -f WINDOWS-1252 -t UTF-8`); a U+FFFD in the input "
    "itself is refused too"
)
WHOLE_NUMBER = re.compile(r" *(-?[0-9]+) *")  # a level or delay_ms cell: ASCII digits


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


# ---------------------------------------------------------------- transform


def to_options(record: dict[str, Any], key_from_row: bool, fmt: str = "csv") -> dict[str, Any]:
    """Pure: a record's send options. Empty cells are absent; a body (or tags, properties)
    that is JSON text is decoded, but in JSON Lines (`fmt`) the body is the line's value as it
    is (a string stays a string); a level or delay_ms is a whole number; deliver_at is ISO
    8601. Raises ValidationError; the producer checks everything else."""
    unknown = sorted(k for k in record if k not in FIELDS and record[k] not in (None, ""))
    if unknown:
        raise ValidationError(unknown[0], f"unknown column; allowed: {', '.join(FIELDS)}")
    if fmt == "csv":  # Spark reads a byte that is not UTF-8 as U+FFFD, and says nothing
        for name, cell in record.items():
            if isinstance(cell, str) and REPLACED in cell:
                raise ValidationError(name, NOT_UTF8)
    options = {k: _plain(v) for k, v in record.items() if k in FIELDS and v not in (None, "")}
    for name in ("topic", "body"):
        if name not in options:
            raise ValidationError(name, "is required")
    if fmt != "jsonl" and isinstance(options["body"], str):
        options["body"] = body_value(options["body"])
    for name in ("tags", "properties"):
        if isinstance(options.get(name), str):
            try:
                options[name] = json.loads(options[name])
            except ValueError:
                raise ValidationError(name, "is not JSON") from None
    for name in WHOLE_FIELDS:
        value = options.get(name)
        if isinstance(value, str):
            whole = WHOLE_NUMBER.fullmatch(value)
            if whole is None:
                raise ValidationError(name, f"{value!r} is not a whole number")
            options[name] = int(whole.group(1))
        elif isinstance(value, float) and value.is_integer() and abs(value) < MAX_WHOLE_FLOAT:
            options[name] = int(value)  # a float column of whole numbers (pandas', with a gap)
    options["deliver_at"] = _instant(options.get("deliver_at"))
    if options["deliver_at"] is None:
        del options["deliver_at"]
    if key_from_row and "key" not in options:
        options["key"] = row_key(record)
    return options


def body_value(text: str) -> Any:
    """A body cell: the JSON value it spells, else the text itself (plain text is a body).
    `NaN`, `Infinity`, `-Infinity` and a number too large for a float (`1e400`), which Python's
    parser takes and JSON has not, are text (as `delaysvc send` reads its BODY)."""
    try:
        return json.loads(text, parse_constant=not_json, parse_float=_finite)
    except ValueError:
        return text
    except RecursionError:
        raise ValidationError("body", "is nested too deeply to read as JSON") from None


def _finite(number: str) -> float:
    value = float(number)
    if math.isinf(value):
        raise ValueError(f"{number} is too large for a float")
    return value


def row_key(record: dict[str, Any]) -> str:
    """A keyless row's stable key: the same content gives the same key on every run."""
    content = {k: v for k, v in record.items() if v not in (None, "")}
    canonical = json.dumps(content, sort_keys=True, default=str)
    return "row-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _plain(value: Any) -> Any:
    """Spark structs and maps as dicts, binary as bytes, at any depth: a struct inside a list
    or a map was a Row, a tuple, which JSON wrote as an array (`[{"a": 1}]` stored as
    `[[1]]`)."""
    if hasattr(value, "asDict"):
        return {name: _plain(item) for name, item in value.asDict().items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {name: _plain(item) for name, item in value.items()}
    if isinstance(value, bytearray):
        return bytes(value)
    return value


def _instant(value: Any) -> datetime | None:
    """deliver_at as a datetime; naive ISO text is refused by the producer. A Parquet
    TIMESTAMP (an instant) arrives from Spark as a naive local time of this process; a
    TIMESTAMP_NTZ (no time zone) as naive ISO text (`rules.prepare`), refused."""
    if value is None or (isinstance(value, datetime) and value.tzinfo is not None):
        return value
    if isinstance(value, datetime):
        return value.astimezone()  # a TIMESTAMP column's instant, in this process's zone
    try:
        return datetime.fromisoformat(str(value))  # a naive time is refused by the producer
    except ValueError:
        raise ValidationError("deliver_at", f"{value!r} is not an ISO 8601 time") from None


def _record(row: Any, fmt: str) -> dict[str, Any]:
    if fmt != "jsonl":
        record = dict(row.asDict())
        text = record.pop(CELLS, None)
        if text is not None:  # a CSV row of more or fewer cells than the header
            cells = len(next(csv.reader(io.StringIO(text)), []))
            if cells > len(record):
                raise ValidationError(
                    "row",
                    f"has {cells} cells, the header {len(record)} (an unquoted comma in a "
                    "cell? quote the cell)",
                )
        return record
    if REPLACED in row["value"]:
        raise ValidationError("line", NOT_UTF8)
    try:
        value = json.loads(row["value"])
    except ValueError as exc:
        raise ValidationError("line", f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValidationError("line", "must be a JSON object")
    return value


# ---------------------------------------------------------------- load


def store_fast(batches: Iterable[Any], settings: Settings, run: str) -> Iterator[Any]:
    """Store one partition of `rules.prepare`'s rows, given as Arrow record batches: the rows
    the JVM encoded whole (`_line`) as they are, the fast rows with a body left to Python
    (`_head`, `_body`) once it is encoded. Yields one Arrow batch of REPORT rows: the rejects,
    the rows left to the producer's path (SLOW), and the counts."""
    import pyarrow as pa

    engine = make_engine(settings, pool_size=1)
    created = duplicates = 0
    report: list[tuple[str, int, int | None, str | None]] = []
    lines: list[str] = []
    ids: list[int] = []
    # the keys of rows left to the producer's path: a later row with one is left there too,
    # so that the first row of a key is stored first, whichever path it takes (the fast path
    # stored a later row before an earlier one that the producer's path stores after it)
    left: set[str] = set()

    def flush() -> None:
        nonlocal created, duplicates
        new, repeated, refused = _store_batch(engine, settings, run, lines, ids, duplicates > 0)
        created += new
        duplicates += repeated
        report.extend(refused)
        lines.clear()
        ids.clear()

    try:
        for batch in batches:
            rids = batch.column(RID).to_pylist()
            encoded = batch.column("_line")
            if encoded.null_count == 0 and not left:  # the JVM encoded every row: the common case
                lines.extend(encoded.to_pylist())
                ids.extend(rids)
            else:
                columns = ("_fast", "_line", "_head", "_body", "_topic_key")
                rows = zip(rids, *(batch.column(c).to_pylist() for c in columns), strict=True)
                for rid, fast, line, head, body, topic_key in rows:
                    if not fast or topic_key in left:
                        if topic_key is not None:
                            left.add(topic_key)
                        report.append((SLOW, rid, None, None))
                        continue
                    try:
                        lines.append(line if line is not None else fast_line(head, body, settings))
                        ids.append(rid)
                    except ValidationError as exc:
                        report.append((REJECT, rid, None, str(exc)))
            if len(lines) >= BATCH:
                flush()
        if lines:
            flush()
    finally:
        engine.dispose()
    report.append((COUNTS, created, duplicates, None))
    yield pa.RecordBatch.from_pylist(
        [dict(zip(("tag", "a", "b", "reason"), r, strict=True)) for r in report],
        schema=pa.schema(
            [("tag", pa.string()), ("a", pa.int64()), ("b", pa.int64()), ("reason", pa.string())]
        ),
    )


def fast_line(head: str, body: str, settings: Settings) -> str:
    """A fast row's COPY text line from its head and a body the JVM left to the producer's
    `encode_body`. Raises ValidationError (a body too large, or not encodable)."""
    data, is_json = encode_body(body_value(body), settings.max_body_bytes)
    return f"{head}\t{'t' if is_json else 'f'}\t\\\\x{data.hex()}\n"


def store_partition(
    rows: Iterable[Any], settings: Settings, fmt: str, key_from_row: bool, run: str
) -> Iterator[tuple[str, int, Any, Any]]:
    """Validate and store one partition of `rules.prepare`'s rows, given as Spark Rows, any
    path. Yields REPORT tuples: (REJECT, row id, None, reason) per refused row, then one
    (COUNTS, created, duplicates, None)."""
    engine = make_engine(settings, pool_size=1)
    producer = Producer(settings, engine)
    created = duplicates = 0
    lines: list[str] = []
    ids: list[int] = []
    try:
        for batch in _batches(rows, BATCH):
            for rid, line, reason in validate(batch, producer, fmt, key_from_row):
                if line is None:
                    yield (REJECT, rid, None, reason)
                else:
                    lines.append(line)
                    ids.append(rid)
            if lines:
                new, repeated, refused = _store_batch(
                    engine, settings, run, lines, ids, duplicates > 0
                )
                created += new
                duplicates += repeated
                yield from refused
            lines, ids = [], []
    finally:
        engine.dispose()
    yield (COUNTS, created, duplicates, None)


def validate(
    rows: Iterable[Any], producer: Producer, fmt: str, key_from_row: bool
) -> Iterator[tuple[int, str | None, str | None]]:
    """-> (row id, COPY text line or None, reason or None) per `rules.prepare` row (_rid,
    _fast, _line, _head, _body, _orig): a line the JVM built is taken as it is, a body the JVM
    left is encoded here; every other row goes through the producer's own `prepare`."""
    now = datetime.now().astimezone()
    for row in rows:
        rid, fast, line, head, body, original = row[:6]  # (`_topic_key` after them)
        try:
            if line is not None:
                yield rid, line, None
            elif fast:
                yield rid, fast_line(head, body, producer.settings), None
            else:
                options = to_options(_record(original, fmt), key_from_row, fmt)
                yield rid, message_line(producer.prepare(**options, now=now)), None
        except ValidationError as exc:
            yield rid, None, str(exc)


def _batches(rows: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def message_line(m: NewMessage) -> str:
    """A message the producer prepared as a COPY text line of `store.COPY_COLUMNS`."""
    fields = [
        m.topic,
        _escape(m.key) if m.key is not None else NULL,
        "{" + ",".join(f'"{t}"' for t in m.tags) + "}" if m.tags is not None else NULL,
        _escape(json.dumps(m.properties)) if m.properties is not None else NULL,
        _number(m.delay_level),
        str(m.lane),
        _number(m.delay_ms),
        # in UTC: PostgreSQL's text input takes offsets up to 15:59, Python's (and a send's)
        # any below a day (`+16:00` failed the whole COPY)
        m.deliver_at.astimezone(UTC).isoformat() if m.deliver_at is not None else NULL,
        "t" if m.body_is_json else "f",
        "\\\\x" + m.body.hex(),
    ]
    return "\t".join(fields) + "\n"


def _escape(text: str) -> str:
    # keys and JSON text hold no tab, newline or carriage return (keys refuse control
    # characters; json.dumps escapes them), so only the backslash needs doubling
    return text.replace("\\", "\\\\")


def _number(value: int | None) -> str:
    return NULL if value is None else str(value)


def _store_batch(
    engine: Any,
    settings: Settings,
    run: str,
    lines: list[str],
    ids: list[int],
    keys_may_be_held: bool,
) -> tuple[int, int, list[tuple[str, int, None, str]]]:
    """Store the rows `ids` as COPY text `lines`. The backlog caps apply as they do to the
    producer's sends: rows a `reject` cap covers are stored apart from the rest, each set of
    rows under the same reject caps in a transaction of its own (`_by_rejecting_caps`), so a
    full cap refuses only the rows it covers. -> (how many were created, how many were
    duplicates of a held key, a REJECT report per row refused by a cap)."""
    placed = []  # what the caps count: each message's topic, key and lane
    for line in lines:
        topic, key, _, _, _, lane, _ = line.split("\t", 6)
        held = None if key == NULL else key.replace("\\\\", "\\")
        placed.append(NewMessage(topic, b"", True, int(lane), None, None, None, key=held))
    with engine.connect() as conn:
        groups = _by_rejecting_caps(conn, settings, placed)
    created = duplicates = 0
    refused: list[tuple[str, int, None, str]] = []
    for group in groups:
        rows = [ids[i] for i in group]
        try:
            new, repeated = _store_rows(
                engine,
                settings,
                run,
                [lines[i] for i in group],
                rows,
                [placed[i] for i in group],
                keys_may_be_held,
            )
        except BacklogFull as exc:
            # a row whose key an unfinished message holds is a duplicate, not a refusal: it
            # would store nothing (a re-run's rows were listed as refused by a full cap)
            holding = _held([placed[i] for i in group], engine)
            duplicates += len(holding)
            reason = f"backlog_full: {exc}"
            refused += [
                (REJECT, ids[i], None, reason) for n, i in enumerate(group) if n not in holding
            ]
            continue
        created += new
        duplicates += repeated
    return created, duplicates, refused


def _held(placed: list[NewMessage], engine: Any) -> set[int]:
    """The indexes of `placed` whose key an unfinished message of their topic holds."""
    keys = [(m.topic, m.key) for m in placed if m.key is not None]
    if not keys:
        return set()
    with engine.connect() as conn:
        holders = find_unfinished_by_keys(conn, keys)
    return {n for n, m in enumerate(placed) if m.key is not None and (m.topic, m.key) in holders}


def _by_rejecting_caps(conn: Any, settings: Settings, placed: list[NewMessage]) -> list[list[int]]:
    """The batch's rows (their indexes, in order) in sets that the same `reject` caps cover:
    one set, the whole batch, when no reject cap covers any of it."""
    from delaysvc.producer import caps

    rejecting = [
        cap for cap in caps.covering(conn, settings.caps, placed) if cap.policy == "reject"
    ]
    if not rejecting:
        return [list(range(len(placed)))]
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, message in enumerate(placed):
        covering = tuple(n for n, cap in enumerate(rejecting) if caps.covers(cap, message))
        groups.setdefault(covering, []).append(index)
    return list(groups.values())


def _store_rows(
    engine: Any,
    settings: Settings,
    run: str,
    lines: list[str],
    ids: list[int],
    placed: list[NewMessage],
    keys_may_be_held: bool,
) -> tuple[int, int]:
    """Store the rows `ids` in one transaction, recorded as a batch of `run` in it
    (`store.claim_bulk_batch`): a task run again skips what an earlier attempt stored. A task
    whose batches have met no held key yet tries the plain insert first
    (`store.insert_copy_text`). -> (created, duplicates of a held key); raises BacklogFull,
    nothing stored."""
    from delaysvc.producer import caps

    attempt = 0
    while True:
        attempt += 1
        try:
            with engine.begin() as conn:
                earlier = store.claim_bulk_batch(conn, run, ids[0], ids[-1], len(ids))
                if earlier is not None:
                    log.info("bulk.batch_stored_before", extra={"run": run, "first_rid": ids[0]})
                    return earlier, len(lines) - earlier
                capped = caps.covering(conn, settings.caps, placed)
                caps.before_insert(conn, capped, placed)
                created = store.insert_copy_text(
                    conn, "".join(lines), keys_may_be_held=keys_may_be_held
                )
                store.record_bulk_created(conn, run, ids[0], created)
                if capped and created:  # which rows a held key skipped is not told
                    caps.after_insert(conn, capped, placed)
            return created, len(lines) - created
        except (psycopg.Error, DBAPIError) as exc:
            # a deadlock with another writer of the same keys (a `send_batch` inserting them in
            # its own order), or a serialization failure: PostgreSQL rolled the batch back,
            # nothing of it stored; it is stored again
            if attempt == ROLLED_BACK_TRIES or not rolled_back(getattr(exc, "orig", exc)):
                raise
            log.warning("bulk.batch_rolled_back", extra={"run": run, "first_rid": ids[0]})
            time.sleep(0.05 * attempt)


def _raw(row: Any, fmt: str) -> str:
    if fmt == "jsonl":
        return str(row["value"])
    cells = row.asDict(recursive=True)
    return json.dumps({k: _text(v) for k, v in cells.items() if k not in (RID, CELLS)})


def _text(value: Any) -> str | None:
    """A rejected cell as text (rejects keep every input column as a string)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return str(value)


def check_database(settings: Settings) -> None:
    """Before any Spark job: the database is there and migrated for the configured levels,
    as one error (SchemaNotReady, DatabaseUnavailable) instead of a failed Spark task's
    traceback."""
    engine = make_engine(settings, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            check_schema(conn, settings.levels)
            store.forget_bulk_run(conn, "")  # the batches' table is there (no run is "")
    except OperationalError as exc:
        reason = one_line(exc)
        raise DatabaseUnavailable(f"database unreachable: {reason}", maybe_stored=False) from None
    except DBAPIError as exc:
        missing = not_migrated(exc)
        if missing is None:
            raise
        raise missing from None
    finally:
        engine.dispose()


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
    from pyspark.sql import functions as F

    from delaysvc.pipeline import rules

    started = time.monotonic()
    ledger = uuid.uuid4().hex  # this run's batches (`_store_batch`), whichever task attempt
    fmt = detect_format(path, fmt)
    rejects = rejects or default_rejects(path, fmt)
    if not path.exists():
        raise ValidationError("path", f"{path} does not exist")
    check_rejects(rejects, path, fmt)
    check_database(settings)
    # row ids are given before any repartition, so a second read of the file gives each row
    # the same id (the rejects' original cells are read back by id)
    frame = extract(spark, path, fmt).withColumn(RID, F.monotonically_increasing_id())
    columns = [c for c in frame.columns if c not in (RID, CELLS)]
    # a CSV read with multiLine (quoted newlines) is one partition: spread the rows before
    # validating, so every core validates and stores (`_spread`); rows with keys always, so
    # that a key's rows are in one partition, in row id order, and its first row is stored
    # (a Parquet folder's files, a JSON Lines file's parts, read as partitions of their own
    # stored either)
    source = frame
    wanted = partitions or max(spark.sparkContext.defaultParallelism, 1)
    keyed = "key" in frame.columns or fmt == "jsonl"
    if partitions or keyed or source.rdd.getNumPartitions() < wanted:
        source = _spread(source, wanted, fmt)
    report: list[tuple[Any, ...]] = []
    if fmt == "jsonl":  # every row takes the producer's path (rules.py says why)
        slow = source
    else:
        fast = rules.prepare(source, settings, key_from_row).select(*FAST_COLUMNS)
        # collect() runs the stores exactly once (a second action would store again)
        stored = fast.mapInArrow(lambda batches: store_fast(batches, settings, ledger), REPORT)
        report = [tuple(row) for row in stored.collect()]
        slow_ids = [rid for tag, rid, _, _ in report if tag == SLOW]
        # the second pass takes the rows the first left by id, not by deciding again: a rule
        # that reads the clock (deliver_at within the longest delay) could decide otherwise
        slow = _spread(_rows_with_ids(spark, frame, slow_ids), wanted, fmt) if slow_ids else None
    if slow is not None:
        rows = rules.prepare(slow, settings, key_from_row).rdd
        report += rows.mapPartitions(
            lambda rows: store_partition(rows, settings, fmt, key_from_row, ledger)
        ).collect()
    _forget_batches(settings, ledger)
    written = sum(a for tag, a, _, _ in report if tag == COUNTS)
    duplicates = sum(b for tag, _, b, _ in report if tag == COUNTS)
    reasons = {rid: reason for tag, rid, _, reason in report if tag == REJECT}
    refused = _refused_rows(spark, frame, reasons, fmt)
    write_rejects(refused, columns, fmt, rejects)
    read = written + duplicates + len(refused)
    log.info("bulk.done", extra={"read": read, "written": written, "rejected": len(refused)})
    return BulkResult(read, written, duplicates, len(refused), time.monotonic() - started, rejects)


def _spread(frame: Any, partitions: int, fmt: str) -> Any:
    """The rows in `partitions` partitions by range of (topic, key): partitions writing at once
    insert into different parts of the key index (round-robin rows interleave there, and
    sessions inserting into the same index pages wait on each other), and a key's rows are in
    one partition (equal values are in one range). A row without a key ranges by its row id,
    so keyless rows spread over every partition (by (topic, key) alone they were one range:
    one task stored a keyless file). Each partition in row id order: a task run again (its
    executor lost), which reads its rows from the shuffle in another order, makes the same
    batches (`_store_batch`), and a key's first row is stored first."""
    from pyspark.sql import functions as F

    if fmt == "jsonl":  # a line's topic and key as Spark spells them: the same for the same
        topic, key = (F.get_json_object("value", f"$.{name}") for name in ("topic", "key"))
    elif "topic" in frame.columns:
        topic = F.col("topic").cast("string")
        key = F.col("key").cast("string") if "key" in frame.columns else F.lit(None)
    else:
        return frame.repartition(partitions).sortWithinPartitions(RID)
    unkeyed = F.concat(F.lit("\u0000"), F.col(RID).cast("string"))  # below any key
    by = F.coalesce(F.nullif(key, F.lit("")), unkeyed)
    return frame.repartitionByRange(partitions, topic, by).sortWithinPartitions(RID)


def _forget_batches(settings: Settings, ledger: str) -> None:
    engine = make_engine(settings, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            store.forget_bulk_run(conn, ledger)
    finally:
        engine.dispose()


def _refused_rows(
    spark: Any, frame: Any, reasons: dict[int, str], fmt: str
) -> list[tuple[str, str]]:
    """(reason, the row's original cells as JSON) per refused row id, in input order."""
    if not reasons:
        return []
    rows = _rows_with_ids(spark, frame, list(reasons)).collect()
    rows.sort(key=lambda row: row[RID])
    return [(reasons[row[RID]], _raw(row, fmt)) for row in rows]


def _rows_with_ids(spark: Any, frame: Any, ids: list[int]) -> Any:
    """The input rows with these row ids (a second read of the input gives each row the same
    id)."""
    from pyspark.sql import functions as F

    wanted = spark.createDataFrame([(rid,) for rid in ids], f"{RID} long")
    return frame.join(F.broadcast(wanted), RID)
