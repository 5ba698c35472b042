// Pure logic of the statistics panel (web/stats_model.js). Run: node --test tests/web/*.test.mjs
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  applyRun, applyStep, badgeFor, binCells, branchCells, branchExplanation, cellReason, counters, createState,
  describeCell, escapeHtml, featureCards, featuresTitle, formatBytes, formatPercent, formatSeconds, formatSpeedup, formatValue,
  forecastWords, formatWhen, isCacheRun, lanes, legend, plotData, progress, runKinds, runNumbers, selectRun, shownRun, speedupBasis, stepStrip,
  stepTicks, stepTotals, warnings,
} from "../../web/stats_model.js";

const header = (run_id, extra = {}) => ({
  run_id, prompt_id: "p1", node_id: "10", node_title: "Apply TeaCache", workflow_id: "wf-a", kind: "teacache",
  model: "Wan", threshold: 0.25, started_at: 1000, ...extra,
});

// one evaluation with a cond and an uncond branch; uncondReason differs from cond's when given
const step = (run_id, i, computed, { total = 4, reason, uncondReason, metric = i * 0.1, extra = {} } = {}) => {
  const r = reason ?? (computed ? "threshold" : "reuse");
  return {
    ...header(run_id, extra), step: i, total_steps: total, computed, seconds: computed ? 0.2 : 0.01,
    branches: [
      { branch: "cond", computed, reason: r, metric, threshold: 0.25 },
      { branch: "uncond", computed, reason: uncondReason ?? r, metric: uncondReason ? metric / 2 : metric, threshold: 0.25 },
    ],
  };
};

const feed = (s, id, pattern, opts) => pattern.forEach((c, i) => applyStep(s, step(id, i, c, opts?.(i) ?? {})));

test("identical branches share one lane coloured by reason; step numbers are 1-based", () => {
  const s = createState();
  feed(s, "r1", [true, false, false, true], (i) => ({ reason: i === 0 ? "first" : undefined }));
  const list = lanes(shownRun(s));
  assert.equal(list.length, 1);
  assert.equal(list[0].label, "cond + uncond");
  assert.deepEqual(list[0].cells.map(cellReason), ["first", "reuse", "reuse", "threshold"]);
  assert.deepEqual(legend(list), ["reuse", "threshold", "first"]);
  assert.match(branchExplanation(list), /share one row/);
  assert.deepEqual(stepTicks(list[0].cells).map((t) => t.label), ["1", "2", "4"]);
  assert.equal(describeCell(list[0].cells[3], list[0]), "cond + uncond, step 4: computed (over threshold), change 0.3");
});

test("forecast steps are their own reason: a colour, a legend entry, counted as reused", () => {
  const s = createState();
  const reasons = ["first", "threshold", "reuse", "forecast", "forecast-fallback", "forced"];
  feed(s, "r1", [true, true, false, false, false, true], (i) => ({ reason: reasons[i] }));
  const list = lanes(shownRun(s));
  assert.deepEqual(list[0].cells.map(cellReason), reasons);
  assert.deepEqual(legend(list), ["reuse", "forecast", "forecast-fallback", "threshold", "first", "forced"]);
  assert.equal(counters(shownRun(s)).reused, 3);
  assert.equal(describeCell(list[0].cells[3], list[0]), "cond + uncond, step 4: reused, change 0.3");
  // binned: a cell of skips only is coloured by its most frequent skip reason; any computed reason wins
  assert.equal(cellReason({ reasons: { reuse: 1, forecast: 3 } }), "forecast");
  assert.equal(cellReason({ reasons: { reuse: 2, forecast: 2 } }), "reuse");
  assert.equal(cellReason({ reasons: { forecast: 5, threshold: 1 } }), "threshold");
});

