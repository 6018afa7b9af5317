"""``verl ship RUN --service URL --route R``: offline gates, a canary with a sequential test, then promote or roll
back, every decision in an append-only audit log and a ship report (see ``eval.ship.gates`` and
``eval.ship.canary`` for the stages and the statistics, docs/shipping.md for the whole loop).

The candidate is the run's best checkpoint (or ``--ckpt``); it is loaded into the service as a LoRA adapter over
the served base model when it is one, else from its export. The incumbent is the model with the largest share of
the route now. Nothing changes in the service before the offline gates pass; a refused or rolled-back candidate is
unloaded and the route's weights are put back as they were; a promoted one gets the whole route, and the incumbent
stays loaded (warm) so that one ``verl promote --model INCUMBENT`` undoes it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eval.ship.canary import Canary, describe_reward, settings_dict
from eval.ship.gates import Gate, capacity_gate, guardrail_gate, quality_gate, training_trend, tripwire_gate
from eval.ship.settings import ShipSettings
from serve.promote import ADMIN_KEY_ENV, AdminClient, PromoteError, new_weights
from verl.errors import ConfigError, VerlError

EXIT_PROMOTED, EXIT_NOT_PROMOTED = 0, 10


class AuditLog:
    """Append-only JSONL: one line per decision, flushed and fsynced before the next action."""

    def __init__(self, path: Path, ship_id: str):
        self.path, self.ship_id = path, ship_id
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, event: dict) -> dict:
        row = {"time": time.time(), "ship_id": self.ship_id, **event}
        with self.path.open("a") as handle:
            handle.write(json.dumps(row, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return row


def _candidate(settings: ShipSettings) -> tuple[Path, int | None, Path]:
    from serve.export import select_checkpoint  # noqa: PLC0415  (torch-heavy)

    run = Path(settings.run).expanduser()
    if settings.ckpt:
        ckpt = Path(settings.ckpt).expanduser()
        if not ckpt.is_dir():
            raise ConfigError(f"--ckpt '{ckpt}' is not a checkpoint directory")
        step = int(ckpt.name.rsplit("_", 1)[-1]) if ckpt.name.startswith("global_step_") else None
        return ckpt, step, run
    selection = select_checkpoint(run, "best")
    return selection.checkpoint, selection.step, run


def already_served(model: dict | None, ckpt: Path, share: float) -> bool:
    """Whether the service already serves the candidate under its name (``/v1/load_lora_adapter`` or
    ``POST /admin/models`` before the ship): then the canary ships that model as it is and leaves it loaded after a
    rollback. A model of that name with other weights, or one that already has a share of the route, is refused."""
    from serve.lineage import lineage_of  # noqa: PLC0415  (torch-heavy)

    if model is None:
        return False
    weights = lineage_of(str(ckpt)).weights
    if model.get("weights") != weights:
        raise ConfigError(f"the service already serves a model named '{model['name']}' with other weights (sha256 "
                          f"{model.get('weights')}, the checkpoint's {weights}); pass --name")
    if share > 0:
        raise ConfigError(f"'{model['name']}' already has {share:.0%} of the route; a canary starts from 0% (move "
                          "the route back with `verl promote`, or ship another name with --name)")
    return True


def plan(settings: ShipSettings, client: AdminClient) -> dict:
    """What would happen, from the run and the service's state (``--dry-run`` prints it)."""
    ckpt, step, run = _candidate(settings)
    state = client.call("GET", "/state")
    weights = state["routes"].get(settings.route)
    if not weights:
        raise ConfigError(f"the service has no route '{settings.route}' (routes: {', '.join(state['routes'])})")
    incumbent = max(weights, key=lambda m: weights[m])
    models = {m["name"]: m for m in state["models"]}
    adapter = (ckpt / "adapter_config.json").is_file()
    name = settings.name or f"{run.name}-step{step}"
    fulls = [m for m in state["models"] if m["kind"] == "model"]
    c = settings.canary
    return {"candidate": {"name": name, "checkpoint": str(ckpt), "step": step, "run": str(run),
                          "kind": "adapter" if adapter else "model",
                          "base": models[incumbent]["base"] if adapter else None,
                          "preloaded": already_served(models.get(name), ckpt, weights.get(name, 0.0))},
            "incumbent": {"name": incumbent, **{k: models[incumbent].get(k) for k in ("kind", "source", "base", "run",
                                                                                      "step", "weights")}},
            "route": {"name": settings.route, "weights": weights}, "config_version": state["version"],
            "full_models": [m["name"] for m in fulls],
            "gates": {"offline": settings.offline, "metric": settings.gate_metric, "margin": c.margin,
                      "gate_data": gate_data(settings, run) if settings.offline else None,
                      "capacity": settings.capacity, "capacity_users": settings.capacity_users,
                      "slo_p95_ms": settings.slo_p95_ms},
            "canary": settings_dict(c)}


