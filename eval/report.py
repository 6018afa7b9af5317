"""Markdown and HTML reports for ``verl eval`` (one checkpoint or a whole run) and ``verl compare``.

A report is a list of blocks (heading, paragraph, table, image, list) rendered twice, so ``report.md`` and
``report.html`` always say the same thing. The HTML is self-contained apart from the PNGs beside it.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval import plots
from eval.contamination import line as contamination_line
from verl.utils.fs import atomic_write_text
from verl.utils.log import read_jsonl

# Metrics shown first (in this order) in tables and plots; the rest follow alphabetically.
MAIN_METRICS = ("eval/accuracy", "eval/accuracy_flexible", "eval/reward_mean", "eval/kl_exact", "eval/kl_k1",
                "eval/kl_k3", "eval/response_length_mean", "eval/distinct_1", "eval/distinct_2", "eval/self_bleu",
                "eval/pairwise_accuracy", "eval/margin", "eval/loss")


# The run-dir table and metric-vs-step plot show these (when present).
RUN_TABLE_METRICS = ("eval/accuracy", "eval/accuracy_flexible", "eval/reward_mean", "eval/kl_exact",
                     "eval/response_length_mean", "eval/distinct_1", "eval/pairwise_accuracy", "eval/margin")


@dataclass
class Doc:
    title: str
    blocks: list[tuple] = field(default_factory=list)

    def h(self, text: str, level: int = 2) -> None:
        self.blocks.append(("h", level, text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def ul(self, items: list[str]) -> None:
        if items:
            self.blocks.append(("ul", items))

    def table(self, headers: list[str], rows: list[list[Any]]) -> None:
        self.blocks.append(("table", headers, rows))

    def pre(self, text: str) -> None:
        """Preformatted text (a trajectory, a log excerpt), shown as written."""
        self.blocks.append(("pre", text))

    def img(self, path: Path | None, alt: str) -> None:
        if path is not None:
            self.blocks.append(("img", Path(path).name, alt))

    def markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for block in self.blocks:
            kind = block[0]
            if kind == "h":
                out += ["#" * block[1] + " " + block[2], ""]
            elif kind == "p":
                out += [block[1], ""]
            elif kind == "ul":
                out += [f"- {item}" for item in block[1]] + [""]
            elif kind == "table":
                headers, rows = block[1], block[2]
                out.append("| " + " | ".join(headers) + " |")
                out.append("|" + "|".join("---" for _ in headers) + "|")
                for row in rows:
                    out.append("| " + " | ".join(_md_cell(c) for c in row) + " |")
                out.append("")
            elif kind == "pre":
                out += ["```text", block[1].replace("```", "ʼʼʼ"), "```", ""]
            elif kind == "img":
                out += [f"![{block[2]}]({block[1]})", ""]
        return "\n".join(out)

    def html(self) -> str:
        parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>",
                 f"<style>{_CSS}</style></head><body>", f"<h1>{html.escape(self.title)}</h1>"]
        for block in self.blocks:
            kind = block[0]
            if kind == "h":
                parts.append(f"<h{block[1]}>{html.escape(block[2])}</h{block[1]}>")
            elif kind == "p":
                parts.append(f"<p>{_inline(block[1])}</p>")
            elif kind == "ul":
                parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in block[1]) + "</ul>")
            elif kind == "table":
                head = "".join(f"<th>{html.escape(str(h))}</th>" for h in block[1])
                body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(c))}</td>" for c in row) + "</tr>"
                               for row in block[2])
                parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            elif kind == "pre":
                parts.append(f"<pre>{html.escape(block[1])}</pre>")
            elif kind == "img":
                parts.append(f"<figure><img src='{html.escape(block[1])}' alt='{html.escape(block[2])}'>"
                             f"<figcaption>{html.escape(block[2])}</figcaption></figure>")
        parts.append("</body></html>")
        return "\n".join(parts)

    def write(self, out_dir: Path, stem: str = "report") -> tuple[Path, Path]:
        md = atomic_write_text(out_dir / f"{stem}.md", self.markdown())
        page = atomic_write_text(out_dir / f"{stem}.html", self.html())
        return md, page


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}th,td{border:1px solid #ccc;padding:4px 8px;"
        "text-align:left;vertical-align:top}th{background:#f3f3f3}code{background:#f3f3f3;padding:0 3px}"
        "img{max-width:100%}figure{margin:1em 0}figcaption{color:#666;font-size:0.85em}")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return fmt(value)
    return "" if value is None else str(value)


def _md_cell(value: Any) -> str:
    return _cell(value).replace("|", "\\|").replace("\n", " ")


def _inline(text: str) -> str:
    """Escape, then turn `code` spans into <code> and **bold** into <b> (the Markdown the reports use)."""
    pieces = html.escape(text).split("`")
    out = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, (int,)) and not isinstance(value, bool):
        return str(value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(v):
        return "–"
    return f"{v + 0.0:.{digits}g}" if v != 0 else "0"  # no "-0"


def value_ci(metric: dict | None) -> str:
    """A table cell: the metric's value and its 95% CI (``–`` when the metric is missing)."""
    return "–" if metric is None else f"{fmt(metric.get('value'))} {fmt_ci(metric)}"


