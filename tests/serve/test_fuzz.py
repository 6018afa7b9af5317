"""Schema fuzzing: schemathesis drives every operation of the app's own OpenAPI spec against the live server.

Bounded (25 generated cases per operation in the default run; in the slow group 40, plus schemathesis's coverage
phase: boundary and invalid values of every field, several hundred cases per completion endpoint; short generations)
and checked for two properties: no response is a 5xx, whatever the body, and after every case a normal request is
still answered. Valid and invalid inputs are both generated; invalid ones must be refused with a 4xx, never crash a
handler.
"""

from __future__ import annotations

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from serve.api import create_app
from serve.settings import load_settings
from tests.serve.helpers import TEST_SETTINGS, run_server

# A real process, server, cluster or trainer run: `make test-fast` skips it; its tests share one server.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("fuzz")]

# Short generations keep each fuzzed request cheap; the spec itself does not depend on the settings.
FUZZ_SETTINGS = {**TEST_SETTINGS, "max_output_tokens": 8, "default_max_tokens": 4, "max_n": 2,
                 "max_prompts_per_request": 4}
SPEC = create_app(load_settings(**FUZZ_SETTINGS)).openapi()


def load_schema(coverage: bool):
    """The app's spec; ``coverage``: also schemathesis's coverage phase (boundary values of every field, several
    hundred cases for the completion endpoints, most of the run's time)."""
    schema = schemathesis.openapi.from_dict(SPEC)
    schema.config.phases.coverage.enabled = coverage
    return schema


quick, thorough = load_schema(coverage=False), load_schema(coverage=True)


@pytest.fixture(scope="module")
def fuzz_server():
    with run_server(**FUZZ_SETTINGS) as srv:
        yield srv


FUZZ = dict(deadline=None, derandomize=True, print_blob=True, suppress_health_check=list(hypothesis.HealthCheck),
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])


def check_case(case, server) -> None:
    response = case.call(base_url=server.url, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
    assert response.status_code < 500, response.text
    # Whatever that case did, the service still answers a normal request (a crashed engine would give 503).
    normal = httpx.post(server.url + "/v1/completions", json={"prompt": "1+1=", "max_tokens": 2}, timeout=60)
    assert normal.status_code == 200, normal.text


@quick.parametrize()
@hypothesis.settings(max_examples=25, **FUZZ)
def test_no_server_errors(case, fuzz_server):
    """Every operation: its examples and 25 generated cases."""
    check_case(case, fuzz_server)


@pytest.mark.budget(6)
@pytest.mark.slow
@thorough.parametrize()
@hypothesis.settings(max_examples=40, **FUZZ)
def test_no_server_errors_thorough(case, fuzz_server):
    """Every operation: also the coverage phase (boundary and invalid values of every field) and 40 cases."""
    check_case(case, fuzz_server)