test("a forecasting run's tooltips say which candidate each skipped step used, also when binned", () => {
  const s = createState();
  const candidates = [null, 1, 2, 0, null];  // auto: 1st order, 2nd order, then plain reuse; computed steps have none
  {
    const steps = [true, false, false, false, true].map((computed, i) => {
      const ev = step("r1", i, computed, { total: 5, reason: [undefined, "forecast", "forecast", "reuse"][i] });
      for (const b of ev.branches) b.candidate = candidates[i];
      ev.branches[1].candidate = i === 1 ? 0 : candidates[i];  // uncond reused where cond forecast
      if (i === 1) ev.branches[1].reason = "reuse";
      return ev;
    });
    steps.forEach((ev) => applyStep(s, ev));
  }
  const list = lanes(shownRun(s));
  assert.equal(list.length, 2);  // the branches used different candidates at step 2: a lane each
  assert.equal(describeCell(list[0].cells[1], list[0]), "cond, step 2: reused, 1st order, change 0.1");
  assert.equal(describeCell(list[0].cells[2], list[0]), "cond, step 3: reused, 2nd order, change 0.2");
  assert.equal(describeCell(list[1].cells[3], list[1]), "uncond, step 4: reused, reuse, change 0.3");
  assert.equal(describeCell(list[0].cells[4], list[0]), "cond, step 5: computed (over threshold), change 0.4");
  const binned = binCells(list[0].cells, 1)[0];
  assert.match(describeCell(binned, list[0]), /^cond, steps 1–5: 3\/5 reused \(.*\), reuse 1, 1st order 1, 2nd order 1, /);
  assert.equal(forecastWords({ n: 1, candidates: {} }), "");
});

test("branches that differ get a lane each and an explanation", () => {
  const s = createState();
  feed(s, "r1", [true, true, false], (i) => ({ uncondReason: i === 1 ? "other-branch" : undefined }));
  const list = lanes(shownRun(s));
  assert.deepEqual(list.map((l) => l.label), ["cond", "uncond"]);
  assert.equal(cellReason(list[1].cells[1]), "other-branch");
  assert.match(branchExplanation(list), /uncond the negative prompt.*other branch/);
});

test("live counters, then the server's summary; the speedup says its basis", () => {
  const s = createState();
  feed(s, "r1", [true, false, false, true]);
  let c = counters(shownRun(s));
  assert.deepEqual([c.evaluations, c.reused, c.hitRate], [4, 2, 0.5]);
  assert.ok(Math.abs(c.speedup - (0.42 + 0.4) / 0.42) < 1e-9);
  assert.match(speedupBasis(c), /0\.42 s in the model \+ ~0\.40 s saved: each reused evaluation counted at the mean computed one \(0\.20 s\)/);
  applyRun(s, { ...header("r1"), status: "success", finished_at: 1012.5,
    summary: { evaluations: 4, computed: 2, reused: 2, hit_rate: 0.5, model_seconds: 0.5, estimated_seconds_saved: 0.5,
      estimated_speedup: 2, warnings: [] } });
  c = counters(shownRun(s));
  assert.equal(c.speedup, 2);
  assert.equal(formatWhen(shownRun(s)).split(", ")[1], "12.5 s");
});

test("the progress counter is 1-based like ComfyUI's progress bar", () => {
  const s = createState();
  applyStep(s, step("r1", 0, true, { total: 30 }));
  assert.equal(progress(shownRun(s)), "step 1/30");
  applyStep(s, step("r1", 29, true, { total: 30 }));
  assert.equal(progress(shownRun(s)), "step 30/30");
});

test("badges are keyed by workflow, prompt and node; running while running", () => {
  const s = createState();
  assert.equal(badgeFor(s, "wf-a", "10"), null);
  applyStep(s, step("r1", 0, true));
  assert.equal(badgeFor(s, "wf-a", "10").text, "running step 1/4");
  assert.equal(badgeFor(s, "wf-b", "10"), null);  // same node id in another workflow: never ran there
  assert.equal(badgeFor(s, "wf-a", "11"), null);
  applyStep(s, step("r1", 1, false));
  applyRun(s, { ...header("r1"), status: "success", summary: { evaluations: 2, computed: 1, reused: 1, hit_rate: 0.5 } });
  assert.equal(badgeFor(s, "wf-a", 10).text, "hit 50%");
  // the next prompt of that workflow replaces it, even while it runs
  applyStep(s, step("r2", 0, true, { extra: { prompt_id: "p2", started_at: 2000 } }));
  assert.equal(badgeFor(s, "wf-a", "10").text, "running step 1/4");
  // a prompt queued without a workflow (API) badges nothing
  applyStep(s, step("r3", 0, true, { extra: { prompt_id: "p3", workflow_id: null, node_id: "12", started_at: 3000 } }));
  assert.equal(badgeFor(s, null, "12"), null);
});

