"""The tables (`tables`), and the migrations that make and change them (`migrate`, with the
Alembic revisions in `migrations/`).

`from delaysvc.schema import metadata`, the path from before the package, still works: names
not found here are looked up in `tables` on first use."""

from delaysvc._moved import names_of

__getattr__ = names_of("delaysvc.schema", "tables", {"tables", "migrate"})