def fmt_ci(metric: dict) -> str:
    low, high = metric.get("ci_low"), metric.get("ci_high")
    return "–" if low is None or high is None else f"[{fmt(low)}, {fmt(high)}]"


def ordered_metrics(names: list[str] | set[str]) -> list[str]:
    names = set(names)
    return [m for m in MAIN_METRICS if m in names] + sorted(names - set(MAIN_METRICS))


def metrics_table(doc: Doc, metrics: dict[str, dict]) -> None:
    rows = []
    for name in ordered_metrics(metrics):
        m = metrics[name]
        rows.append([name, fmt(m.get("value")), fmt(m.get("se"), 2), fmt_ci(m), m.get("n"), m.get("method")])
    doc.table(["metric", "value", "SE", "95% CI", "n", "SE method"], rows)


def headline_metrics(groups: dict[str, Any], limit: int = 4) -> list[str]:
    """The metrics a per-group table shows: the main ones first (accuracy, reward, ...), at most ``limit``."""
    names = set().union(*(set(g["metrics"]) for g in groups["values"].values())) if groups["values"] else set()
    return ordered_metrics(names)[:limit]


def groups_table(doc: Doc, groups: dict[str, Any]) -> None:
    """``verl eval --group-by``: a row per group, each headline metric as value and 95% CI."""
    names = headline_metrics(groups)
    doc.h(f"Per {groups['by']}")
    rows = [[group, entry["num_prompts"], entry["num_samples"], *[value_ci(entry["metrics"].get(n)) for n in names]]
            for group, entry in groups["values"].items()]
    doc.table([groups["by"], "prompts", "samples", *[f"{n} [95% CI]" for n in names]], rows)
    doc.p("Every metric of every group, with its SE and CI: `results.json` (`groups`).")


# ---------------------------------------------------------------------------------------------- one checkpoint


