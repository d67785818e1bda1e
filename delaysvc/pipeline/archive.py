"""archive: finished messages older than a retention period -> Parquet (partitioned by topic
and date) -> verified against PostgreSQL -> gone from PostgreSQL.

Finished messages live in the history, one partition per UTC day (`delaysvc.maintenance.history`);
the archive first moves every finished message still in commit_log there, then takes the history
a day at a time. A day that ended before the cutoff is copied whole and its partition dropped
(no DELETE, nothing to vacuum); the day the cutoff falls in is copied up to the cutoff and
those rows deleted in bounded batches (they leave dead rows only in a partition that will be
dropped whole later).

Each run (one day, or the part of one) has a `pipeline_run` row and its own folder
`run=<id>-<token>` (the token random, kept in the run's params: run ids restart at 1 in another
database, or a re-created one, archiving to the same --out), recorded as an absolute path when the
run starts. Before Spark writes into it the folder gets a marker file holding the token; a folder
is only ever removed or replaced when it holds its own run's marker (a write a crash cut short),
never one another run wrote. The order of the steps is what makes a run safe to kill at any point:

1. record the run (id range, day and cutoff) and write its rows to its folder;
2. read the folder back: its row count and sum of id hashes must equal PostgreSQL's for the
   same rows; only then is the checksum recorded (the run is now "verified");
3. a whole day: under the history lock (no row moving in or out), check the partition still
   holds exactly the verified rows, then drop it with its messages' dead letters; part of a
   day: delete the ids found in the folder, in batches, only while still in the history
   (a redriven dead letter has left it). Then mark the run succeeded.

The next run first finishes what a killed one left: without a recorded checksum nothing was
deleted, so the folder is written again from scratch; with one, the verified folder is kept
and the drop or the deletes resume, from the recorded folder (whatever --out or working
directory the next run has); a verified folder gone missing or changed fails its run, and its rows
still in PostgreSQL are taken by a new run. Only verified folders count as archived
(`verified_archive_folders`). One run at a time (a PostgreSQL advisory lock).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import islice
from pathlib import Path
from typing import Any, NoReturn

from sqlalchemy import Connection, Engine
from sqlalchemy.pool import NullPool

from delaysvc.config.levels import parse_duration_ms
from delaysvc.config.settings import DAY_MS, MAX_SETTING_DAYS, Settings
from delaysvc.db.engines import make_engine, session_url
from delaysvc.errors import DelaysvcError, ValidationError
from delaysvc.maintenance import history
from delaysvc.pipeline import store
from delaysvc.pipeline.requirements import unwritable
from delaysvc.pipeline.spark import JdbcTarget, jdbc_target
from delaysvc.store import history as store_history
from delaysvc.store.history import Partition

log = logging.getLogger(__name__)
ROWS_PER_PARTITION = 100_000
DELETE_BATCH = 5_000
DROP_PATIENCE = 600.0
"""How long dropping a day waits for readers of the history (a report running for minutes)
before the command gives up; its copy stays verified and the next run drops it."""
CRASH_POINTS = ("written", "verified", "deleting")
MARKER = "_delaysvc_run"
"""The file in a run's folder holding the run's token, written before Spark writes into it
(Spark and Parquet readers skip names starting with `_`)."""


class SimulatedCrash(RuntimeError):
    """Raised at a named step when a test asks for it: the run stops as if killed there."""


@dataclass
class ArchiveResult:
    runs: list[int] = field(default_factory=list)
    written: int = 0
    deleted: int = 0
    seconds: float = 0.0
    folders: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Span:
    """The history rows with ids in [low, high] that finished in [since, cutoff)."""

    run_id: int
    low: int
    high: int
    since: datetime | None
    cutoff: datetime
    partition: str | None
    """Set when the span is a whole day of history: dropped whole once verified."""
    folder: Path
    """The run's own folder (absolute), recorded in its `pipeline_run.output_path`."""
    token: str | None
    """The run's random token, in its folder's name and marker (None: a run left by a version
    before the tokens; its verified folder is kept, never removed)."""


