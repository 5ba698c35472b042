// OmniHooks statistics: a sidebar tab answering "is it working, where, and why" for every run with one of our nodes
// (a cache's steps; CPU Offload's and Sequence Parallel's cards), and a badge on Apply nodes.
// Listens to "omni_hooks.step"/"omni_hooks.run" (nodes/stats_store.py) from setup(), so no early event is lost;
// loads GET /omni_hooks/runs on start (history survives a page reload). Every string is set as textContent.
// The logic lives in stats_model.js (tested with node --test); this file only draws it.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import {
  REASONS, RUN_EVENT, STEP_EVENT, applyRun, applyStep, badgeFor, branchExplanation, branchOrder, budgetStat, cellReason,
  counters, createState, describeCell, featureCards, featuresTitle, formatBytes, formatPercent, formatSeconds, formatSpeedup, formatValue,
  formatWhen, isCacheRun, lanes, legend, plotData, progress, runKinds, runNumbers, selectRun, shownRun, SKIP_REASONS,
  speedupBasis, stepTicks, UNSET_WORKFLOW_ID, warnings,
} from "./stats_model.js";

const APPLY_NODES = new Set(["OmniHooks.ApplyTeaCache", "OmniHooks.ApplyMagCache"]);
const SVG = "http://www.w3.org/2000/svg";
const CELL_MIN_PX = 3;          // a strip cell is at least this wide; more evaluations are binned
const RENDER_INTERVAL_MS = 80;  // at most ~12 redraws a second while steps stream in
const state = createState();
let container = null;
let resizeObserver = null;
let renderTimer = null;
let lastWidth = 0;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k === "onclick") node.addEventListener("click", v); else node.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children.flat(Infinity)) {
    if (child == null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

function ensureStyles() {
  if (document.getElementById("omni-hooks-stats-css")) return;
  document.head.append(el("link", {
    id: "omni-hooks-stats-css", rel: "stylesheet", href: new URL("./omni_hooks_stats.css", import.meta.url).href,
  }));
}

// ------------------------------------------------------------------------------------------- workflows and nodes

function workflowStore() {
  return app.extensionManager?.workflow ?? null;
}

function workflowIdOf(wf) {
  return wf?.activeState?.id ?? wf?.changeTracker?.activeState?.id ?? wf?.initialState?.id ?? null;
}

/** The name of the open workflow with this id, else a short form of the id; "" for a prompt queued without one
 * (or from a graph that never got an id, which any number of workflows share). */
function workflowName(id) {
  if (!id || id === UNSET_WORKFLOW_ID) return "";
  const found = (workflowStore()?.openWorkflows ?? []).filter((wf) => workflowIdOf(wf) === id);
  return found.length === 1 ? found[0].filename : `workflow ${String(id).slice(0, 8)}`;
}

function canvasWorkflowId() {
  return app.graph?.id ?? null;
}

function selectNodeOf(run) {
  if (!run?.node_id || !run.workflow_id || run.workflow_id === UNSET_WORKFLOW_ID || run.workflow_id !== canvasWorkflowId()) return false;
  const node = app.graph.getNodeById?.(Number(run.node_id)) ?? app.graph.getNodeById?.(run.node_id);
  if (!node || !app.canvas) return false;
  app.canvas.selectNode?.(node);
  app.canvas.centerOnNode?.(node);
  app.canvas.setDirty?.(true, true);
  return true;
}

// ----------------------------------------------------------------------------------------------------- drawing

function headerView(run) {
  const status = run.finished ? run.status ?? "done" : "running";
  const bits = [workflowName(run.workflow_id), runKinds(run), run.model].filter(Boolean);
  const threshold = run.threshold ?? run.summary?.threshold;
  return el("div", { class: "omni-header" },
    el("div", { class: "omni-node-title" }, run.node_title ?? run.kind,
      run.node_id != null ? [" ", el("span", { class: "omni-node-id" }, `#${run.node_id}`)] : null),
    el("div", { class: "omni-meta omni-meta-what" }, bits.join(" · ")),
    el("div", { class: "omni-meta omni-meta-when" },
      isCacheRun(run) ? [el("span", { class: "omni-threshold" }, `threshold ${formatValue(threshold)}`), " · "] : null,
      formatWhen(run),
      run.world_size > 1 ? ` · ${run.world_size} devices` : "", " ",
      el("span", { class: `omni-status omni-status-${status}` },
        run.finished ? status : `running ${progress(run)}`.trim())));
}

function headlineView(run) {
  const c = counters(run);
  const budget = budgetStat(run);
  const stat = (cls, value, label, help) => el("div", { class: `omni-stat ${cls}`, title: help ?? null },
    el("div", { class: "omni-stat-value" }, value), el("div", { class: "omni-stat-label" }, label));
  return el("div", { class: "omni-headline-box" },
    el("div", { class: "omni-headline" },
      stat("omni-stat-reused", `${c.reused}/${c.evaluations}`, `reused (${formatPercent(c.hitRate)})`),
      stat("omni-stat-saved", `~${formatSeconds(c.savedSeconds)}`, "saved"),
      stat("omni-stat-speedup", formatSpeedup(c.speedup), "in the model"),
      budget ? stat("omni-stat-budget", budget.value, budget.label, budget.help) : null),
    el("div", { class: "omni-basis" }, `Speedup: ${speedupBasis(c)}.`));
}

function laneView(lane) {
  const strip = el("div", { class: "omni-strip", "data-branch": lane.label, style: `grid-template-columns: repeat(${lane.cells.length}, 1fr)` });
  for (const cell of lane.cells) {
    const reason = cellReason(cell);
    const mixed = cell.n > 1 && cell.reused > 0 && !SKIP_REASONS.has(reason);
    strip.append(el("span", {
      class: `omni-cell omni-r-${reason}${cell.reused === cell.n ? " omni-reused" : ""}`,
      "data-reason": reason, title: describeCell(cell, lane),
      style: mixed ? `background: linear-gradient(to top, #22c55e ${Math.round((100 * cell.reused) / cell.n)}%, var(--omni-c-solid, var(--omni-c)) 0)` : null,
    }));
  }
  return el("div", { class: "omni-lane" },
    el("div", { class: "omni-lane-label", "data-branch": lane.label, title: lane.label }, lane.label), strip);
}

function stepsView(cells) {
  return el("div", { class: "omni-steps" }, stepTicks(cells).map((t) =>
    el("span", { style: `left: ${(t.position * 100).toFixed(2)}%` }, t.index === 0 ? `step ${t.label}` : t.label)));
}

function stripsView(run, list) {
  if (!list.length) {
    return run.detail === "summary"
      ? el("div", { class: "omni-note" }, "This run was too large to keep per-step detail; the totals above are complete.")
      : null;
  }
  const explanation = branchExplanation(list);
  return el("div", { class: "omni-section omni-strips" },
    el("div", { class: "omni-section-title" }, "Per step: computed or reused, and why"),
    el("div", { class: "omni-lanes" }, list.map(laneView), stepsView(list[0].cells)),
    el("div", { class: "omni-legend" }, legend(list).map((r) =>
      el("span", { class: `omni-legend-item omni-r-${r}`, "data-reason": r, title: REASONS[r].help },
        el("span", { class: "omni-swatch" }), REASONS[r].label))),
    explanation ? el("div", { class: "omni-note omni-branch-note" }, explanation) : null,
    list.some((l) => l.summarised)
      ? el("div", { class: "omni-note omni-binned-note" }, "Long run: each cell sums several evaluations (green part = reused share).")
      : null);
}

function plotView(list, width) {
  const data = plotData(list);
  const notPlotted = data.nonFinite
    ? el("div", { class: "omni-note omni-non-finite-note" },
      `${data.nonFinite} evaluation(s) measured a change that is not a finite number (NaN or Infinity); not plotted.`)
    : null;
  if (!data.series.length) {
    return notPlotted && el("div", { class: "omni-section omni-plot-section" },
      el("div", { class: "omni-section-title" }, "Accumulated change vs threshold"), notPlotted);
  }
  const w = Math.max(120, Math.floor(width)), h = 120;
  const m = { left: 34, right: 6, top: 10, bottom: 16 };
  const iw = w - m.left - m.right, ih = h - m.top - m.bottom;
  const x = (i) => m.left + (data.cells > 1 ? (i / (data.cells - 1)) * iw : iw / 2);
  const y = (v) => m.top + ih - (Math.min(v, data.max) / data.max) * ih;
  const plot = svg("svg", { class: "omni-plot", width: w, height: h, viewBox: `0 0 ${w} ${h}`, role: "img",
    "aria-label": "accumulated change per step against the threshold" });
  plot.append(svg("line", { class: "omni-axis", x1: m.left, x2: m.left, y1: m.top, y2: m.top + ih }));
  plot.append(svg("line", { class: "omni-axis", x1: m.left, x2: m.left + iw, y1: m.top + ih, y2: m.top + ih }));
  const t = typeof data.threshold === "number" && Number.isFinite(data.threshold) ? data.threshold : null;
  for (const v of [0, data.max / 2, data.max]) {
    if (t !== null && Math.abs(y(v) - y(t)) < 10) continue;  // the threshold's own label takes that place
    plot.append(svg("text", { class: "omni-y-tick", x: m.left - 4, y: y(v) + 3, "text-anchor": "end" }, formatValue(v)));
  }
  for (const t of stepTicks(list[0].cells)) {
    const anchor = t.position === 0 ? "start" : t.position === 1 ? "end" : "middle";
    plot.append(svg("text", { class: "omni-x-tick", x: x(t.index), y: h - 3, "text-anchor": anchor }, t.label));
  }
  data.series.slice(0, 3).forEach((s, k) => {
    plot.append(svg("polyline", { class: `omni-series omni-series-${k}`, "data-branch": s.label,
      points: s.points.map((p) => `${x(p.index).toFixed(1)},${y(p.metric).toFixed(1)}`).join(" ") }));
    for (const p of s.points.filter((q) => q.computed)) {
      plot.append(svg("circle", { class: "omni-computed-dot", cx: x(p.index).toFixed(1), cy: y(p.metric).toFixed(1), r: 1.6 }));
    }
  });
  if (t !== null) {
    plot.append(svg("line", { class: "omni-threshold", x1: m.left, x2: m.left + iw, y1: y(t), y2: y(t) }));
    plot.append(svg("text", { class: "omni-y-tick omni-threshold-value", x: m.left - 4, y: y(t) + 3, "text-anchor": "end" },
      formatValue(t)));
  }
  return el("div", { class: "omni-section omni-plot-section" },
    el("div", { class: "omni-section-title" }, "Accumulated change vs threshold"),
    plot,
    el("div", { class: "omni-plot-legend" },
      data.series.slice(0, 3).map((s, k) => el("span", {}, el("span", { class: `omni-line-key omni-line-key-${k}` }), s.label)),
      el("span", { class: "omni-threshold-label" }, el("span", { class: "omni-line-key omni-line-key-threshold" }),
        `threshold ${formatValue(data.threshold)}`),
      el("span", {}, "dots: computed")),
    el("div", { class: "omni-note" }, "A step is reused while its line stays under the threshold; computing resets it."),
    notPlotted);
}

function cardStripView(strip) {
  const cells = strip.cells;
  return el("div", { class: "omni-card-strip" },
    el("div", { class: "omni-section-title" }, `Per step: ${strip.label}`),
    el("div", { class: "omni-bars", style: `grid-template-columns: repeat(${cells.length}, 1fr)` }, cells.map((c) =>
      el("span", { class: `omni-bar${c.skipped ? " omni-bar-skipped" : ""}${c.wait > 0 ? " omni-bar-waited" : ""}`,
        "data-step": c.first_step, title: c.title },
      el("span", { class: "omni-bar-fill", style: `height: ${c.skipped ? 0 : Math.max(4, Math.round(c.share * 100))}%` })))),
    stepsView(cells),
    el("div", { class: "omni-legend" },
      el("span", { class: "omni-legend-item" }, el("span", { class: "omni-swatch omni-swatch-bar" }), strip.label),
      cells.some((c) => c.wait > 0)
        ? el("span", { class: "omni-legend-item" }, el("span", { class: "omni-swatch omni-swatch-waited" }), "waited for copies")
        : null,
      cells.some((c) => c.skipped)
        ? el("span", { class: "omni-legend-item" }, el("span", { class: "omni-swatch omni-swatch-skipped" }), "skipped by the cache")
        : null));
}

function cardView(card) {
  return el("div", { class: "omni-card omni-feature", "data-kind": card.kind },
    el("div", { class: "omni-card-title" }, card.title),
    card.headline ? el("div", { class: "omni-card-headline" }, card.headline) : null,
    card.tiles.length ? el("div", { class: "omni-tiles" }, card.tiles.map((t) =>
      el("div", { class: "omni-stat omni-tile", title: t.help },
        el("div", { class: "omni-stat-value" }, t.value), el("div", { class: "omni-stat-label" }, t.label)))) : null,
    card.strip ? cardStripView(card.strip) : null,
    card.notes.map((n) => el("div", { class: "omni-note omni-setup-note" }, `ℹ ${n}`)),
    el("details", { class: "omni-fields" },
      el("summary", {}, `All fields (${card.rows.length})`),
      el("dl", { class: "omni-kv" }, card.rows.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]))));
}

