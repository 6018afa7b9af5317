"""``verl compare A B [C ...]``: paired A/B comparison of evaluated checkpoints, plus the runs' configs and curves.

Each argument is an eval result dir (``results.json`` + ``samples.jsonl``), a run dir (the checkpoint chosen by
``--ckpt best|latest|global_step_N`` is evaluated if it has no results yet) or a checkpoint dir. The first is
the baseline; every other one is compared with it.

Per metric, on the prompts both evaluations share (paired by prompt id, the hash of the prompt's content):

- both means and the difference (candidate − baseline);
- a paired 95% CI and p-value: bootstrap over prompts of the per-prompt differences (corpus metrics such as
  distinct-n are recomputed from the responses under the same resampling; the ones that count distinct items
  use a paired jackknife);
- McNemar's test when the per-prompt values are binary (n = 1 accuracy, maj@k): exact binomial when there are
  fewer than 25 discordant prompts, χ² otherwise; it decides the verdict for those metrics;
- the correlation of per-prompt scores (how much pairing helps);
- a verdict at ``alpha``: better / worse (metrics with a direction), higher / lower (the others), or no
  significant difference.

Then a config diff (only keys that differ), an experiment table (optimizer, lr, batch size, final reward, max KL
...), overlaid training curves and, with three or more runs, a hyper-parameter importance table (correlation
and permutation importance of each differing key against the chosen metric). Outputs: ``report.md``,
``report.html``, ``compare.json`` and PNGs in ``--out``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.text import Text

from eval import plots
from eval.pairwise import PairEvaluation, check_settings, rm_config_of
from eval.report import Doc, fmt, num, ordered_metrics, training_curves
from eval.results import DEFAULT_SELECT, load_results, load_samples, parse_select, sample_columns
from eval.runner import (
    EvalSettings,
    Evaluation,
    is_run_dir,
    load_run_config,
    resolve_settings,
    resolve_target,
    results_root,
    reward_model_checkpoint,
)
from eval.stats import mcnemar, paired_resample, pearson, permutation_importance
from verl.errors import CheckpointError, ConfigError, VerlError
from verl.evaluators import build_evaluator
from verl.trainer.checkpoint import list_checkpoints, read_pointer
from verl.trainer.rm import VALIDATION_METRIC
from verl.trainer.target import read_target
from verl.utils.fs import atomic_write_json, ensure_writable_dir

# A reward model's run (`verl rm`) logs the last two.
CURVE_METRICS = ["rollout/reward_mean", "eval/accuracy", "ppo/kl_div", "rollout/response_length_mean",
                 "eval/pairwise_accuracy", "train/loss"]
# Config keys that name a run rather than change it.
IGNORED_KEYS = {"trainer.experiment_name", "trainer.output_dir", "trainer.log_dir", "trainer.logger",
                "trainer.project_name", "trainer.resume"}


@dataclass
class Entry:
    """One side of a comparison: its evaluation results and samples, and the run they came from."""

    name: str
    eval_dir: Path
    results: dict
    samples: list[dict]
    run_dir: Path | None = None
    how: str = ""  # how the checkpoint was chosen
    curves: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- inputs


def choose_checkpoint(run_dir: Path, ckpt: str, select: str) -> tuple[Path, str]:
    """The checkpoint dir of ``run_dir`` that ``--ckpt`` names, and how it was chosen."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise CheckpointError(f"run '{run_dir}' has no complete checkpoints (checkpoints/global_step_N/meta.json)")
    if ckpt == "latest":
        return (read_pointer(run_dir) or checkpoints[-1][1]), "latest"
    if ckpt.startswith("global_step_"):
        for _, path in checkpoints:
            if path.name == ckpt:
                return path, ckpt
        raise CheckpointError(f"run '{run_dir}' has no checkpoint {ckpt}; it has "
                              f"{', '.join(p.name for _, p in checkpoints)}")
    if ckpt != "best":
        raise ConfigError(f"--ckpt '{ckpt}' must be best, latest or global_step_N")
    best_file = run_dir / "eval" / "best.json"
    if best_file.is_file():
        label = json.loads(best_file.read_text()).get("label")
        for _, path in checkpoints:
            if path.name == label:
                return path, f"best by verl eval ({best_file})"
    # No evaluation yet: the training log's validation metric saved with each checkpoint decides.
    metric, mode = parse_select(select)
    scored = []
    for step, path in checkpoints:
        meta = json.loads((path / "meta.json").read_text())
        value = meta.get("metrics", {}).get(metric)
        if isinstance(value, (int, float)):
            scored.append((value if mode == "max" else -value, -step, path))
    if scored:
        best = max(scored, key=lambda item: (item[0], item[1]))
        return best[2], f"best by training {metric}:{mode} (meta.json)"
    return checkpoints[-1][1], f"latest (no {metric} in meta.json to pick the best)"


