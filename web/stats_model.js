// Pure logic of the OmniHooks statistics panel: no DOM, no ComfyUI imports (tested with node --test).
// Events come from nodes/stats_store.py: "omni_hooks.step" after each model evaluation of a cache, "omni_hooks.run"
// at the end of every run with one of our nodes (the history entry; a run without a cache has no cache summary, only
// its features' cards). Numbers that are not finite arrive as the text "NaN", "Infinity" or "-Infinity".

export const STEP_EVENT = "omni_hooks.step";
export const RUN_EVENT = "omni_hooks.run";
export const MAX_RUNS = 20;

/** Every reason a cache records for a branch (omni_hooks/caching/stats.py REASONS), with its legend label and tooltip, in the
 * legend's order. */
export const REASONS = {
  reuse: { label: "reused", help: "the change since the last computed step stayed under the threshold: the cached residual was reused" },
  forecast: { label: "forecast", help: "the change since the last computed step stayed under the threshold: the residual was forecast from the last computed steps (forecast input)" },
  "forecast-fallback": { label: "forecast fell back", help: "the forecast residual was not a finite number, so the last computed residual was reused instead" },
  threshold: { label: "over threshold", help: "the accumulated change reached the threshold: computed" },
  "max-skips": { label: "max skips", help: "the allowed number of consecutive reused steps (K) was reached: computed" },
  retention: { label: "retention", help: "within the first retention_ratio of the steps, which are always computed" },
  first: { label: "first", help: "nothing cached yet for this branch (first evaluation): computed" },
  forced: { label: "forced", help: "first/last steps (or calibrated warm-up steps) are always computed" },
  "large-step": { label: "large step", help: "this step moves sigma by at least twice the schedule's mean step (the last steps of a shifted schedule): always computed, since an error there is multiplied by the large step and nothing after it repairs it" },
  budget: { label: "budget", help: "the forward budget's plan placed a computed step here (where the final latent needs it most)" },
  window: { label: "outside window", help: "outside start_percent..end_percent: computed" },
  shape: { label: "shape changed", help: "the input shape changed, the cached residual does not fit: computed" },
  "model-cache": { label: "model cache", help: "the model filled its own key/value cache on this call (HiDream-O1, a prompt or reference image it had not seen): computed" },
  "few-step": { label: "few steps", help: "a run of so few steps always computes its first and last steps and never skips two in a row: computed" },
  "other-branch": { label: "other branch", help: "this branch could have been reused, but another branch of the same batch needed computing" },
  "other-rank": { label: "other rank", help: "every branch here could have been reused, but another Sequence Parallel rank needed computing (all ranks take the same path)" },
  calibrate: { label: "calibrating", help: "a calibration run computes every step" },
  disabled: { label: "disabled", help: "caching is disabled for this run: computed" },
  measure: { label: "measured", help: "measured, not yet compared with the threshold" },
  mixed: { label: "mixed", help: "several evaluations summarised in one cell" },
};

/** The forecast candidates a skipped branch's residual came from, by key (omni_hooks/caching/stats.py
 * BranchDecision.candidate). */
export const FORECAST_CANDIDATES = { 0: "reuse", 1: "1st order", 2: "2nd order", 3: "Taylor", 4: "Chebyshev fit" };

const NON_FINITE = new Set(["NaN", "Infinity", "-Infinity"]);

export function createState() {
  // runs: newest first; liveRunId: the run receiving steps; selectedRunId: the run the user picked (null = latest);
  // badges: "<prompt_id>|<node_id>" -> badge data; latestPrompt: "<workflow_id>|<node_id>" -> prompt_id
  return { runs: [], liveRunId: null, selectedRunId: null, badges: {}, latestPrompt: {} };
}

const HEADER_FIELDS = ["prompt_id", "node_id", "node_title", "workflow_id", "sampler_node_id", "kind", "model",
  "threshold", "started_at", "finished_at", "status", "summary", "features", "world_size", "detail"];

function newRun(ev) {
  return {
    run_id: ev.run_id, prompt_id: null, node_id: null, node_title: null, workflow_id: null, sampler_node_id: null,
    kind: "cache", model: "", threshold: null, started_at: null, finished_at: null, status: null, summary: null,
    features: null, world_size: null, detail: "evaluations", total_steps: null, records: [], timeline: null,
    finished: false, loaded: true, tally: tally([]),
  };
}

function addToTally(t, r) {
  t.evaluations += 1;
  t.seconds += r.seconds;
  if (r.computed) { t.computed += 1; t.computedSeconds += r.seconds; }
  return t;
}

/** Running totals of a run's records, kept up to date step by step (no recount per event). */
function tally(records) {
  return records.reduce(addToTally, { evaluations: 0, computed: 0, seconds: 0, computedSeconds: 0 });
}

function mergeHeader(run, ev) {
  for (const key of HEADER_FIELDS) if (ev[key] !== undefined && ev[key] !== null) run[key] = ev[key];
  if (ev.node_id != null) run.node_id = String(ev.node_id);
  if (ev.total_steps != null) run.total_steps = ev.total_steps;
}

