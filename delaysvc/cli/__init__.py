"""The `delaysvc` command: one module per group of commands, each registering its commands on
the group in `delaysvc.cli.app` when imported (here, all of them), and the pipeline's group."""

from delaysvc.cli import access, bench, database, dead, messages, schedules, service, topics
from delaysvc.cli.app import cli, main
from delaysvc.pipeline.cli import pipeline

cli.add_command(pipeline)

__all__ = [
    "access",
    "bench",
    "cli",
    "database",
    "dead",
    "main",
    "messages",
    "schedules",
    "service",
    "topics",
]

if __name__ == "__main__":  # pragma: no cover
    main()
