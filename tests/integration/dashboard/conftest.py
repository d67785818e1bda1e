"""The dashboard tests' fixtures: settings with var/ in a temporary folder, an app on the test's
database with an admin and a viewer, and clients logged in as each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine

from delaysvc import auth
from delaysvc.config.settings import Settings
from delaysvc.web import create_app
from tests.support.dashboard import ADMIN, VIEWER, login


@pytest.fixture
def settings(settings: Settings, tmp_path: Path) -> Settings:
    """The shared settings, with var/ (where the session key is kept) in a temporary folder."""
    return settings.model_copy(update={"var_dir": tmp_path / "var"})


@pytest.fixture
def app(settings: Settings, engine: Engine) -> Iterator[Flask]:
    auth.create_user(engine, *ADMIN, role="admin")
    auth.create_user(engine, *VIEWER, role="viewer")
    app = create_app(settings)
    yield app
    app.extensions["delaysvc"]["engine"].dispose()


@pytest.fixture
def admin(app: Flask) -> FlaskClient:
    client = app.test_client()
    assert login(client, ADMIN).status_code == 302
    return client


@pytest.fixture
def viewer(app: Flask) -> FlaskClient:
    client = app.test_client()
    assert login(client, VIEWER).status_code == 302
    return client
