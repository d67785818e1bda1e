"""A history-checked concurrency test (Jepsen's approach on a queue): client processes send
(keys with every policy, priorities, levels, arbitrary delays), cancel, redrive dead letters and
change topic limits while two delivery workers, two consumer workers and two beats run, and
faults come on a seeded schedule: kill -9 of a worker and of beat, an immediate PostgreSQL
restart, a deploy, a level change with a restart. Every operation and every handler run is
recorded, and `delaysvc.bench.chaos_check` proves its properties from that history and a final
read (the module says how each is defined). `delaysvc bench chaos` is the long form.

DELAYSVC_TEST_SEED picks the seed (printed always); DELAYSVC_TEST_CHAOS_FAULTS the fault kinds
(comma-separated, of `chaos.FAULT_KINDS`). A failing run prints its seed,
the property it broke and the message ids; `python -m delaysvc.bench.chaos recheck FOLDER`
checks its history again."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine

from delaysvc.bench.chaos import FAULT_KINDS, ChaosConfig, run_chaos
from delaysvc.bench.chaos_faults import migrate
from delaysvc.config.settings import Settings
from tests.conftest import ROOT
from tests.e2e.conftest import Service, restart_postgres
from tests.support.passes import first_pass_only

pytestmark = pytest.mark.e2e

SEED = int(os.environ.get("DELAYSVC_TEST_SEED", "20261"))
FAULTS = tuple(
    kind.strip()
    for kind in os.environ.get("DELAYSVC_TEST_CHAOS_FAULTS", ",".join(FAULT_KINDS)).split(",")
    if kind.strip()
)
LEASE_SECONDS = 10
MIN_SENDS = 2000


class ServiceDeployment:
    """`chaos.Deployment` on the e2e harness: the workers and beat are the Service's (ended by
    its fixture, also when the test fails)."""

    def __init__(self, service: Service):
        self.service = service

    def spawn(self, role: str) -> subprocess.Popen[bytes]:
        if role == "delivery":
            return self.service.delivery_worker()
        if role == "consume":
            return self.service.consume_worker()
        return self.service.beat()

    def use_levels(self, levels: str) -> None:
        self.service.env["DELAYSVC_DELAY_LEVELS"] = levels
        self.service.settings = Settings.from_env(self.service.env)

    def migrate(self) -> None:
        migrate(self.service.env, cwd=ROOT)

    def restart_postgres(self) -> None:
        restart_postgres()

    def env(self) -> dict[str, str]:
        return dict(self.service.env)


@first_pass_only("about 3 minutes; a seeded history, the same on either server and broker")
def test_a_seeded_history_of_sends_cancels_and_faults_keeps_every_property(
    service_factory: Callable[..., Service], engine: Engine, tmp_path: Path
) -> None:
    service = service_factory(
        lease_seconds=str(LEASE_SECONDS), handlers="delaysvc.bench.chaos_handlers"
    )
    config = ChaosConfig(
        seed=SEED,
        seconds=60,
        faults=FAULTS,
        fault_count=len(FAULTS),
        lease_seconds=LEASE_SECONDS,
    )
    print(f"\nchaos seed {SEED} (DELAYSVC_TEST_SEED), faults {', '.join(FAULTS)}")
    outcome = run_chaos(config, ServiceDeployment(service), engine, tmp_path / "history")
    print("\n".join(outcome.lines()))
    # the races really happened: traffic of every kind, and every scheduled fault
    assert outcome.ops["send"]["ok"] >= MIN_SENDS, outcome.ops
    for kind in ("cancel", "redrive", "limits"):
        assert outcome.ops[kind].get("ok", 0) >= 5, (kind, outcome.ops)
    assert outcome.faults == {kind: FAULTS.count(kind) for kind in set(FAULTS)}
    assert outcome.reruns.get("retry or redrive", 0) >= 50, outcome.reruns
    assert outcome.drained, "messages left unfinished at the end"
    broken = {name: found for name, found in outcome.violations.items() if found}
    assert not broken, f"seed {SEED}: " + "; ".join(
        f"{name}: ids {[v.message_id for v in found[:20]]}" for name, found in broken.items()
    )
