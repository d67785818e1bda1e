"""bulk-schedule's rejects: the refused rows with a `reason` column, in the input's format
family, and the checks made before anything is stored that writing them loses nothing."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from delaysvc.config.validation import not_json
from delaysvc.errors import ValidationError
from delaysvc.pipeline.requirements import unwritable

PARQUET_PART = "part-00000.parquet"  # the one file of a Parquet rejects folder


def write_rejects(
    rejected: list[tuple[str, str]], columns: list[str], fmt: str, path: Path
) -> None:
    """The refused rows with a `reason` column, in the input's format family: CSV -> CSV,
    JSON Lines -> JSON Lines, Parquet -> a Parquet folder (every column as text). Written by
    the driver, which holds them (no Spark job: a run without rejects costs nothing here)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with path.open("w") as f:
            for reason, raw in rejected:
                f.write(_jsonl_reject(raw, reason) + "\n")
        return
    records = [{**json.loads(raw), "reason": reason} for reason, raw in rejected]
    names = [*columns, "reason"]
    if fmt == "csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=names)
            writer.writeheader()
            writer.writerows(records)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    # a folder of ours (`check_rejects`): its one file is replaced, nothing else is deleted
    path.mkdir(exist_ok=True)
    table = pa.table({n: pa.array([r.get(n) for r in records], pa.string()) for n in names})
    pq.write_table(table, path / PARQUET_PART)


def check_rejects(rejects: Path, path: Path, fmt: str) -> None:
    """Before anything is stored: the rejects can be written at `rejects`, and writing them
    there loses nothing that is not an earlier rejects output. Refused (ValidationError): the
    input itself, a folder holding the input or inside it, a Parquet rejects path that is a
    file or a folder holding anything but a rejects file (`PARQUET_PART`), a CSV or JSON
    Lines rejects path that is a folder or a file other than an earlier rejects file (one
    whose first row has a `reason`), and a place that cannot be written (its folders are
    made here)."""
    target, source = rejects.resolve(), path.resolve()
    if target == source or source.is_relative_to(target) or target.is_relative_to(source):
        raise ValidationError(
            "rejects", f"{rejects} is the input {path}, holds it or is inside it: name another"
        )
    if fmt == "parquet" and rejects.is_dir():
        others = sorted(p.name for p in rejects.iterdir() if p.name != PARQUET_PART)
        if others:
            raise ValidationError(
                "rejects",
                f"{rejects} is a folder holding other files ({', '.join(others[:3])}): name a "
                "new path (only an earlier rejects folder, holding "
                f"{PARQUET_PART} alone, is written over)",
            )
    elif rejects.is_dir():
        raise ValidationError("rejects", f"{rejects} is a folder; the rejects are one file")
    elif rejects.exists() and (fmt == "parquet" or not _earlier_rejects(rejects, fmt)):
        raise ValidationError(
            "rejects",
            f"{rejects} is a file that is not an earlier rejects output: name a new path",
        )
    why = unwritable(rejects if rejects.is_dir() else rejects.parent)
    if why is None and rejects.is_file():
        try:
            rejects.open("a").close()
        except OSError as exc:
            why = exc.strerror or str(exc)
    if why is not None:
        raise ValidationError("rejects", f"{rejects} cannot be written ({why})")


def _earlier_rejects(path: Path, fmt: str) -> bool:
    """An existing file is an earlier rejects file: empty, or its first row has `reason`."""
    try:
        with path.open(newline="") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError):
        return False
    if not first.strip():
        return True
    if fmt == "csv":
        return "reason" in next(csv.reader([first]), [])
    try:
        value = json.loads(first)
    except ValueError:
        return False
    return isinstance(value, dict) and "reason" in value


def _jsonl_reject(raw: str, reason: str) -> str:
    """A rejected line as the rejects file has it: a JSON object's text as it came, with
    `reason` added after its last member (values are not parsed and written again: 1e400
    would come out as Infinity, no JSON, and 1e3 as 1000.0); any other line, not JSON or not
    an object, as a string under `line`."""
    try:
        value = json.loads(raw, parse_constant=not_json)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        return json.dumps({"line": raw, "reason": reason})
    inside = raw.strip()[1:-1].strip()  # the members, between the braces
    added = f'"reason": {json.dumps(reason)}'
    return "{" + (f"{inside}, {added}" if inside else added) + "}"