def write_checkpoint_report(out_dir: Path, results: dict, samples: list[dict]) -> None:
    doc = Doc(f"verl eval — {results['label']}")
    s, d = results["sampling"], results["data"]
    doc.p(f"Checkpoint `{results['checkpoint']}` (model hash `{results['model_hash']}`"
          + (f", step {results['step']}" if results.get("step") is not None else "") + ").")
    doc.p(f"{d['num_prompts']} prompts from {', '.join(f'`{f}`' for f in d['files'])}, n={s['n']} per prompt "
          f"({d['num_samples']} responses); temperature={s['temperature']}"
          f"{' (greedy)' if s['greedy'] else ''}, top_p={s['top_p']}, top_k={s['top_k']}, "
          f"max_new_tokens={s['max_new_tokens']}, seed={s['seed']}, engine={s['engine']}. "
          f"Evaluators: {', '.join(f'`{e}`' for e in results['evaluators'])}"
          + (f"; reference `{results['reference']}`" if results.get("reference") else "") + ".")
    doc.h("Metrics")
    metrics_table(doc, results["metrics"])
    contamination = results.get("contamination")
    if contamination:
        doc.p(contamination_line(contamination))
        if contamination["overlapping"]:
            doc.table(["metric", "all prompts", "clean prompts", "n clean"],
                      [[name, fmt(results["metrics"][name].get("value")), fmt(c["value"]), c["n"]]
                       for name, c in contamination["clean"].items() if name in results["metrics"]])
    if results.get("groups"):
        groups_table(doc, results["groups"])
    doc.p("SE: standard error — `mean`: s/√n; `cluster`: clustered by prompt (n > 1 samples per prompt); "
          "`bootstrap`: resampling prompts (CI = 2.5/97.5 percentiles); `jackknife`: delete-a-group over prompts "
          "(for distinct-n and entropy, which a bootstrap biases). Otherwise 95% CI = value ± 1.96·SE, clipped to "
          "[0, 1] for proportions.")
    doc.ul(results.get("notes", []))
    t = results["timing"]
    doc.p(f"Generation {fmt(t['generation_seconds'], 3)} s ({fmt(t['samples_per_second'], 4)} samples/s), "
          f"KL {fmt(t['kl_seconds'], 3)} s, evaluators {fmt(t['evaluator_seconds'], 3)} s, "
          f"total {fmt(t['total_seconds'], 3)} s on {results['device']}.")
    lengths = [r["response_length"] for r in samples]
    doc.h("Plots")
    doc.img(plots.length_histogram(lengths, s["max_new_tokens"], out_dir / "length_hist.png",
                                   f"response length — {results['label']}"), "response length histogram")
    if samples and all(r.get("kl_exact") is not None and r.get("reward") is not None for r in samples):
        doc.img(plots.reward_kl_scatter([r["reward"] for r in samples], [r["kl_exact"] for r in samples],
                                        out_dir / "reward_kl.png", f"reward vs KL — {results['label']}"),
                "reward vs KL per response")
    if plots._pyplot() is None:
        doc.p(plots.INSTALL_HINT)
    doc.h("Samples")
    columns = [c for c in ("reward", "accuracy", "accuracy_flexible", "kl_exact") if samples and c in samples[0]]
    rows = [[r["prompt"][-60:], r["response"][:80], r["ground_truth"], *[fmt(r.get(c)) for c in columns]]
            for r in samples[:10]]
    doc.table(["prompt (end)", "response", "ground truth", *columns], rows)
    if samples and "tool_trace" in samples[0]:
        trajectories_section(doc, samples)
    doc.p("Every response with every per-sample value: `samples.jsonl`; all numbers: `results.json`.")
    doc.write(out_dir)


def write_tool_report(out_dir: Path, results: dict, samples: list[dict], tool: str, description: str,
                      stderr_key: str, limit: int = 10) -> None:
    """The report of a task another tool ran and scored (``--lm-eval-task``: eval/lm_eval_tasks.py;
    ``--inspect-task``: eval/inspect_tasks.py): what ran, every metric with the tool's stderr beside ours, and the
    first samples."""
    doc = Doc(f"verl eval — {tool} tasks, {results['label']}")
    doc.p(f"Checkpoint `{results['checkpoint']}` (model hash `{results['model_hash']}`): {description} "
          f"({results['data']['num_samples']} samples).")
    doc.h("Metrics")
    rows = [[name, fmt(m.get("value")), fmt(m.get(stderr_key), 2), fmt(m.get("se"), 2), fmt_ci(m), m.get("n")]
            for name, m in results["metrics"].items()]
    doc.table(["metric", "value", f"{tool} stderr", "SE", "95% CI", "n"], rows)
    doc.p(f"Value and stderr are {tool}'s own; SE and CI are ours from the per-sample values (mean metrics), else "
          f"{tool}'s stderr × 1.96. `verl compare` pairs the samples of mean metrics.")
    contamination = results.get("contamination")
    if contamination:
        doc.p(contamination_line(contamination))
    doc.h("Samples")
    doc.table(["task", "sample", "input (end)", "response", "target"],
              [[r["task"], r["prompt_id"].split(":")[2], r["prompt"][-60:], str(r["response"])[:80],
                str(r["ground_truth"])[:40]] for r in samples[:limit]])
    doc.p("Every sample with every per-sample value: `samples.jsonl`; all numbers: `results.json`.")
    doc.write(out_dir)