function findRun(state, runId) {
  return state.runs.find((r) => r.run_id === runId) ?? null;
}

function upsertRun(state, ev) {
  let run = findRun(state, ev.run_id);
  if (!run) {
    run = newRun(ev);
    state.runs = [run, ...state.runs].slice(0, MAX_RUNS);
    if (state.selectedRunId && !findRun(state, state.selectedRunId)) state.selectedRunId = null;
  }
  mergeHeader(run, ev);
  return run;
}

function record(ev) {
  return {
    step: Number.isInteger(ev.step) ? ev.step : null,
    total_steps: Number.isInteger(ev.total_steps) ? ev.total_steps : null,
    computed: !!ev.computed,
    seconds: finiteOr(ev.seconds, 0),
    branches: (Array.isArray(ev.branches) ? ev.branches : []).map((b) => ({
      branch: String(b?.branch ?? "all"), computed: !!b?.computed, reason: String(b?.reason ?? ""),
      metric: b?.metric ?? null, threshold: b?.threshold ?? null,
      candidate: Number.isInteger(b?.candidate) ? b.candidate : null,
    })),
  };
}

function badgeKey(promptId, nodeId) {
  return `${promptId}|${nodeId}`;
}

function noteBadge(state, run) {
  if (run.prompt_id == null || run.node_id == null) return;
  const key = badgeKey(run.prompt_id, run.node_id);
  const runs = state.runs.filter((r) => r.prompt_id === run.prompt_id && r.node_id === run.node_id);
  const c = runs.map(counters);
  const evaluations = c.reduce((a, x) => a + x.evaluations, 0);
  const reused = c.reduce((a, x) => a + x.reused, 0);
  state.badges[key] = {
    running: runs.some((r) => !r.finished), reused, evaluations, hitRate: evaluations ? reused / evaluations : 0,
    progress: progress(run),
  };
  if (run.workflow_id) state.latestPrompt[badgeKey(run.workflow_id, run.node_id)] = run.prompt_id;
}

/** Record one "omni_hooks.step" event: the run it belongs to gains an evaluation and becomes the live run. */
export function applyStep(state, ev) {
  if (!ev || typeof ev !== "object" || !ev.run_id) return state;
  const run = upsertRun(state, ev);
  const r = record(ev);
  run.records.push(r);
  addToTally(run.tally, r);
  state.liveRunId = run.run_id;
  noteBadge(state, run);
  return state;
}

/** Record one "omni_hooks.run" event or an entry of GET /omni_hooks/runs (with or without its evaluations). */
export function applyRun(state, entry) {
  if (!entry || typeof entry !== "object" || !entry.run_id) return state;
  const run = upsertRun(state, entry);
  run.finished = true;
  const evaluations = Array.isArray(entry.evaluations) ? entry.evaluations : [];
  if (evaluations.length && evaluations.length >= run.records.length) run.records = evaluations.map(record);
  if (entry.timeline && typeof entry.timeline === "object") run.timeline = entry.timeline;
  run.tally = tally(run.records);
  // an entry listed without detail (GET /omni_hooks/runs?detail=0) has to be fetched before its steps can be shown
  run.loaded = run.records.length > 0 || !!run.timeline || run.detail === "summary" || (run.summary?.evaluations ?? 0) === 0;
  if (state.liveRunId === run.run_id) state.liveRunId = null;
  state.runs.sort((a, b) => (b.started_at ?? 0) - (a.started_at ?? 0));
  noteBadge(state, run);
  return state;
}

/** The run the panel shows: the one the user picked, else the live one, else the newest. */
export function shownRun(state) {
  return (state.selectedRunId && findRun(state, state.selectedRunId))
    || (state.liveRunId && findRun(state, state.liveRunId)) || state.runs[0] || null;
}

export function selectRun(state, runId) {
  state.selectedRunId = runId && findRun(state, runId) ? runId : null;
  return state;
}

/** The id a graph has when it was never given one (e.g. loaded from API-format JSON): it names no workflow. */
export const UNSET_WORKFLOW_ID = "00000000-0000-0000-0000-000000000000";

/** The badge of node ``nodeId`` in the workflow ``workflowId`` (the latest prompt of that workflow that ran it). */
export function badgeFor(state, workflowId, nodeId) {
  if (!workflowId || workflowId === UNSET_WORKFLOW_ID || nodeId == null) return null;
  const promptId = state.latestPrompt[badgeKey(workflowId, String(nodeId))];
  const badge = promptId == null ? null : state.badges[badgeKey(promptId, String(nodeId))];
  if (!badge) return null;
  if (badge.running) return { ...badge, text: `running ${badge.progress}`.trim() };
  return { ...badge, text: `hit ${formatPercent(badge.hitRate)}` };
}

export function finiteOr(x, fallback = null) {
  return typeof x === "number" && Number.isFinite(x) ? x : fallback;
}

