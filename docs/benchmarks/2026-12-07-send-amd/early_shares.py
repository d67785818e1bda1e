"""The Messages of a batch made partly before the commit log's COPY ends (early-messages.diff
applied to the working tree, which reads the share from X_EARLY), several shares against another
checkout, in turn, each run a process of its own (batch_sides.py's measure).

Run from the repository root, with OTHER_CHECKOUT a `git worktree` of the commit before:
    python docs/benchmarks/2026-12-07-send-amd/early_shares.py SERVER_URL ROUNDS OTHER_CHECKOUT
"""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

from timing import checkouts_in_turn  # noqa: E402

tree = str(BENCHMARKS.parents[1])
server, rounds, other = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ways = [(f"e{share}", tree, {"X_EARLY": str(share)}) for share in (0, 30, 45, 60)]
checkouts_in_turn(str(BENCHMARKS / "batch_sides.py"), server, [*ways, ("ref", other, {})], rounds)
