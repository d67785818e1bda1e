"""Schema upgrades: Alembic to head, then one consume-queue partition per configured level."""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

from delaysvc import store
from delaysvc.levels import DelayLevels

log = logging.getLogger(__name__)
MIGRATION_LOCK = 0x64656C61  # "dela": one migrator at a time across processes


def alembic_config() -> Config:
    from delaysvc import migrations

    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return config


def heads() -> list[str]:
    return list(ScriptDirectory.from_config(alembic_config()).get_heads())


def upgrade(engine: Engine, levels: DelayLevels, revision: str = "head") -> list[store.LevelChange]:
    """Idempotent; safe to run from several processes at once. -> the levels whose delay
    changed or that went (`store.ensure_levels`: their waiting messages keep their due times)."""
    config = alembic_config()
    with engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
        changes = store.ensure_levels(conn, levels)
    for change in changes:
        log.warning(
            "schema.level_changed",
            extra={
                "level": change.level,
                "old_ms": change.old_ms,
                "new_ms": change.new_ms,
                "relocated_to_timer_lane": change.relocated,
            },
        )
    log.info("schema.migrated", extra={"levels": str(levels)})
    return changes


def downgrade(engine: Engine, revision: str) -> None:
    config = alembic_config()
    with engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        config.attributes["connection"] = conn
        command.downgrade(config, revision)
