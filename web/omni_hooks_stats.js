// OmniHooks cache statistics: a sidebar tab with the live run and recent runs, and a hit-rate badge on Apply nodes.
// Listens to "omni_hooks.step"/"omni_hooks.run" (nodes/stats_store.py) from setup(), so no early event is lost;
// loads GET /omni_hooks/runs on start (history survives a page reload). Every string is set as textContent.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import {
  RUN_EVENT, STEP_EVENT, applyRun, applyStep, counters, createState, formatBytes, formatPercent, formatSpeedup,
  metricSeries, strips, warnings,
} from "./stats_model.js";

const APPLY_NODES = new Set(["OmniHooks.ApplyTeaCache", "OmniHooks.ApplyMagCache"]);
const SVG = "http://www.w3.org/2000/svg";
const state = createState();
let container = null;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") node.style.cssText = v; else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child == null) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function stripView(name, cells) {
  const row = el("div", { class: "omni-strip", "data-branch": name, style: "display:flex;align-items:center;gap:6px;margin:2px 0" },
    el("span", { style: "width:64px;font-size:11px;opacity:.8" }, name));
  const boxes = el("div", { style: "display:flex;flex-wrap:wrap;gap:1px" });
  cells.forEach((cell, i) => boxes.append(el("span", {
    class: `omni-cell omni-${cell}`, title: `evaluation ${i + 1}: ${cell}`,
    style: `display:inline-block;width:7px;height:14px;border-radius:1px;background:${cell === "reused" ? "#3fb950" : "#6e7681"}`,
  })));
  row.append(boxes);
  return row;
}

function plotView(live, branch) {
  const points = metricSeries(live, branch);
  if (!points.length) return null;
  const w = 260, h = 60, n = live.branches[branch].length;
  const max = Math.max(...points.map((p) => Math.max(p.metric, p.threshold ?? 0)), 1e-9);
  const x = (i) => (n > 1 ? (i / (n - 1)) * (w - 4) + 2 : w / 2);
  const y = (v) => h - 2 - (v / max) * (h - 4);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", h);
  svg.setAttribute("class", "omni-plot");
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", points.map((p) => `${x(p.index)},${y(p.metric)}`).join(" "));
  line.setAttribute("fill", "none"); line.setAttribute("stroke", "#58a6ff");
  svg.append(line);
  const threshold = points[points.length - 1].threshold;
  if (threshold != null) {
    const t = document.createElementNS(SVG, "line");
    t.setAttribute("x1", 0); t.setAttribute("x2", w); t.setAttribute("y1", y(threshold)); t.setAttribute("y2", y(threshold));
    t.setAttribute("stroke", "#f85149"); t.setAttribute("stroke-dasharray", "4 3");
    svg.append(t);
  }
  return el("div", {}, el("div", { style: "font-size:11px;opacity:.8" }, `${branch}: accumulated metric vs threshold`), svg);
}

function liveView(live) {
  if (!live) {
    return el("div", { class: "omni-empty", style: "opacity:.8;line-height:1.5" },
      "No cache runs yet. Put Apply TeaCache or Apply MagCache between your model loader and the sampler and queue "
      + "the workflow: every step's decision (computed or reused, per branch) shows up here while it runs.");
  }
  const c = counters(live);
  const summary = live.summary;
  const box = el("div", { class: "omni-live" },
    el("div", { style: "font-weight:600" }, `${live.kind} · ${live.model}`),
    el("div", { class: "omni-counters", style: "margin:4px 0" },
      el("span", { class: "omni-count-reused" }, `reused ${c.reused}`), " / ",
      el("span", { class: "omni-count-evaluations" }, `${c.evaluations} evaluations`), " · hit rate ",
      el("span", { class: "omni-count-hit-rate" }, formatPercent(c.hitRate)), " · est. ",
      el("span", { class: "omni-count-speedup" }, formatSpeedup(summary ? summary.estimated_speedup : c.speedup)),
      live.finished ? ` · ${live.status ?? "done"}` : ` · running (step ${live.evaluations.at(-1)?.step ?? "?"}`
        + `${live.total_steps ? `/${live.total_steps}` : ""})`),
    summary ? el("div", { style: "font-size:11px;opacity:.8" },
      `time in model ${summary.model_seconds.toFixed(2)} s, saved ~${summary.estimated_seconds_saved.toFixed(2)} s, `
      + `cache ${formatBytes(summary.cache_bytes)}`) : null);
  for (const note of summary?.notes ?? []) {
    box.append(el("div", { class: "omni-note", style: "font-size:11px;opacity:.75;margin:2px 0" }, `ℹ ${note}`));
  }
  for (const [name, cells] of Object.entries(strips(live))) box.append(stripView(name, cells));
  for (const name of Object.keys(live.branches)) {
    const plot = plotView(live, name);
    if (plot) box.append(plot);
  }
  for (const w of warnings(live)) {
    box.append(el("div", { class: "omni-warning", style: "margin-top:6px;padding:6px;border-radius:4px;background:#5a1e1e;color:#ffd7d5" }, `⚠ ${w}`));
  }
  return box;
}