def resolve_entry(spec: str, ckpt: str, settings: EvalSettings, console: Any) -> Entry:
    path = Path(spec).expanduser()
    if (path / "results.json").is_file():
        results = load_results(path)
        run_dir = Path(results["run_dir"]) if results.get("run_dir") else None
        return Entry(_entry_name(results, run_dir, path), path, results, load_samples(path), run_dir, "given")
    target = resolve_target(path) if path.is_dir() else None
    reward_model = target is not None and reward_model_checkpoint(target) is not None
    if is_run_dir(path):
        run_dir = path
        select = settings.select
        if reward_model and select == DEFAULT_SELECT:  # a `verl rm` run: its best is by pairwise accuracy
            select = VALIDATION_METRIC
        checkpoint, how = choose_checkpoint(run_dir, ckpt, select)
    elif path.is_dir() and (path / "config.json").is_file() and path.parent.name == "checkpoints":
        run_dir, checkpoint, how = path.parent.parent, path, "given"
    else:
        raise VerlError(f"'{spec}' is not an eval result dir (results.json), a run dir (config.yaml + checkpoints/) "
                        "or a checkpoint dir (<run>/checkpoints/global_step_N)")
    if reward_model:  # scored on preference pairs, not sampled (eval.pairwise)
        check_settings(settings, spec)
        evaluation = PairEvaluation(settings, *rm_config_of(run_dir), console)
        out_dir = evaluation.results_root(run_dir) / checkpoint.name
    else:
        run_cfg, raw, _ = load_run_config(run_dir if (run_dir / "config.yaml").is_file() else None)
        resolved = resolve_settings(settings, run_cfg, settings.reference)
        # Results under other data/sampling settings live in their own directory: an earlier evaluation is kept.
        out_dir = results_root(run_dir, resolved, run_cfg) / checkpoint.name
        evaluation = Evaluation(settings, resolved, run_cfg, raw, str(checkpoint), console)
    step = int(checkpoint.name.rsplit("_", 1)[-1]) if checkpoint.name.startswith("global_step_") else None
    results = evaluation.evaluate(str(checkpoint), out_dir, checkpoint.name, step, run_dir)
    return Entry(_entry_name(results, run_dir, out_dir), out_dir, results, load_samples(out_dir), run_dir, how)


def _entry_name(results: dict, run_dir: Path | None, path: Path) -> str:
    if run_dir is not None:
        return f"{run_dir.name}@{results.get('label')}"
    return path.name or str(path)


# ---------------------------------------------------------------------------------------------- pairing


def per_prompt(samples: list[dict], column: str) -> dict[str, float]:
    """``prompt_id -> mean of column`` over the prompt's samples (missing / null values skipped)."""
    sums: dict[str, list[float]] = {}
    for row in samples:
        value = row.get(column)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            sums.setdefault(row["prompt_id"], []).append(float(value))
    return {k: float(np.mean(v)) for k, v in sums.items()}


def _verdict(diff: float, p_value: float, alpha: float, higher_is_better: bool | None) -> str:
    if not math.isfinite(p_value) or p_value >= alpha or diff == 0:
        return "no significant difference"
    if higher_is_better is None:
        return "higher" if diff > 0 else "lower"
    return "better" if (diff > 0) == higher_is_better else "worse"


