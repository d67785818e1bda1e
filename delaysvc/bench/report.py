"""Benchmark output: results.json (everything), results.md (the table people read) and PNG
plots (lateness distribution, backlog over time), with the command line and machine facts."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from delaysvc.bench.suites import Figures
from delaysvc.db.names import sql

PEER_SAMPLES = "peer_lateness_ms:"  # + peer label: samples plotted together as CDFs
PG_SETTINGS = (
    "shared_buffers",
    "synchronous_commit",
    "fsync",
    "max_connections",
    "work_mem",
    "autovacuum",  # off here (the machine's conf.d/90-ci.conf): dead tuples then only grow
)


def machine_facts(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        version = conn.execute(sql("SHOW server_version")).scalar_one()
        pg = {name: conn.execute(sql(f"SHOW {name}")).scalar_one() for name in PG_SETTINGS}
    memory_kb = 0
    if Path("/proc/meminfo").exists():
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        memory_kb = int(first.split()[1])
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(memory_kb / 1024 / 1024, 1),
        "cpu": _cpu_model(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "postgresql": version,
        "postgresql_settings": pg,
    }


def code_version() -> str:
    """The commit of the code that ran (and `+changes` when its work tree differs), when it
    runs from a git checkout; else the installed version."""
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10
        )
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return f"delaysvc {version('delaysvc')}"
    return f"commit {commit}{' +changes' if dirty else ''}"


def _cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def write(
    out: Path,
    figures: Figures,
    facts: dict[str, Any],
    started: str,
    sizes: dict[str, int | float] | None = None,
    timings: dict[str, float] | None = None,
    quick: bool = False,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    command = "delaysvc " + " ".join(sys.argv[1:]) if sys.argv else "delaysvc bench"
    document = {
        "command": command,
        "code": code_version(),
        "started": started,
        "quick": quick,
        "machine": facts,
        "sizes": sizes or {},
        "suite_seconds": timings or {},
        "results": figures.results,
        "series": figures.series,
    }
    (out / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    plots = _plots(out, figures)
    (out / "results.md").write_text(_markdown(document, plots))


def _markdown(document: dict[str, Any], plots: list[str]) -> str:
    facts = document["machine"]
    lines = [
        f"# delaysvc bench — {document['started']}",
        "",
        f"Command: `{document['command']}`",
        "",
        f"Code: {document['code']}.",
        "",
        f"Machine: {facts['cores']} cores ({facts['cpu']}), {facts['memory_gib']} GiB, "
        f"{facts['os']}, Python {facts['python']}, PostgreSQL {facts['postgresql']} "
        f"({', '.join(f'{k}={v}' for k, v in facts['postgresql_settings'].items())}).",
        "",
    ]
    if document["suite_seconds"]:
        took = ", ".join(f"{k} {v:g} s" for k, v in document["suite_seconds"].items())
        lines += [f"Suites ran (wall time): {took}.", ""]
    if document["sizes"]:
        sized = ", ".join(f"{k}={v:g}" for k, v in document["sizes"].items())
        lines += [f"Sizes{' (--quick)' if document['quick'] else ''}: {sized}.", ""]
    peers, rows = {}, []
    for name, result in document["results"].items():
        if name.startswith("peer_"):
            peers[name] = result
        else:
            rows.extend(_rows(name, result))
    if rows:
        lines += ["| measure | service | raw limit | ratio | target |", "|---|---|---|---|---|"]
        lines += [*rows, ""]
    if peers:
        lines += peers_table(peers)
    lines.append("")
    lines.extend(f"![{plot}]({plot})" for plot in plots)
    return "\n".join(lines) + "\n"


def _ratio(r: dict[str, Any]) -> str:
    """A result's ratio; measured in rounds (`suites.SIDE_BY_SIDE`), their median and range."""
    rounds = r.get("round_ratios")
    if not rounds or len(rounds) < 2:
        return f"{r['ratio']:.0%}"
    return f"{r['ratio']:.0%} ({min(rounds):.0%}-{max(rounds):.0%})"