test("two runs of one node in one prompt add up in its badge", () => {
  const s = createState();
  for (const [id, reused] of [["r1", 1], ["r2", 3]]) {
    applyRun(s, { ...header(id), status: "success", summary: { evaluations: 4, computed: 4 - reused, reused, hit_rate: reused / 4 } });
  }
  assert.equal(badgeFor(s, "wf-a", "10").text, "hit 50%");
});

test("a listed run loads its detail later; the shown run is the picked, else the live, else the newest", () => {
  const s = createState();
  const summary = { evaluations: 2, computed: 1, reused: 1, hit_rate: 0.5, warnings: [] };
  applyRun(s, { ...header("old", { started_at: 10 }), status: "success", summary, evaluations: [], timeline: null, detail: "evaluations" });
  assert.equal(shownRun(s).loaded, false);
  applyRun(s, { ...header("old", { started_at: 10 }), status: "success", summary,
    evaluations: [step("old", 0, true), step("old", 1, false)].map(({ run_id, ...e }) => e) });
  assert.equal(shownRun(s).loaded, true);
  assert.deepEqual(lanes(shownRun(s))[0].cells.map(cellReason), ["threshold", "reuse"]);
  applyRun(s, { ...header("new", { started_at: 20 }), status: "success", summary, evaluations: [] });
  assert.equal(shownRun(s).run_id, "new");
  applyStep(s, step("live", 0, true, { extra: { started_at: 30 } }));
  selectRun(s, "old");
  assert.equal(shownRun(s).run_id, "old");
  selectRun(s, null);
  assert.equal(shownRun(s).run_id, "live");
  assert.deepEqual(s.runs.map((r) => r.run_id), ["live", "new", "old"]);
});

test("a summarised long run draws its timeline bins; binning keeps every count", () => {
  const timeline = { bin_size: 50, bins: [
    { first_step: 0, last_step: 49, evaluations: 50, computed: 20,
      branches: { cond: { computed: 20, reused: 30, reasons: { first: 1, threshold: 19, reuse: 30 }, metric_max: 0.3, threshold: 0.25 } } },
    { first_step: 50, last_step: 99, evaluations: 50, computed: 50,
      branches: { cond: { computed: 50, reused: 0, reasons: { forced: 50 }, metric_max: null, threshold: 0.25 } } },
  ] };
  const s = createState();
  applyRun(s, { ...header("long"), status: "success", detail: "timeline", evaluations: [], timeline,
    summary: { evaluations: 100, computed: 70, reused: 30, hit_rate: 0.3 } });
  const run = shownRun(s);
  assert.equal(run.loaded, true);
  const [lane] = lanes(run);
  assert.equal(lane.summarised, true);
  assert.deepEqual(lane.cells.map(cellReason), ["threshold", "forced"]);
  assert.equal(describeCell(lane.cells[0], lane), "cond, steps 1–50: 30/50 reused (first 1, over threshold 19, reused 30), peak change 0.3");
  assert.deepEqual(legend([lane]), ["reuse", "threshold", "first", "forced"]);  // reused shares count too
  assert.deepEqual(stepTicks(lane.cells).map((t) => t.label), ["1", "100"]);  // the last tick is the last step
  const many = Array.from({ length: 1000 }, (_, i) => branchCells({ records: [{ step: i, computed: i % 2 === 0, seconds: 0,
    branches: [{ branch: "cond", computed: i % 2 === 0, reason: i % 2 ? "reuse" : "threshold", metric: i, threshold: 1 }] }] }).cond[0]);
  const binned = binCells(many, 64);
  assert.ok(binned.length <= 64);
  assert.equal(binned.reduce((a, c) => a + c.n, 0), 1000);
  assert.equal(binned.reduce((a, c) => a + c.reused, 0), 500);
  assert.equal(binned.at(-1).metric, 999);
  assert.equal(binned.at(-1).last_step, 999);
});