def compare_pair(base: Entry, cand: Entry, alpha: float, n_boot: int, seed: int,
                 bound_alpha: float | None = None) -> dict:
    """Every metric both evaluations report, paired by prompt id; ``bound_alpha``: each row also has its one-sided
    bounds at that level (``lower``, ``upper``; eval.stats.paired_resample)."""
    common = sorted(set(r["prompt_id"] for r in base.samples) & set(r["prompt_id"] for r in cand.samples))
    if not common:
        raise VerlError(f"{base.name} and {cand.name} share no prompts (prompt ids differ); evaluate both on the "
                        "same --data")
    rows: dict[str, dict] = {}
    # Prompts either side's training data holds (verl eval's contamination check): each metric again without them.
    dirty = {r["prompt_id"] for r in base.samples + cand.samples if r.get("contaminated")}
    names = ordered_metrics(set(base.results["metrics"]) & set(cand.results["metrics"]))
    corpus_groups: dict[str, list[str]] = {}
    for name in names:
        mb, mc = base.results["metrics"][name], cand.results["metrics"][name]
        if mb.get("aggregate") == "corpus":
            if mb.get("evaluator") != mc.get("evaluator"):
                continue  # computed with different options: not comparable
            corpus_groups.setdefault(mb["evaluator"], []).append(name)
            continue
        column = mb.get("column") or name.split("/", 1)[-1]
        a_map, b_map = per_prompt(base.samples, column), per_prompt(cand.samples, column)
        ids = [p for p in common if p in a_map and p in b_map]
        if not ids:
            continue
        a = np.array([a_map[p] for p in ids])
        b = np.array([b_map[p] for p in ids])
        diff = b - a

        def mean_diff(w: np.ndarray, diff: np.ndarray = diff) -> dict[str, float]:
            return {"d": float(np.average(diff, weights=w)) if w.sum() else float("nan")}

        test = paired_resample(mean_diff, len(ids), "bootstrap", n_boot, seed, bound_alpha=bound_alpha)["d"]
        row = _row(name, mb, float(a.mean()), float(b.mean()), test, len(ids), pearson(a, b))
        if mb.get("binary") and np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all():
            row["mcnemar"] = mcnemar(a, b)
            row["p_value"] = row["mcnemar"]["p_value"]
            row["test"] = f"McNemar ({row['mcnemar']['method']})"
        row["verdict"] = _verdict(row["diff"], row["p_value"], alpha, mb.get("higher_is_better"))
        clean = [k for k, p in enumerate(ids) if p not in dirty]
        if dirty and clean:
            row["clean"] = {"baseline": float(a[clean].mean()), "candidate": float(b[clean].mean()),
                            "diff": float(diff[clean].mean()), "n_prompts": len(clean)}
        rows[name] = row
    for spec, metric_names in corpus_groups.items():
        rows.update(_compare_corpus(spec, metric_names, base, cand, common, alpha, n_boot, seed, bound_alpha))
    ordered = {name: rows[name] for name in ordered_metrics(rows)}
    return {"baseline": base.name, "candidate": cand.name, "num_prompts": len(common), "alpha": alpha,
            "contaminated_prompts": len(dirty & set(common)), "metrics": ordered}


def _row(name: str, meta: dict, mean_a: float, mean_b: float, test: dict, n: int, corr: float) -> dict:
    bounds = {k: test[k] for k in ("lower", "upper", "bound_alpha", "replicates") if k in test}
    return {"metric": name, "baseline": mean_a, "candidate": mean_b, "diff": test["diff"],
            "ci_low": test["ci_low"], "ci_high": test["ci_high"], "se": test["se"], "p_value": test["p_value"],
            "test": f"paired {test['method']}", "n_prompts": n, "correlation": corr,
            "higher_is_better": meta.get("higher_is_better"), **bounds}


def _compare_corpus(spec: str, names: list[str], base: Entry, cand: Entry, common: list[str], alpha: float,
                    n_boot: int, seed: int, bound_alpha: float | None = None) -> dict[str, dict]:
    """Corpus metrics: recompute them from both sides' responses under the same resampling of shared prompts."""
    evaluator = build_evaluator(spec)
    unit = {p: i for i, p in enumerate(common)}

    def side(entry: Entry) -> tuple[Any, np.ndarray]:
        rows = [r for r in entry.samples if r["prompt_id"] in unit]
        state = evaluator.corpus_state([r["response"] for r in rows], sample_columns(rows))
        return state, np.array([unit[r["prompt_id"]] for r in rows])

    state_a, units_a = side(base)
    state_b, units_b = side(cand)

    def values(w_units: np.ndarray) -> tuple[dict, dict]:
        return (evaluator.corpus_values(state_a, w_units[units_a]), evaluator.corpus_values(state_b, w_units[units_b]))

    def diff_at(w_units: np.ndarray) -> dict[str, float]:
        va, vb = values(w_units)
        return {n: vb[n.split("/", 1)[-1]] - va[n.split("/", 1)[-1]] for n in names}

    method = getattr(evaluator, "corpus_resampling", "bootstrap")
    tests = paired_resample(diff_at, len(common), method, min(n_boot, 1000) if bound_alpha is None else n_boot, seed,
                            bound_alpha=bound_alpha)
    va, vb = values(np.ones(len(common), dtype=np.int64))
    rows = {}
    for name in names:
        key = name.split("/", 1)[-1]
        meta = base.results["metrics"][name]
        row = _row(name, meta, va[key], vb[key], tests[name], len(common), float("nan"))
        row["verdict"] = _verdict(row["diff"], row["p_value"], alpha, meta.get("higher_is_better"))
        rows[name] = row
    return rows