def _rows(name: str, r: dict[str, Any]) -> list[str]:
    def ratio_row(what: str, value: str, raw: str) -> str:
        target = f">= {r['target_ratio']:.0%} of raw"
        return f"| {name}: {what} | {value} | {raw} | {_ratio(r)} | {target} |"

    if "failed" in r:
        return [f"| {name}: FAILED | {r['failed']} | - | - | - |"]
    if "skipped" in r:
        return [f"| {name}: not run | {r['skipped']} | - | - | - |"]
    if "claim_slowdown" in r:
        target = f"<= {r['target_slowdown']}x of empty"
        versus = f"{r['finished']:,} finished vs none"
        hot = "; ".join(
            f"{t} {_mib(r['hot_bytes_empty'][t])} -> {_mib(v)}"
            for t, v in r["hot_bytes_history"].items()
        )
        return [
            f"| {name}: send msgs/s, {versus} | {r['send_per_s_history']:,} vs "
            f"{r['send_per_s_empty']:,} | - | {r['send_slowdown']}x slower | {target} |",
            f"| {name}: delivery move (mean ms), {versus} | {r['move_ms_history']['mean']} vs "
            f"{r['move_ms_empty']['mean']} | - | {r['move_slowdown']}x | {target} |",
            f"| {name}: no-op jobs claimed and run/s, {versus} | {r['claim_per_s_history']:,} vs "
            f"{r['claim_per_s_empty']:,} | - | {r['claim_slowdown']}x slower | {target} |",
            f"| {name}: hot tables, none -> {r['finished']:,} finished ({_mib(r['history_bytes'])}"
            f" of history in {r['days']} day partitions) | {hot} | - | - | flat |",
            f"| {name}: retention: drop the oldest day ({r['retention_rows']:,} messages) | "
            f"{r['retention_seconds']} s | - | - | seconds |",
            f"| {name}: sweep, finished rows moved out of commit_log/s | "
            f"{r['sweep_rows_per_s']:,} | - | - | keeps up with the consumers |",
        ]
    if "send_slowdown" in r:
        target = f"<= {r['target_slowdown']}x of empty"
        rss = "; ".join(
            f"{k} {_mib(v['empty'])} -> {_mib(v['backlog'])}" for k, v in r["rss_bytes"].items()
        )
        return [
            f"| {name}: send msgs/s, {r['pending']:,} pending vs empty | "
            f"{r['send_per_s_backlog']:,} vs {r['send_per_s_empty']:,} | - | "
            f"{r['send_slowdown']}x slower | {target} |",
            f"| {name}: delivery move of {r['batch']:,} (mean ms), {r['pending']:,} pending vs "
            f"empty | {r['move_ms_backlog']['mean']} vs {r['move_ms_empty']['mean']} | - | "
            f"{r['move_slowdown']}x | {target} |",
            f"| {name}: RSS empty -> {r['pending']:,} pending | {rss} | - | - | flat |",
        ]
    if "end_vs_start" in r:
        sizes = ", ".join(f"{k} {_mib(v)}" for k, v in r["peak_bytes"].items())
        dead = ", ".join(f"{k} {v:,}" for k, v in r["final_dead_tuples"].items())
        return [
            f"| {name}: jobs claimed/s at the end vs the start ({r['messages']:,} msgs at "
            f"{r['rate_per_s']:,}/s{', all run' if r['drained'] else ', NOT all run'}"
            f"{'; no job claimed at ' + r['stalls'] if r.get('stalls') else ''}) | "
            f"{r['claimed_per_s_end']:,} vs {r['claimed_per_s_start']:,} | - | "
            f"{r['end_vs_start']} | >= {r['target_ratio']} |",
            f"| {name}: peak table sizes; dead tuples at the end | {sizes}; {dead} | - | - | "
            "bounded |",
        ]
    if "reruns_by_cause" in r:  # chaos
        ops = ", ".join(f"{k} {v.get('ok', 0):,} ok" for k, v in sorted(r["operations"].items()))
        faults = ", ".join(f"{k} {v}" for k, v in sorted(r["faults_injected"].items()))
        found = "; ".join(
            f"{p} {v['violations']} of {v['checked']:,}" for p, v in r["properties"].items()
        )
        return [
            f"| {name}: seed {r['seed']}, {r['clients']} clients for {r['seconds']:g} s ({ops}); "
            f"faults: {faults} | violations (of checked): {found} | - | - | 0 violations |"
        ]
    if "reruns" in r:
        late, start = r["lateness_ms"], r["deliver_to_start_ms"]
        return [
            f"| {name}: delivery then consumer worker replaced under {r['rate_per_s']:,} msg/s "
            f"for {r['seconds']:g} s ({r['sent']:,} msgs) | lost {r['lost']:,}; re-runs "
            f"{r['reruns']:,} (running at the consumer's SIGTERM: "
            f"{r['running_at_consumer_sigterm']}); in topic queue p99 {late.get('p99')} ms, "
            f"max {late.get('max')} ms; handler started p99 {start.get('p99')} ms | - | - | "
            f"0 lost, re-runs <= in flight, p99 <= {r['target_p99_ms']:g} ms |"
        ]
    if "http_msgs_per_s" in r:
        return [
            f"| {name}: POST /api/v1/messages/batch of {r['batch']:,}, 1 connection, vs "
            f"send_batch in Python | {r['http_msgs_per_s']:,} msgs/s; p99 {r['p99_ms']:.1f} ms; "
            f"{r['errors']} errors | {r['python_batch_msgs_per_s']:,} msgs/s | "
            f"{r['ratio']:.0%} | >= {r['target_ratio']:.0%} of Python's |"
        ]
    if "requests_per_s" in r:
        late, errors = r["latency_ms"], sum(r["errors"].values())
        return [
            f"| {name}: POST /api/v1/messages, {r['clients']} clients for {r['seconds']:g} s "
            f"({_served(r)}) | "
            f"{r['requests_per_s']:,} req/s; p50 "
            f"{late['p50']:.1f} ms, p99 {late['p99']:.1f} ms; {errors} errors; lost "
            f"{r['lost']} | {r['raw_insert_per_s']:,} tx/s | {r['ratio_to_raw']:.1%} | "
            + (f">= {r['target_ratio']:.0%}, " if "target_ratio" in r else "")
            + "0 errors |"
        ]
    if "pages_ms" in r:
        slowest = sorted(r["pages_ms"].items(), key=lambda item: -item[1]["p95"])[:4]
        listed = "; ".join(f"{page} {t['p95']} ms" for page, t in slowest)
        return [
            f"| {name}: slowest pages (p95) with {r['rows']:,} rows | {listed} | - | - | "
            "responsive |"
        ]
    if "first_rows_per_s" in r:
        return [
            f"| {name}: Spark bulk-schedule rows/s ({r['rows']:,} {r['format']} rows, "
            f"{r['partitions']} partitions, {r['master']}) | {r['first_rows_per_s']:,} (re-run, "
            f"all duplicates: {r['rerun_rows_per_s']:,}) | {r['ceiling_rows_per_s']:,} "
            f"(PostgreSQL alone, 2 sessions) | {r['first_of_ceiling']:.0%} | "
            f">= {r['target_rows_per_s']:,} rows/s |"
        ]
    if "jobs_per_db_cpu_s" in r:
        return [
            f"| {name}: jobs/s with {r['hosts']} worker host(s) of {r['processes_per_host']} "
            f"consumer processes ({r['succeeded']:,} of {r['jobs']:,} run, {r['ran_twice']} "
            f"twice) | {r['jobs_per_s']:,} ({r['vs_one_host']}x one host) | "
            f"{r['jobs_per_db_cpu_s'] or 0:,} jobs per PostgreSQL CPU second | - | grows until the "
            "database is busy |"
        ]
    if "pgbouncer_msgs_per_s" in r:
        straight = (
            f"{r['direct_msgs_per_s']:,} (direct; without prepared statements "
            f"{r['direct_unprepared_msgs_per_s']:,})"
        )
        rows = [
            f"| {name}: msgs/s through PgBouncer (transaction pooling, {r['server_connections']} "
            f"server connections) vs straight to PostgreSQL | {r['pgbouncer_msgs_per_s']:,} | "
            f"{straight} | {r['ratio']:.0%} | >= 80% of direct |"
        ]
        if "ratio_prepared" in r:
            rows.append(
                f"| {name}: the same, PgBouncer keeping prepared statements "
                f"(DELAYSVC_DATABASE_POOLING=transaction-prepared) | "
                f"{r['pgbouncer_prepared_msgs_per_s']:,} | {straight} | "
                f"{r['ratio_prepared']:.0%} | >= 80% of direct |"
            )
        return rows
    if "pgbouncer_version" in r:
        return []
    if "timer_msgs_per_s" in r:
        return [
            f"| {name}: msgs/s of a single send to the longest level vs to the timer lane, "
            f"1 client, alternating | {r['level_msgs_per_s']:,} | {r['timer_msgs_per_s']:,} "
            f"(timer) | {r['ratio']:.0%} | >= {r['target_ratio']:.0%} of the timer's |"
        ]
    if name == "send_batch_database_write":
        return [
            f"| {name}: msgs/s through a batch's own statements, no Python of ours (the "
            f"ceiling of send_batch_10000) | {r['msgs_per_s']:,} | "
            f"{r['raw_copy_per_s']:,} rows/s | {_ratio(r)} | - |"
        ]
    if "raw_insert_per_s" in r:
        return [ratio_row("msgs/s", f"{r['msgs_per_s']:,}", f"{r['raw_insert_per_s']:,} tx/s")]
    if "raw_copy_per_s" in r:
        return [ratio_row("msgs/s", f"{r['msgs_per_s']:,}", f"{r['raw_copy_per_s']:,} rows/s")]
    if "raw_move_per_s" in r:
        return [ratio_row("msgs/s", f"{r['msgs_per_s']:,}", f"{r['raw_move_per_s']:,} rows/s")]
    if "jobs_per_s" in r:
        return [
            f"| {name}: jobs/s ({r['processes']} processes) | {r['jobs_per_s']:,} | - | - | "
            f">= {r['target_jobs_per_s']:,}/s |"
        ]
    rows = []
    if "lateness_ms" in r:
        late = r["lateness_ms"]
        rows.append(
            f"| {name}: deliver_ts -> in topic queue at {r['rate_per_s']:,}/s "
            f"({r['delivered']:,} msgs) | p50 {late.get('p50')} ms, p99 {late.get('p99')} ms, "
            f"max {late.get('max')} ms | - | - | p99 <= {r['target_p99_ms']} ms |"
        )
    if "deliver_to_start_ms" in r:
        start = r["deliver_to_start_ms"]
        rows.append(
            f"| {name}: deliver_ts -> handler started ({r['started']:,} jobs) | "
            f"p50 {start.get('p50')} ms, p99 {start.get('p99')} ms, max {start.get('max')} ms "
            f"| - | - | p99 <= {r['target_start_p99_ms']} ms |"
        )
    return rows


