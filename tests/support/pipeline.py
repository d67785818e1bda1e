"""What the pipeline's tests share besides the SparkSession (`tests/pipeline/conftest.py`):
counting rows and a nearest-rank percentile."""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime

from sqlalchemy import Engine, text

DAY_MS = 86_400_000
T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)


def _count(engine: Engine, where: str = "true") -> int:
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM message WHERE {where}")).scalar_one()


def _md5_hash_sum(ids: list[int]) -> int:
    return sum(int(hashlib.md5(str(i).encode()).hexdigest()[:15], 16) for i in ids)


def _nearest_rank(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(p * len(ordered)) - 1]