function featuresView(run) {
  const cards = featureCards(run);
  if (!cards.length) return null;
  return el("div", { class: "omni-section omni-features" },
    el("div", { class: "omni-section-title" }, featuresTitle(run)),
    cards.map(cardView));
}

function detailsView(run) {
  const s = run.summary;
  const notes = s?.notes ?? [];
  const rows = [];
  if (s) {
    rows.push(["time in model", formatSeconds(s.model_seconds)], ["cache memory", formatBytes(s.cache_bytes)]);
    // per branch, one row for branches with the same counts
    const byCounts = new Map();
    for (const [name, b] of Object.entries(s.branches ?? {}).sort(([a], [b]) => branchOrder(a, b))) {
      const counts = `${b.reused}/${b.computed + b.reused}`;
      byCounts.set(counts, [...(byCounts.get(counts) ?? []), name]);
    }
    for (const [counts, names] of byCounts) rows.push([`${names.join(", ")} reused`, counts]);
  }
  if (!rows.length && !notes.length) return null;
  return el("div", { class: "omni-section omni-details" },
    notes.map((n) => el("div", { class: "omni-note omni-setup-note" }, `ℹ ${n}`)),
    rows.length ? el("dl", { class: "omni-kv" }, rows.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)])) : null);
}

function runView(run, width) {
  const list = run.loaded ? lanes(run, Math.max(8, Math.floor(width / CELL_MIN_PX))) : [];
  return el("div", { class: "omni-run-view", "data-run": run.run_id },
    warnings(run).length ? el("div", { class: "omni-warnings" }, warnings(run).map((w) => el("div", { class: "omni-warning" }, `⚠ ${w}`))) : null,
    headerView(run), isCacheRun(run) ? headlineView(run) : null,
    !isCacheRun(run) ? null
      : run.loaded ? stripsView(run, list) : el("div", { class: "omni-note" }, "loading the steps of this run…"),
    list.length ? plotView(list, width) : null,
    featuresView(run), detailsView(run));
}