def _chart(
    out: Path,
    plt: Any,
    filename: str,
    draw: Any,
    title: str,
    xlabel: str,
    ylabel: str,
    legend: bool = False,
) -> str:
    """One PNG: `draw(ax)` puts the data on the axes; the rest is the same for every chart."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    draw(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / filename, dpi=100)
    plt.close(fig)
    return filename


def _line(points: list[tuple[float, float]], color: str, scale: float = 1) -> Any:
    return lambda ax: ax.plot([t for t, _ in points], [v / scale for _, v in points], color=color)


def _rolling_plots(out: Path, figures: Figures, plt: Any) -> list[str]:
    """Lateness per second of the rolling restart's flow, with the restarts marked."""
    p99 = figures.series.get("rolling_lateness_p99")
    top = figures.series.get("rolling_lateness_max")
    if not p99 or not top:
        return []
    events = figures.results.get("rolling_restart", {}).get("events", [])

    def draw(ax: Any) -> None:
        ax.plot([t for t, _ in top], [v for _, v in top], color="#a53b3b", label="max")
        ax.plot([t for t, _ in p99], [v for _, v in p99], color="#3b6ea5", label="p99", ls=":")
        for at, what in events:
            ax.axvline(at, color="#888888", linestyle="--", linewidth=0.8)
            ax.text(
                at,
                0.98,
                what,
                transform=ax.get_xaxis_transform(),  # x in data, y in axes fractions
                rotation=90,
                fontsize=7,
                va="top",
                ha="right",
            )
        ax.set_yscale("symlog", linthresh=10)

    return [
        _chart(
            out,
            plt,
            "rolling_lateness.png",
            draw,
            "rolling restart: deliver_ts -> in topic queue, per second of the flow",
            "seconds since the flow began (by due time)",
            "ms (log above 10)",
            legend=True,
        )
    ]


