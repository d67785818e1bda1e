"""Fixtures the integration tests share: the web app on the test's database, and its client
(a module wanting other settings defines its own `app`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flask import Flask
from flask.testing import FlaskClient

from delaysvc.config.settings import Settings
from delaysvc.web import create_app


@pytest.fixture
def app(settings: Settings) -> Iterator[Flask]:
    app = create_app(settings)
    yield app
    app.extensions["delaysvc"]["engine"].dispose()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()