function runsView(shown) {
  const list = el("div", { class: "omni-section omni-recent" }, el("div", { class: "omni-section-title" }, "Recent runs"));
  const runs = el("div", { class: "omni-runs" });
  for (const run of state.runs) {
    const where = [workflowName(run.workflow_id) || "API prompt", runKinds(run), formatWhen(run)].filter(Boolean).join(" · ");
    runs.append(el("button", {
      class: `omni-run${run === shown ? " omni-selected" : ""}`, "data-run": run.run_id, type: "button",
      title: "Show this run and select its node", onclick: () => onRunClicked(run.run_id),
    },
    el("div", { class: "omni-run-line" },
      el("span", { class: "omni-run-title" }, `${run.node_title ?? run.kind} #${run.node_id ?? "?"}`),
      el("span", { class: "omni-run-numbers" }, runNumbers(run))),
    el("div", { class: "omni-run-sub" }, where + (run.finished && run.status && run.status !== "success" ? ` · ${run.status}` : ""))));
  }
  list.append(state.runs.length ? runs : el("div", { class: "omni-empty" }, "none yet"));
  return list;
}

function emptyView() {
  return el("div", { class: "omni-empty" },
    "No runs yet. Put Apply TeaCache or Apply MagCache between your model loader and the sampler and queue "
    + "the workflow: every step's decision (computed or reused, and why) shows up here while it runs. Runs with CPU "
    + "Offload or Sequence Parallel show what those did.");
}