/** "step 12/30" (1-based, like ComfyUI's progress bar) of the newest evaluation, or "". */
export function progress(run) {
  const last = run?.records?.at(-1);
  const total = last?.total_steps ?? run?.total_steps;
  if (!last || last.step == null) return "";
  return total ? `step ${last.step + 1}/${total}` : `step ${last.step + 1}`;
}

/** The run's headline numbers: the server's summary once finished, else counted from the steps seen so far. */
export function counters(run) {
  const s = run?.finished ? run.summary : null;
  const records = run?.records ?? [];
  if (s && typeof s === "object" && Number.isFinite(s.evaluations)) {
    const computed = finiteOr(s.computed, 0);
    return {
      evaluations: s.evaluations, computed, reused: finiteOr(s.reused, 0), hitRate: finiteOr(s.hit_rate, 0),
      modelSeconds: finiteOr(s.model_seconds, 0), savedSeconds: finiteOr(s.estimated_seconds_saved, 0),
      speedup: s.estimated_speedup, meanComputedSeconds: meanComputed(run, s),
    };
  }
  const t = run?.tally ?? tally(records);
  const reused = t.evaluations - t.computed;
  const mean = t.computed ? t.computedSeconds / t.computed : 0;
  const saved = reused * mean;
  return {
    evaluations: t.evaluations, computed: t.computed, reused,
    hitRate: t.evaluations ? reused / t.evaluations : 0, modelSeconds: t.seconds, savedSeconds: saved,
    speedup: t.seconds > 0 ? (t.seconds + saved) / t.seconds : 1, meanComputedSeconds: mean,
  };
}

function meanComputed(run, summary) {
  const t = run?.tally;
  if (t?.computed) return t.computedSeconds / t.computed;
  const reused = finiteOr(summary?.reused, 0);
  return reused ? finiteOr(summary?.estimated_seconds_saved, 0) / reused : 0;
}

/** With a forward budget (the run summary's ``budget``): the headline's tile, "computed / budget", and what it
 * says on hover: the steps the budget computed (numbered from 1), what placed them (``placed_by``, the cache's own
 * words) and how many the threshold brought forward;
 * null without a budget or before the run finished. */
export function budgetStat(run) {
  const b = run?.finished ? run.summary?.budget : null;
  if (!b || typeof b !== "object" || !Number.isFinite(b.steps) || !Array.isArray(b.computed)) return null;
  const steps = b.computed.filter(Number.isFinite).map((s) => s + 1);
  const parts = [`budget ${b.steps} of ${b.total_steps ?? "?"} steps; computed ${steps.length}: steps ${compactSteps(steps)}`];
  if (typeof b.placed_by === "string") parts.push(`placed by ${b.placed_by}`);
  if (b.brought_forward > 0) parts.push(`${b.brought_forward} brought forward by the threshold`);
  return { value: `${steps.length}/${b.steps}`, label: "budget steps computed", help: parts.join("; ") };
}

/** [1, 2, 3, 6, 8, 9] as "1–3, 6, 8–9". */
export function compactSteps(steps) {
  const runs = [];
  for (const s of [...steps].sort((a, b) => a - b)) {
    if (runs.length && s === runs.at(-1).at(-1) + 1) runs.at(-1).push(s);
    else runs.push([s]);
  }
  return runs.map((r) => (r.length > 1 ? `${r[0]}–${r.at(-1)}` : `${r[0]}`)).join(", ");
}

/** How the speedup was estimated, in words. */
export function speedupBasis(c) {
  if (!c.evaluations) return "no model evaluations yet";
  if (!c.reused) return `nothing reused: all ${c.evaluations} evaluations computed`;
  return `${formatSeconds(c.modelSeconds)} in the model + ~${formatSeconds(c.savedSeconds)} saved: each reused `
    + `evaluation counted at the mean computed one (${formatSeconds(c.meanComputedSeconds)})`;
}

function emptyCell(step) {
  return { first_step: step, last_step: step, n: 0, computed: 0, reused: 0, reasons: {}, candidates: {}, metric: null,
    threshold: null };
}

/** Per branch, one cell per evaluation (or per timeline bin of a summarised long run). */
export function branchCells(run) {
  const out = {};
  if (run?.records?.length) {
    run.records.forEach((e) => {
      for (const b of e.branches) {
        const cell = emptyCell(e.step);
        cell.n = 1;
        cell[b.computed ? "computed" : "reused"] = 1;
        cell.reasons[b.reason || (b.computed ? "threshold" : "reuse")] = 1;
        if (b.candidate != null) cell.candidates[b.candidate] = 1;
        cell.metric = b.metric;
        cell.threshold = b.threshold;
        (out[b.branch] ??= []).push(cell);
      }
    });
    return out;
  }
  for (const bin of run?.timeline?.bins ?? []) {
    for (const [name, b] of Object.entries(bin.branches ?? {})) {
      const cell = emptyCell(bin.first_step);
      cell.last_step = bin.last_step;
      cell.computed = finiteOr(b.computed, 0);
      cell.reused = finiteOr(b.reused, 0);
      cell.n = cell.computed + cell.reused;
      cell.reasons = { ...(b.reasons ?? {}) };
      cell.candidates = { ...(b.candidates ?? {}) };
      cell.metric = b.metric_max ?? null;
      cell.threshold = b.threshold ?? null;
      (out[name] ??= []).push(cell);
    }
  }
  return out;
}

