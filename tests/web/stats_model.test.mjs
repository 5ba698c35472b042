// Pure logic of the statistics panel (web/stats_model.js). Run: node --test tests/web/
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  applyRun, applyStep, counters, createState, escapeHtml, formatBytes, formatPercent, liveFromRun, metricSeries,
  strips, warnings,
} from "../../web/stats_model.js";

const step = (run_id, step, computed, extra = {}) => ({
  run_id, prompt_id: "p1", node_id: "10", kind: "teacache", model: "Wan", step, total_steps: 4, computed,
  seconds: computed ? 0.2 : 0.01,
  branches: [
    { branch: "cond", computed, reason: computed ? "threshold" : "reuse", metric: step * 0.1, threshold: 0.25 },
    { branch: "uncond", computed, reason: computed ? "threshold" : "reuse", metric: null, threshold: 0.25 },
  ],
  ...extra,
});

test("step events build per-branch strips and counters", () => {
  const s = createState();
  [true, false, false, true].forEach((c, i) => applyStep(s, step("r1", i, c)));
  assert.deepEqual(strips(s.live), {
    cond: ["computed", "reused", "reused", "computed"], uncond: ["computed", "reused", "reused", "computed"],
  });
  const c = counters(s.live);
  assert.equal(c.evaluations, 4);
  assert.equal(c.reused, 2);
  assert.equal(c.hitRate, 0.5);
  assert.ok(Math.abs(c.speedup - (0.42 + 0.4) / 0.42) < 1e-9);
});

test("a new run id starts a new live run", () => {
  const s = createState();
  applyStep(s, step("r1", 0, true));
  applyStep(s, step("r2", 0, true));
  assert.equal(s.live.run_id, "r2");
  assert.equal(s.live.evaluations.length, 1);
});

test("the run event finishes the live run, records the node's hit rate and dedupes history", () => {
  const s = createState();
  applyStep(s, step("r1", 0, true));
  const entry = { run_id: "r1", node_id: "10", status: "success", summary: { hit_rate: 0.25, warnings: [] }, evaluations: [] };
  applyRun(s, entry);
  applyRun(s, entry);
  assert.equal(s.live.finished, true);
  assert.equal(s.runs.length, 1);
  assert.equal(s.hitRateByNode["10"], 0.25);
});

test("history after a reload rebuilds the last run", () => {
  const entry = {
    run_id: "r9", node_id: "3", kind: "magcache", model: "Flux", status: "success",
    summary: { hit_rate: 0.5, warnings: [] },
    evaluations: [step("r9", 0, true), step("r9", 1, false)].map(({ run_id, ...e }) => e),
  };
  const s = createState();
  applyRun(s, entry);
  assert.equal(s.live.run_id, "r9");
  assert.deepEqual(strips(s.live).cond, ["computed", "reused"]);
  assert.equal(liveFromRun(entry).finished, true);
});

test("a finished run that reused nothing warns; server warnings win", () => {
  const s = createState();
  applyStep(s, step("r1", 0, true));
  assert.deepEqual(warnings(s.live), []);  // still running
  applyRun(s, { run_id: "r1", summary: { hit_rate: 0, warnings: [] } });
  assert.match(warnings(s.live)[0], /nothing was reused/);
  applyRun(s, { run_id: "r1", summary: { hit_rate: 0, warnings: ["threshold is 0"] } });
  assert.deepEqual(warnings(s.live), ["threshold is 0"]);
});

test("metric series skips evaluations without a metric", () => {
  const s = createState();
  [true, false].forEach((c, i) => applyStep(s, step("r1", i, c)));
  assert.equal(metricSeries(s.live, "cond").length, 2);
  assert.equal(metricSeries(s.live, "uncond").length, 0);
});

test("malformed events are ignored", () => {
  const s = createState();
  applyStep(s, null);
  applyStep(s, { step: 1 });
  applyRun(s, "nope");
  assert.equal(s.live, null);
  assert.equal(s.runs.length, 0);
});

test("formatting and escaping", () => {
  assert.equal(formatPercent(0.456), "46%");
  assert.equal(formatPercent(NaN), "–");
  assert.equal(formatBytes(0), "0 B");
  assert.equal(formatBytes(1536), "1.5 KB");
  assert.equal(escapeHtml(`<img src=x onerror="a">&'`), "&lt;img src=x onerror=&quot;a&quot;&gt;&amp;&#39;");
});