def gate_data(settings: ShipSettings, run: Path) -> dict:
    """Which prompts judge the offline gate, and which chose the checkpoint. The run picked its best checkpoint on
    its validation prompts, so gating on them again inflates the difference (the winner's curse): the gate uses
    ``--gate-data``, else the built-in task's test split (never trained on, never used to choose), else — for the
    user's own validation files — the validation prompts, flagged as biased."""
    from eval.runner import load_run_config  # noqa: PLC0415

    run_cfg, _, _ = load_run_config(run)
    chose = list(run_cfg.data.val_files)
    if settings.gate_data:
        return {"judged_by": list(settings.gate_data), "chosen_by": chose, "independent": True}
    tests = [held_out_split(name) for name in chose]
    if all(t is not None for t in tests):
        return {"judged_by": tests, "chosen_by": chose, "independent": True}
    return {"judged_by": chose, "chosen_by": chose, "independent": False,
            "warning": "the gate reuses the validation prompts that chose the checkpoint (the winner's curse "
                       "inflates the difference): pass --gate-data FILE with prompts the run never saw"}


def held_out_split(name: str) -> str | None:
    """The built-in task's test split for a built-in validation split (``builtin:arithmetic/val`` ->
    ``builtin:arithmetic/test``), or None."""
    from verl.data.builtin import BUILTIN_PREFIX, TASK_SPLITS  # noqa: PLC0415

    if not name.startswith(BUILTIN_PREFIX):
        return None
    task, _, split = name[len(BUILTIN_PREFIX):].partition("/")
    if split != "val" or "test" not in TASK_SPLITS.get(task, ()):
        return None
    return f"{BUILTIN_PREFIX}{task}/test"


OBSERVE_S = 900.0  # --dry-run plans with the route's last 15 minutes of records


def dry_run_power(settings: ShipSettings, client: AdminClient, incumbent: str) -> dict:
    """The canary's power and budget for the route's observed traffic (``eval.ship.power``)."""
    from eval.ship.power import observe, power_plan  # noqa: PLC0415

    rows = client.call("GET", "/records", params={"since": time.time() - OBSERVE_S})["records"]
    return power_plan(observe(rows, settings.route, incumbent, settings.canary.slo_p95_ms), settings.canary)


def offline_gates(settings: ShipSettings, shipping: dict, out: Path) -> list[Gate]:
    """Quality, guardrails and the tripwire on prompts the checkpoint selection never saw (``gate_data``)."""
    from eval.compare import compare_pair, resolve_entry  # noqa: PLC0415
    from eval.runner import EvalSettings, run_eval  # noqa: PLC0415
    from serve.lifecycle import resolve_adapter_dir  # noqa: PLC0415

    run = Path(shipping["candidate"]["run"])
    prompts = shipping["gates"]["gate_data"]
    data = list(prompts["judged_by"])
    samples = settings.max_samples
    evaluators = "accuracy,diversity,length"
    base = EvalSettings(data=data, max_samples=samples, evaluators=evaluators, quiet=True)
    # The candidate also gets its exact KL to its run's base model (a guardrail the incumbent need not share).
    with_kl = EvalSettings(data=data, max_samples=samples, evaluators=evaluators + ",kl", quiet=True)
    candidate = run_eval(shipping["candidate"]["checkpoint"], with_kl, out / "candidate")
    overlap = candidate.get("contamination") or {}
    if settings.strict and overlap.get("overlapping"):
        return [Gate("contamination", False, f"--strict: {overlap['overlapping']} of {overlap['checked']} gate prompts "
                     f"overlap the run's training data ({overlap['exact']} exactly, {overlap['ngram']} by a shared "
                     f"{overlap['n']}-gram); pass --gate-data with clean prompts, or `verl data decontaminate` the "
                     "training data", {k: v for k, v in overlap.items() if k != "clean"})]
    kl = (candidate["metrics"].get("eval/kl_exact") or {}).get("value")
    incumbent = shipping["incumbent"]
    source = incumbent["source"]
    if incumbent["kind"] == "adapter":
        source = resolve_adapter_dir(source)
    run_eval(source, base, out / "incumbent")
    bounds = settings.canary.offline_bounds()  # one-sided, at the offline gates' share of the budget
    pair = compare_pair(resolve_entry(str(out / "incumbent"), "best", base, None),
                        resolve_entry(str(out / "candidate"), "best", base, None), settings.canary.alpha,
                        bounds["replicates"], 0, bound_alpha=bounds["alpha"])
    margin = settings.canary.margin
    trend = training_trend(run, shipping["candidate"]["step"])
    quality = quality_gate(pair, settings.gate_metric, margin)
    quality.evidence["prompts"] = prompts
    if overlap:  # the gate's prompts against the candidate's training data, in the gate's evidence
        quality.evidence["contamination"] = {k: v for k, v in overlap.items() if k != "clean"}
    return [quality, guardrail_gate(pair, margin, kl, settings.max_kl),
            tripwire_gate(trend, pair, settings.gate_metric, margin)]


