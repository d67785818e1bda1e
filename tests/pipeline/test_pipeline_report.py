"""The report's output folder: a report replaces an earlier report there, and nothing else.
`report --out` naming the folder that held the archive (and a user's files) deleted both
while reading them: "read 11, written 0", exit 0, the archived messages gone everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text

from delaysvc.config.settings import Settings
from delaysvc.errors import ValidationError
from delaysvc.pipeline import archive, report
from tests.pipeline.test_pipeline_archive import _finished_messages
from tests.support.pipeline import DAY_MS


def test_a_report_replaces_an_earlier_report_and_refuses_a_folder_holding_anything_else(
    spark: Any, settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    _finished_messages(settings, engine, 4)
    work = tmp_path / "work"
    archived = archive.run(spark, settings, engine, 30 * DAY_MS, work / "archive")
    assert archived.written == 6
    (work / "notes.txt").write_text("mine")
    with engine.begin() as conn:
        runs = conn.execute(text("SELECT count(*) FROM pipeline_run")).scalar_one()

    for out, said in [
        (work, "holds or is in the archive's folder"),  # around the archive's folders
        (work / "archive", "holds or is in the archive's folder"),
        (tmp_path, "holds or is in the archive's folder"),
    ]:
        with pytest.raises(ValidationError, match=said):
            report.run(spark, settings, engine, out)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.csv").write_text("a,b\n")
    with pytest.raises(ValidationError, match=r"holds other things than an earlier report"):
        report.run(spark, settings, engine, other)
    with pytest.raises(ValidationError, match="is a file"):
        report.run(spark, settings, engine, other / "keep.csv")

    assert (work / "notes.txt").read_text() == "mine" and (other / "keep.csv").exists()
    with engine.begin() as conn:  # refused before a run was recorded
        assert conn.execute(text("SELECT count(*) FROM pipeline_run")).scalar_one() == runs
    first = report.run(spark, settings, engine, tmp_path / "report")
    again = report.run(spark, settings, engine, tmp_path / "report")  # an earlier report
    assert first.read == again.read == 6  # the archive is still there to read