@dataclass
class ArchiveRun:
    spark: Any
    engine: Engine
    target: JdbcTarget
    crash_at: str | None
    result: ArchiveResult

    def crash(self, point: str) -> None:
        if self.crash_at == point:
            raise SimulatedCrash(point)


# ---------------------------------------------------------------- extract


def extract(spark: Any, target: JdbcTarget, span: Span) -> Any:
    """The span's rows, read over JDBC in parallel id slices."""
    low, high = span.low, span.high
    rows = high - low + 1
    parallelism = spark.sparkContext.defaultParallelism
    partitions = max(min(parallelism, rows), math.ceil(rows / ROWS_PER_PARTITION))
    return spark.read.jdbc(
        target.url,
        store.archive_query(low, high, span.since, span.cutoff),
        column="id",
        lowerBound=low,
        upperBound=high + 1,
        numPartitions=partitions,
        properties={**target.properties, "fetchsize": "10000"},
    )


# ---------------------------------------------------------------- transform


def transform(frame: Any) -> Any:
    """Pure: the partition column `date` (UTC day each message finished)."""
    from pyspark.sql import functions as F

    return frame.withColumn("date", F.to_date("finished_at"))


def id_hash(column: str = "id") -> Any:
    """Spark's twin of `store.ID_HASH_SQL`: the first 15 hex digits of md5(id) as a number."""
    from pyspark.sql import functions as F

    digits = F.substring(F.md5(F.col(column).cast("string")), 1, 15)
    return F.conv(digits, 16, 10).cast("decimal(38,0)")


def checksum(frame: Any) -> tuple[int, int]:
    """Pure: (rows, sum of id hashes)."""
    from pyspark.sql import functions as F

    row = frame.agg(F.count(F.lit(1)).alias("n"), F.sum(id_hash()).alias("s")).collect()[0]
    return int(row["n"]), int(row["s"] or 0)


def format_checksum(value: tuple[int, int]) -> str:
    return f"{value[0]}:{value[1]}"


# ---------------------------------------------------------------- load


def load(frame: Any, folder: Path) -> None:
    """Into the run's folder, which holds only its marker: Spark adds, never deletes."""
    frame.write.mode("append").partitionBy("topic", "date").parquet(str(folder))


def read_folder(spark: Any, folder: Path | str) -> Any:
    """A run's folder as `load` wrote it (`read_folders`)."""
    return read_folders(spark, [str(folder)])


def read_folders(spark: Any, folders: Sequence[str]) -> Any:
    """Runs' folders as `load` wrote them, in one frame, each folder's `topic` as the text it
    is and `date` a date. Spark reads the folders' names (`topic=007`) as values, and took one
    that looks like a number for a number (`007` read back as 7) unless told not to guess.
    Folders are read from the folder holding them (`basePath`), one read each such folder:
    named `run=...`, runs' folders read as roots of their own looked like two tables to Spark
    (CONFLICTING_DIRECTORY_STRUCTURES), and the report failed once a second run was made."""
    from pyspark.sql import functions as F

    by_parent: dict[str, list[str]] = {}
    for folder in folders:
        by_parent.setdefault(str(Path(folder).parent), []).append(str(folder))
    guessing = "spark.sql.sources.partitionColumnTypeInference.enabled"
    was = spark.conf.get(guessing)
    spark.conf.set(guessing, "false")
    try:  # the folders' partitions are found here, as each frame is made
        frames = [
            # a run from before a column was added (priority, queue_offset) lacks it: merged
            spark.read.option("basePath", parent).option("mergeSchema", "true").parquet(*group)
            for parent, group in by_parent.items()
        ]
    finally:
        spark.conf.set(guessing, was)
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionByName(other, allowMissingColumns=True)
    return frame.drop("run").withColumn("date", F.to_date("date"))


# ---------------------------------------------------------------- the command's checks


