"""The canary's error rates and power, cell by cell (issue 41): the real ``Canary`` driven by a simulated service.

    .venv/bin/python benchmarks/canary_matrix.py --sims 2000 --workers 2          # the table in RESULTS.md
    .venv/bin/python benchmarks/canary_matrix.py --sims 300 --cells base sticky   # some cells, quicker

Each cell changes one factor from the base case (0/1 rewards at 60%, requests without a user, no errors, p95 at
half the SLO, stages 5/25/50%, a 10,000-request budget; alpha 0.05 split as ``CanarySettings.alpha_split``) and runs
``--sims`` seeded ships three times: identical models (A/A), a candidate worse by exactly the margin, and a drop of
10 points (where the base rate allows one). Printed: the rate of each outcome with its Wilson 95% interval, and the
requests by which 80% of the drops were rolled back. Every decision is the real canary's: its record reading,
randomized units, tests, alpha split and stage logic (``eval.ship.simulate``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from eval.ship.simulate import cells, matrix, requests_for_power, simulate

ALPHA = 0.05


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def interval(pair: tuple[float, float]) -> str:
    return f"{100 * pair[0]:.1f}-{100 * pair[1]:.1f}"


def table(rows: list[dict]) -> str:
    lines = ["| cell | A/A rolled back (95% CI) | A/A promoted / inconclusive | worse by the margin promoted (95% CI) "
             "| 10-point drop rolled back | requests for 80% power |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        drop = (pct(r["drop_rollback"]), f"{r['drop_requests_80']:,.0f}" if math.isfinite(r["drop_requests_80"])
                else "not within the budget") if "drop_rollback" in r else ("n/a (base rate)", "n/a")
        lines.append(f"| {r['cell']} | {pct(r['aa_rollback'])} ({interval(r['aa_rollback_ci'])}) | "
                     f"{pct(r['aa_promote'])} / {pct(r['aa_inconclusive'])} | {pct(r['margin_promote'])} "
                     f"({interval(r['margin_promote_ci'])}) | {drop[0]} | {drop[1]} |")
    return "\n".join(lines)


def costs(sims: int, seed: int) -> str:
    """What the alpha split and the exact test cost in power: requests by which 80% of 10-point drops (base case)
    are rolled back, with the reward test at alpha/2 (the split) or at the whole alpha, by betting or the mixture."""
    base = cells()[0]
    lines = ["| reward test | its alpha | requests for 80% power | drop rolled back |", "|---|---|---|---|"]
    for test in ("betting", "mixture"):
        for alpha in (ALPHA, 2 * ALPHA):  # the split gives the reward test alpha / 2
            cell = replace(base, settings=replace(base.settings, test=test, alpha=alpha))
            dropped = simulate(cell, -0.10, sims, seed + 2)
            lines.append(f"| {test} | {pct(alpha / 2)}{' (the split)' if alpha == ALPHA else ''} | "
                         f"{requests_for_power(dropped):,.0f} | {pct(dropped['rollback'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sims", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cells", nargs="*", help="only cells whose name starts with one of these")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/canary_matrix.json"))
    parser.add_argument("--no-costs", dest="costs", action="store_false", help="skip the power-cost table")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = matrix(args.sims, args.seed, args.cells, args.workers)
    args.out.write_text(json.dumps(rows, indent=1))
    worst_aa = max(r["aa_rollback"] for r in rows)
    worst_margin = max(r["margin_promote"] for r in rows)
    base = rows[0]
    print("=== summary")
    print(table(rows))
    print(f"\n{args.sims} seeded ships per case, seed {args.seed}, {time.perf_counter() - started:.0f} s on "
          f"{args.workers} processes. Worst A/A rollback rate {pct(worst_aa)}, worst margin-worse promote rate "
          f"{pct(worst_margin)} (alpha {pct(ALPHA)}: {'held' if max(worst_aa, worst_margin) <= ALPHA else 'BROKEN'} "
          f"in every cell).")
    if "drop_rollback" in base:
        print(f"Base case: a 10-point drop is rolled back in {pct(base['drop_rollback'])} of ships, 80% of them by "
              f"{base['drop_requests_80']:,.0f} requests.")
    if args.costs:
        print("\nWhat the split and the exact test cost (base case, 10-point drop):\n")
        print(costs(args.sims, args.seed))


if __name__ == "__main__":
    main()
