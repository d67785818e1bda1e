"""`delaysvc bench` end to end at toy sizes: every suite runs and writes its results, table and
plots. (What the numbers are is the benchmark's business, never a test's.)"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, text

from delaysvc.bench import (
    SUITES,
    BenchContext,
    Size,
    Suite,
    all_sizes,
    failed_suites,
    peers,
    run,
)
from delaysvc.bench.peers import PEERS
from delaysvc.bench.suites import (
    NOOP_TOPIC,
    SIDE_BY_SIDE,
    Figures,
    _batch_database_write,
    _in_turn,
)
from delaysvc.cli import cli
from delaysvc.config.settings import Settings
from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer
from tests.support.passes import first_pass_only, second_pass_only


def in_schema_jobs(seconds: int) -> pytest.MarkDecorator:
    """A bench suite at toy size runs the same on either server, but for the schema's name,
    which CI's second pass sets to another (`jobs`): there a statement that names the schema
    itself instead of going through delaysvc.db.names fails."""
    return second_pass_only(f"~{seconds} s, the same on either server but for the schema's name")


@in_schema_jobs(50)
def test_every_suite_runs_and_writes_results_table_and_plots(
    settings: Settings, tmp_path: Path
) -> None:
    out = run(
        settings.model_copy(update={"delay_levels": "1s 2s"}),
        ["send", "delivery", "consume"],
        tmp_path / "run",
        seconds=0.5,
        batch_rows=2000,
        backlog=3000,
        rate=500,
        flow_seconds=2,
        jobs=2000,
        processes=1,
    )
    document = json.loads((out / "results.json").read_text())
    results = document["results"]
    assert set(results) == {
        "send_single_c1",
        "send_single_c4",
        "send_single_level_vs_timer",
        "send_batch_1000",
        "send_batch_10000",
        "send_batch_database_write",
        "delivery_drain",
        "delivery_flow",
        "consume_drain",
        "consume_flow",
    }
    assert results["delivery_drain"]["messages"] == 3000
    assert results["consume_drain"]["jobs"] == 2000
    # every message sent was delivered; the sender holds 500/s for 2 s on a quiet machine (1,000)
    # and sent 675 on a loaded CI one: its count is the machine's, not the check
    flow = results["delivery_flow"]
    assert flow["sent"] == flow["delivered"]
    assert 0 < flow["sent"] <= 1000
    assert document["machine"]["cores"] >= 1
    table = (out / "results.md").read_text()
    assert "| delivery_drain: msgs/s |" in table
    assert "| send_batch_database_write: msgs/s through a batch's own statements" in table
    assert "| send_single_level_vs_timer: msgs/s of a single send to the longest level" in table
    # each send ratio from SIDE_BY_SIDE rounds of the raw limit and the service in turn
    for name in ("send_single_c1", "send_single_c4", "send_batch_1000", "send_batch_10000"):
        rounds = results[name]["round_ratios"]
        assert len(rounds) == SIDE_BY_SIDE and min(rounds) <= results[name]["ratio"] <= max(rounds)
    c1 = results["send_single_c1"]
    assert f"| {c1['ratio']:.0%} ({min(c1['round_ratios']):.0%}-" in table
    versus = results["send_single_level_vs_timer"]
    assert versus["level_msgs_per_s"] > 0 and versus["timer_msgs_per_s"] > 0
    for plot in ("lateness_ms.png", "start_latency_ms.png", "backlog.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"


def test_the_batch_database_write_stores_every_message_in_its_lane(
    settings: Settings, engine: Engine, producer: Producer
) -> None:
    """What the send suite times as a batch's database write is the service's own write: every
    message lands in the commit log and its lane, as `send_batch` would store it."""
    rate = _batch_database_write(libpq_url(settings.database_url), producer, 3000)
    assert rate > 0
    with engine.connect() as conn:
        stored = conn.execute(
            text("SELECT count(*), count(DISTINCT queue_offset) FROM commit_log WHERE topic = :t"),
            {"t": NOOP_TOPIC},
        ).one()
        lanes = (
            "SELECT message_id, queue_offset, deliver_ts FROM consume_queue "
            "UNION ALL SELECT message_id, queue_offset, deliver_ts FROM timer_queue"
        )
        in_lanes = conn.execute(text(f"SELECT count(*) FROM ({lanes}) q")).scalar_one()
        matching = conn.execute(
            text(
                f"SELECT count(*) FROM commit_log c JOIN ({lanes}) q ON q.message_id = c.id "
                "AND q.queue_offset = c.queue_offset AND q.deliver_ts = c.deliver_ts"
            )
        ).scalar_one()
    assert tuple(stored) == (3000, 3000)
    assert in_lanes == matching == 3000


def test_a_registered_suite_runs_with_its_quick_sizes_and_lands_in_the_report(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[BenchContext] = []

    def toy(ctx: BenchContext) -> Figures:
        seen.append(ctx)
        with ctx.engine.connect() as conn:
            database = conn.execute(text("SELECT current_database()")).scalar_one()
        return Figures(results={"toy": {"skipped": f"toy ran in {database}", "n": ctx.size("n")}})

    monkeypatch.setitem(SUITES, "toy", Suite(toy, (Size("n", 7, 3, "toy size"),)))
    out = run(settings, ["toy"], tmp_path / "toy", quick=True)
    assert [ctx.size("n") for ctx in seen] == [3]
    assert seen[0].settings.database_url == seen[0].url
    document = json.loads((out / "results.json").read_text())
    assert document["results"] == {"toy": {"skipped": "toy ran in delaysvc_bench", "n": 3}}
    assert document["sizes"]["n"] == 3
    assert document["quick"] is True
    assert set(document["suite_seconds"]) == {"toy"}
    assert document["code"].startswith("commit ")  # the tests run from a git checkout
    assert f"Code: {document['code']}." in (out / "results.md").read_text()
    assert "| toy: not run | toy ran in delaysvc_bench |" in (out / "results.md").read_text()

    run(settings, ["toy"], tmp_path / "full", n=11)
    assert seen[1].size("n") == 11
    with pytest.raises(ValueError, match="unknown suite"):
        run(settings, ["toy", "nope"], tmp_path / "nope")


def test_the_cli_writes_under_var_unless_told_where(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never into a docs/ of whatever folder runs it: var/bench/DATE-SUITES, or --out."""

    def toy(ctx: BenchContext) -> Figures:
        return Figures(results={"toy": {"skipped": "toy", "n": ctx.size("n")}})

    monkeypatch.setitem(SUITES, "toy", Suite(toy, (Size("n", 7, 3, "toy size"),)))
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith("DELAYSVC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DELAYSVC_DATABASE_URL", settings.database_url)
    ran = CliRunner().invoke(cli, ["bench", "toy", "--quick"])
    assert ran.exit_code == 0, ran.output
    (folder,) = (tmp_path / "var" / "bench").iterdir()
    assert folder.name.endswith("-toy-quick") and (folder / "results.json").is_file()
    assert f"written to {Path('var') / 'bench' / folder.name}/" in ran.output
    ran = CliRunner().invoke(cli, ["bench", "toy", "--quick", "--out", "here"])
    assert ran.exit_code == 0, ran.output
    assert (tmp_path / "here" / "results.md").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "var"]