function render() {
  renderTimer = null;
  if (!container) return;
  const shown = shownRun(state);
  const width = Math.max(160, (container.clientWidth || 240) - 16);
  lastWidth = container.clientWidth;
  const bar = el("div", { class: "omni-titlebar" }, el("span", { class: "omni-titlebar-title" }, "CACHE STATS"),
    state.selectedRunId ? el("button", { class: "omni-follow-latest", type: "button", onclick: () => { selectRun(state, null); render(); } }, "show latest") : null);
  const body = el("div", { class: "omni-body" }, shown ? runView(shown, width) : emptyView(), runsView(shown));
  let root = container.querySelector(":scope > .omni-hooks-panel");
  if (!root) {
    root = el("div", { class: "omni-hooks-panel" });
    container.replaceChildren(root);
  }
  const scroll = root.querySelector(".omni-body")?.scrollTop ?? 0;
  root.replaceChildren(bar, body);
  body.scrollTop = scroll;
}

function scheduleRender() {
  if (renderTimer == null) renderTimer = setTimeout(render, RENDER_INTERVAL_MS);
}

function redrawCanvas() {
  app.graph?.setDirtyCanvas?.(true, true);
}

async function loadDetail(run) {
  if (!run || run.loaded || run.loading) return;
  run.loading = true;
  try {
    const response = await api.fetchApi(`/omni_hooks/runs/${encodeURIComponent(run.run_id)}`);
    if (response.ok) applyRun(state, await response.json());
  } catch (e) {
    console.warn("OmniHooks: could not load run", run.run_id, e);
  } finally {
    run.loading = false;
    scheduleRender();
  }
}

