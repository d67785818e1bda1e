"""A body encoded by orjson (`validation._json_bytes`, as delaysvc does now) against json's C
encoder alone (`_to_json(body).encode()`, as it did before 2026-12-01), side by side in one
process: each way's time to encode a body and lay out its commit-log row for a batch COPY
(psycopg's binary row formatting, as `send_batch` does), then `send_batch` of 10,000 messages
with each way, alternating, on one database. Bodies: the bench's two fields, an order of ten
lines (~0.8 KB), an order of a hundred lines (~6.9 KB). Then a batch whose messages carry three
properties (as a traced application's do: `traceparent`), their jsonb written by
`validation.json_text` (orjson, now) or by psycopg's own `json.dumps` (before), in turn.

Run from the repository root: python docs/benchmarks/body_encoding.py [SERVER_URL] [ROUNDS]
(default the local PostgreSQL, 3 rounds); it works in a database of its own. Set
PGOPTIONS="-c synchronous_commit=off" to take the disk's flush out of the batches' figures.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg._copy_base import format_row_binary
from psycopg.adapt import PyFormat, Transformer
from psycopg.pq import Format

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scratch import scratch_database, server_and_rounds

from delaysvc.config import validation
from delaysvc.db.engines import libpq_url
from delaysvc.producer.sending import Producer
from delaysvc.store import batches

SIZE = 10_000


def _order(lines: int, n: int) -> dict[str, Any]:
    return {
        "order_id": n,
        "customer": {"id": 1000 + n, "email": f"buyer{n}@example.com", "tier": "gold"},
        "lines": [
            {"sku": f"SKU-{i:05d}", "name": "Grüner Tee 100 g", "qty": i % 4 + 1, "price": 4.95}
            for i in range(lines)
        ],
        "coupon": "WINTER",
        "paid": True,
    }


BODIES: dict[str, Callable[[int], Any]] = {
    "two fields (the bench's)": lambda n: {"order_id": n, "action": "cancel"},
    "order of 10 lines": lambda n: _order(10, n),
    "order of 100 lines": lambda n: _order(100, n),
}
WAYS: dict[str, Callable[[Any], bytes]] = {
    "orjson (now)": validation._json_bytes,
    "json's C encoder (before)": lambda body: validation._to_json(body).encode("utf-8"),
}


def _row_formatter(url: str) -> Callable[[bytes, int], None]:
    """Lays out a commit-log row with `body` as `send_batch`'s COPY does, into a buffer that is
    dropped every 32 KiB (psycopg's own size for a COPY's writes)."""
    conn = psycopg.connect(url)
    cursor = conn.cursor()
    cursor.adapters.register_dumper(bytes, cursor.adapters.get_dumper(bytes, PyFormat.BINARY))
    transformer = Transformer(cursor)
    types = conn.adapters.types
    oids = [
        types[kind[:-2]].array_oid if kind.endswith("[]") else types[kind].oid
        for _, kind in batches.MESSAGE_ROW
    ]
    transformer.set_dumper_types(oids, Format.BINARY)
    buffer = bytearray()

    def format_row(body: bytes, n: int) -> None:
        nonlocal buffer
        row = (n, "bench", None, None, body, True, None, 17, 0, 17, n, "scheduled", 1, 2, None)
        format_row_binary(row, transformer, buffer)
        if len(buffer) > 32768:
            buffer = bytearray()

    return format_row


def encoding(url: str, rounds: int) -> None:
    format_row = _row_formatter(url)
    print("a body encoded and its row laid out, us (best of each way's rounds, in turn)")
    for body_name, make in BODIES.items():
        bodies = [make(n) for n in range(SIZE)]
        size = len(validation._json_bytes(bodies[0]))
        best: dict[str, float] = {}
        for _ in range(rounds * 2):
            for way, encode in WAYS.items():
                gc.disable()
                started = time.perf_counter()
                for n, body in enumerate(bodies):
                    format_row(encode(body), n)
                spent = (time.perf_counter() - started) / SIZE * 1e6
                gc.enable()
                best[way] = min(best.get(way, spent), spent)
        now, before = best.values()
        print(
            f"  {body_name} ({size:,} bytes): "
            + ", ".join(f"{way} {us:.2f}" for way, us in best.items())
            + f"; {before / now:.2f}x"
        )


def _batches_in_turn(
    producer: Producer,
    items: list[dict[str, Any]],
    module: Any,
    name: str,
    ways: dict[str, Any],
    rounds: int,
) -> str:
    """`send_batch(items)` with `module.name` set to each of `ways` in turn, `rounds` times
    (put back as it was after each); -> each way's rates and the first's median over the
    second's, as a line."""
    kept = getattr(module, name)
    producer.send_batch(items)  # warm: connections, plans
    rates: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(rounds):
        for way, function in ways.items():
            setattr(module, name, function)
            try:
                started = time.perf_counter()
                producer.send_batch(items)
                rates[way].append(SIZE / (time.perf_counter() - started))
            finally:
                setattr(module, name, kept)
    now, before = (statistics.median(r) for r in rates.values())
    spelled = (f"{way} " + ", ".join(f"{rate:,.0f}" for rate in r) for way, r in rates.items())
    return "; ".join(spelled) + f"; {now / before:.2f}x"


def batches_side_by_side(server: str, rounds: int) -> None:
    print(f"send_batch of {SIZE:,}, msg/s (each way's rounds, in turn; median)")
    with scratch_database(server, "delaysvc_body_encoding") as (engine, settings):
        producer = Producer(settings, engine)
        for body_name, make in BODIES.items():
            items = [{"topic": "bench.noop", "body": make(n), "delay": "1h"} for n in range(SIZE)]
            line = _batches_in_turn(producer, items, validation, "_json_bytes", WAYS, rounds)
            print(f"  {body_name}: {line}")


PROPERTIES = {
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tenant": "acme",
    "source": "checkout",
}


def properties_side_by_side(server: str, rounds: int) -> None:
    print(f"send_batch of {SIZE:,} with three properties each, msg/s (in turn; median)")
    ways = {"json_text (now)": validation.json_text, "json.dumps (before)": json.dumps}
    with scratch_database(server, "delaysvc_body_encoding") as (engine, settings):
        producer = Producer(settings, engine)
        body = {"topic": "bench.noop", "delay": "1h", "properties": PROPERTIES}
        items = [{**body, "body": {"order_id": n}} for n in range(SIZE)]
        print("  " + _batches_in_turn(producer, items, batches, "json_text", ways, rounds))


def main() -> None:
    server, rounds = server_and_rounds(3)
    encoding(libpq_url(server), rounds)
    batches_side_by_side(server, rounds)
    properties_side_by_side(server, rounds)


if __name__ == "__main__":
    main()