def older_than_ms(text: str) -> int:
    """`--older-than`: a duration of at most MAX_SETTING_DAYS (a longer one puts the cutoff
    before year 1)."""
    ms = parse_duration_ms(text, field="--older-than")
    if ms > MAX_SETTING_DAYS * DAY_MS:
        raise ValidationError(
            "--older-than", f"{text!r} is more than {MAX_SETTING_DAYS}d, the most allowed"
        )
    return ms


def check_out(out: Path) -> Path:
    """`--out` is a folder this process can write into (made if missing), checked before Spark
    starts. -> its absolute path, the one recorded."""
    out = out.resolve()
    if out.exists() and not out.is_dir():
        raise ValidationError("--out", f"{out} is a file, not a folder")
    why = unwritable(out)
    if why is not None:
        raise ValidationError("--out", f"cannot write into {out} ({why})")
    return out


# ---------------------------------------------------------------- the run


def run(
    spark: Any,
    settings: Settings,
    engine: Engine,
    older_than_ms: int,
    out: Path,
    crash_at: str | None = None,
) -> ArchiveResult:
    """Finish any run a crash left behind, then archive what is older than the retention.
    `crash_at` (one of CRASH_POINTS) stops the run there, as a kill would (tests)."""
    if older_than_ms > MAX_SETTING_DAYS * DAY_MS:
        raise ValidationError("--older-than", f"more than {MAX_SETTING_DAYS}d, the most allowed")
    out = check_out(out)
    started = time.monotonic()
    result = ArchiveResult()
    url = session_url(settings, ARCHIVE)  # the lock's session, and the reads (not pooled)
    with _archive_lock(settings, url), jdbc_target(url) as target:
        job = ArchiveRun(spark, engine, target, crash_at, result)
        moved = history.move_all(engine)
        log.info("archive.history_moved", extra={"rows": moved})
        for left, recorded in _leftovers(engine, out):
            log.info("archive.resume", extra={"run_id": left.run_id})
            _finish(job, left, recorded)
        with engine.connect() as conn:  # once: rows finishing meanwhile wait for the next run
            cutoff = store.transaction_now(conn) - timedelta(milliseconds=older_than_ms)
        while (fresh := _start(engine, cutoff, older_than_ms, out)) is not None:
            _finish(job, fresh, None)
    result.seconds = time.monotonic() - started
    return result


ARCHIVE = "delaysvc pipeline archive"