def _soak_plots(out: Path, figures: Figures, plt: Any) -> list[str]:
    made = []
    throughput = figures.series.get("soak_throughput")
    if throughput:
        made.append(
            _chart(
                out,
                plt,
                "soak_throughput.png",
                _line(throughput, "#3b6ea5"),
                "soak: throughput over time",
                "seconds",
                "jobs claimed per second",
            )
        )
    for kind, label in (("soak_bytes", "MiB"), ("soak_dead", "dead tuples")):
        series = {k.split(":", 1)[1]: v for k, v in figures.series.items() if k.startswith(kind)}
        if not series:
            continue
        scale = 1024 * 1024 if kind == "soak_bytes" else 1

        def draw(ax: Any, series: dict[str, Any] = series, scale: float = scale) -> None:
            for table, points in series.items():
                ax.plot([t for t, _ in points], [v / scale for _, v in points], label=table)

        made.append(
            _chart(
                out,
                plt,
                f"{kind}.png",
                draw,
                f"soak: {label} of the hot tables over time",
                "seconds",
                label,
                legend=True,
            )
        )
    return made


def _chaos_plots(out: Path, figures: Figures, plt: Any) -> list[str]:
    """The chaos run's backlog: what is unfinished, and what is behind its due time."""
    series = {
        k.split(":", 1)[1]: v for k, v in figures.series.items() if k.startswith("chaos_backlog:")
    }
    if not any(series.values()):
        return []

    def draw(ax: Any) -> None:
        for label, points in series.items():
            ax.plot([t for t, _ in points], [v for _, v in points], label=label)

    return [
        _chart(
            out,
            plt,
            "chaos_backlog.png",
            draw,
            "chaos: messages not finished, through the faults and the drain",
            "seconds since the clients began",
            "messages",
            legend=True,
        )
    ]