test("non-finite values arrive as text and are shown as such, never plotted", () => {
  const s = createState();
  applyStep(s, { ...step("r1", 0, true), threshold: "Infinity",
    branches: [{ branch: "cond", computed: true, reason: "threshold", metric: "NaN", threshold: "Infinity" }] });
  applyStep(s, { ...step("r1", 1, false), threshold: "Infinity",
    branches: [{ branch: "cond", computed: false, reason: "reuse", metric: 0.5, threshold: "Infinity" }] });
  const run = shownRun(s);
  assert.equal(formatValue(run.threshold), "Infinity");
  const data = plotData(lanes(run));
  assert.equal(data.threshold, "Infinity");
  assert.deepEqual(data.series[0].points.map((p) => p.metric), [0.5]);
  assert.equal(data.nonFinite, 1);  // counted, so the panel can say what it could not draw
  assert.ok(Number.isFinite(data.max) && data.max >= 0.5);
  assert.match(describeCell(lanes(run)[0].cells[0], lanes(run)[0]), /change NaN$/);
  assert.equal(formatSpeedup("Infinity"), "Infinity×");
});

test("other features' summaries become key/value cards", () => {
  const cards = featureCards({ features: [
    { kind: "offload", node_id: "12", node_title: "CPU Offload", summary: { moved_bytes: 1024, peak_seconds: 0.123456, streams: [1, 2], note: null } },
    null, "junk",
  ] });
  assert.equal(cards.length, 1);
  assert.equal(cards[0].title, "offload · CPU Offload · #12");
  assert.deepEqual(cards[0].rows, [["moved bytes", "1.0 KB"], ["peak seconds", "0.12 s"], ["streams", "1, 2"], ["note", "–"]]);
  // a kind the panel has no view for: its published headline, no tiles, no strip
  const [other] = featureCards({ features: [{ kind: "future", headline: "did a thing", summary: { sizes_bytes: { a: 2048 } } }] });
  assert.deepEqual(other, { kind: "future", title: "future", headline: "did a thing", tiles: [], strip: null, notes: [],
    rows: [["sizes bytes", "a 2.0 KB"]] });
  assert.deepEqual(featureCards({}), []);
});

test("a finished run that reused nothing warns; server warnings win", () => {
  const s = createState();
  applyStep(s, step("r1", 0, true));
  assert.deepEqual(warnings(shownRun(s)), []);  // still running
  applyRun(s, { run_id: "r1", summary: { evaluations: 1, computed: 1, reused: 0, hit_rate: 0, warnings: [] } });
  assert.match(warnings(shownRun(s))[0], /nothing was reused/);
  applyRun(s, { run_id: "r1", summary: { evaluations: 1, computed: 1, reused: 0, hit_rate: 0, warnings: ["threshold is 0"] } });
  assert.deepEqual(warnings(shownRun(s)), ["threshold is 0"]);
});

test("malformed events are ignored", () => {
  const s = createState();
  applyStep(s, null);
  applyStep(s, { step: 1 });
  applyRun(s, "nope");
  applyStep(s, { run_id: "x", branches: "not a list", seconds: "NaN" });
  assert.equal(s.runs.length, 1);
  assert.equal(counters(shownRun(s)).evaluations, 1);
  assert.deepEqual(lanes(shownRun(s)), []);
});

test("formatting and escaping", () => {
  assert.equal(formatPercent(0.456), "46%");
  assert.equal(formatPercent(NaN), "–");
  assert.equal(formatBytes(0), "0 B");
  assert.equal(formatBytes(1536), "1.5 KB");
  assert.equal(formatValue(0.000012), "1.20e-5");
  assert.equal(formatValue(true), "yes");
  assert.equal(formatSeconds(0.0012), "1.2 ms");
  assert.equal(formatSeconds(2.345), "2.35 s");
  assert.equal(escapeHtml(`<img src=x onerror="a">&'`), "&lt;img src=x onerror=&quot;a&quot;&gt;&amp;&#39;");
});

