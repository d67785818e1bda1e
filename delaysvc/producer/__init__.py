"""Sending: scheduling, cancelling and reading messages (`sending`), the module-level
`delaysvc.send` and friends (`default`), backlog caps (`caps`), redriving dead letters
(`dead_letters`).

`from delaysvc.producer import Producer`, the path from before the package, still works: names
not found here are looked up in `sending` on first use."""

from delaysvc._moved import names_of

__getattr__ = names_of(
    "delaysvc.producer", "sending", {"sending", "default", "caps", "dead_letters"}
)