def write_pair_report(out_dir: Path, results: dict, samples: list[dict], limit: int = 10) -> None:
    """A reward model's report (``eval.pairwise``): what was scored, the metrics, and the pairs it ranks worst."""
    doc = Doc(f"verl eval — reward model {results['label']}")
    d = results["data"]
    doc.p(f"Reward model `{results['checkpoint']}` (model hash `{results['model_hash']}`"
          + (f", step {results['step']}" if results.get("step") is not None else "")
          + f") on {d['num_pairs']} preference pairs from {', '.join(f'`{f}`' for f in d['files'])} "
          f"(max_length {d['max_length']} tokens a side).")
    doc.h("Metrics")
    metrics_table(doc, results["metrics"])
    doc.p("pairwise_accuracy: share of pairs scored r(chosen) > r(rejected), ties wrong; margin: mean "
          "r(chosen) − r(rejected); loss: Bradley–Terry −log σ(margin). SE over pairs; 95% CI = value ± 1.96·SE "
          "(clipped to [0, 1] for the accuracy).")
    doc.ul(results.get("notes", []))
    t = results["timing"]
    doc.p(f"Scoring {fmt(t['scoring_seconds'], 3)} s ({fmt(t['pairs_per_second'], 4)} pairs/s), total "
          f"{fmt(t['total_seconds'], 3)} s on {results['device']}.")
    doc.h("Pairs ranked worst")
    worst = sorted(samples, key=lambda r: r["margin"])[:limit]
    doc.table(["prompt (end)", "chosen", "rejected", "r(chosen)", "r(rejected)", "margin"],
              [[r["prompt"][-60:], r["chosen"][:60], r["rejected"][:60], fmt(r["reward_chosen"]),
                fmt(r["reward_rejected"]), fmt(r["margin"])] for r in worst])
    doc.p("Every pair with its scores: `samples.jsonl`; all numbers: `results.json`.")
    doc.write(out_dir)


def trajectories_section(doc: Doc, samples: list[dict], limit: int = 6) -> None:
    """Whole agent trajectories, readable: the question, the text of every turn (tool results included), then each
    call with its arguments and result; those with tool calls first."""
    doc.h("Trajectories")
    ranked = sorted(samples, key=lambda r: (not r["tool_trace"], -(r.get("reward") or 0.0)))
    for row in ranked[:limit]:
        lines = [f"prompt (end): {row['prompt'][-80:]}", f"trajectory: {row['response']}", ""]
        for number, call in enumerate(row["tool_trace"], start=1):
            arguments = json.dumps(call.get("arguments"), ensure_ascii=False)
            lines.append(f"call {number} (turn {call.get('turn')}): {call.get('name') or '?'}({arguments}) -> "
                         f"{call['result'] if call.get('result') is not None else call.get('error')}")
        lines.append(f"turns {row['turns']}, finish {row['finish_reason']}, reward {fmt(row.get('reward'))}, "
                     f"ground truth {row['ground_truth']}")
        doc.pre("\n".join(lines))


# ---------------------------------------------------------------------------------------------- a run dir