def capacity_run(settings: ShipSettings, client: AdminClient, name: str, out: Path,
                 allowance: float = 0.01) -> tuple[dict, list[dict]]:
    """A short load test of model ``name`` alone: its capacity report and the service's records of its requests."""
    from loadtest.run import run_loadtest  # noqa: PLC0415
    from loadtest.settings import SLO, LoadTestConfig  # noqa: PLC0415

    config = LoadTestConfig(out_dir=out, url=settings.service, api_key=settings.api_key,
                            step_users=str(settings.capacity_users), step_time_s=settings.capacity_s,
                            step_settle_s=min(2.0, settings.capacity_s / 3), user_classes=["CompletionUser"],
                            extra_locust_args=["--model", name, "--num-prompts", "32"],
                            slo=SLO(p95_ms=settings.slo_p95_ms, max_failure_rate=allowance))
    started = time.time()
    report, _ = run_loadtest(config)
    rows = [r for r in client.call("GET", "/records", params={"since": started})["records"]
            if r.get("kind", "request") == "request" and r.get("model") == name and r.get("route") is None]
    return report, rows


def failure_allowance(settings: ShipSettings, client: AdminClient, incumbent: str) -> float:
    """The capacity gate's failure limit: the incumbent's own error rate on the route over the last 15 minutes
    (a service that fails 1% of requests fails them for the candidate too) plus ``--max-error-increase``, and at
    least 1%."""
    from eval.ship.power import observe  # noqa: PLC0415

    rows = client.call("GET", "/records", params={"since": time.time() - OBSERVE_S})["records"]
    base = observe(rows, settings.route, incumbent, None)["error_rate"]
    return min(1.0, max(0.01, base + settings.canary.max_error_increase))


def ship(settings: ShipSettings, say: Any = print) -> tuple[int, dict]:
    """The whole loop; returns (exit code, the ship record written to ship.json)."""
    key = settings.admin_key or os.environ.get(ADMIN_KEY_ENV)
    if not key:
        raise ConfigError(f"verl ship changes routes through the admin API: pass --admin-key or set {ADMIN_KEY_ENV}")
    client = AdminClient(settings.service, key, timeout=600)
    shipment = Shipment(settings, client, plan(settings, client), say)
    shipment.announce()
    return shipment.dry_run() if settings.dry_run else shipment.run()


