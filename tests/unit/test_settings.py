"""The database URLs are checked where the settings are read: the service's own connections
are psycopg 3's, so a URL for another driver (SQLAlchemy's `postgresql+psycopg2://`, an
asyncio driver's) or another database is refused at start, naming the variable and what it
takes, not found out at the first connection (psycopg2's did not connect at all: every pooled
connection was taken for one the server had closed)."""

from __future__ import annotations

import pytest

from delaysvc.config.settings import Settings
from delaysvc.errors import ConfigError


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@h:5432/d",
        "postgres://u@h/d",
        "postgresql+psycopg://u@h/d?sslmode=disable",
    ],
)
@pytest.mark.parametrize("variable", ["DELAYSVC_DATABASE_URL", "DELAYSVC_DIRECT_DATABASE_URL"])
def test_a_url_psycopg_3_reaches_is_taken(variable: str, url: str) -> None:
    settings = Settings.from_env({variable: url})
    assert url in (settings.database_url, settings.direct_database_url)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("postgresql+psycopg2://u@h/d", "driver psycopg2"),
        ("postgresql+asyncpg://u@h/d", "driver asyncpg"),
        ("mysql://u@h/d", "a mysql URL"),
        ("localhost:5432", "not a database URL"),
    ],
)
@pytest.mark.parametrize("variable", ["DELAYSVC_DATABASE_URL", "DELAYSVC_DIRECT_DATABASE_URL"])
def test_a_url_for_another_driver_or_database_is_refused_naming_what_is_taken(
    variable: str, url: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({variable: url})
    message = str(refused.value)
    assert message.startswith(f"{variable}: ")
    assert problem in message
    assert "postgresql://" in message and "postgresql+psycopg://" in message
    assert "u@h" not in message  # a URL may hold a password: it is not echoed
