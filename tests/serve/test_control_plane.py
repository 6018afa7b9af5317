"""The fleet's control plane (serve.fleet.ControlPlane) in-process, without Ray or replicas: what it keeps of the
replicas' reports. The fleet end to end (real Ray, real replicas) is tests/serve/test_fleet.py (slow)."""

from __future__ import annotations

import asyncio

from serve.fleet import LIVE_S, METRICS_KEEP_S, ControlPlane


def test_a_replica_whose_poll_lapses_keeps_its_metrics_page_until_it_is_gone():
    """The fleet's /metrics (serve.fleet.ControlPlane.metrics_pages): a replica polling late under load (past LIVE_S)
    keeps its last page, so its counters do not vanish from one scrape and return in the next (a delta would count its
    whole history as new requests); a replica gone for METRICS_KEEP_S leaves."""
    plane = ControlPlane({"models": [], "routes": {}})

    async def scrape_after(lapse_s: float) -> set[str]:
        for replica in ("r1", "r2"):
            await plane.report(replica, active=1, prepared=1, error=None, metrics=f"page of {replica}\n")
        plane.replicas["r2"]["seen"] -= lapse_s
        return set(await plane.metrics_pages())

    assert asyncio.run(scrape_after(LIVE_S + 1)) == {"r1", "r2"}
    assert asyncio.run(scrape_after(METRICS_KEEP_S + 1)) == {"r1"}
