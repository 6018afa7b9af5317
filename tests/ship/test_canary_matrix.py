"""A seeded subset of the canary's simulation matrix (slow group; the whole matrix is benchmarks/canary_matrix.py and
docs/shipping.md's table): the real ``Canary`` against the simulated service, in the conditions issue 41 found it
breaking its own alpha — identical models are rolled back, and a candidate worse by exactly the margin promoted, at
most alpha = 5% of the time. ``n = 4``: a request's four choices on prompts of varying difficulty, rolled back 12.0%
of 200 identical pairs when each choice was a unit (issue 61), 0% as one unit per request."""

from __future__ import annotations

import pytest

from eval.ship.simulate import cells, simulate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # ~1.5 min alone on the 2-core box

SIMS = 200  # seeded: the same outcomes on every machine; the whole matrix (2,000 per cell): benchmarks/
ALPHA = 0.05


def cell(prefix: str):
    return next(c for c in cells() if c.name.startswith(prefix))


@pytest.mark.budget(20)
@pytest.mark.parametrize("prefix", ["base", "errors 1%", "sticky users", "reward rate drifts", "n = 4"])
def test_identical_models_are_rarely_rolled_back(prefix: str):
    result = simulate(cell(prefix), 0.0, SIMS, seed=0)
    assert result["rollback"] <= ALPHA, (prefix, result["rollback"])
    assert result["promote"] + result["rollback"] + result["inconclusive"] == pytest.approx(1.0)


@pytest.mark.budget(20)
@pytest.mark.parametrize("prefix", ["base", "0/1 at 95%"])
def test_a_candidate_worse_by_the_margin_is_rarely_promoted(prefix: str):
    chosen = cell(prefix)
    result = simulate(chosen, -chosen.settings.margin, SIMS, seed=1)
    assert result["promote"] <= ALPHA, (prefix, result["promote"])


@pytest.mark.budget(15)
def test_a_ten_point_drop_is_caught_within_the_budget():
    result = simulate(cell("base"), -0.10, 150, seed=2)
    assert result["rollback"] >= 0.95
