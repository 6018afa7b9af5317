"""Fixtures: one shared server on the tiny model for the API tests (started once per session)."""

from __future__ import annotations

import pytest

from tests.serve.helpers import run_server


@pytest.fixture(scope="session")
def server():
    with run_server() as srv:
        yield srv