def test_the_cli_lists_every_registered_size_as_a_flag_and_refuses_unknown_suites() -> None:
    runner = CliRunner()
    shown = runner.invoke(cli, ["bench", "--help"])
    assert shown.exit_code == 0
    for size in all_sizes().values():
        assert "--" + size.name.replace("_", "-") in shown.output
    refused = runner.invoke(cli, ["bench", "sned"])
    assert refused.exit_code == 2
    assert "unknown suite(s) ['sned']" in refused.output


@second_pass_only(
    "~30 s; strict (every peer must run) where Redis, RabbitMQ and PostgreSQL 15 are up"
)
@pytest.mark.usefixtures("rabbitmq")  # a peer's broker, which a fault test of the other pass stops
def test_peers_run_one_workload_each_or_say_why_not(settings: Settings, tmp_path: Path) -> None:
    """Toy size. Where CI's second pass runs (Redis broker, so Redis, RabbitMQ and PostgreSQL
    15 are up), every peer must have run; elsewhere a peer may be unavailable, but then it
    says why, and delaysvc itself always runs."""
    out = run(
        settings,
        ["peers"],
        tmp_path / "peers",
        peer_jobs=30,
        peer_delay=1.0,
        peer_pending=40,
        peer_workers=1,
    )
    results = json.loads((out / "results.json").read_text())["results"]
    assert set(results) == {"peer_raw"} | {f"peer_{name}" for name in PEERS}
    assert results.pop("peer_raw")["raw_insert_per_s"] > 0
    services_up = os.environ.get("DELAYSVC_TEST_BROKER_URL", "").startswith("redis://")
    for name, result in results.items():
        if "unavailable" in result:
            assert not services_up and name != "peer_delaysvc", result
            assert (
                "not installed" in result["unavailable"]
                or "not reachable" in (result["unavailable"])
            )
            continue
        assert (result["sent"], result["received"], result["duplicates"]) == (30, 30, 0), result
        late = result["lateness_ms"]
        assert 0 <= late["p50"] <= late["p95"] <= late["p99"] <= late["max"]
        assert result["enqueue_per_s"] > 0
        assert result["memory"]["pending"] == 40
        assert result["memory"]["enqueued_by"]  # the peer's bulk way, or one call per job
        assert "worker RSS growth" in result["memory"]["bytes"]
        assert result["not_durable"]
    table = (out / "results.md").read_text()
    for result in results.values():
        assert f"| {result['label']} |" in table
    assert (out / "peers_lateness.png").read_bytes()[:4] == b"\x89PNG"