test("a run without a cache (CPU Offload alone) is its feature's card, with its headline in the list", () => {
  const s = createState();
  const offload = { kind: "offload", node_id: "20", node_title: "CPU Offload", headline: "3/4 blocks offloaded, 0.50 GiB moved",
    summary: { blocks_offloaded: 3, blocks_total: 4, bytes_moved: 536870912, status: "success" } };
  // the entry as nodes/stats_store.py publishes it for a run without a cache
  applyRun(s, { run_id: "r-off", prompt_id: "p2", node_id: "20", node_title: "CPU Offload", workflow_id: "wf-a",
    sampler_node_id: "3", kind: "offload", model: "", threshold: null, status: "success", started_at: 2000,
    finished_at: 2003, summary: null, detail: "evaluations", evaluations: [], timeline: null, features: [offload] });
  const run = shownRun(s);
  assert.equal(run.run_id, "r-off");
  assert.equal(isCacheRun(run), false);
  assert.equal(run.loaded, true);
  assert.deepEqual(lanes(run), []);
  assert.deepEqual(warnings(run), []);  // "nothing was reused" is for caches
  assert.equal(featuresTitle(run), "What this run did");
  assert.deepEqual(featureCards(run).map((c) => [c.title, c.rows]), [["offload · CPU Offload · #20",
    [["blocks offloaded", "3"], ["blocks total", "4"], ["bytes moved", "512.0 MB"], ["status", "success"]]]]);
  assert.equal(runNumbers(run), "3/4 blocks offloaded, 0.50 GiB moved");
  // Sequence Parallel with the offload: both headlines, and the world size the header shows
  applyRun(s, { run_id: "r-sp", node_id: "30", node_title: "Sequence Parallel", kind: "sequence_parallel", started_at: 2010,
    status: "success", summary: null, world_size: 2, features: [offload,
      { kind: "sequence_parallel", node_id: "30", node_title: "Sequence Parallel", headline: "2 devices (ulysses 2 × ring 1)",
        summary: { world_size: 2 } }] });
  assert.equal(shownRun(s).world_size, 2);
  assert.equal(runNumbers(shownRun(s)), "3/4 blocks offloaded, 0.50 GiB moved · 2 devices (ulysses 2 × ring 1)");
});

test("a cache's run stays a cache run: its numbers in the list, the other features under their own title", () => {
  const s = createState();
  feed(s, "r1", [true, false]);
  assert.equal(isCacheRun(shownRun(s)), true);
  assert.equal(runNumbers(shownRun(s)), "running step 2/4");
  applyRun(s, { ...header("r1"), status: "success", finished_at: 1001, features: [{ kind: "offload", headline: "x", summary: {} }],
    summary: { evaluations: 2, computed: 1, reused: 1, hit_rate: 0.5, model_seconds: 0.2, estimated_seconds_saved: 0.2,
      estimated_speedup: 2 } });
  assert.equal(runNumbers(shownRun(s)), "1/2 · 2.00×");
  assert.equal(featuresTitle(shownRun(s)), "Other features in this run");
  // listed without detail (GET /omni_hooks/runs?detail=0): the summary alone says it was a cache's run
  const listed = createState();
  applyRun(listed, { ...header("r9"), status: "error", summary: { evaluations: 0, computed: 0, reused: 0 }, evaluations: [] });
  assert.equal(isCacheRun(shownRun(listed)), true);
});

const MB = 1024 * 1024;
// an offload summary as nodes/offload/node.py publishes it: 3 of 4 blocks offloaded, 4 steps, a cache skipped 2
const offloadSummary = (extra = {}) => ({
  kind: "offload", device: "cuda:0", active: true, blocks_total: 4, blocks_offloaded: 3, blocks_promoted: 0,
  offloaded_bytes: 300 * MB, device_bytes: 200 * MB, slots: 2, promoted_bytes: 0, sync_loads: 1, block_calls: 12,
  bytes_moved: 500 * MB, copy_wait_seconds: 0.25, calls_computed: 2, calls_skipped: 2, bytes_moved_on_skipped_calls: 0,
  device_weight_bytes: 600 * MB, unchanged_reason: null, notes: ["VRAM for the blocks: 0.2 GiB (...)"],
  steps: [
    { first_step: 0, last_step: 0, calls: 1, skipped: 0, bytes_moved: 200 * MB, copy_wait_seconds: 0.2 },
    { first_step: 1, last_step: 1, calls: 1, skipped: 1, bytes_moved: 0, copy_wait_seconds: 0 },
    { first_step: 2, last_step: 2, calls: 1, skipped: 1, bytes_moved: 0, copy_wait_seconds: 0 },
    { first_step: 3, last_step: 3, calls: 1, skipped: 0, bytes_moved: 100 * MB, copy_wait_seconds: 0.05 },
  ],
  ...extra,
});