class Shipment:
    """One ``verl ship``: the plan, the audit log and the ship record, and each stage as a method. Nothing in the
    service changes before the offline gates pass; from the candidate's loading on, every way out puts the route
    back (``back_out``) unless the canary promotes."""

    def __init__(self, settings: ShipSettings, client: AdminClient, shipping: dict, say: Any):
        self.settings, self.client, self.shipping, self.say = settings, client, shipping, say
        self.ship_id = uuid.uuid4().hex[:12]
        self.out = settings.out or Path(shipping["candidate"]["run"]) / "ship" / self.ship_id
        self.record: dict[str, Any] = {"ship_id": self.ship_id, "plan": shipping, "gates": [], "canary": None,
                                       "decision": None}
        self.cand, self.inc = shipping["candidate"]["name"], shipping["incumbent"]["name"]
        self.route = settings.route
        self.original = dict(shipping["route"]["weights"])
        self.audit: AuditLog | None = None

    def announce(self) -> None:
        shipping, say = self.shipping, self.say
        say(f"candidate {self.cand} ({shipping['candidate']['checkpoint']}) against incumbent {self.inc} on route "
            f"{self.route}")
        say("alpha split: " + ", ".join(f"{k} {v:.4g}" for k, v in shipping["canary"]["alpha_split"].items()))
        bounds = shipping["canary"].get("offline_bounds")
        if bounds:
            say(f"offline gates: one-sided {bounds['level']:.2%} bounds from {bounds['replicates']:,} bootstrap "
                "replicates")
        prompts = shipping["gates"]["gate_data"]
        if prompts is not None:
            say(f"offline gate judged on {', '.join(prompts['judged_by'])} (checkpoint chosen on "
                f"{', '.join(prompts['chosen_by'])})")
            if prompts.get("warning"):
                say(f"warning: {prompts['warning']}")

    def dry_run(self) -> tuple[int, dict]:
        """Print the plan and the canary's power for the route's observed traffic; change nothing."""
        power = self.shipping["power"] = dry_run_power(self.settings, self.client, self.inc)
        self.say(json.dumps(self.shipping, indent=1, default=str))
        if "requests_for_80pct_power" in power:
            self.say(f"power: a drop of the margin {self.settings.canary.margin:g} is rolled back with 80% power "
                     f"after {power['requests_for_80pct_power']:.0f} requests (~{power['minutes_for_80pct_power']:.1f} "
                     f"min at {power['observed']['rate_per_s']:.1f} requests/s); within the budget: "
                     f"{power['drop_rolled_back_within_budget']:.0%}")
        if power.get("warning"):
            self.say(f"warning: {power['warning']}")
        return EXIT_PROMOTED, self.record

    def run(self) -> tuple[int, dict]:
        self.audit = AuditLog(self.out / "audit.jsonl", self.ship_id)
        self.audit({"event": "plan", **self.shipping})
        if self.settings.offline:
            self.say("offline gates: evaluating candidate and incumbent on the same prompts")
            for gate in offline_gates(self.settings, self.shipping, self.out / "offline"):
                if not self.gate(gate):
                    return self.finish("refused", f"{gate.name} gate: {gate.reason}", gate.evidence)
        self.load_candidate()
        try:
            if self.settings.capacity:
                gate = self.capacity()
                if not self.gate(gate):
                    return self.back_out("refused", f"capacity gate: {gate.reason}", gate.evidence)
            canary = Canary(self.settings.canary, self.inc, self.cand, self.route, self.set_share,
                            lambda since: self.client.call("GET", "/records", params={"since": since})["records"],
                            lambda event: self.audit({"event": "canary", **event}))
            if self.settings.shadow_fraction > 0:
                passed, reason, evidence = self.shadow(canary)
                if not passed:
                    return self.back_out("refused", f"shadow: {reason}", evidence)
            outcome, reason, evidence = canary.run()
            self.record["canary"] = {"outcome": outcome, "reason": reason, "evidence": evidence,
                                     "stages": canary.stage_log}
        except (PromoteError, VerlError, KeyboardInterrupt) as exc:
            self.back_out("rollback", f"stopped by an error: {exc}")
            raise
        if outcome != "promote":
            return self.back_out("rollback" if outcome == "rollback" else "inconclusive", reason, evidence)
        self.client.call("PUT", f"/routes/{self.route}", json={"weights": new_weights(self.original, self.cand, 1.0)})
        return self.finish("promote", f"{reason}; {self.inc} stays loaded: `verl promote --service "
                           f"{self.settings.service} --route {self.route} --model {self.inc}` rolls back in one call",
                           evidence)

    # ------------------------------------------------------------ stages

    def gate(self, gate: Gate) -> bool:
        """Record a gate's result; True when it passed."""
        self.record["gates"].append(asdict(gate))
        self.audit({"event": "gate", **asdict(gate)})
        self.say(f"  {gate.name}: {'pass' if gate.passed else 'FAIL'} - {gate.reason}")
        return gate.passed

    def load_candidate(self) -> None:
        c = self.shipping["candidate"]
        if c["preloaded"]:
            state = self.client.call("GET", "/state")
            self.record["candidate_lineage"] = next(m for m in state["models"] if m["name"] == self.cand)
            self.audit({"event": "already_loaded", "model": self.record["candidate_lineage"],
                        "config_version": state["version"]})
            return
        body = ({"name": self.cand, "adapter": c["checkpoint"], "base": c["base"]} if c["kind"] == "adapter"
                else {"name": self.cand, "path": c["checkpoint"]})
        state = self.client.call("POST", "/models", json=body)
        self.record["candidate_lineage"] = next((m for m in state["models"] if m["name"] == self.cand), None)
        self.audit({"event": "loaded", "model": self.record["candidate_lineage"], "config_version": state["version"]})

    def capacity(self) -> Gate:
        s = self.settings
        self.say(f"capacity gate: {s.capacity_users} users on {self.cand} for {s.capacity_s:g} s")
        allowance = failure_allowance(s, self.client, self.inc)
        report, rows = capacity_run(s, self.client, self.cand, self.out / "capacity", allowance)
        return capacity_gate(report, rows, s.slo_p95_ms, allowance, s.canary.alpha_split()["capacity"])

    def shadow(self, canary: Canary) -> tuple[bool, str, dict]:
        fraction = self.settings.shadow_fraction
        self.say(f"shadow: mirroring {fraction:.0%} of route {self.route} to {self.cand} (answers never returned)")
        self.client.call("PUT", f"/shadow/{self.route}", json={"model": self.cand, "fraction": fraction})
        try:
            passed, reason, evidence = canary.shadow(self.settings.shadow_requests)
        finally:
            self.client.call("DELETE", f"/shadow/{self.route}")
        self.record["shadow"] = {"passed": passed, "reason": reason, "evidence": evidence}
        self.audit({"event": "shadow", "passed": passed, "reason": reason, "evidence": evidence})
        self.say(f"  shadow: {'pass' if passed else 'FAIL'} - {reason}")
        return passed, reason, evidence

    def set_share(self, share: float) -> tuple[int, dict[str, float]]:
        """The canary's route move: the candidate at ``share``; returns the service's config version and weights."""
        weights = new_weights(self.original, self.cand, share)
        state = self.client.call("PUT", f"/routes/{self.route}", json={"weights": weights})
        self.say(f"canary: {self.cand} at {share:.0%} of route {self.route} (config version {state['version']})")
        return int(state["version"]), state["routes"][self.route]

    # ------------------------------------------------------------ the way out

    def finish(self, decision: str, reason: str, evidence: dict | None = None) -> tuple[int, dict]:
        self.record["decision"] = {"decision": decision, "reason": reason}
        self.audit({"event": "decision", "decision": decision, "reason": reason, "evidence": evidence or {},
                    "config_version": self.client.call("GET", "/state")["version"]})
        write_ship_report(self.out, self.record)
        self.say(f"{decision}: {reason} (audit: {self.out / 'audit.jsonl'}, report: {self.out / 'ship_report.md'})")
        return (EXIT_PROMOTED if decision == "promote" else EXIT_NOT_PROMOTED), self.record

    def back_out(self, decision: str, reason: str, evidence: dict | None = None) -> tuple[int, dict]:
        """Put the route's weights back as they were, unload the candidate (unless it was served before the ship),
        then finish."""
        self.client.call("PUT", f"/routes/{self.route}", json={"weights": self.original})
        if not self.shipping["candidate"]["preloaded"]:
            self.client.call("DELETE", f"/models/{self.cand}")
        return self.finish(decision, reason, evidence)