/** Merge neighbouring cells so that at most ``maxCells`` remain (counts add up, metric keeps the peak). */
export function binCells(cells, maxCells) {
  if (cells.length <= maxCells || maxCells < 1) return cells;
  const size = Math.ceil(cells.length / maxCells);
  const out = [];
  for (let i = 0; i < cells.length; i += size) {
    const group = cells.slice(i, i + size);
    const cell = emptyCell(group[0].first_step);
    for (const c of group) {
      cell.n += c.n; cell.computed += c.computed; cell.reused += c.reused;
      for (const [r, k] of Object.entries(c.reasons)) cell.reasons[r] = (cell.reasons[r] ?? 0) + k;
      for (const [f, k] of Object.entries(c.candidates ?? {})) cell.candidates[f] = (cell.candidates[f] ?? 0) + k;
      const m = finiteOr(c.metric);
      if (m !== null) cell.metric = Math.max(finiteOr(cell.metric, -Infinity), m);
      cell.threshold = c.threshold ?? cell.threshold;
      if (c.first_step != null) cell.first_step ??= c.first_step;
      if (c.last_step != null) cell.last_step = c.last_step;
    }
    out.push(cell);
  }
  return out;
}

/** The reasons of a skipped (reused) branch: the blocks did not run. */
export const SKIP_REASONS = new Set(["reuse", "forecast", "forecast-fallback"]);

const byCountThenLegend = (a, b) => b[1] - a[1] || Object.keys(REASONS).indexOf(a[0]) - Object.keys(REASONS).indexOf(b[0]);

/** The reason a cell is coloured by: its only reason, else its most frequent computed one, else its most frequent
 * skip reason ("reuse", "forecast", ...). */
export function cellReason(cell) {
  const reasons = Object.entries(cell.reasons);
  if (reasons.length === 1) return reasons[0][0];
  const computed = reasons.filter(([r]) => !SKIP_REASONS.has(r)).sort(byCountThenLegend);
  if (computed.length) return computed[0][0];
  const skipped = reasons.sort(byCountThenLegend);
  return skipped.length ? skipped[0][0] : "reuse";
}

function laneKey(cells) {
  return cells.map((c) => `${c.first_step}:${Object.entries(c.reasons).sort().join(",")}`
    + `:${Object.entries(c.candidates ?? {}).sort().join(",")}`).join(";");
}

/** Sort order of branch names: cond entries, then uncond entries, then the rest (numbers by value). */
export function branchOrder(a, b) {
  const rank = (n) => (n.startsWith("cond") ? 0 : n.startsWith("uncond") ? 1 : 2);
  return rank(a) - rank(b) || a.localeCompare(b, undefined, { numeric: true });
}

/** One lane per distinct strip: branches whose every cell has the same reasons share a lane ("cond + uncond"). */
export function lanes(run, maxCells = Infinity) {
  const byBranch = branchCells(run);
  const groups = new Map();
  for (const name of Object.keys(byBranch).sort(branchOrder)) {
    const cells = byBranch[name];
    const key = laneKey(cells);
    if (!groups.has(key)) groups.set(key, { branches: [], cells });
    groups.get(key).branches.push(name);
  }
  return [...groups.values()].map((g) => ({
    label: g.branches.join(" + "), branches: g.branches, cells: binCells(g.cells, maxCells),
    summarised: g.cells.length > maxCells || (run?.records?.length ?? 0) === 0,
  }));
}

/** Words for the strip's rows: what cond/uncond are, and why their rows differ or are one. */
export function branchExplanation(laneList) {
  const names = laneList.flatMap((l) => l.branches);
  if (names.length < 2) return "";
  const cfg = names.some((n) => n.startsWith("uncond"))
    ? "cond is your prompt, uncond the negative prompt of classifier-free guidance; "
    : "each conditioning entry is its own branch; ";
  if (laneList.length === 1) return `${cfg}both were decided alike at every evaluation, so they share one row.`;
  return `${cfg}each keeps its own cache state, but one batch is computed or reused as a whole: a branch that could `
    + `have been reused while another needed computing shows "other branch".`;
}

/** The legend: every reason that occurs in ``laneList`` (also inside binned cells), in REASONS order. */
export function legend(laneList) {
  const present = new Set(laneList.flatMap((l) => l.cells.flatMap((c) => [cellReason(c), ...Object.keys(c.reasons)])));
  return Object.keys(REASONS).filter((r) => present.has(r));
}

