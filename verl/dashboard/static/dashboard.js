// verl dashboard: polls /api/data for new metric points and redraws uPlot charts, one series per run.
// State lives in window.verlDashboard (read by the browser test, handy in the devtools console).
"use strict";
(() => {
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  // A panel plots the first of its tags that a run has (runs of different algorithms name value loss differently).
  const PANELS = [
    { id: "reward", title: "Reward — rollout/reward_mean", tags: ["rollout/reward_mean"] },
    { id: "kl", title: "KL to reference — ppo/kl_div", tags: ["ppo/kl_div"] },
    { id: "policy_loss", title: "Policy loss — ppo/policy_loss", tags: ["ppo/policy_loss"] },
    // Only PPO with a critic (GAE) has a value loss: the panel stays hidden for GRPO-style runs.
    { id: "value_loss", title: "Value loss — critic/value_loss", tags: ["critic/value_loss", "ppo/value_loss"],
      optional: true },
    { id: "entropy", title: "Entropy — ppo/entropy", tags: ["ppo/entropy"] },
    { id: "response_length", title: "Response length — rollout/response_length_mean",
      tags: ["rollout/response_length_mean"] },
    { id: "throughput", title: "Throughput — throughput/tokens_per_second", tags: ["throughput/tokens_per_second"] },
    { id: "eval_accuracy", title: "Eval accuracy — eval/accuracy", tags: ["eval/accuracy"] },
    // Rollout/trainer mismatch (docs/mismatch.md), verl's names first; TRL's stand in for a run that logged only
    // those. Hidden for runs whose engine gave no log-probs.
    { id: "mismatch", title: "Rollout/trainer mismatch — rollout_corr/k3_kl", tags: ["rollout_corr/k3_kl"],
      optional: true },
    { id: "probs_diff", title: "Rollout vs trainer log-probs — sampling/sampling_logp_difference/mean (TRL)",
      tags: ["sampling/sampling_logp_difference/mean", "training/rollout_probs_diff_mean"], optional: true },
  ];
  const STEP_INCREMENTS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000, 20000,
    50000, 100000, 200000, 500000, 1000000];
  const params = new URLSearchParams(window.location.search);

  const state = {
    runs: [],          // {id, name, generation, cursor, status, color}
    data: {},          // run id -> tag -> Map(step -> value)
    charts: {},        // panel id -> uPlot instance
    panels: PANELS.map((p) => ({ ...p })),
    tags: new Set(),
    refreshMs: 5000,
    refreshCount: 0,
    lastError: null,
    samples: [],
    alerts: [],
  };
  window.verlDashboard = state;

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs = {}, text) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (key === "class") node.className = value;
      else node.setAttribute(key, value);
    }
    if (text !== undefined && text !== null) node.textContent = String(text);  // never innerHTML: logs are data
    return node;
  }

  function fmt(value) {
    if (value === null || value === undefined) return "";
    if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toPrecision(4);
    return String(value);
  }

  // ------------------------------------------------------------------ data

  // Per environment (rollout/env/<name>/...: verl.envs), panels appear as its metrics do.
  const ENV_METRICS = [
    ["reward_mean", "reward"], ["length_mean", "trajectory length"], ["turns_mean", "turns"],
    ["error_rate", "failed episodes"], ["step_seconds_mean", "step latency (s)"],
  ];
  const ENV_TAG = /^rollout\/env\/(.+)\/([a-z_]+)$/;

  function addEnvironmentPanels() {
    for (const tag of state.tags) {
      const match = ENV_TAG.exec(tag);
      if (!match) continue;
      const [, name, metric] = match;
      const known = ENV_METRICS.find(([m]) => m === metric);
      const id = `env-${name.replace(/[^A-Za-z0-9_-]/g, "_")}-${metric}`;
      if (!known || state.panels.some((p) => p.id === id)) continue;
      state.panels.push({ id, title: `Environment ${name}: ${known[1]} — ${tag}`, tags: [tag], optional: true,
                          environment: name });
    }
  }

  // Per held-out task (trainer.eval_tasks: eval/<task>/<metric>), a panel per headline metric as it appears.
  const TASK_METRICS = [
    ["accuracy", "accuracy"], ["accuracy_flexible", "flexible accuracy"], ["pass@1", "pass@1"],
    ["tests_passed", "tests passed"], ["solved", "solved"],
  ];
  const TASK_TAG = /^eval\/([A-Za-z0-9_.-]+)\/([a-z_@0-9]+)$/;
  const NOT_TASKS = new Set(["clean"]);  // eval/clean/*: validation's own prompts without the overlapping ones

  function addTaskPanels() {
    for (const tag of state.tags) {
      const match = TASK_TAG.exec(tag);
      if (!match || NOT_TASKS.has(match[1])) continue;
      const [, name, metric] = match;
      const known = TASK_METRICS.find(([m]) => m === metric);
      const id = `task-${name.replace(/[^A-Za-z0-9_-]/g, "_")}-${metric.replace("@", "_at_")}`;
      if (!known || state.panels.some((p) => p.id === id)) continue;
      state.panels.push({ id, title: `Eval task ${name}: ${known[1]} — ${tag}`, tags: [tag], optional: true,
                          task: name });
    }
  }

  function applyRun(run) {
    let known = state.runs.find((r) => r.id === run.id);
    if (!known) {
      known = { id: run.id, name: run.name, color: COLORS[run.id % COLORS.length] };
      state.runs.push(known);
    }
    if (run.reset || !state.data[run.id]) state.data[run.id] = {};
    const series = state.data[run.id];
    for (const [tag, points] of Object.entries(run.points)) {
      const map = series[tag] || (series[tag] = new Map());
      for (const [step, value] of points) map.set(step, value);  // a re-logged step (resume) replaces the old one
      state.tags.add(tag);
    }
    known.generation = run.generation;
    known.cursor = run.cursor;
    known.status = run.status;
  }

  function seriesFor(runId, tags) {
    const series = state.data[runId] || {};
    for (const tag of tags) if (series[tag] && series[tag].size) return series[tag];
    return null;
  }

  // ------------------------------------------------------------------ charts

  function panelElement(panel) {
    let node = document.getElementById(`panel-${panel.id}`);
    if (node) return node;
    node = el("div", { class: "panel", id: `panel-${panel.id}`, "data-panel": panel.id });
    const title = el("h3", {}, panel.title);
    if (panel.removable) {
      const close = el("button", { title: "remove chart", "aria-label": "remove chart" }, "×");
      close.addEventListener("click", () => {
        if (state.charts[panel.id]) state.charts[panel.id].destroy();
        delete state.charts[panel.id];
        state.panels = state.panels.filter((p) => p.id !== panel.id);
        node.remove();
        renderTagSelect();
      });
      title.appendChild(close);
    }
    node.appendChild(title);
    node.appendChild(el("div", { class: "empty" }, `no data yet for ${panel.tags.join(" / ")}`));
    node.appendChild(el("div", { class: "plot" }));
    $("charts").appendChild(node);
    return node;
  }

  function renderChart(panel) {
    const node = panelElement(panel);
    const lines = state.runs
      .map((run) => ({ run, map: seriesFor(run.id, panel.tags) }))
      .filter((line) => line.map !== null);
    const empty = node.querySelector(".empty");
    let chart = state.charts[panel.id];
    node.hidden = !lines.length && Boolean(panel.optional);
    if (!lines.length) {
      empty.hidden = false;
      if (chart) chart.destroy();
      delete state.charts[panel.id];
      return;
    }
    empty.hidden = true;
    const steps = new Set();
    for (const line of lines) for (const step of line.map.keys()) steps.add(step);
    const xs = Array.from(steps).sort((a, b) => a - b);
    const data = [xs, ...lines.map((line) => xs.map((x) => (line.map.has(x) ? line.map.get(x) : null)))];
    const key = lines.map((line) => line.run.id).join(",");
    if (chart && chart.verlKey === key) {
      chart.setData(data);
      return;
    }
    if (chart) chart.destroy();
    const width = Math.max(300, node.clientWidth - 20);
    const opts = {
      width,
      height: 220,
      scales: { x: { time: false } },
      // Steps are integers: no 1.5-step ticks.
      axes: [{ label: "step", incrs: STEP_INCREMENTS }, { size: 64 }],
      legend: { live: true },
      series: [
        { label: "step" },
        ...lines.map((line) => ({
          label: line.run.name,
          stroke: line.run.color,
          width: 2,
          spanGaps: true,  // eval points come every test_freq steps
          points: { show: xs.length <= 60, size: 5 },
        })),
      ],
    };
    chart = new uPlot(opts, data, node.querySelector(".plot"));
    chart.verlKey = key;
    state.charts[panel.id] = chart;
  }

  function renderCharts() {
    for (const panel of state.panels) renderChart(panel);
  }

  function renderTagSelect() {
    const select = $("add-chart");
    const shown = new Set(state.panels.flatMap((p) => p.tags));
    const wanted = Array.from(state.tags).filter((t) => !shown.has(t)).sort();
    const current = Array.from(select.options).slice(1).map((o) => o.value);
    if (wanted.join("\n") === current.join("\n")) return;
    while (select.options.length > 1) select.remove(1);
    for (const tag of wanted) select.appendChild(el("option", { value: tag }, tag));
  }

  $("add-chart").addEventListener("change", (event) => {
    const tag = event.target.value;
    if (!tag) return;
    const panel = { id: `tag-${tag.replace(/[^A-Za-z0-9_-]/g, "_")}`, title: tag, tags: [tag], removable: true };
    state.panels.push(panel);
    event.target.value = "";
    renderChart(panel);
    renderTagSelect();
  });

  window.addEventListener("resize", () => {
    for (const [id, chart] of Object.entries(state.charts)) {
      const node = document.getElementById(`panel-${id}`);
      if (node) chart.setSize({ width: Math.max(300, node.clientWidth - 20), height: 220 });
    }
  });

  // ------------------------------------------------------------------ runs, samples, alerts

  function renderRuns() {
    const box = $("runs");
    box.replaceChildren();
    for (const run of state.runs) {
      const status = run.status || {};
      const item = el("div", { class: "run", "data-run": run.name });
      const chip = el("span", { class: "chip" });
      chip.style.background = run.color;
      item.appendChild(chip);
      item.appendChild(el("strong", {}, run.name));
      const total = status.total_steps ? `/${status.total_steps}` : "";
      const step = status.last_step === null || status.last_step === undefined ? "no steps yet" : `step ${status.last_step}${total}`;
      item.appendChild(el("span", {}, step));
      let label = status.state || "waiting";
      let cls = label;
      if (label === "finished" && status.reason && status.reason !== "completed") {
        label = `stopped: ${status.reason}`;
        cls = "stopped";
      }
      item.appendChild(el("span", { class: `state ${cls}` }, label));
      if (status.target) {
        const t = status.target;
        item.appendChild(el("span", { class: "target" },
          `target ${t.target} at step ${t.step}: ${Number(t.minutes).toFixed(2)} min`));
      }
      box.appendChild(item);
    }
  }

  function renderTable(tableId, emptyId, rows, columns) {
    const body = $(tableId).querySelector("tbody");
    body.replaceChildren();
    for (const row of rows) {
      const tr = el("tr", { class: row.level ? `level-${row.level}` : "" });
      for (const [key, isText] of columns) {
        tr.appendChild(el("td", isText ? { class: "text" } : {}, fmt(row[key])));
      }
      body.appendChild(tr);
    }
    $(emptyId).hidden = rows.length > 0;
  }

  // ------------------------------------------------------------------ polling

  async function loadConfig() {
    const response = await fetch("/api/config");
    const config = await response.json();
    document.title = config.title;
    $("title").textContent = config.title;
    const fromQuery = Number(params.get("refresh"));
    state.refreshMs = fromQuery > 0 ? fromQuery : config.refresh_ms;
  }

  async function poll() {
    const cursors = state.runs
      .slice()
      .sort((a, b) => a.id - b.id)
      .map((r) => `${r.generation}:${r.cursor}`)
      .join(",");
    try {
      const response = await fetch(`/api/data?cursors=${encodeURIComponent(cursors)}`);
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const payload = await response.json();
      for (const run of payload.runs) applyRun(run);
      addEnvironmentPanels();
      addTaskPanels();
      state.samples = payload.samples;
      state.alerts = payload.alerts;
      renderRuns();
      renderCharts();
      renderTagSelect();
      renderTable("alerts", "alerts-empty", payload.alerts, [["run"], ["step"], ["rule"], ["message", true]]);
      renderTable("samples", "samples-empty", payload.samples,
        [["run"], ["step"], ["split"], ["score"], ["prompt", true], ["response", true], ["ground_truth", true]]);
      state.lastError = null;
      state.refreshCount += 1;
      $("refresh-info").textContent =
        `updated ${new Date().toLocaleTimeString()} · refreshing every ${(state.refreshMs / 1000).toFixed(1)} s`;
    } catch (error) {
      state.lastError = String(error);
      $("refresh-info").textContent = `cannot reach the dashboard server (${error}); retrying`;
    }
    window.setTimeout(poll, state.refreshMs);
  }

  loadConfig()
    .catch(() => {})
    .then(poll);
})();