function onRunClicked(runId) {
  selectRun(state, runId);
  const run = shownRun(state);
  selectNodeOf(run);
  render();
  loadDetail(run);
}

// ------------------------------------------------------------------------------------------------------ badges

function hitRateBadge(node) {
  return () => {
    const badge = badgeFor(state, node.graph?.rootGraph?.id ?? canvasWorkflowId(), node.id);
    const text = badge?.text ?? "";
    return {
      text,
      height: 20,
      getWidth(ctx) { return text ? ctx.measureText(text).width + 12 : 0; },
      draw(ctx, x, y) {
        if (!text) return;
        ctx.save();
        ctx.font = "12px sans-serif";
        const width = ctx.measureText(text).width + 12;
        ctx.fillStyle = badge.running ? "#1d4ed8" : badge.reused > 0 ? "#15803d" : "#52525b";
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

// ------------------------------------------------------------------------------------------------------ wiring

async function loadHistory() {
  try {
    const response = await api.fetchApi("/omni_hooks/runs?limit=20&detail=0");
    if (!response.ok) return;
    const { runs } = await response.json();
    for (const entry of [...(runs ?? [])].reverse()) {
      try { applyRun(state, entry); } catch (e) { console.warn("OmniHooks: skipping a malformed run", e); }
    }
    await loadDetail(shownRun(state));
    render();
    redrawCanvas();
  } catch (e) {
    console.warn("OmniHooks: cache statistics history unavailable", e);
  }
}

function guarded(fn) {
  return (event) => {
    try { fn(event.detail); } catch (e) { console.warn("OmniHooks: could not show a statistics event", e); }
  };
}

app.registerExtension({
  name: "OmniHooks.CacheStats",
  async setup() {
    ensureStyles();
    api.addEventListener(STEP_EVENT, guarded((detail) => { applyStep(state, detail); scheduleRender(); redrawCanvas(); }));
    api.addEventListener(RUN_EVENT, guarded((detail) => { applyRun(state, detail); scheduleRender(); redrawCanvas(); }));
    app.extensionManager?.registerSidebarTab?.({
      id: "omni-hooks-stats",
      icon: "pi pi-bolt",
      title: "Cache stats",
      tooltip: "OmniHooks cache statistics",
      type: "custom",
      render: (element) => {
        container = element;
        container.style.height = "100%";
        resizeObserver?.disconnect();
        resizeObserver = new ResizeObserver(() => { if (container && container.clientWidth !== lastWidth) scheduleRender(); });
        resizeObserver.observe(container);
        render();
      },
      destroy: () => { resizeObserver?.disconnect(); resizeObserver = null; container = null; },
    });
    await loadHistory();
  },
  nodeCreated(node) {
    if (APPLY_NODES.has(node.comfyClass) && Array.isArray(node.badges)) node.badges.push(hitRateBadge(node));
  },
});