def test_the_peers_table_growth_counts_delaysvc_tables_in_their_own_schema(
    settings: Settings, engine: Engine
) -> None:
    """delaysvc's tables are in a schema of their own: the peers' memory column counted only
    `public`'s, so delaysvc's pending jobs grew its tables by 0 MiB."""
    before = peers._tables_bytes(engine)
    Producer(settings, engine).send_batch([{"topic": "t", "body": "x" * 200, "delay": "1h"}] * 5000)
    assert peers._tables_bytes(engine) - before > 5000 * 200


def test_a_peer_whose_service_is_not_there_is_reported_unavailable(
    settings: Settings, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers, "AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2F")
    ctx = BenchContext(settings, engine, str(settings.database_url), {"peer_delay": 1.0})
    result, lateness = peers.measure(peers.RabbitPeer(ctx, tmp_path), 10, 1.0, 10, 1)
    assert lateness == []
    assert result["label"] == peers.RabbitPeer.label
    assert "RabbitMQ at 127.0.0.1:1 not reachable" in result["unavailable"] or (
        "pika is not installed" in result["unavailable"]
    )


@in_schema_jobs(11)
def test_scale_measures_send_and_moves_empty_and_with_a_backlog(
    settings: Settings, tmp_path: Path
) -> None:
    out = run(
        settings.model_copy(update={"lane_budget_seconds": 1.0}),
        ["scale"],
        tmp_path / "scale",
        pending=3000,
        scale_seconds=0.5,
        scale_due=2500,
    )
    result = json.loads((out / "results.json").read_text())["results"]["scale"]
    assert result["pending"] == 3000
    assert result["send_per_s_empty"] > 0 and result["send_per_s_backlog"] > 0
    # 2,500 due rows in batches of 1,000: three moves in each phase
    assert result["move_ms_empty"]["moves"] == result["move_ms_backlog"]["moves"] == 3
    assert set(result["rss_bytes"]) == {"delivery worker", "consume worker", "beat"}
    for rss in result["rss_bytes"].values():
        assert rss["empty"] > 10 * 1024 * 1024 and rss["backlog"] > 10 * 1024 * 1024
    assert "| scale: send msgs/s, 3,000 pending vs empty |" in (out / "results.md").read_text()