/** Words for one cell (its tooltip). */
export function describeCell(cell, lane) {
  const steps = cell.first_step == null ? "evaluation"
    : cell.last_step != null && cell.last_step !== cell.first_step ? `steps ${cell.first_step + 1}–${cell.last_step + 1}`
      : `step ${cell.first_step + 1}`;
  const reasons = Object.entries(cell.reasons).map(([r, k]) => (cell.n > 1 ? `${REASONS[r]?.label ?? r} ${k}` : REASONS[r]?.label ?? r));
  const what = cell.n > 1 ? `${cell.reused}/${cell.n} reused (${reasons.join(", ")})`
    : `${cell.reused ? "reused" : "computed"}${cell.reused ? "" : ` (${reasons.join(", ")})`}`;
  const metric = cell.metric == null ? "" : `, ${cell.n > 1 ? "peak " : ""}change ${formatValue(cell.metric)}`;
  return `${lane.label}, ${steps}: ${what}${forecastWords(cell)}${metric}`;
}

/** With a forecast: which candidate each skipped evaluation of ``cell`` used, e.g. ", 1st order" or
 * ", 1st order 3, reuse 1" ("" without a forecast). */
export function forecastWords(cell) {
  const used = Object.entries(cell.candidates ?? {}).sort((a, b) => b[1] - a[1] || a[0] - b[0]);
  if (!used.length) return "";
  const name = (f) => FORECAST_CANDIDATES[f] ?? `candidate ${f}`;
  return ", " + (cell.n > 1 ? used.map(([f, k]) => `${name(f)} ${k}`) : used.map(([f]) => name(f))).join(", ");
}

/** Axis labels for a strip: 1-based step numbers at the first, middle and last cell (the last one's last step). */
export function stepTicks(cells) {
  if (!cells.length) return [];
  const last = cells.length - 1;
  const idx = cells.length < 3 ? [...cells.keys()] : [0, Math.floor(last / 2), last];
  return [...new Set(idx)].filter((i) => cells[i].first_step != null).map((i) => ({
    index: i, position: last > 0 ? i / last : 0,
    label: String((i === last && i > 0 ? cells[i].last_step ?? cells[i].first_step : cells[i].first_step) + 1),
  }));
}

/** The plot's data: per lane, finite metric points by cell index, the threshold and the value range. */
export function plotData(laneList) {
  const series = laneList.map((l) => ({
    label: l.label, n: l.cells.length,
    points: l.cells.map((c, i) => ({ index: i, step: c.first_step, metric: finiteOr(c.metric), computed: c.computed > 0 }))
      .filter((p) => p.metric !== null),
  })).filter((s) => s.points.length);
  // "NaN"/"Infinity" metrics cannot be drawn: count them so the panel can say so
  const nonFinite = laneList.reduce((a, l) => a + l.cells.filter((c) => isNonFinite(c.metric)).length, 0);
  const thresholds = laneList.flatMap((l) => l.cells.map((c) => c.threshold)).filter((t) => t != null);
  const threshold = thresholds.length ? thresholds.at(-1) : null;
  const values = series.flatMap((s) => s.points.map((p) => p.metric));
  const t = finiteOr(threshold);
  const max = Math.max(...values, t ?? 0, 0) || 1;
  return { series, threshold, nonFinite, max: niceMax(max * 1.05), cells: Math.max(0, ...laneList.map((l) => l.cells.length)) };
}