test("the CPU Offload card answers what was offloaded and what it cost, in a headline, tiles and a strip", () => {
  const [card] = featureCards({ features: [{ kind: "offload", node_id: "20", node_title: "CPU Offload", summary: offloadSummary() }] });
  assert.equal(card.headline, "3 of 4 blocks in RAM (300.0 MB); sampling waited 0.25 s for copies; "
    + "nothing moved on the 2 skipped steps");
  assert.deepEqual(card.tiles.map((t) => [t.label, t.value]), [
    ["VRAM kept free", "100.0 MB"], ["moved per computed step", "150.0 MB"], ["waiting for copies", "0.25 s"],
    ["weights in VRAM (peak)", "600.0 MB"]]);
  assert.equal(card.strip.label, "bytes moved");
  assert.deepEqual(card.strip.cells.map((c) => [c.skipped, c.share]), [[false, 1], [true, 0], [true, 0], [false, 0.5]]);
  assert.equal(card.strip.cells[3].title, "step 4: 100.0 MB moved, waited 0.05 s");
  assert.equal(card.strip.cells[1].title, "step 2: skipped by the cache, nothing to move");
  assert.deepEqual(card.notes, ["VRAM for the blocks: 0.2 GiB (...)"]);
  // every field is still there (folded away by the panel), the per-step list drawn as the strip instead
  const rows = Object.fromEntries(card.rows);
  assert.equal(rows["bytes moved"], "500.0 MB");
  assert.equal(rows["copy wait seconds"], "0.25 s");
  assert.ok(!("steps" in rows) && !("notes" in rows));
  // bytes moved on skipped steps are named, not hidden
  const leaky = featureCards({ features: [{ kind: "offload", summary: offloadSummary({ bytes_moved_on_skipped_calls: 2048 }) }] })[0];
  assert.match(leaky.headline, /2\.0 KB moved on the 2 skipped steps$/);
});

test("the CPU Offload card says whether the run reused the last run's packed blocks and the RAM kept for the next", () => {
  const tile = (extra) => featureCards({ features: [{ kind: "offload", summary: offloadSummary(extra) }] })[0].tiles.at(-1);
  const kept = tile({ placement: "kept", placement_reason: "kept from the last run of this model", kept_placement_bytes: 300 * MB });
  assert.deepEqual([kept.label, kept.value], ["RAM kept for the next run", "300.0 MB"]);
  assert.match(kept.help, /^this run reused the blocks packed by the last run of this model; /);
  const anew = tile({ placement: "new", placement_reason: "ComfyUI unloaded the model", kept_placement_bytes: 300 * MB });
  assert.match(anew.help, /^this run packed the blocks anew \(ComfyUI unloaded the model\)/);
  assert.equal(tile({}).label, "weights in VRAM (peak)");  // an older summary: no such tile
});

test("a CPU Offload run that changed nothing says why, with no tiles and no strip", () => {
  const reason = "nothing to offload to: ComfyUI runs this model on the CPU (offload device cpu), so CPU Offload changes nothing";
  const [card] = featureCards({ features: [{ kind: "offload", headline: "nothing offloaded", summary: offloadSummary({
    active: false, blocks_offloaded: 0, unchanged_reason: reason, notes: [reason], bytes_moved: 0,
    steps: [{ first_step: 0, last_step: 0, calls: 1, skipped: 0, bytes_moved: 0, copy_wait_seconds: 0 }] }) }] });
  assert.equal(card.headline, reason);
  assert.deepEqual(card.tiles, []);
  assert.equal(card.strip, null);
  assert.deepEqual(card.notes, []);  // the reason is the headline, not repeated
  // an older entry without the reason: its last note
  const older = featureCards({ features: [{ kind: "offload", summary: { active: false, notes: ["a", "auto: all 4 blocks fit"] } }] })[0];
  assert.equal(older.headline, "auto: all 4 blocks fit");
});