def write_ship_report(out: Path, record: dict) -> None:
    """``ship.json`` and ``ship_report.md`` / ``.html``: the plan, each gate with its numbers, the canary's stages,
    the decision, and the candidate's offline accuracy beside its online reward (the drift between the two)."""
    from eval.report import Doc  # noqa: PLC0415
    from verl.utils.fs import atomic_write_json  # noqa: PLC0415

    atomic_write_json(out / "ship.json", record)
    plan_ = record["plan"]
    doc = Doc(f"verl ship — {plan_['candidate']['name']} vs {plan_['incumbent']['name']}")
    decision = record["decision"] or {}
    doc.p(f"**Decision: {decision.get('decision')}** — {decision.get('reason')}")
    lineage = record.get("candidate_lineage") or {}
    doc.table(["", "model", "run", "step", "weights"],
              [["candidate", plan_["candidate"]["name"], lineage.get("run"), lineage.get("step"),
                lineage.get("weights")],
               ["incumbent", plan_["incumbent"]["name"], plan_["incumbent"].get("run"), plan_["incumbent"].get("step"),
                plan_["incumbent"].get("weights")]])
    report_gates(doc, record)
    shadow = record.get("shadow")
    if shadow:
        doc.h("Shadow")
        reward, errors = shadow["evidence"]["reward"], shadow["evidence"]["errors"]
        doc.p(f"{'Passed' if shadow['passed'] else 'Failed'}: {shadow['reason']} ({reward['n_pairs']} rewarded "
              f"pairs, mean difference candidate - incumbent {fmt_num(reward['mean_difference'])}, e-value for "
              f"'worse' {reward['e_value']:.3g} against {reward['threshold']:.0f}; errors e-value "
              f"{errors['e_value']:.3g}).")
    if record.get("canary"):
        report_canary(doc, record)
    doc.write(out, "ship_report")


