"""``verl compare --online URL|FILE``: the A/B report of models served side by side, from the service's own records.

The service records one row per finished sequence (``verl/data/records.py``): model, route, prompt id, TTFT, e2e
latency, tokens, error, and the rule reward when the request carried the ``verl`` extension. This module reads
those rows (from a running service's ``/admin/records`` or a ``records_path`` JSONL file) and compares each model
with the baseline (``--baseline``, else the model with the most requests — the incumbent of a canary split):

- **reward**: *paired* on prompts both models answered (per-prompt mean reward, paired bootstrap of the difference,
  McNemar when per-prompt values are 0/1, as the offline ``verl compare`` does); *unpaired* otherwise (bootstrap
  of each model's requests independently, the difference of means, percentile CI, p-value from the replicates
  shifted to the null);
- **latency**: e2e and TTFT, unpaired bootstrap of the difference of means (requests are not repeated per model in
  a split, so there is nothing to pair), p50/p95 beside;
- **errors**: counts and rates (sequences the client abandoned — disconnects, timeouts, a load test stopping —
  are counted apart as ``aborted`` and left out of latency and reward).

Verdicts at ``alpha``: reward better / worse, latency faster / slower, or no significant difference.
Outputs ``online.json``, ``report.md`` and ``report.html`` in ``--out``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from eval.report import Doc, fmt
from eval.stats import mcnemar, paired_bootstrap
from verl.data.records import join_rewards, load_records
from verl.errors import ConfigError
from verl.utils.fs import atomic_write_json


def unpaired_bootstrap(a: np.ndarray, b: np.ndarray, n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Bootstrap of ``mean(b) - mean(a)`` resampling each group on its own; percentile 95% CI, two-sided p-value
    from the replicates shifted to the null (as ``paired_bootstrap``)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    nan = float("nan")
    if a.size == 0 or b.size == 0:
        return {"diff": nan, "ci_low": nan, "ci_high": nan, "p_value": nan, "n": int(a.size + b.size)}
    d = float(b.mean() - a.mean())
    if a.size < 2 or b.size < 2:
        return {"diff": d, "ci_low": nan, "ci_high": nan, "p_value": nan, "n": int(a.size + b.size)}
    rng = np.random.default_rng(seed)
    reps = (b[rng.integers(0, b.size, (n_boot, b.size))].mean(1) - a[rng.integers(0, a.size, (n_boot, a.size))]
            .mean(1))
    low, high = (float(v) for v in np.percentile(reps, [2.5, 97.5]))
    extreme = int(np.sum(np.abs(reps - d) >= abs(d) - 1e-12))
    p_value = 1.0 if d == 0 else min(1.0, (1 + extreme) / (1 + n_boot))
    return {"diff": d, "ci_low": low, "ci_high": high, "p_value": p_value, "n": int(a.size + b.size)}


def _verdict(test: dict, alpha: float, better: str, worse: str, higher_is_better: bool) -> str:
    p = test.get("p_value")
    if p is None or not math.isfinite(p) or p >= alpha:
        return "no significant difference"
    return better if (test["diff"] > 0) == higher_is_better else worse


def model_summary(rows: list[dict]) -> dict[str, Any]:
    ok = [r for r in rows if not r.get("error") and r.get("finish_reason") != "abort"]
    e2e = np.array([r["e2e_s"] for r in ok], dtype=np.float64)
    ttft = np.array([r["ttft_s"] for r in ok if r.get("ttft_s") is not None], dtype=np.float64)
    rewards = [r["reward"] for r in ok if r.get("reward") is not None]

    def pct(values: np.ndarray, q: float) -> float | None:
        return float(np.percentile(values, q)) if values.size else None

    tokens = sum(int(r.get("completion_tokens") or 0) for r in ok)
    errors = sum(1 for r in rows if r.get("error"))
    return {"requests": len(rows), "errors": errors, "error_rate": errors / len(rows) if rows else None,
            # Aborted: the client went away or timed out (a load test stopping mid-request); not the model's fault.
            "aborted": sum(1 for r in rows if not r.get("error") and r.get("finish_reason") == "abort"),
            "e2e_mean": float(e2e.mean()) if e2e.size else None, "e2e_p50": pct(e2e, 50), "e2e_p95": pct(e2e, 95),
            "ttft_mean": float(ttft.mean()) if ttft.size else None, "ttft_p50": pct(ttft, 50),
            "ttft_p95": pct(ttft, 95), "completion_tokens": tokens, "rewarded": len(rewards),
            "reward_mean": float(np.mean(rewards)) if rewards else None}


def compare_reward(base: list[dict], cand: list[dict], alpha: float, n_boot: int, seed: int) -> dict | None:
    """Paired on shared prompts when there are at least 2, else unpaired over requests; None without rewards."""
    def by_prompt(rows: list[dict]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for r in rows:
            if r.get("reward") is not None and not r.get("error"):
                out.setdefault(r["prompt_id"], []).append(float(r["reward"]))
        return out

    a, b = by_prompt(base), by_prompt(cand)
    if not a or not b:
        return None
    shared = sorted(set(a) & set(b))
    if len(shared) >= 2:
        va = np.array([np.mean(a[p]) for p in shared])
        vb = np.array([np.mean(b[p]) for p in shared])
        test = paired_bootstrap(va, vb, n_boot, seed)
        result = {"pairing": "paired", "n": len(shared), "baseline": float(va.mean()), "candidate": float(vb.mean()),
                  **{k: test[k] for k in ("diff", "ci_low", "ci_high", "p_value")}, "test": "paired bootstrap"}
        binary = all(len(a[p]) == 1 and len(b[p]) == 1 for p in shared) and set(va) | set(vb) <= {0.0, 1.0}
        if binary:
            m = mcnemar(va, vb)
            result.update(mcnemar=m, p_value=m["p_value"], test=f"McNemar ({m['method']})")
    else:
        va = np.array([v for vs in a.values() for v in vs])
        vb = np.array([v for vs in b.values() for v in vs])
        test = unpaired_bootstrap(va, vb, n_boot, seed)
        result = {"pairing": "unpaired", "n": int(va.size + vb.size), "baseline": float(va.mean()),
                  "candidate": float(vb.mean()), **{k: test[k] for k in ("diff", "ci_low", "ci_high", "p_value")},
                  "test": "unpaired bootstrap"}
    result["verdict"] = _verdict(result, alpha, "better", "worse", higher_is_better=True)
    return result


def compare_latency(base: list[dict], cand: list[dict], field: str, alpha: float, n_boot: int, seed: int) -> dict:
    def values(rows: list[dict]) -> np.ndarray:
        return np.array([r[field] for r in rows if r.get(field) is not None and not r.get("error")
                         and r.get("finish_reason") != "abort"], dtype=np.float64)

    va, vb = values(base), values(cand)
    test = unpaired_bootstrap(va, vb, n_boot, seed)
    result = {"metric": field, "baseline": float(va.mean()) if va.size else None,
              "candidate": float(vb.mean()) if vb.size else None, **test, "test": "unpaired bootstrap"}
    result["verdict"] = _verdict(result, alpha, "faster", "slower", higher_is_better=False)
    return result


def compare_online(source: str, out: str | Path | None = None, baseline: str | None = None,
                   models: list[str] | None = None, alpha: float = 0.05, n_boot: int = 2000, seed: int = 0,
                   since: float | None = None, admin_key: str | None = None, reward_source: str | None = None) -> dict:
    """Build the online A/B report; writes it to ``out`` when given and returns it. ``reward_source`` picks the
    rewards compared (``rule``, ``feedback``, ``rm:NAME``, ``judge:NAME``; verl.data.records.source_matches); without
    it the records must hold one source only — sources are never mixed."""
    rows = [r for r in load_records(source, admin_key) if since is None or r.get("time", 0) >= since]
    if reward_source is None:
        sources = sorted({r["reward_source"] for r in rows if r.get("reward_source") and r.get("reward") is not None})
        if len(sources) > 1:
            raise ConfigError(f"{source} holds rewards from {len(sources)} sources ({', '.join(sources)}); they are "
                              "not comparable: pick one with --reward-source (e.g. rule, feedback, rm:NAME)")
        reward_source = sources[0] if sources else None
    rows = join_rewards(rows, reward_source)
    per_model: dict[str, list[dict]] = {}
    for r in rows:
        per_model.setdefault(r["model"], []).append(r)
    if models:
        missing = [m for m in models if m not in per_model]
        if missing:
            raise ConfigError(f"no records for model(s) {', '.join(missing)} in {source} (recorded: "
                              f"{', '.join(sorted(per_model)) or 'none'})")
        per_model = {m: per_model[m] for m in models}
    if len(per_model) < 2:
        raise ConfigError(f"{source} has records of {len(per_model)} model(s) ({', '.join(per_model) or 'none'}); "
                          "an A/B report needs two: send traffic to both (a route with weights on both)")
    if baseline is None:
        baseline = max(per_model, key=lambda m: len(per_model[m]))
    elif baseline not in per_model:
        raise ConfigError(f"--baseline {baseline}: no records (recorded: {', '.join(sorted(per_model))})")
    report = {"source": source, "reward_source": reward_source, "alpha": alpha, "baseline": baseline,
              "records": len(rows), "models": {m: model_summary(rs) for m, rs in per_model.items()}, "comparisons": []}
    for model, rs in per_model.items():
        if model == baseline:
            continue
        base = per_model[baseline]
        report["comparisons"].append({"baseline": baseline, "candidate": model,
                                      "reward": compare_reward(base, rs, alpha, n_boot, seed),
                                      "e2e": compare_latency(base, rs, "e2e_s", alpha, n_boot, seed),
                                      "ttft": compare_latency(base, rs, "ttft_s", alpha, n_boot, seed)})
    if out is not None:
        write_report(Path(out), report)
    return report


def write_report(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = Doc("verl compare --online — " + " vs ".join(report["models"]))
    doc.p(f"From {report['records']} service records ({report['source']}); rewards from "
          f"**{report.get('reward_source') or 'no source'}**. Baseline: **{report['baseline']}**; "
          f"differences are candidate − baseline; verdicts at α = {report['alpha']}. Reward is paired by prompt "
          "where both models answered the same prompts (McNemar for 0/1 outcomes), unpaired otherwise; latency "
          "is unpaired (bootstrap of the difference of means).")
    doc.h("Per model")
    doc.table(["model", "requests", "errors", "aborted", "reward (mean, n)", "e2e mean / p50 / p95 s",
               "TTFT mean / p95 s", "tokens"],
              [[m, s["requests"], s["errors"], s["aborted"], f"{fmt(s['reward_mean'])} ({s['rewarded']})",
                f"{fmt(s['e2e_mean'])} / {fmt(s['e2e_p50'])} / {fmt(s['e2e_p95'])}",
                f"{fmt(s['ttft_mean'])} / {fmt(s['ttft_p95'])}", s["completion_tokens"]]
               for m, s in report["models"].items()])
    for pair in report["comparisons"]:
        doc.h(f"{pair['candidate']} vs {pair['baseline']}")
        rows = []
        if pair["reward"] is not None:
            r = pair["reward"]
            rows.append(["reward", fmt(r["baseline"]), fmt(r["candidate"]), fmt(r["diff"]),
                         f"[{fmt(r['ci_low'])}, {fmt(r['ci_high'])}]", fmt(r["p_value"], 3),
                         f"{r['test']}, {r['pairing']}, n={r['n']}", r["verdict"]])
        for key, label in (("e2e", "e2e latency (s)"), ("ttft", "TTFT (s)")):
            r = pair[key]
            rows.append([label, fmt(r["baseline"]), fmt(r["candidate"]), fmt(r["diff"]),
                         f"[{fmt(r['ci_low'])}, {fmt(r['ci_high'])}]", fmt(r["p_value"], 3),
                         f"{r['test']}, n={r['n']}", r["verdict"]])
        doc.table(["metric", "baseline", "candidate", "diff", "95% CI", "p", "test", "verdict"], rows)
        if pair["reward"] is None:
            doc.p("No rewards recorded: send the `verl` extension field (ground_truth, reward) with requests to "
                  "compare reward online.")
    atomic_write_json(out_dir / "online.json", report)
    doc.write(out_dir)