def peers_table(peers: dict[str, dict[str, Any]]) -> list[str]:
    """One row per peer: the same workload (N jobs at one fixed delay), then memory at a
    pending peak, then what is not durable about it."""
    lines = [
        "| peer | jobs received (of sent) | enqueue jobs/s | lateness p50 | p95 | p99 | max "
        "| memory at pending peak | not durable |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, r in peers.items():
        label = r.get("label", name)
        if "raw_insert_per_s" in r:
            lines.append(f"| {label} | - | {r['raw_insert_per_s']:,} |" + " - |" * 6)
            continue
        if "unavailable" in r:
            lines.append(f"| {label} | unavailable: {r['unavailable']} |" + " - |" * 7)
            continue
        late = r.get("lateness_ms", {})
        memory = r.get("memory", {})
        mem = "; ".join(f"{k} {_mib(v)}" for k, v in memory.get("bytes", {}).items())
        if memory:
            how = f" ({memory['enqueued_by']})" if memory.get("enqueued_by") else ""
            mem = f"{memory.get('pending', 0):,} pending{how}: {mem}"
        got = f"{r['received']:,} of {r['sent']:,}"
        if r.get("duplicates"):
            got += f", {r['duplicates']:,} duplicates"
        lines.append(
            f"| {label} | {got} | {r['enqueue_per_s']:,} | {_ms(late.get('p50'))} | "
            f"{_ms(late.get('p95'))} | {_ms(late.get('p99'))} | {_ms(late.get('max'))} | {mem} "
            f"| {r.get('not_durable', '')} |"
        )
        if r.get("setup"):
            notes.append(f"- {label}: {r['setup']}")
    return [*lines, "", *notes] if notes else lines


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.1f} ms"


def _mib(value: float) -> str:
    return f"{value / 1024 / 1024:,.1f} MiB"


def _plots(out: Path, figures: Figures) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for name, title in (
        ("lateness_ms", "deliver_ts -> in topic queue (ms)"),
        ("start_latency_ms", "deliver_ts -> handler started (ms)"),
    ):
        values = figures.samples.get(name)
        if not values:
            continue

        def histogram(ax: Any, values: list[float] = values) -> None:
            ax.hist(values, bins=100, color="#3b6ea5")
            ax.set_yscale("log")

        made.append(_chart(out, plt, f"{name}.png", histogram, title, "ms", "messages"))
    backlog = figures.series.get("backlog")
    if backlog:
        made.append(
            _chart(
                out,
                plt,
                "backlog.png",
                _line(backlog, "#a53b3b"),
                "backlog during the steady flow",
                "seconds",
                "pending messages",
            )
        )
    made += _soak_plots(out, figures, plt)
    made += _rolling_plots(out, figures, plt)
    made += _chaos_plots(out, figures, plt)
    peer_samples = {
        k.split(":", 1)[1]: v for k, v in figures.samples.items() if k.startswith(PEER_SAMPLES)
    }
    if any(peer_samples.values()):

        def cdf(ax: Any) -> None:
            for label, values in peer_samples.items():
                if values:
                    ordered = sorted(max(v, 0.1) for v in values)
                    share = [(i + 1) / len(ordered) for i in range(len(ordered))]
                    ax.plot(ordered, share, label=label)
            ax.set_xscale("log")

        made.append(
            _chart(
                out,
                plt,
                "peers_lateness.png",
                cdf,
                "lateness of the same workload on each peer (CDF)",
                "due -> handler received (ms, log)",
                "share of jobs",
                legend=True,
            )
        )
    return made


def _served(r: dict[str, Any]) -> str:
    """How an HTTP run was served (runs before 2026-12-06 name gunicorn's workers and threads;
    before 2026-11-28, no threads)."""
    if "server" in r:
        return str(r["server"])
    threads = f" --threads {r['gunicorn_threads']}" if r.get("gunicorn_threads", 1) > 1 else ""
    return f"gunicorn -w {r['gunicorn_workers']}{threads}"