def _soak(settings: Settings, tmp_path: Path, messages: int) -> Path:
    """The soak suite with MESSAGES at 1,000/s, one consumer process, 1 s lane budgets."""
    return run(
        settings.model_copy(update={"lane_budget_seconds": 1.0}),
        ["soak"],
        tmp_path / "soak",
        soak_messages=messages,
        soak_rate=1000,
        processes=1,
    )


@in_schema_jobs(13)
def test_soak_runs_messages_through_the_whole_path_and_samples_the_tables(
    settings: Settings, tmp_path: Path
) -> None:
    out = _soak(settings, tmp_path, 6000)
    document = json.loads((out / "results.json").read_text())
    result = document["results"]["soak"]
    # `drained`: every message sent ran. The sender holds 1,000/s for 6 s, or nearly: on a
    # loaded machine it falls a tick or two behind (5,900 sent in a parallel CI run)
    assert result["drained"] is True and 4800 <= result["messages"] <= 6000
    assert result["claimed_per_s_start"] > 0 and result["claimed_per_s_end"] > 0
    assert result["peak_bytes"]["commit_log"] > 0
    assert len(document["series"]["soak_throughput"]) >= 2
    for plot in ("soak_throughput.png", "soak_bytes.png", "soak_dead.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"
    assert result["stalls"] == ""
    assert not (out / "soak-worker-logs").exists()  # kept only when not all ran, or stalled


def test_the_soak_names_the_spans_in_which_no_job_was_claimed_while_sending() -> None:
    from delaysvc.bench.soak import _stalls

    rates = [4000, 0, 0, 0, 0, 0, 0, 3000, 4000, 0, 4000, 0, 0, 0, 0, 0, 0, 0]
    samples = [{"t": 0.0, "at": 100.0}] + [
        {"t": 2.0 * i, "at": 100.0 + 2 * i, "claimed_per_s": rate}
        for i, rate in enumerate(rates, start=1)
    ]
    # 4-16 s: 12 s without a claim; 20-22 s: too short to count; 24-36 s: until sending ended
    assert _stalls(samples, sending_ended=100.0 + 2 * 18) == "4-16 s, 24-36 s"
    assert _stalls(samples, sending_ended=100.0 + 2 * 14) == "4-16 s"  # 24-28 s: too short
    assert _stalls(samples, sending_ended=100.0 + 2 * 5) == ""  # 4-10 s: too short


def test_the_soak_database_logs_lock_waits_slow_statements_and_their_plans(
    settings: Settings, engine: Engine
) -> None:
    from delaysvc.bench.soak import SLOW_PLAN_MS, _log_waits_and_slow_statements

    _log_waits_and_slow_statements(engine)
    engine.dispose()  # the settings apply to new sessions
    with engine.connect() as conn:
        shown = {
            name: conn.execute(text(f"SHOW {name}")).scalar_one()
            for name in (
                "log_lock_waits",
                "log_min_duration_statement",
                "session_preload_libraries",
            )
        }
        plans = conn.execute(text("SHOW auto_explain.log_min_duration")).scalar_one()
    assert shown == {
        "log_lock_waits": "on",
        "log_min_duration_statement": "1s",
        "session_preload_libraries": "auto_explain",
    }
    assert plans == f"{SLOW_PLAN_MS // 1000}s"


def test_the_soak_sampler_sees_a_transaction_held_open(engine: Engine) -> None:
    from delaysvc.bench.soak import long_running

    with engine.connect() as holder, engine.connect() as sampler:
        holder.execute(text("SELECT 1"))  # a transaction begun and left open
        pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
        time.sleep(1.2)
        seen = {row["pid"]: row for row in long_running(sampler, seconds=1)}
    assert seen[pid]["state"] == "idle in transaction"
    assert seen[pid]["transaction_s"] >= 1.0
    json.dumps(list(seen.values()), default=str)  # goes into results.json as it is


@in_schema_jobs(7)
def test_a_soak_that_does_not_drain_keeps_the_workers_logs(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from delaysvc.bench import soak

    monkeypatch.setattr(soak, "DRAIN_SECONDS", 0.0)  # level 1 is 1 s: the last are not run yet
    out = _soak(settings, tmp_path, 2000)
    result = json.loads((out / "results.json").read_text())["results"]["soak"]
    assert result["drained"] is False
    logs = list((out / "soak-worker-logs").glob("*.out"))
    assert logs, "the workers' logs were kept"


def test_a_suite_that_raises_is_reported_failed_and_the_others_still_run(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: BenchContext) -> Figures:
        raise RuntimeError("no Spark today")

    def fine(ctx: BenchContext) -> Figures:
        return Figures(results={"fine": {"skipped": "nothing to measure"}})

    monkeypatch.setitem(SUITES, "broken", Suite(broken))
    monkeypatch.setitem(SUITES, "fine", Suite(fine))
    out = run(settings, ["broken", "fine"], tmp_path / "mixed")
    assert failed_suites(out) == {"broken": "RuntimeError: no Spark today"}
    assert "| broken: FAILED | RuntimeError: no Spark today |" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["results"]["fine"] == {
        "skipped": "nothing to measure"
    }


@first_pass_only("starts three worker hosts three times (~1 min), the same on either server")
def test_hosts_runs_every_job_once_with_one_two_and_three_hosts(
    settings: Settings, tmp_path: Path
) -> None:
    out = run(settings, ["hosts"], tmp_path / "run", hosts_jobs=600, processes=1)
    results = json.loads((out / "results.json").read_text())["results"]
    for hosts in (1, 2, 3):
        result = results[f"hosts_{hosts}"]
        assert (result["hosts"], result["succeeded"], result["ran_twice"]) == (hosts, 600, 0)
        assert result["jobs_per_s"] > 0 and result["db_cpu_s"] >= 0
    table = (out / "results.md").read_text()
    assert "| hosts_3: jobs/s with 3 worker host(s) of 1 consumer processes" in table


def test_history_measures_with_and_without_a_finished_history_and_drops_a_day(
    settings: Settings, tmp_path: Path
) -> None:
    out = run(
        settings,
        ["history"],
        tmp_path / "run",
        history_finished=3000,
        history_days=3,
        history_seconds=0.3,
        history_due=1500,
        history_sweep=2000,
    )
    result = json.loads((out / "results.json").read_text())["results"]["history"]
    assert (result["finished"], result["days"], result["retention_rows"]) == (3000, 3, 1000)
    # 1,500 due rows in batches of 1,000: two moves in each phase, every job run
    assert result["move_ms_empty"]["moves"] == result["move_ms_history"]["moves"] == 2
    assert result["claim_per_s_empty"] > 0 and result["claim_per_s_history"] > 0
    assert result["sweep_rows_per_s"] > 0 and result["history_bytes"] > 0
    assert set(result["hot_bytes_history"]) == {
        "commit_log",
        "topic_queue",
        "consume_queue_1",
        "timer_queue",
    }
    table = (out / "results.md").read_text()
    assert "| history: retention: drop the oldest day (1,000 messages) |" in table


def test_measures_taken_in_turn_round_after_round() -> None:
    done: list[str] = []

    def measure(name: str, figure: float) -> float:
        done.append(name)
        return figure

    taken = _in_turn({"raw": lambda: measure("raw", 10.0), "send": lambda: measure("send", 4.0)}, 3)
    assert done == ["raw", "send"] * 3
    assert taken == {"raw": [10.0] * 3, "send": [4.0] * 3}