@contextmanager
def _archive_lock(settings: Settings, url: str) -> Iterator[None]:
    engine = make_engine(settings, url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")  # no long transaction
            if not store.try_lock_archive(conn):
                raise DelaysvcError("another archive run is in progress; try again when it ends")
            try:
                yield
            finally:
                store.unlock_archive(conn)
    finally:
        engine.dispose()


def _leftovers(engine: Engine, out: Path) -> list[tuple[Span, str | None]]:
    """The runs a crash left, each with its recorded folder: a verified one where it was
    written; an unverified one left by a version before the tokens gets a token and a new
    folder under `out` (it is written again from scratch anyway)."""
    with engine.begin() as conn:
        runs = store.unfinished_runs(conn, "archive")
        left = []
        for r in runs:
            params, path = dict(r.params), r.output_path
            if r.checksum is None and params.get("token") is None:
                params["token"] = secrets.token_hex(16)
                path = str(_folder(out, r.id, params["token"]))
                store.merge_run_params(conn, r.id, {"token": params["token"]})
                store.update_run(conn, r.id, output_path=path)
            folder = Path(path) if path else _folder(out, r.id, None)
            left.append((_span(r.id, r.range_from_id, r.range_to_id, params, folder), r.checksum))
    return left


def _folder(out: Path, run_id: int, token: str | None) -> Path:
    return out / (f"run={run_id}" if token is None else f"run={run_id}-{token[:8]}")


def _span(run_id: int, low: int, high: int, params: dict[str, Any], folder: Path) -> Span:
    since = params.get("since")  # absent in a run left by a version before the history
    return Span(
        run_id,
        low,
        high,
        None if since is None else datetime.fromisoformat(since),
        datetime.fromisoformat(params["cutoff"]),
        params.get("partition"),
        folder,
        params.get("token"),
    )


def _start(engine: Engine, cutoff: datetime, older_than_ms: int, out: Path) -> Span | None:
    """Record a run for the oldest day of history with rows finished before the cutoff: the
    whole day if it ended by then, else its rows up to the cutoff. None: nothing to archive.
    A day with no rows left is dropped on the way."""
    with engine.begin() as conn:
        days = store_history.partitions(conn)
    for day in days:
        if day.starts >= cutoff:
            break
        whole = day.ends <= cutoff
        until = day.ends if whole else cutoff
        with engine.begin() as conn:
            low, high = store.archivable_range(conn, day.starts, until)
        if low is None or high is None:
            if whole and _drop_empty_day(engine, day):
                log.info("archive.empty_day_dropped", extra={"partition": day.name})
            continue
        token = secrets.token_hex(16)
        with engine.begin() as conn:
            params = {
                "cutoff": until.isoformat(),
                "since": day.starts.isoformat(),
                "partition": day.name if whole else None,
                "older_than_ms": older_than_ms,
                "token": token,
            }
            run_id = store.start_run(conn, "archive", params, low, high)
            folder = _folder(out, run_id, token)
            store.update_run(conn, run_id, output_path=str(folder))
        log.info(
            "archive.started",
            extra={"run_id": run_id, "partition": day.name, "whole_day": whole},
        )
        return _span(run_id, low, high, params, folder)
    log.info("archive.nothing_to_do", extra={"cutoff": cutoff.isoformat()})
    return None


def _finish(job: ArchiveRun, span: Span, recorded: str | None) -> None:
    folder = span.folder
    job.result.runs.append(span.run_id)
    job.result.folders.append(str(folder))
    if recorded is None:
        _write_and_verify(job, span, folder)
    elif _folder_checksum(job.spark, folder) != recorded:
        _fail(job.engine, span.run_id, f"its verified folder {folder} is missing or changed")
    if span.partition is None:
        _delete(job, span, folder)
    else:
        _drop(job, span, folder)


def _folder_checksum(spark: Any, folder: Path) -> str | None:
    """The checksum of a verified folder as it is now; None when it is gone or unreadable."""
    from pyspark.errors import AnalysisException

    if not folder.is_dir():
        return None
    try:
        return format_checksum(checksum(read_folder(spark, folder)))
    except AnalysisException:  # no Parquet left in it
        return None


def _write_and_verify(job: ArchiveRun, span: Span, folder: Path) -> None:
    _claim(job.engine, span)
    load(transform(extract(job.spark, job.target, span)), folder)
    job.crash("written")
    written = checksum(read_folder(job.spark, folder))
    with job.engine.connect() as conn:
        source = store.range_checksum(conn, span.low, span.high, span.since, span.cutoff)
    if written != source:
        _remove_own(span)
        _fail(
            job.engine,
            span.run_id,
            f"the Parquet copy ({written[0]} rows) does not match PostgreSQL ({source[0]} rows); "
            "nothing was deleted, run it again",
        )
    with job.engine.begin() as conn:
        store.update_run(
            conn,
            span.run_id,
            rows_read=written[0],
            rows_written=written[0],
            checksum=format_checksum(written),
            output_path=str(folder),
        )
    job.result.written += written[0]
    log.info("archive.verified", extra={"run_id": span.run_id, "rows": written[0]})
    job.crash("verified")


def _claim(engine: Engine, span: Span) -> None:
    """Make the run's folder empty but for its marker: a folder holding the run's own marker
    is a write a crash cut short, replaced; any other folder there is refused, untouched
    (the run fails: nothing was deleted from PostgreSQL, the next run writes a new folder)."""
    assert span.token is not None  # an unverified run always has one (`_leftovers`)
    if os.path.lexists(span.folder):
        if not _own(span):
            _fail(
                engine,
                span.run_id,
                f"{span.folder} exists and was not written by this run; left as it is, "
                "nothing deleted, run it again to archive into a new folder",
                invalid=True,
            )
        shutil.rmtree(span.folder)
    span.folder.mkdir(parents=True)
    (span.folder / MARKER).write_text(span.token)


def _own(span: Span) -> bool:
    """The folder holds this run's marker (a symbolic link is never taken as the run's)."""
    try:
        return (
            span.token is not None
            and not span.folder.is_symlink()
            and (span.folder / MARKER).read_text() == span.token
        )
    except (OSError, UnicodeDecodeError):
        return False


def _remove_own(span: Span) -> None:
    if _own(span):
        shutil.rmtree(span.folder, ignore_errors=True)


def _delete(job: ArchiveRun, span: Span, folder: Path) -> None:
    """Delete the folder's ids from PostgreSQL, DELETE_BATCH per transaction."""
    ids = (row["id"] for row in read_folder(job.spark, folder).select("id").toLocalIterator())
    deleted = 0
    while batch := list(islice(ids, DELETE_BATCH)):
        with job.engine.begin() as conn:
            deleted += store.delete_archived(conn, batch, span.since, span.cutoff)
        job.crash("deleting")
    with job.engine.begin() as conn:
        store.merge_run_params(conn, span.run_id, {"deleted": deleted})
        store.update_run(conn, span.run_id, status="succeeded", finished=True)
    job.result.deleted += deleted
    log.info("archive.deleted", extra={"run_id": span.run_id, "rows": deleted})


def _drop(job: ArchiveRun, span: Span, folder: Path) -> None:
    """Drop the span's day of history, if it still holds exactly the verified rows; waits
    for long readers of the history (DROP_PATIENCE)."""
    assert span.partition is not None
    dropped = history.patiently(
        job.engine, lambda conn: _drop_if_unchanged(conn, span), span.partition, DROP_PATIENCE
    )
    if dropped is None:
        _remove_own(span)
        _fail(
            job.engine,
            span.run_id,
            f"{span.partition} changed after its copy was verified (a message finished late "
            "into it, or a dead letter was redriven out of it); nothing was dropped, run it "
            "again",
        )
    job.result.deleted += dropped
    log.info("archive.dropped", extra={"run_id": span.run_id, "partition": span.partition})


def _drop_if_unchanged(conn: Connection, span: Span) -> int | None:
    """Under the history lock: drop the span's day when it holds exactly the verified rows
    (or is gone already) and mark the run succeeded. -> rows dropped; None: the day changed."""
    assert span.partition is not None
    verified = store.run_checksum(conn, span.run_id)
    store_history.lock_history(conn, wait=True)
    held = span.partition in {day.name for day in store_history.partitions(conn)}
    if held and format_checksum(store.partition_checksum(conn, span.partition)) != verified:
        return None
    dropped = 0
    if held:
        store_history.drop_partition(conn, span.partition)
        dropped = int(verified.split(":")[0])
    store.merge_run_params(conn, span.run_id, {"deleted": dropped})
    store.update_run(conn, span.run_id, status="succeeded", finished=True)
    return dropped


def _drop_empty_day(engine: Engine, day: Partition) -> bool:
    """Drop a day of history that holds no row, if it still holds none under the history
    lock (a late row may have moved in since it was looked at). -> dropped."""

    def drop(conn: Connection) -> bool:
        store_history.lock_history(conn, wait=True)
        if store.archivable_range(conn, day.starts, day.ends)[0] is not None:
            return False
        store_history.drop_partition(conn, day.name)
        return True

    return history.patiently(engine, drop, day.name, DROP_PATIENCE)


def _fail(engine: Engine, run_id: int, why: str, *, invalid: bool = False) -> NoReturn:
    with engine.begin() as conn:
        store.update_run(conn, run_id, status="failed", error=why, finished=True)
    if invalid:
        raise ValidationError("--out", f"archive run {run_id}: {why}")
    raise DelaysvcError(f"archive run {run_id}: {why}")
