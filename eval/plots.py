"""Matplotlib PNGs for eval and compare reports (Agg backend; matplotlib is imported only here, lazily).

Every function writes one PNG and returns its path, or None when matplotlib is missing (the report then says
how to install it; nothing else fails).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from verl.utils.fs import atomic_path

INSTALL_HINT = "plots need matplotlib: pip install matplotlib (or, in a checkout: pip install -e '.[eval]')"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _integer_locator():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def length_histogram(lengths: Sequence[float], max_new_tokens: int, path: Path, title: str = "") -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    values = np.asarray(lengths, dtype=float)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    bins = np.arange(0, max(int(values.max(initial=0)), max_new_tokens) + 2) - 0.5
    ax.hist(values, bins=bins, color="#4C72B0", edgecolor="white")
    ax.axvline(max_new_tokens, color="#C44E52", linestyle="--", label=f"max_new_tokens={max_new_tokens}")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("responses")
    ax.set_title(title or "response length")
    ax.legend(frameon=False, fontsize=8)
    return _save(fig, path)


def reward_kl_scatter(rewards: Sequence[float], kls: Sequence[float], path: Path, title: str = "") -> Path | None:
    """Per response: KL to the reference (x) against reward (y)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    rng = np.random.default_rng(0)
    y = np.asarray(rewards, dtype=float)
    jitter = (rng.random(y.size) - 0.5) * 0.04 * max(np.ptp(y), 1e-9)  # binary rewards would overplot
    ax.scatter(np.asarray(kls, dtype=float), y + jitter, s=10, alpha=0.5, color="#4C72B0")
    ax.set_xlabel("KL(policy || reference) per response (nats)")
    ax.set_ylabel("reward")
    ax.set_title(title or "reward / KL trade-off")
    return _save(fig, path)


def tradeoff_points(points: dict[str, tuple[float, float, float, float]], path: Path, title: str = "") -> Path | None:
    """One point per checkpoint or run: ``label -> (kl, kl_half_ci, reward, reward_half_ci)``."""
    plt = _pyplot()
    if plt is None or not points:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, (kl, kl_err, reward, reward_err) in points.items():
        ax.errorbar([kl], [reward], xerr=[[kl_err]] if np.isfinite(kl_err) else None,
                    yerr=[[reward_err]] if np.isfinite(reward_err) else None, fmt="o", capsize=3, label=label)
    ax.set_xlabel("KL to reference (nats / response)")
    ax.set_ylabel("reward (mean, 95% CI)")
    ax.set_title(title or "reward / KL trade-off")
    ax.legend(frameon=False, fontsize=7, loc="best")
    return _save(fig, path)


def metric_vs_step(series: dict[str, tuple[list[int], list[float], list[float], list[float]]],
                   training: dict[str, tuple[list[int], list[float]]], path: Path, title: str = "") -> Path | None:
    """``series``: metric -> (steps, values, ci_low, ci_high) from verl eval; ``training``: metric -> (steps,
    values) from verl_logs.jsonl, drawn dashed on the same axes."""
    plt = _pyplot()
    if plt is None or not series:
        return None
    names = list(series)
    cols = min(2, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        steps, values, low, high = (np.asarray(v, dtype=float) for v in series[name])
        ax.plot(steps, values, "o-", color="#4C72B0", label="verl eval")
        ok = np.isfinite(low) & np.isfinite(high)
        if ok.any():
            ax.fill_between(steps[ok], low[ok], high[ok], color="#4C72B0", alpha=0.2, label="95% CI")
        if name in training:
            t_steps, t_values = training[name]
            ax.plot(t_steps, t_values, "--", color="#DD8452", label="training log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(_integer_locator())
        ax.legend(frameon=False, fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def overlaid_curves(runs: dict[str, dict[str, tuple[list[int], list[float]]]], metrics: list[str], path: Path,
                    title: str = "") -> Path | None:
    """Training curves of several runs: run -> metric -> (steps, values); one panel per metric."""
    plt = _pyplot()
    present = [m for m in metrics if any(m in curves for curves in runs.values())]
    if plt is None or not present:
        return None
    cols = min(2, len(present))
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.0 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, present, strict=False):
        for run, curves in runs.items():
            if metric in curves:
                steps, values = curves[metric]
                ax.plot(steps, values, "-", marker="." if len(steps) < 30 else None, label=run)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(_integer_locator())
        ax.legend(frameon=False, fontsize=7)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def difference_forest(rows: list[tuple[str, float, float, float]], path: Path, title: str = "") -> Path | None:
    """Paired differences with 95% CIs: (label, diff, ci_low, ci_high); a CI off zero is a significant change."""
    plt = _pyplot()
    rows = [r for r in rows if all(np.isfinite(v) for v in r[1:])]
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.0, 0.45 * len(rows) + 1.2))
    y = np.arange(len(rows))[::-1]
    for yi, (_, diff, low, high) in zip(y, rows, strict=True):
        color = "#55A868" if low > 0 else "#C44E52" if high < 0 else "#8C8C8C"
        ax.errorbar([diff], [yi], xerr=[[diff - low], [high - diff]], fmt="o", color=color, capsize=3)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.set_xlabel("difference (candidate − baseline), paired bootstrap 95% CI")
    ax.set_title(title or "paired differences", fontsize=10)
    return _save(fig, path)
