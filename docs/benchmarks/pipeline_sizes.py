"""bulk-schedule's rate by file size: what a user's one command gives, cold JVM included.

    python docs/benchmarks/pipeline_sizes.py postgresql://root@127.0.0.1:5432/SCRATCH OUT

For each format and each size, generates N keyed jobs of their own (`pipeline.bench.generate`,
new keys every time) and runs `delaysvc pipeline --master local[2] bulk-schedule FILE` in a
new process, so every run pays Spark's start as a user's command does. Records the rate of
the command's summary line (rows / its seconds: the run, from reading the file to the last
commit) and of the command's whole wall time (the JVM's start included). Writes OUT/sizes.json,
OUT/sizes.md and OUT/sizes.png (rows/s by size, with the 100,000 rows/s target). The database
must be migrated and should be a scratch one: every run adds its rows.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from delaysvc.pipeline.bench import generate

SIZES = (250_000, 500_000, 1_000_000, 2_000_000, 5_000_000)
FORMATS = ("parquet", "csv")
TARGET = 100_000
SUMMARY = re.compile(r"read (\d+), written (\d+), rejected (\d+), ([0-9.]+)s")


def one(url: str, rows: int, fmt: str, workdir: Path) -> dict[str, float]:
    source = generate(workdir / f"jobs-{rows}.{fmt}", rows, fmt, uuid.uuid4().hex[:8])
    command = ["delaysvc", "pipeline", "--master", "local[2]", "bulk-schedule", str(source)]
    started = time.monotonic()
    done = subprocess.run(
        command,
        env={**os.environ, "DELAYSVC_DATABASE_URL": url},
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.monotonic() - started
    found = SUMMARY.search(done.stdout + done.stderr)
    if found is None:
        raise RuntimeError(f"no summary line in: {done.stdout[-500:]}{done.stderr[-500:]}")
    read, written, rejected, seconds = found.groups()
    if int(written) != rows:
        raise RuntimeError(f"{fmt} {rows:,}: wrote {written} (read {read}, rejected {rejected})")
    source.unlink()
    return {
        "rows": rows,
        "format": fmt,
        "seconds": float(seconds),
        "wall_seconds": round(wall, 2),
        "rows_per_s": round(rows / float(seconds)),
        "wall_rows_per_s": round(rows / wall),
    }


def plot(results: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for fmt in FORMATS:
        mine = [r for r in results if r["format"] == fmt]
        sizes = [r["rows"] / 1e6 for r in mine]
        ax.plot(sizes, [r["rows_per_s"] for r in mine], "o-", label=f"{fmt}: the run")
        ax.plot(sizes, [r["wall_rows_per_s"] for r in mine], "x--", label=f"{fmt}: whole command")
    ax.axhline(TARGET, color="grey", linestyle=":", label="target 100,000 rows/s")
    ax.set_xlabel("rows in the file (millions)")
    ax.set_ylabel("rows/s (every row new)")
    ax.set_title("bulk-schedule, local[2], a new process per run")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(url: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="delaysvc-pipeline-sizes-") as workdir:
        for fmt in FORMATS:
            for rows in SIZES:
                result = one(url, rows, fmt, Path(workdir))
                print(
                    f"{fmt} {rows:>9,}: run {result['rows_per_s']:>7,} rows/s "
                    f"({result['seconds']} s), whole command {result['wall_rows_per_s']:>7,} "
                    f"rows/s ({result['wall_seconds']} s)",
                    flush=True,
                )
                results.append(result)
    (out / "sizes.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        f"Command: `python docs/benchmarks/pipeline_sizes.py {' '.join(sys.argv[1:])}`",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}; every run a new `delaysvc pipeline --master local[2] "
        "bulk-schedule` process, every row new.",
        "",
        "| format | rows | the run: s | rows/s | whole command: s | rows/s |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['format']} | {r['rows']:,} | {r['seconds']} | {r['rows_per_s']:,} | "
            f"{r['wall_seconds']} | {r['wall_rows_per_s']:,} |"
            for r in results
        ),
    ]
    (out / "sizes.md").write_text("\n".join(lines) + "\n")
    plot(results, out / "sizes.png")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], Path(sys.argv[2]))
