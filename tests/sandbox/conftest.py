"""The sandbox tests need bubblewrap (.ci/run installs it; `apt-get install bubblewrap` here)."""

from __future__ import annotations

import pytest

from tests.conftest import NO_BUBBLEWRAP
from verl.sandbox.isolation import mechanism, probe_failure


@pytest.fixture(scope="session")
def bubblewrap() -> None:
    if mechanism() != "bubblewrap":
        pytest.skip(f"{NO_BUBBLEWRAP}: {probe_failure()} (apt-get install bubblewrap)")