def report_gates(doc: Any, record: dict) -> None:
    plan_ = record["plan"]
    doc.h("Gates")
    doc.table(["gate", "passed", "reason"], [[g["name"], g["passed"], g["reason"]] for g in record["gates"]])
    prompts = plan_["gates"].get("gate_data")
    if prompts:
        doc.p(f"Offline gate prompts: judged on {', '.join(prompts['judged_by'])}; the checkpoint was chosen on "
              f"{', '.join(prompts['chosen_by'])}" + ("." if prompts["independent"] else f" — {prompts['warning']}."))
    doc.p("Alpha split (one budget for every decision): " + ", ".join(
        f"{k} {v:.4g}" for k, v in plan_["canary"]["alpha_split"].items()) + ".")
    bounds = plan_["canary"].get("offline_bounds")
    if bounds:
        doc.p(f"Offline gates: one-sided {bounds['level']:.2%} bounds from {bounds['replicates']:,} bootstrap "
              "replicates (their shares of alpha).")


def report_canary(doc: Any, record: dict) -> None:
    """The canary's stages, its guardrails, the outcome, and the offline-vs-online drift."""
    canary = record["canary"]
    doc.h("Canary")
    source = canary["evidence"].get("reward_source", "rule")
    doc.p(f"Rewards from **{source}**" + {"rule": " (requests that carried an answer, scored by a rule).",
                                          "feedback": " (users' feedback on the answers, POST /v1/feedback)."}.get(
        source.split(":")[0], " (reward rows of that scorer)."))
    rows = []
    # A promote's last stage is already in the stage log; a rollback or a budget ends mid-stage.
    for ev in canary["stages"] + ([canary["evidence"]] if canary["outcome"] != "promote" else []):
        reward = ev["reward"]
        rows.append([ev["stage"], f"{ev['share']:.0%}", ev["config_version"], fmt_num(reward["mean_candidate"]),
                     fmt_num(reward["mean_incumbent"]), describe_reward(reward), ev["units"]["pending_rewards"],
                     fmt_num(ev["candidate"]["error_rate"]), fmt_num(ev["candidate"]["p95_ms"]), reward["decision"]])
    doc.table(["stage", "share", "config version", "reward cand", "reward inc", "evidence (cand - inc)",
               "rewards pending", "cand errors", "cand p95 ms", "test"], rows)
    last = canary["evidence"]
    doc.table(["guardrail", "candidate", "incumbent", "e-value", "threshold"],
              [[name, fmt_num(g.get("rate_candidate", g.get("share_above"))), fmt_num(g.get("rate_incumbent")),
                f"{g['e_value']:.3g}", f"{g['threshold']:.0f}"] for name, g in last["guardrails"].items()])
    doc.p(f"Outcome: {canary['outcome']} — {canary['reason']}. Test: {last['reward']['test']}; units are requests "
          f"whose arm was drawn at random ({last['units']['units']} units, {last['units']['repeat_requests']} "
          "repeat requests of a user at the same stage not counted again); see docs/shipping.md.")
    quality = next((g for g in record["gates"] if g["name"] == "quality"), None)
    online = last["reward"]["mean_candidate"]
    if quality and online is not None:
        offline = quality["evidence"].get("candidate")
        doc.p(f"Offline vs online: the candidate scored {offline:.3f} on the held-out prompts and "
              f"{online:.3f} reward online (drift {online - offline:+.3f}).")


def fmt_num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"
