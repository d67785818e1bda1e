"""Connections: engines and the embedded PostgreSQL (`engines`), the connections a producer
keeps for its single sends (`held`), the caller's own connections (`connections`), and the
schema names SQL is written with (`names`).

`from delaysvc.db import make_engine`, the path from before the package, still works: names
not found here are looked up in `engines` on first use (nothing is imported at load, so
`config` may use `names` without a cycle)."""

from delaysvc._moved import names_of

__getattr__ = names_of("delaysvc.db", "engines", {"engines", "held", "connections", "names"})
