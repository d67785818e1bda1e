"""The `chaos` run's clients (`delaysvc.bench.chaos`): each a process of its own, sending,
cancelling, redriving dead letters and changing topic limits on a seeded mix, and recording
every operation as Jepsen does: invoke, then ok / fail / info (`chaos_history.Op`)."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError

from delaysvc.bench.chaos_handlers import TOPICS
from delaysvc.bench.chaos_history import Op, Recorder, epoch
from delaysvc.errors import DatabaseUnavailable, DelaysvcError
from delaysvc.producer.dead_letters import DeadLetters
from delaysvc.producer.sending import Producer
from delaysvc.worker.limits import set_limits

KEYS = 30
"""Keys shared by every client: they race on them."""


class Client:
    """One client process's workload: a seeded mix of sends (keys with every policy,
    priorities, levels, arbitrary delays), cancels, redrives and limit changes, at `rate`
    operations a second, each recorded as invoke then ok / fail / info."""

    def __init__(self, number: int, seed: int, producer: Producer, recorder: Recorder):
        self.number = number
        self.rng = random.Random(seed * 1000 + number)
        self.producer = producer
        self.engine = producer.engine
        self.dead = DeadLetters(self.engine)
        self.recorder = recorder
        self.index = 0
        self.sent: deque[tuple[int, float]] = deque(maxlen=50)  # (id, due time) of each

    def run(self, seconds: float, rate: float) -> None:
        deadline = time.monotonic() + seconds
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            self.one()
            next_at += 1 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))

    def one(self) -> None:
        roll = self.rng.random()
        if roll < 0.13 and self.sent:
            self.cancel()
        elif roll < 0.18:
            self.redrive()
        elif roll < 0.20:
            self.limits()
        else:
            self.send()

    def send(self) -> None:
        rng = self.rng
        topic = rng.choices(TOPICS, weights=(65, 10, 10, 15))[0]
        args: dict[str, Any] = {"topic": topic}
        if rng.random() < 0.35:
            args["key"] = f"k{rng.randrange(KEYS)}"
            args["on_duplicate"] = rng.choice(("keep", "replace", "debounce"))
        if rng.random() < 0.2:
            args["priority"] = rng.randint(1, 5)
        timing = rng.random()
        if timing < 0.65:
            args["delay_level"] = rng.choices((1, 2, 3, 4), weights=(25, 20, 15, 5))[0]
        elif timing < 0.85:
            args["delay_ms"] = rng.randint(200, 4000)
        sleep = rng.randint(200, 1500) if rng.random() < 0.05 else rng.randint(0, 5)
        body = {"c": self.number, "n": self.index, "sleep": sleep}

        def call() -> dict[str, Any]:
            options = {k: v for k, v in args.items() if k != "topic"}
            message = self.producer.send(topic, body, **options)
            if message.created:
                self.sent.append((message.id, message.deliver_at.timestamp()))
            return {
                "id": message.id,
                "created": message.created,
                "replaced_id": message.replaced_id,
                "status": message.status,
                "stored_at": epoch(message.stored_at),
                "deliver_at": epoch(message.deliver_at),
            }

        self._op("send", args, call)

    def cancel(self) -> None:
        """By topic and key, by the id of a message sent lately, or (half of those) by the id
        of the one due nearest now: the cancel then races its move and its claim."""
        roll = self.rng.random()
        if roll < 0.3:
            args: dict[str, Any] = {
                "topic": self.rng.choice(TOPICS),
                "key": f"k{self.rng.randrange(KEYS)}",
            }
        elif roll < 0.65:
            now = time.time()
            args = {"id": min(self.sent, key=lambda sent: abs(sent[1] - now))[0]}
        else:
            args = {"id": self.rng.choice(self.sent)[0]}

        def call() -> dict[str, Any]:
            message = self.producer.cancel(
                args.get("id"), topic=args.get("topic"), key=args.get("key")
            )
            return {"id": message.id, "finished_at": epoch(message.finished_at)}

        self._op("cancel", args, call)

    def redrive(self) -> None:
        letters = self._quietly(lambda: self.dead.list("chaos.dead", limit=20))
        if not letters:
            return self.send()
        args = {"id": int(self.rng.choice(letters).message_id)}

        def call() -> dict[str, Any]:
            message = self.dead.redrive(args["id"])
            return {"id": message.id, "deliver_at": epoch(message.deliver_at)}

        self._op("redrive", args, call)
        return None

    def limits(self) -> None:
        max_running = self.rng.choice((None, 1, 2, 4))
        rate = self.rng.choice((None, None, 20.0, 50.0))
        args = {"topic": "chaos.limited", "max_running": max_running, "rate": rate}

        def call() -> dict[str, Any]:
            set_limits(self.engine, "chaos.limited", max_running=max_running, rate=rate)
            return {}

        self._op("limits", args, call)

    def _op(self, kind: str, args: dict[str, Any], call: Callable[[], dict[str, Any]]) -> None:
        self.index += 1
        self.recorder.write(Op(self.number, self.index, kind, "invoke", time.time(), args))
        try:
            result, phase = call(), "ok"
        except DatabaseUnavailable as exc:
            result, phase = {"error": str(exc)[:200]}, "info" if exc.maybe_stored else "fail"
        except DelaysvcError as exc:  # refused: NotCancellable, NotFound, DuplicateKey ...
            result, phase = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}, "fail"
        except (DBAPIError, OSError) as exc:  # cut off mid-call: it may have happened
            result, phase = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}, "info"
        self.recorder.write(Op(self.number, self.index, kind, phase, time.time(), args, result))

    @staticmethod
    def _quietly(read: Callable[[], list[Any]]) -> list[Any]:
        try:
            return read()
        except (DBAPIError, DelaysvcError):
            return []


def client_main(number: int, seed: int, seconds: float, rate: float, out: Path) -> None:
    """One client process (`python -m delaysvc.bench.chaos client`): settings from its
    environment, as a producer's would be."""
    from delaysvc.config.settings import Settings
    from delaysvc.db.engines import make_engine

    settings = Settings.from_env()
    engine = make_engine(settings)
    recorder = Recorder(out)
    try:
        Client(number, seed, Producer(settings, engine), recorder).run(seconds, rate)
    finally:
        recorder.close()
        engine.dispose()