# ---------------------------------------------------------------------------------------------- runs


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def config_diff(entries: list[Entry]) -> dict[str, list[Any]]:
    """Dotted keys whose values differ between the entries' run configs (missing = None)."""
    flats = [flatten(e.results.get("config") or {}) for e in entries]
    keys = sorted(set().union(*flats) - IGNORED_KEYS)
    return {k: [f.get(k) for f in flats] for k in keys if len({repr(f.get(k)) for f in flats}) > 1}


def experiment_row(entry: Entry) -> dict[str, Any]:
    """One line of the experiment table, from the run's config and training log."""
    flat = flatten(entry.results.get("config") or {})
    curves = entry.curves

    def last(key: str) -> float | None:
        return curves[key][1][-1] if key in curves and curves[key][1] else None

    def extreme(key: str, fn) -> tuple[float | None, int | None]:
        if key not in curves or not curves[key][1]:
            return None, None
        steps, values = curves[key]
        i = int(fn(values))
        return values[i], steps[i]

    if flat.get("actor.use_kl_loss"):
        kl_coef = flat.get("actor.kl_loss_coef")
    elif flat.get("algorithm.use_kl_in_reward"):
        kl_coef = flat.get("algorithm.kl_ctrl.kl_coef")
    else:
        kl_coef = 0.0 if flat else None
    batch = flat.get("data.train_batch_size")
    n = flat.get("rollout.n")
    best_acc, best_step = extreme("eval/accuracy", np.argmax)
    max_kl, _ = extreme("ppo/kl_div", np.argmax)
    metrics = entry.results["metrics"]
    eval_metric = metrics.get("eval/accuracy") or metrics.get(VALIDATION_METRIC) or {}  # a policy's, a reward model's
    target = read_target(entry.run_dir) if entry.run_dir is not None else None
    if target is not None:
        time_to_target = f"{target['minutes']:.2f} min (step {target['step']})"
    else:
        time_to_target = "not reached" if flat.get("trainer.target") else None
    return {
        "run": entry.name,
        "algorithm": flat.get("algorithm.adv_estimator"),
        # The actor's optimizer is always AdamW (verl.workers.optim); weight decay is what varies.
        "optimizer": f"AdamW (wd {flat.get('actor.optim.weight_decay')})" if flat else None,
        "lr": flat.get("actor.optim.lr", flat.get("optim.lr")),  # a policy's run, a reward model's
        "batch": f"{batch}×{n}" if batch is not None else None,
        "kl_coef": kl_coef,
        "steps": curves["rollout/reward_mean"][0][-1] if "rollout/reward_mean" in curves else None,
        "final_reward": last("rollout/reward_mean"),
        "max_kl": max_kl,
        "final_train_accuracy": last("eval/accuracy"),
        "best_train_accuracy": best_acc,
        "best_train_step": best_step,
        "eval_accuracy": eval_metric.get("value"),
        "checkpoint": entry.results.get("label"),
        "target": flat.get("trainer.target"),
        "time_to_target": time_to_target,
    }


def importance_table(entries: list[Entry], diff: dict[str, list[Any]], metric: str) -> list[dict]:
    """Correlation and permutation importance of each differing config key against ``metric`` (>= 3 runs)."""
    target = np.array([num(e.results["metrics"].get(metric, {}).get("value")) for e in entries])
    if np.isnan(target).any():
        return []
    keys, columns = [], []
    for key, values in diff.items():
        if all(isinstance(v, (int, float)) for v in values):  # numbers and booleans
            column = [float(v) for v in values]
        else:  # categorical: codes in order of first appearance (indicative only)
            codes: dict[str, int] = {}
            column = [float(codes.setdefault(repr(v), len(codes))) for v in values]
        keys.append(key)
        columns.append(column)
    if not keys:
        return []
    features = np.array(columns).T
    importance = permutation_importance(features, target)
    total = float(np.sum(np.clip(importance, 0, None)))
    rows = []
    for j, key in enumerate(keys):
        rows.append({"key": key, "values": diff[key], "correlation": pearson(features[:, j], target),
                     "importance": float(importance[j]),
                     "importance_share": float(max(importance[j], 0.0) / total) if total > 0 else float("nan")})
    return sorted(rows, key=lambda r: -r["importance"])