function niceMax(x) {
  const p = 10 ** Math.floor(Math.log10(x));
  for (const m of [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

/** The warnings of a run: the server's, or ours when a finished run reused nothing. */
export function warnings(run) {
  const fromServer = run?.summary?.warnings ?? [];
  if (fromServer.length) return fromServer.map(String);
  const c = counters(run);
  if (run?.finished && c.evaluations > 0 && c.reused === 0) {
    return ["nothing was reused: the threshold may be too low, the model may be few-step or distilled, "
      + "or the start/end window may exclude every step"];
  }
  return [];
}

/** Whether the run has a cache's numbers (steps seen, or a finished cache's summary); a run of CPU Offload or
 * Sequence Parallel alone has only its features' cards. */
export function isCacheRun(run) {
  return (run?.records?.length ?? 0) > 0 || !!run?.timeline
    || (!!run?.summary && typeof run.summary === "object" && Number.isFinite(run.summary.evaluations));
}

function features(run) {
  return (Array.isArray(run?.features) ? run.features : []).filter((f) => f && typeof f === "object");
}

/** The run's features other than its cache (offload, sequence parallel, ...), or every feature of a run without
 * one, as cards: a title; a headline that says what the feature did and what it cost (CPU Offload and Sequence
 * Parallel: from their numbers; any other kind: the one it published, may be ""); tiles ``{value, label}``; a per-step
 * strip (``stepStrip``, null without per-step numbers); its notes; and every field as key/value rows (folded away in
 * the panel). */
export function featureCards(run) {
  return features(run).map((f) => {
    const summary = f.summary && typeof f.summary === "object" ? f.summary : {};
    const view = CARD_VIEWS[f.kind]?.(summary) ?? {};
    return {
      kind: String(f.kind ?? "feature"),
      title: [FEATURE_NAMES[f.kind] ?? f.kind ?? "feature", f.node_title, f.node_id != null ? `#${f.node_id}` : null]
        .filter(Boolean).join(" · "),
      headline: view.headline ?? (typeof f.headline === "string" ? f.headline : ""),
      tiles: view.tiles ?? [],
      strip: view.strip ? { ...view.strip, label: view.stripLabel } : null,
      notes: (Array.isArray(summary.notes) ? summary.notes : []).map(String).filter((n) => n !== view.headline),
      rows: Object.entries(summary).filter(([k]) => !FOLDED_OUT.has(k)).map(([k, v]) => [k.replace(/_/g, " "), formatField(k, v)]),
    };
  });
}

const FEATURE_NAMES = { offload: "offload", sequence_parallel: "sequence parallel" };
const FOLDED_OUT = new Set(["steps", "notes"]);  // drawn as the strip and the notes

/** Per-step numbers of a feature (``nodes/stats_store.py`` StepTotals): the steps the model ran (each item may
 * cover several steps of a long run), how many were all skipped by a cache, and the items that ran. */
export function stepTotals(summary) {
  const items = (Array.isArray(summary?.steps) ? summary.steps : []).filter((x) => x && typeof x === "object");
  const span = (x) => (Number.isInteger(x.first_step) && Number.isInteger(x.last_step) ? x.last_step - x.first_step + 1 : 1);
  const skippedWhole = (x) => finiteOr(x.calls, 0) > 0 && finiteOr(x.skipped, 0) >= finiteOr(x.calls, 0);
  return {
    items,
    steps: items.reduce((a, x) => a + span(x), 0),
    skippedSteps: items.filter(skippedWhole).reduce((a, x) => a + span(x), 0),
    ran: items.filter((x) => !skippedWhole(x)),
    ranSteps: items.filter((x) => !skippedWhole(x)).reduce((a, x) => a + span(x), 0),
    sum: (key, list = items) => list.reduce((a, x) => a + finiteOr(x[key], 0), 0),
  };
}

/** The strip of a card: one cell per item of ``summary.steps``, its bar the share of the run's largest ``key`` value;
 * a step a cache skipped on every call is marked so. */
export function stepStrip(summary, key, describe) {
  const t = stepTotals(summary);
  if (!t.items.length) return null;
  const max = Math.max(0, ...t.items.map((x) => finiteOr(x[key], 0)));
  return {
    cells: t.items.map((x) => {
      const skipped = finiteOr(x.calls, 0) > 0 && finiteOr(x.skipped, 0) >= finiteOr(x.calls, 0);
      const steps = x.first_step == null ? "calls without a step"
        : x.last_step !== x.first_step ? `steps ${x.first_step + 1}–${x.last_step + 1}` : `step ${x.first_step + 1}`;
      return { first_step: x.first_step, last_step: x.last_step, skipped, value: finiteOr(x[key], 0),
        share: max > 0 ? finiteOr(x[key], 0) / max : 0, wait: finiteOr(x.copy_wait_seconds, 0),
        title: `${steps}: ${describe(x, skipped)}` };
    }),
  };
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function offloadView(s) {
  const t = stepTotals(s);
  if (!s.active) {
    const notes = Array.isArray(s.notes) ? s.notes : [];
    const headline = String(s.unchanged_reason ?? notes.at(-1) ?? "nothing offloaded");
    return s.host_streaming && typeof s.host_streaming === "object" ? hostStreamingView(s, t, headline) : { headline };
  }
  const skipped = t.items.length ? t.skippedSteps : finiteOr(s.calls_skipped, 0);
  const skippedWord = t.items.length ? "skipped step" : "skipped call";
  const onSkipped = finiteOr(s.bytes_moved_on_skipped_calls, 0);
  const parts = [];
  if (finiteOr(s.blocks_offloaded, 0) > 0) {
    parts.push(`${s.blocks_offloaded} of ${s.blocks_total} blocks in RAM (${formatBytes(s.offloaded_bytes)})`,
      `sampling waited ${formatSeconds(finiteOr(s.copy_wait_seconds, 0))} for copies`);
  } else {
    parts.push("no block offloaded");
  }
  if (finiteOr(s.blocks_promoted, 0) > 0) {
    parts.push(`${plural(s.blocks_promoted, "partly loaded block")} completed on the device (${formatBytes(s.promoted_bytes)})`);
  }
  if (skipped > 0) {
    parts.push(onSkipped ? `${formatBytes(onSkipped)} moved on the ${plural(skipped, skippedWord)}`
      : `nothing moved on the ${plural(skipped, skippedWord)}`);
  }
  const moved = t.sum("bytes_moved", t.ran);
  const tiles = [
    { value: formatBytes(Math.max(0, finiteOr(s.offloaded_bytes, 0) - finiteOr(s.device_bytes, 0))), label: "VRAM kept free",
      help: `the offloaded blocks' weights (${formatBytes(s.offloaded_bytes)}) less the ${plural(finiteOr(s.slots, 0), "slot")} they run from (${formatBytes(s.device_bytes)})` },
    { value: formatBytes(t.ranSteps ? moved / t.ranSteps : finiteOr(s.bytes_moved, 0) / Math.max(1, finiteOr(s.calls_computed, 0))),
      label: t.ranSteps ? "moved per computed step" : "moved per computed call", help: "host-to-device copies of the offloaded blocks" },
    { value: formatSeconds(finiteOr(s.copy_wait_seconds, 0)), label: "waiting for copies",
      help: `${plural(finiteOr(s.sync_loads, 0), "block call")} of ${finiteOr(s.block_calls, 0)} loaded on the critical path` },
  ];
  if (finiteOr(s.device_weight_bytes, 0) > 0) {
    tiles.push({ value: formatBytes(s.device_weight_bytes), label: "weights in VRAM (peak)",
      help: "this model's weights on the device during the run, slots included, as ComfyUI counts them" });
  }
  if (s.placement === "kept" || s.placement === "new") {
    const how = s.placement === "kept" ? "this run reused the blocks packed by the last run of this model"
      : `this run packed the blocks anew (${s.placement_reason ?? "no reason given"})`;
    tiles.push({ value: formatBytes(finiteOr(s.kept_placement_bytes, 0)), label: "RAM kept for the next run",
      help: `${how}; what is kept is freed when ComfyUI unloads the model or its weights change` });
  }
  return {
    headline: parts.join("; "), tiles,
    strip: stepStrip(s, "bytes_moved", (x, skip) => (skip ? "skipped by the cache, nothing to move"
      : `${formatBytes(x.bytes_moved)} moved, waited ${formatSeconds(finiteOr(x.copy_wait_seconds, 0))}`
        + (finiteOr(x.calls, 0) > 1 ? ` (${x.calls} calls)` : ""))),
    stripLabel: "bytes moved",
  };
}

/** CPU Offload stood aside for ComfyUI's dynamic VRAM: what ComfyUI kept resident and what it streamed instead. */
function hostStreamingView(s, t, headline) {
  const h = s.host_streaming;
  const model = finiteOr(h.model_bytes, 0);
  const resident = finiteOr(h.resident_bytes_last_call, 0);
  const streamed = t.ranSteps ? t.sum("not_resident_bytes", t.ran) / t.ranSteps : Math.max(0, model - resident);
  return {
    headline,
    tiles: [
      { value: formatBytes(resident), label: "resident (ComfyUI)",
        help: `this model's weights ComfyUI's dynamic VRAM held on the GPU at the last call, of ${formatBytes(model)}` },
      { value: formatBytes(streamed), label: "streamed per computed step",
        help: "the weights not resident when a computed step began: ComfyUI copies them to the GPU during the step" },
      { value: formatBytes(finiteOr(h.free_bytes_first_call, 0)), label: "VRAM free to ComfyUI",
        help: "what ComfyUI could still give this model at the first call, beyond what it held resident" },
    ],
    strip: stepStrip(s, "not_resident_bytes", (x, skip) => (skip ? "skipped by the cache: no block ran"
      : `${formatBytes(finiteOr(x.not_resident_bytes, 0))} not resident, streamed by ComfyUI`)),
    stripLabel: "streamed by ComfyUI",
  };
}

function sequenceParallelView(s) {
  const t = stepTotals(s);
  const degrees = [`ulysses ${s.ulysses_degree}`, `ring ${s.ring_degree}`,
    finiteOr(s.cfg_degree, 1) > 1 ? `cfg ${s.cfg_degree}` : null].filter(Boolean).join(" × ");
  const devices = Array.isArray(s.local_devices) && s.local_devices.length ? s.local_devices.join(", ") : "";
  const ranks = `${s.world_size} ranks${devices ? ` (${devices})` : ""}`;
  const steps = t.steps || null;
  const perStep = steps ? finiteOr(t.sum("seconds"), 0) / steps : null;
  const bytesPerStep = steps ? t.sum("bytes_sent") / steps : null;
  const decided = t.sum("decided"), skipped = t.sum("skipped");
  const parts = [`${ranks}, ${degrees}`];
  if (perStep != null) parts.push(`${formatSeconds(perStep)} and ${formatBytes(bytesPerStep)} sent per step on rank 0`);
  if (decided) parts.push(`every rank agreed on ${plural(decided, "cache decision")}, ${skipped} skipped`);
  if (finiteOr(s.calls_unsplit, 0) > 0) parts.push(`${plural(s.calls_unsplit, "call")} not split by CFG: ${s.unsplit_reason}`);
  const tiles = [
    { value: String(s.world_size), label: "ranks",
      help: `${degrees}${devices ? ` on ${devices}` : ""}, ${s.backend ?? ""}${s.interface ? ` over ${s.interface}` : ""}`.trim() },
  ];
  if (perStep != null) {
    tiles.push({ value: formatSeconds(perStep), label: "per step",
      help: "rank 0's time in the model per sampler step (no single-rank run of this model to compare with)" });
    tiles.push({ value: formatBytes(bytesPerStep), label: "sent per step", help: "bytes rank 0 sent to the other ranks" });
  }
  if (decided) tiles.push({ value: `${skipped}/${decided}`, label: "agreed skips", help: "cache decisions made alike on every rank" });
  return {
    headline: parts.join("; "), tiles,
    strip: stepStrip(s, "bytes_sent", (x, skip) => `${formatBytes(x.bytes_sent)} sent, ${formatSeconds(finiteOr(x.seconds, 0))}`
      + (skip ? ", skipped by the cache on every rank" : "") + (finiteOr(x.calls, 0) > 1 ? ` (${x.calls} calls)` : "")),
    stripLabel: "bytes sent",
  };
}

const CARD_VIEWS = { offload: offloadView, sequence_parallel: sequenceParallelView };

/** The kinds of what ran in a run: its node's, then its other features' ("teacache + offload"). */
export function runKinds(run) {
  return [...new Set([run?.kind, ...features(run).map((f) => f.kind)].filter(Boolean))]
    .map((k) => FEATURE_NAMES[k] ?? k).join(" + ");
}

/** The heading over the feature cards. */
export function featuresTitle(run) {
  return isCacheRun(run) ? "Other features in this run" : "What this run did";
}

/** The numbers of a run in the list of recent runs: a cache's reuse and speedup, else its features' headlines. */
export function runNumbers(run) {
  if (!run?.finished) return `running ${progress(run)}`.trim();
  if (isCacheRun(run)) {
    const c = counters(run);
    return `${c.reused}/${c.evaluations} · ${formatSpeedup(c.speedup)}`;
  }
  return features(run).map((f) => f.headline).filter((h) => typeof h === "string" && h).join(" · ");
}

/** A summary value by what its key says it holds: "..._bytes" or "bytes_..." as a size, "..._seconds" as a
 * duration. */
function formatField(key, v) {
  if (v && typeof v === "object" && !Array.isArray(v)) {
    return Object.entries(v).map(([k, x]) => `${k} ${formatField(key, x)}`).join(", ") || "–";
  }
  if (typeof v === "number" && Number.isFinite(v)) {
    if (/(^|_)bytes($|_)/.test(key)) return formatBytes(v);
    if (/(^|_)seconds$/.test(key)) return formatSeconds(v);
  }
  return formatValue(v);
}

/** A number, a non-finite marker ("NaN", "Infinity") or anything else, as text for the panel. */
export function formatValue(v) {
  if (v == null) return "–";
  if (typeof v === "number") {
    if (!Number.isFinite(v)) return String(v);
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    return a !== 0 && (a < 0.001 || a >= 1e6) ? v.toExponential(2) : String(Number(v.toPrecision(4)));
  }
  if (typeof v === "string") return v;
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (Array.isArray(v)) return v.map(formatValue).join(", ");
  return JSON.stringify(v);
}

export function isNonFinite(v) {
  return typeof v === "string" && NON_FINITE.has(v);
}

export function formatPercent(x) {
  return Number.isFinite(x) ? `${Math.round(x * 100)}%` : "–";
}

export function formatSpeedup(x) {
  return Number.isFinite(x) ? `${x.toFixed(2)}×` : isNonFinite(x) ? `${x}×` : "–";
}

export function formatSeconds(x) {
  if (!Number.isFinite(x)) return "–";
  if (x === 0) return "0 s";
  if (x > 0 && x < 0.01) return `${Math.max(0.1, Math.round(x * 10000) / 10)} ms`;
  return x >= 100 ? `${Math.round(x)} s` : x >= 10 ? `${x.toFixed(1)} s` : `${x.toFixed(2)} s`;
}

/** "14:03:07" (local time) of a Unix timestamp in seconds. */
export function formatClock(t) {
  if (!Number.isFinite(t)) return "";
  const d = new Date(t * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map((x) => String(x).padStart(2, "0")).join(":");
}

/** When a run ran: "14:03:07, 12.3 s" (or "14:03:07, running"). */
export function formatWhen(run) {
  const start = formatClock(run?.started_at);
  if (!start) return "";
  if (!run.finished) return `${start}, running`;
  const took = Number.isFinite(run.finished_at) && Number.isFinite(run.started_at) ? run.finished_at - run.started_at : null;
  return took == null ? start : `${start}, ${formatSeconds(took)}`;
}

export function formatBytes(n) {
  if (!Number.isFinite(n) || n <= 0) return "0 B";
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

/** For any string put into HTML markup (the panel itself only ever sets textContent). */
export function escapeHtml(value) {
  return String(value).replace(/[&<>"']/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[ch]));
}
