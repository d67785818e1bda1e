"""Reading the bucketed histograms the engine records (lateness per lane, handler duration per
topic): counts per bucket of fixed upper bounds, plus one bucket for everything beyond."""

from __future__ import annotations

from collections.abc import Sequence


def percentile_bound(
    counts: Sequence[int], bounds: Sequence[float], q: float, beyond: float = float("inf")
) -> float | None:
    """The upper bound of the bucket holding the q-quantile (`q` in 0..1): "p99 <= this".
    None when empty; `beyond` (say, the largest value seen) past the last bound."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        seen += count
        if seen >= rank and count:
            return float(bounds[index]) if index < len(bounds) else beyond
    return beyond