# ---------------------------------------------------------------------------------------------- the command


def compare(paths: list[str], ckpt: str = "best", out: str | Path | None = None, alpha: float = 0.05,
            settings: EvalSettings | None = None, n_boot: int = 2000, seed: int = 0, console: Any = None) -> dict:
    if len(paths) < 2:
        raise ConfigError("verl compare needs at least two runs / checkpoints / eval dirs (the first is the baseline)")
    if not 0 < alpha < 1:
        raise ConfigError(f"--alpha must lie in (0, 1), got {alpha}")
    settings = settings or EvalSettings()
    entries = [resolve_entry(p, ckpt, settings, console) for p in paths]
    seen: dict[str, int] = {}
    for entry in entries:  # the same run twice (e.g. two seeds of one eval) still needs distinct labels
        seen[entry.name] = seen.get(entry.name, 0) + 1
        if seen[entry.name] > 1:
            entry.name = f"{entry.name}#{seen[entry.name]}"
        entry.curves = training_curves(entry.run_dir) if entry.run_dir else {}
    metric, _ = parse_select(settings.select)
    base = entries[0]
    pairs = [compare_pair(base, other, alpha, n_boot, seed) for other in entries[1:]]
    diff = config_diff(entries)
    experiments = [experiment_row(e) for e in entries]
    importance = importance_table(entries, diff, metric) if len(entries) >= 3 else []
    default_out = Path("outputs") / "compare" / _slug("-vs-".join(e.name for e in entries))
    out_dir = ensure_writable_dir(Path(out) if out is not None else default_out, "the compare report dir (--out)")
    report = {
        "schema": "verl-compare/1",
        "alpha": alpha,
        "n_bootstrap": n_boot,
        "seed": seed,
        "entries": [{"name": e.name, "eval_dir": str(e.eval_dir), "run_dir": str(e.run_dir) if e.run_dir else None,
                     "checkpoint": e.results.get("checkpoint"), "chosen": e.how,
                     "model_hash": e.results.get("model_hash"), "sampling": e.results.get("sampling"),
                     "settings_fingerprint": e.results.get("settings_fingerprint")}
                    for e in entries],
        "comparisons": pairs,
        "config_diff": diff,
        "experiments": experiments,
        "importance": {"metric": metric, "rows": importance} if importance else None,
    }
    _write(out_dir, report, entries)
    if console is not None and not settings.quiet:
        for pair in pairs:
            console.print(Text.assemble((f"{pair['candidate']} vs {pair['baseline']}", "bold"),
                                        f" ({pair['num_prompts']} prompts)"),
                          highlight=False)
            for row in list(pair["metrics"].values())[:6]:
                console.print(f"  {row['metric']}: {fmt(row['baseline'])} -> {fmt(row['candidate'])} "
                              f"(diff {fmt(row['diff'])}, 95% CI [{fmt(row['ci_low'])}, {fmt(row['ci_high'])}], "
                              f"p={fmt(row['p_value'], 3)}): {row['verdict']}", highlight=False)
        console.print(f"report: {out_dir / 'report.md'}", highlight=False)
    return report


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:150]