test("a CPU Offload run that stood aside for ComfyUI's dynamic VRAM shows what ComfyUI kept resident and streamed", () => {
  const reason = "this MODEL is a ModelPatcherDynamic (ComfyUI's dynamic VRAM): ComfyUI streams this model's weights";
  const summary = offloadSummary({ active: false, blocks_offloaded: 0, bytes_moved: 0, unchanged_reason: reason,
    notes: [reason], host_streaming: { model_bytes: 1000 * MB, resident_bytes_first_call: 300 * MB, resident_bytes_last_call: 400 * MB,
      free_bytes_first_call: 2 * MB },
    steps: [
      { first_step: 0, last_step: 0, calls: 1, skipped: 0, not_resident_bytes: 700 * MB },
      { first_step: 1, last_step: 1, calls: 1, skipped: 1, not_resident_bytes: 0 },
      { first_step: 2, last_step: 2, calls: 1, skipped: 0, not_resident_bytes: 600 * MB },
    ] });
  const [card] = featureCards({ features: [{ kind: "offload", summary }] });
  assert.equal(card.headline, reason);
  assert.deepEqual(card.tiles.map((t) => [t.label, t.value]), [["resident (ComfyUI)", "400.0 MB"],
    ["streamed per computed step", "650.0 MB"], ["VRAM free to ComfyUI", "2.0 MB"]]);
  assert.equal(card.strip.label, "streamed by ComfyUI");
  assert.deepEqual(card.strip.cells.map((c) => [c.skipped, c.share]), [[false, 1], [true, 0], [false, 600 / 700]]);
  assert.equal(card.strip.cells[1].title, "step 2: skipped by the cache: no block ran");
  assert.match(Object.fromEntries(card.rows)["host streaming"], /model_bytes/);
});

test("the Sequence Parallel card: ranks, degrees, time and bytes per step, agreed cache decisions, unsplit calls", () => {
  const summary = { world_size: 2, ulysses_degree: 2, ring_degree: 1, cfg_degree: 1, backend: "gloo", local_devices: ["cpu", "cpu"],
    interface: "lo (127.0.0.1)", calls: 4, bytes_sent: 3 * MB, bytes_sent_by_exchange: { ulysses_all_to_all: 3 * MB - 64, cache_agreement: 64 },
    calls_unsplit: 0, unsplit_reason: null, steps: [0, 1, 2, 3].map((i) => ({ first_step: i, last_step: i, calls: 1,
      seconds: i === 1 ? 0.1 : 0.5, bytes_sent: i === 1 ? 16 : MB - 5, decided: 1, skipped: i === 1 ? 1 : 0 })) };
  const [card] = featureCards({ features: [{ kind: "sequence_parallel", node_title: "Sequence Parallel", node_id: "30", summary }] });
  assert.equal(card.title, "sequence parallel · Sequence Parallel · #30");
  assert.equal(card.headline, "2 ranks (cpu, cpu), ulysses 2 × ring 1; 0.40 s and 768.0 KB sent per step on rank 0; "
    + "every rank agreed on 4 cache decisions, 1 skipped");
  assert.deepEqual(card.tiles.map((t) => [t.label, t.value]), [["ranks", "2"], ["per step", "0.40 s"],
    ["sent per step", "768.0 KB"], ["agreed skips", "1/4"]]);
  assert.deepEqual(card.strip.cells.map((c) => c.skipped), [false, true, false, false]);
  assert.equal(card.tiles[0].help, "ulysses 2 × ring 1 on cpu, cpu, gloo over lo (127.0.0.1)");  // where the ranks exchange
  assert.equal(Object.fromEntries(card.rows).interface, "lo (127.0.0.1)");
  assert.equal(Object.fromEntries(card.rows)["bytes sent by exchange"], "ulysses_all_to_all 3.0 MB, cache_agreement 64 B");
  const cfg = featureCards({ features: [{ kind: "sequence_parallel", summary: { ...summary, cfg_degree: 2, world_size: 4, local_devices: [],
    calls_unsplit: 2, unsplit_reason: "a batch of 1 does not split into cfg_degree 2 equal parts" } }] })[0];
  assert.match(cfg.headline, /^4 ranks, ulysses 2 × ring 1 × cfg 2; /);
  assert.match(cfg.headline, /; 2 calls not split by CFG: a batch of 1 does not split into cfg_degree 2 equal parts$/);
});