def training_curves(run_dir: Path, keys: list[str] | None = None) -> dict[str, tuple[list[int], list[float]]]:
    """``scope/name -> (steps, values)`` from ``verl_logs.jsonl`` (numeric INFO rows; the last value per step)."""
    path = Path(run_dir) / "verl_logs.jsonl"
    if not path.is_file():
        return {}
    per_key: dict[str, dict[int, float]] = {}
    skip = {"timestamp", "level", "scope", "step"}
    for row in read_jsonl(path):
        scope, step = row.get("scope"), row.get("step")
        if row.get("level", "INFO") != "INFO" or scope in ("sample", "alert") or not isinstance(step, int):
            continue
        for name, value in row.items():
            if name in skip or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            key = f"{scope}/{name}"
            if keys is None or key in keys:
                per_key.setdefault(key, {})[step] = float(value)
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in per_key.items()}


def write_run_report(out_dir: Path, summary: dict, run_dir: Path) -> None:
    checkpoints = summary["checkpoints"]
    best = summary["best"]
    doc = Doc(f"verl eval — run {Path(run_dir).name}")
    s = summary["sampling"]
    scored_on = (f"n={s['n']} per prompt, temperature={s['temperature']}, seed={s['seed']}" if s is not None else
                 f"a reward model scored on {summary['data']['num_pairs']} preference pairs")
    if best is None:
        doc.p(f"Run `{run_dir}`: {len(checkpoints)} checkpoints, {scored_on}. No best checkpoint: these evaluators "
              f"give no `{summary['select']['metric']}`; `--select METRIC:max|min` ranks by one they give.")
    else:
        doc.p(f"Run `{run_dir}`: {len(checkpoints)} checkpoints, {scored_on}. Best by "
              f"`{best['metric']}:{best['mode']}`: **{best['label']}** ({fmt(best['value'])}, 95% CI "
              f"[{fmt(best['ci95'][0])}, {fmt(best['ci95'][1])}]) — written to `best.json`.")
    names = ordered_metrics(set().union(*(c["metrics"] for c in checkpoints)))
    preferred = [n for n in RUN_TABLE_METRICS if n in names]
    shown = preferred or names[:6]
    rows = [[c["label"] + (" ★" if best and c["label"] == best["label"] else ""), c["step"],
             *[value_ci(c["metrics"].get(name)) for name in shown]] for c in checkpoints]
    doc.h("Checkpoints")
    doc.table(["checkpoint", "step", *[f"{n[5:]} [95% CI]" for n in shown]], rows)
    doc.p("Each checkpoint's full report: `<checkpoint>/report.md`.")
    series = {}
    for name in shown:
        pts = [(c["step"], c["metrics"][name]) for c in checkpoints if name in c["metrics"] and c["step"] is not None]
        if pts:
            series[name] = ([p[0] for p in pts], [num(p[1].get("value")) for p in pts],
                            [num(p[1].get("ci_low")) for p in pts], [num(p[1].get("ci_high")) for p in pts])
    training = training_curves(run_dir, list(series))
    doc.h("Plots")
    doc.img(plots.metric_vs_step(series, training, out_dir / "metrics_vs_step.png", f"run {Path(run_dir).name}"),
            "metrics vs step (verl eval with 95% CI; training log dashed)")
    points = {}
    for c in checkpoints:
        kl, reward = c["metrics"].get("eval/kl_exact"), c["metrics"].get("eval/reward_mean")
        if kl and reward and kl.get("value") is not None and reward.get("value") is not None:
            points[c["label"]] = (num(kl["value"]), 1.96 * num(kl.get("se")), num(reward["value"]),
                                  1.96 * num(reward.get("se")))
    doc.img(plots.tradeoff_points(points, out_dir / "reward_kl_tradeoff.png", "reward / KL trade-off by checkpoint"),
            "reward / KL trade-off by checkpoint")
    if plots._pyplot() is None:
        doc.p(plots.INSTALL_HINT)
    doc.write(out_dir)


def num(value: Any) -> float:
    """A metric's value as a float; None (not computed) as NaN, which plots leave out."""
    return float("nan") if value is None else float(value)