def _write(out_dir: Path, report: dict, entries: list[Entry]) -> None:
    doc = Doc("verl compare — " + " vs ".join(e.name for e in entries))
    doc.p(f"Baseline: **{entries[0].name}**. Paired by prompt; differences are candidate − baseline; "
          f"verdicts at α = {report['alpha']} (McNemar for binary per-prompt outcomes, paired bootstrap otherwise; "
          "distinct-n / entropy: paired jackknife). McNemar wins/losses: prompts only the candidate / only the "
          "baseline got right.")
    doc.h("Evaluations")
    doc.table(["name", "checkpoint", "chosen", "n", "temperature", "seed", "model hash"],
              [[e["name"], e["checkpoint"], e["chosen"], (e["sampling"] or {}).get("n"),
                (e["sampling"] or {}).get("temperature"), (e["sampling"] or {}).get("seed"), e["model_hash"]]
               for e in report["entries"]])
    if len({json_key(e["sampling"]) for e in report["entries"]}) > 1:
        doc.p("Note: the evaluations used different sampling settings; differences mix model and setting effects.")
    for pair in report["comparisons"]:
        doc.h(f"{pair['candidate']} vs {pair['baseline']} ({pair['num_prompts']} shared prompts)")
        rows = []
        for row in pair["metrics"].values():
            test = row["test"]
            if "mcnemar" in row:
                m = row["mcnemar"]
                test += f", wins/losses = {m['n01']}/{m['n10']}"
            rows.append([row["metric"], fmt(row["baseline"]), fmt(row["candidate"]), fmt(row["diff"]),
                         f"[{fmt(row['ci_low'])}, {fmt(row['ci_high'])}]", fmt(row["p_value"], 3), test,
                         fmt(row["correlation"], 3), row["verdict"]])
        doc.table(["metric", "baseline", "candidate", "diff", "95% CI (paired)", "p", "test", "corr", "verdict"], rows)
        if pair.get("contaminated_prompts"):
            doc.p(f"Contamination: {pair['contaminated_prompts']} of the {pair['num_prompts']} shared prompts overlap "
                  "a run's training data (verl eval's check). On the clean prompts alone:")
            doc.table(["metric", "baseline", "candidate", "diff", "clean prompts"],
                      [[r["metric"], fmt(r["clean"]["baseline"]), fmt(r["clean"]["candidate"]),
                        fmt(r["clean"]["diff"]), r["clean"]["n_prompts"]]
                       for r in pair["metrics"].values() if "clean" in r])
        forest = [(r["metric"][5:], r["diff"], r["ci_low"], r["ci_high"]) for r in pair["metrics"].values()
                  if r.get("higher_is_better") is True]
        name = _slug(pair["candidate"])
        doc.img(plots.difference_forest(forest, out_dir / f"compare_diffs_{name}.png",
                                        f"{pair['candidate']} − {pair['baseline']}"),
                f"paired differences with 95% CIs: {pair['candidate']} − {pair['baseline']}")
    doc.h("Config diff")
    if report["config_diff"]:
        doc.table(["key", *[e.name for e in entries]], [[k, *[_short(v) for v in vals]]
                                                        for k, vals in report["config_diff"].items()])
    else:
        doc.p("The run configs are identical (or not available).")
    doc.h("Experiments")
    cols = ["run", "algorithm", "optimizer", "lr", "batch", "kl_coef", "steps", "final_reward", "max_kl",
            "final_train_accuracy", "best_train_accuracy", "best_train_step", "eval_accuracy"]
    if any(r.get("target") for r in report["experiments"]):
        cols += ["target", "time_to_target"]
    doc.table(cols, [[r.get(c) for c in cols] for r in report["experiments"]])
    doc.p("final_reward / max_kl: last `rollout/reward_mean` and largest `ppo/kl_div` in the training log; "
          "train accuracy: the trainer's `eval/accuracy`; eval_accuracy: this comparison's evaluation."
          + (" time_to_target: training wall time to the update of the first step that reached `trainer.target` "
             "(validation excluded)." if "target" in cols else ""))
    # Training curves belong to runs, not checkpoints: label them by run name.
    runs = {(e.run_dir.name if e.run_dir else e.name): e.curves for e in entries if e.curves}
    if runs:
        doc.img(plots.overlaid_curves(runs, CURVE_METRICS, out_dir / "compare_curves.png", "training curves"),
                "training curves, overlaid")
    points = {}
    for e in entries:
        kl, reward = e.results["metrics"].get("eval/kl_exact"), e.results["metrics"].get("eval/reward_mean")
        if kl and reward and kl.get("value") is not None and reward.get("value") is not None:
            points[e.name] = (kl["value"], 1.96 * num(kl.get("se")), reward["value"], 1.96 * num(reward.get("se")))
    doc.img(plots.tradeoff_points(points, out_dir / "compare_tradeoff.png"), "reward / KL trade-off per run")
    if report["importance"]:
        doc.h(f"Hyper-parameter importance for {report['importance']['metric']}")
        doc.table(["key", "values", "correlation", "permutation importance (ΔMSE)", "share"],
                  [[r["key"], ", ".join(_short(v) for v in r["values"]), fmt(r["correlation"], 3),
                    fmt(r["importance"], 3), fmt(r["importance_share"], 3)] for r in report["importance"]["rows"]])
        doc.p(f"From {len(entries)} runs: a ridge fit on the differing keys, each key's column shuffled 50 times. "
              "With this few runs the ranking is a hint, not a finding.")
    if plots._pyplot() is None:
        doc.p(plots.INSTALL_HINT)
    atomic_write_json(out_dir / "compare.json", report)
    doc.write(out_dir)


def json_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _short(value: Any) -> str:
    text = json_key(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."