test("per-step totals of a long run count the steps each merged item covers", () => {
  const t = stepTotals({ steps: [{ first_step: 0, last_step: 4, calls: 5, skipped: 0, bytes_moved: 10 },
    { first_step: 5, last_step: 9, calls: 5, skipped: 5, bytes_moved: 0 }, "junk"] });
  assert.deepEqual([t.steps, t.skippedSteps, t.ranSteps, t.sum("bytes_moved")], [10, 5, 5, 10]);
  assert.equal(stepStrip({ steps: [{ first_step: 0, last_step: 4, calls: 5, bytes_moved: 10 }] }, "bytes_moved",
    () => "x").cells[0].title, "steps 1–5: x");
  assert.equal(stepStrip({}, "bytes_moved", () => ""), null);
});

test("a cache run with offload on the same MODEL reads as one run: both kinds in its header", () => {
  const s = createState();
  applyRun(s, { ...header("r1"), status: "success", features: [{ kind: "offload", summary: offloadSummary() }],
    summary: { evaluations: 4, computed: 2, reused: 2, hit_rate: 0.5 } });
  assert.equal(runKinds(shownRun(s)), "teacache + offload");
  assert.equal(runKinds({ kind: "offload", features: [{ kind: "offload" }] }), "offload");
  assert.equal(runKinds({ kind: "teacache", features: [{ kind: "sequence_parallel" }] }), "teacache + sequence parallel");
});

test("a run with a forward budget shows the steps it computed against the budget, numbered from 1", async () => {
  const { budgetStat, compactSteps } = await import("../../web/stats_model.js");
  const s = createState();
  feed(s, "rb", [true, false, true, true], (i) => ({ reason: i === 0 ? "first" : "budget" }));
  assert.equal(budgetStat(shownRun(s)), null);  // not finished: no summary yet
  applyRun(s, { ...header("rb"), finished_at: 2000, status: "success", summary: {
    evaluations: 4, computed: 3, reused: 1, hit_rate: 0.25, notes: [],
    budget: { steps: 3, total_steps: 4, planned: [0, 2, 3], computed: [0, 2, 3], brought_forward: 1, calibrated: false,
              placement: "schedule", placed_by: "the schedule (no calibration)" },
  } });
  const b = budgetStat(shownRun(s));
  assert.equal(b.value, "3/3");
  assert.match(b.help, /^budget 3 of 4 steps; computed 3: steps 1, 3–4; placed by the schedule \(no calibration\)/);
  assert.match(b.help, /1 brought forward by the threshold$/);
  assert.equal(compactSteps([9, 1, 2, 3, 6]), "1–3, 6, 9");
  applyRun(s, { ...header("rm"), finished_at: 2000, status: "success", summary: {
    evaluations: 4, computed: 3, reused: 1, hit_rate: 0.25, notes: [],
    budget: { steps: 3, total_steps: 4, planned: [0, 2, 3], computed: [0, 2, 3], brought_forward: 0, calibrated: true,
              placement: "measured", placed_by: "the calibration's measured trajectory and the sampler's step weights" },
  } });
  assert.equal(budgetStat(shownRun(s)).help,
               "budget 3 of 4 steps; computed 3: steps 1, 3–4; placed by the calibration's measured trajectory and "
               + "the sampler's step weights");
  applyRun(s, { ...header("rn"), finished_at: 2000, status: "success", summary: { evaluations: 4, budget: null } });
  assert.equal(budgetStat(shownRun(s)), null);
});
