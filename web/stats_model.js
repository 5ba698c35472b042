// Pure logic of the OmniHooks cache-statistics panel: no DOM, no ComfyUI imports (tested with node --test).
// Events come from nodes/stats_store.py: "omni_hooks.step" after each model evaluation, "omni_hooks.run" at the end.

export const STEP_EVENT = "omni_hooks.step";
export const RUN_EVENT = "omni_hooks.run";
export const MAX_RUNS = 20;

export function createState() {
  return { live: null, runs: [], hitRateByNode: {} };
}

function newLive(ev) {
  return {
    run_id: ev.run_id, prompt_id: ev.prompt_id ?? null, node_id: ev.node_id ?? null, kind: ev.kind ?? "cache",
    model: ev.model ?? "", total_steps: ev.total_steps ?? null, evaluations: [], branches: {}, finished: false,
    summary: null, status: null,
  };
}

/** Record one "omni_hooks.step" event. Starts a new live run when the run id changes. */
export function applyStep(state, ev) {
  if (!ev || typeof ev !== "object" || !ev.run_id) return state;
  if (!state.live || state.live.run_id !== ev.run_id) state.live = newLive(ev);
  const live = state.live;
  if (ev.total_steps != null) live.total_steps = ev.total_steps;
  const record = { step: ev.step ?? null, computed: !!ev.computed, seconds: Number(ev.seconds) || 0 };
  live.evaluations.push(record);
  for (const b of Array.isArray(ev.branches) ? ev.branches : []) {
    const name = String(b.branch ?? "all");
    (live.branches[name] ??= []).push({
      step: ev.step ?? null, computed: !!b.computed, reason: String(b.reason ?? ""),
      metric: typeof b.metric === "number" ? b.metric : null,
      threshold: typeof b.threshold === "number" ? b.threshold : null,
    });
  }
  return state;
}

/** Record one "omni_hooks.run" event or a run from GET /omni_hooks/runs. */
export function applyRun(state, entry) {
  if (!entry || typeof entry !== "object" || !entry.run_id) return state;
  state.runs = [entry, ...state.runs.filter((r) => r.run_id !== entry.run_id)].slice(0, MAX_RUNS);
  if (entry.node_id != null && entry.summary) state.hitRateByNode[String(entry.node_id)] = entry.summary.hit_rate;
  if (state.live && state.live.run_id === entry.run_id) {
    state.live.finished = true;
    state.live.summary = entry.summary ?? null;
    state.live.status = entry.status ?? null;
  } else if (!state.live || state.live.finished) {
    state.live = liveFromRun(entry);
  }
  return state;
}

/** Rebuild a (finished) live view from a stored run, e.g. after a page reload. */
export function liveFromRun(entry) {
  const live = newLive(entry);
  for (const ev of entry.evaluations ?? []) {
    applyStep({ live }, { ...ev, run_id: entry.run_id });
  }
  live.finished = true;
  live.summary = entry.summary ?? null;
  live.status = entry.status ?? null;
  return live;
}

/** Counters of a live run: what the panel shows while it is going. */
export function counters(live) {
  const evaluations = live?.evaluations ?? [];
  const computed = evaluations.filter((e) => e.computed);
  const reused = evaluations.length - computed.length;
  const modelSeconds = evaluations.reduce((a, e) => a + e.seconds, 0);
  const meanComputed = computed.length ? computed.reduce((a, e) => a + e.seconds, 0) / computed.length : 0;
  const saved = reused * meanComputed;
  return {
    evaluations: evaluations.length, computed: computed.length, reused,
    hitRate: evaluations.length ? reused / evaluations.length : 0,
    speedup: modelSeconds > 0 ? (modelSeconds + saved) / modelSeconds : 1,
  };
}

/** Per branch, one cell per evaluation: "computed" or "reused". */
export function strips(live) {
  const out = {};
  for (const [name, cells] of Object.entries(live?.branches ?? {})) {
    out[name] = cells.map((c) => (c.computed ? "computed" : "reused"));
  }
  return out;
}

/** The warnings to show for a run: the server's, or ours when a finished run reused nothing. */
export function warnings(live) {
  const fromServer = live?.summary?.warnings ?? [];
  if (fromServer.length) return fromServer.map(String);
  const c = counters(live);
  if (live?.finished && c.evaluations > 0 && c.reused === 0) {
    return ["nothing was reused: the threshold may be too low, the model may be few-step or distilled, "
      + "or the start/end window may exclude every step"];
  }
  return [];
}

/** Points for the metric-vs-threshold plot of one branch (evaluations that measured something). */
export function metricSeries(live, branch) {
  return (live?.branches?.[branch] ?? [])
    .map((c, i) => ({ index: i, step: c.step, metric: c.metric, threshold: c.threshold, computed: c.computed }))
    .filter((p) => p.metric !== null);
}

export function formatPercent(x) {
  return Number.isFinite(x) ? `${Math.round(x * 100)}%` : "–";
}

export function formatSpeedup(x) {
  return Number.isFinite(x) ? `${x.toFixed(2)}×` : "–";
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