function runsView() {
  const list = el("div", { class: "omni-runs" }, el("div", { style: "font-weight:600;margin-top:10px" }, "Recent runs"));
  if (!state.runs.length) list.append(el("div", { style: "opacity:.7" }, "none yet"));
  for (const run of state.runs) {
    const s = run.summary ?? {};
    list.append(el("div", { class: "omni-run", "data-run": run.run_id, style: "font-size:12px;margin:2px 0" },
      `${run.kind} · node #${run.node_id ?? "?"} · reused ${s.reused ?? 0}/${s.evaluations ?? 0} `
      + `(${formatPercent(s.hit_rate)}) · ${formatSpeedup(s.estimated_speedup)} · ${run.status ?? ""}`));
  }
  return list;
}

function render() {
  if (!container) return;
  container.replaceChildren(el("div", { class: "omni-hooks-panel", style: "padding:8px;font-size:13px" },
    el("h3", { style: "margin:0 0 6px" }, "Cache statistics"), liveView(state.live), runsView()));
}

function redrawCanvas() {
  app.graph?.setDirtyCanvas?.(true, true);
}

function hitRateBadge(node) {
  return () => {
    const rate = state.hitRateByNode[String(node.id)];
    const text = rate == null ? "" : `hit ${formatPercent(rate)}`;
    return {
      text,
      height: 20,
      getWidth(ctx) { return text ? ctx.measureText(text).width + 12 : 0; },
      draw(ctx, x, y) {
        if (!text) return;
        ctx.save();
        ctx.font = "12px sans-serif";
        const width = ctx.measureText(text).width + 12;
        ctx.fillStyle = rate > 0 ? "#1f6f3a" : "#7a2a2a";
        ctx.beginPath();
        ctx.roundRect ? ctx.roundRect(x, y, width, 20, 5) : ctx.rect(x, y, width, 20);
        ctx.fill();
        ctx.fillStyle = "#fff";
        ctx.textBaseline = "middle";
        ctx.fillText(text, x + 6, y + 10);
        ctx.restore();
      },
    };
  };
}

async function loadHistory() {
  try {
    const response = await api.fetchApi("/omni_hooks/runs?limit=20");
    if (!response.ok) return;
    const { runs } = await response.json();
    for (const run of [...(runs ?? [])].reverse()) applyRun(state, run);
    render();
    redrawCanvas();
  } catch (e) {
    console.warn("OmniHooks: cache statistics history unavailable", e);
  }
}

app.registerExtension({
  name: "OmniHooks.CacheStats",
  async setup() {
    api.addEventListener(STEP_EVENT, ({ detail }) => { applyStep(state, detail); render(); });
    api.addEventListener(RUN_EVENT, ({ detail }) => { applyRun(state, detail); render(); redrawCanvas(); });
    app.extensionManager?.registerSidebarTab?.({
      id: "omni-hooks-stats",
      icon: "pi pi-bolt",
      title: "Cache stats",
      tooltip: "OmniHooks cache statistics",
      type: "custom",
      render: (el_) => { container = el_; render(); },
      destroy: () => { container = null; },
    });
    await loadHistory();
  },
  nodeCreated(node) {
    if (APPLY_NODES.has(node.comfyClass) && Array.isArray(node.badges)) node.badges.push(hitRateBadge(node));
  },
});
