"""A steady stream of sends: `rate` messages per second for `seconds`, sent in batches every
50 ms. The benchmark's flows use it, and so does `delaysvc load`, which sends into the
service's own database so the dashboard can be watched under load."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from delaysvc.bench.progress import Progress
from delaysvc.producer.sending import Producer

TICK_SECONDS = 0.05


def send_at_rate(
    producer: Producer,
    rate: int,
    seconds: float,
    batch: Callable[[int], Sequence[Mapping[str, Any]]],
    on_tick: Callable[[float], None] = lambda elapsed: None,
) -> int:
    """Send `batch(n)` items every tick to hold `rate`/s for `seconds`; -> messages sent.
    `on_tick(elapsed)` runs after each batch (sampling, say)."""
    per_tick = max(1, round(rate * TICK_SECONDS))
    sent, started = 0, time.monotonic()
    progress = Progress("send", int(rate * seconds), "msgs")
    while (elapsed := time.monotonic() - started) < seconds:
        producer.send_batch(batch(per_tick))
        sent += per_tick
        progress.update(sent)
        on_tick(elapsed)
        behind = started + sent / rate - time.monotonic()
        if behind > 0:
            time.sleep(behind)
    progress.done()
    return sent
