// node --test tests/web   (node >= 20; run from pytest by tests/test_web_logic.py)
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  BACKEND_STYLES, FEATURE_CHIPS, TextBadge, applyBackendRecord, applyStatusNodes, badgeFor, badgeForNode,
  createBackendState, createPoller, escapeHtml, formatBytes, isPackNode, measuredLines, memoryBar, memoryBarHTML,
  missingModelFolders, packNodeSet, recordForNode, renderStatusHTML, reportText, wrapName,
} from "../../web/lib/status_model.js";

// Shaped like nodes/status's record_node_backend() output.
const refRecord = {
  node_id: "7", node_class: "MetalKSampler", backend: "reference",
  reason: "Metal runs only on MPS tensors (this call is on cpu)",
  kernels: { sampler_step: { backend: "reference", reason: "Metal runs only on MPS tensors (this call is on cpu)", device: "cpu" } },
  time: 10,
};
const metalRecord = {
  node_id: "3", node_class: "MetalVAEDecodeTiled", backend: "metal", reason: "every kernel passed its self-check",
  kernels: { vae_conv: { backend: "metal", reason: "passed its self-check", device: "mps" } }, time: 11,
};

test("pack nodes are the classes the status route lists, not a name prefix", () => {
  const pack = packNodeSet({ pack_nodes: ["MetalKSampler", "MetalStatus"] });
  assert.equal(isPackNode("MetalKSampler", pack), true);
  assert.equal(isPackNode("KSampler", pack), false);
  assert.equal(isPackNode("MetalFromAnotherPack", pack), false);   // a "Metal" prefix is not enough
  assert.equal(isPackNode(undefined, pack), false);
  assert.equal(isPackNode("MetalKSampler", null), false);           // no list yet: nothing is the pack's
  assert.equal(packNodeSet({ error: "down" }), null);
});

test("badge text, colour and tooltip follow the record", () => {
  const m = badgeFor(metalRecord);
  assert.equal(m.text, "Metal");
  assert.equal(m.bgColor, BACKEND_STYLES.metal.bgColor);
  const r = badgeFor(refRecord);
  assert.equal(r.text, "Reference");
  assert.notEqual(r.bgColor, m.bgColor);
  assert.match(r.tooltip, /Last run: Reference/);
  assert.match(r.tooltip, /sampler_step: reference on cpu \(Metal runs only on MPS/);
  const noted = badgeFor({ ...metalRecord, note: "metal_flash 1.9x sub_quad" });
  assert.equal(noted.text, "Metal · metal_flash 1.9x sub_quad");
  assert.match(noted.tooltip, /Last run: Metal\nmetal_flash 1.9x sub_quad/);
  assert.equal(badgeFor(null), null);
  assert.equal(badgeFor({ node_class: "MetalX" }), null);
  assert.equal(badgeFor({ backend: "mixed", reason: "reference for a: x" }).text, "Mixed");
  assert.equal(badgeFor({ backend: "weird" }).text, "weird");
});

test("records are found by node id, class-only records by class", () => {
  const s = createBackendState();
  assert.equal(applyBackendRecord(s, refRecord), true);
  assert.equal(applyBackendRecord(s, { nonsense: 1 }), false);
  assert.equal(recordForNode(s, 7, "MetalKSampler"), refRecord);
  assert.equal(recordForNode(s, "7", "MetalKSampler"), refRecord);
  // another node of the same class that has not run has no badge (the record names node 7)
  assert.equal(recordForNode(s, 8, "MetalKSampler"), null);
  // a stale id now holding another class does not borrow the record
  assert.equal(recordForNode(s, 7, "MetalOther"), null);
  const classOnly = { node_id: null, node_class: "MetalLoader", backend: "metal", kernels: {} };
  applyBackendRecord(s, classOnly);
  assert.equal(recordForNode(s, 99, "MetalLoader"), classOnly);
  // kernels run inside a core node: no class in the record, it belongs to the executing node id
  const inSampler = { node_id: "12", node_class: null, backend: "metal", kernels: {} };
  applyBackendRecord(s, inSampler);
  assert.equal(recordForNode(s, 12, "KSampler"), inSampler);
  assert.equal(recordForNode(s, 13, "KSampler"), null);
  const badge = badgeForNode(s, 99, "MetalLoader");
  assert.ok(badge instanceof TextBadge);
  assert.equal(badge.text, "Metal");
  assert.equal(badgeForNode(s, 1, "MetalNothing").visible, false);
});

test("status node_backends seed the state oldest first", () => {
  const s = createBackendState();
  const older = { ...refRecord, backend: "metal", time: 1 };
  const n = applyStatusNodes(s, { node_backends: { a: refRecord, b: older } });
  assert.equal(n, 2);
  assert.equal(recordForNode(s, "7", "MetalKSampler").backend, "reference");
  assert.equal(applyStatusNodes(s, {}), 0);
});

test("bytes format like nodes/common/report.py human_bytes", () => {
  assert.equal(formatBytes(512), "512 B");
  assert.equal(formatBytes(1536), "1.5 KiB");
  assert.equal(formatBytes(21.5 * 1024 ** 3), "21.5 GiB");
  assert.equal(formatBytes(null), "n/a");
  assert.equal(formatBytes("x"), "n/a");
});

test("memory bar fraction, level and label", () => {
  const gib = 1024 ** 3;
  const ok = memoryBar({ device: "mps", in_use: 4 * gib, recommended_max: 16 * gib, driver_allocated: 5 * gib });
  assert.equal(ok.fraction, 0.25);
  assert.equal(ok.level, "ok");
  assert.equal(ok.label, "mps: 4.0 GiB of 16.0 GiB recommended max (25%), driver 5.0 GiB");
  assert.equal(memoryBar({ device: "mps", in_use: 12 * gib, recommended_max: 16 * gib }).level, "warn");
  assert.equal(memoryBar({ device: "mps", in_use: 15 * gib, recommended_max: 16 * gib }).level, "high");
  const over = memoryBar({ device: "cuda", in_use: 20 * gib, recommended_max: 16 * gib });
  assert.equal(over.fraction, 1);
  assert.match(over.label, /\(125%\)/);
  assert.deepEqual(memoryBar({ device: "cpu", in_use: null }), { fraction: null, label: "cpu: memory unknown", level: "unknown" });
  assert.equal(memoryBar({ device: "cpu", in_use: 1024, recommended_max: null }).label, "cpu: 1.0 KiB in use");
  assert.match(memoryBarHTML({ device: "mps", in_use: 1, recommended_max: 4 }), /width:25%/);
});

// Shaped like nodes/status/summary.py plain_summary() output (the status route's `summary`).
const macSummary = {
  verdict: "Apple GPU: in use for attention and sampling; 2.1× faster attention measured",
  saved: ["flux1-dev-Q4_K_S.gguf: 6.0 GiB in memory, where bf16 would take 22.0 GiB"],
  todo: ["PyTorch 2.13.0: upgrade to 2.15 or newer (pip install --upgrade torch)"],
  features: [
    { feature: "attention", state: "metal", words: "uses the Apple GPU", kernels: ["flash_attention"], failed: [] },
    { feature: "FP8 models", state: "mixed", words: "1 of 2 parts: uses the Apple GPU; 1 of 2 parts: plain PyTorch code",
      kernels: ["fp8_decode", "gemv"], failed: [{ kernel: "gemv", reason: "self-check case 0 failed: <x>" }] },
  ],
  runs: [{ node: "#7 MetalKSampler", backend: "metal", words: "uses the Apple GPU", note: "metal_flash 1.9x sub_quad" }],
  machine: [{ label: "Apple GPU", value: "yes", key: "mps_available" }, { label: "<b>", value: "<script>", key: "k" }],
  backend: "Kernel choice: automatic (COMFY_METAL_BACKEND=auto)",
};

test("the tab leads with the verdict; saved, to do and memory follow; the rest is in a collapsed Details", () => {
  const html = renderStatusHTML({ summary: macSummary, force_reference: false,
    memory: { device: "mps", in_use: 1024, recommended_max: 4096 },
    measured: [{ kernel: "flash_attention", choice: "metal_flash", times_ms: { metal_flash: 10, sub_quad: 21 } }] });
  assert.ok(html.startsWith('<p class="comfy-metal-verdict">Apple GPU: in use for attention and sampling; 2.1× faster'));
  const details = html.indexOf('<details class="comfy-metal-details">');
  assert.ok(details > 0 && html.includes("<summary>Details</summary>"));
  for (const first of ["What Comfy Metal saved", "flux1-dev-Q4_K_S.gguf: 6.0 GiB", "What to do", "upgrade to 2.15", "width:25%"]) {
    assert.ok(html.indexOf(first) > 0 && html.indexOf(first) < details, first);
  }
  for (const later of ["comfy-metal-force", "COMFY_METAL_BACKEND=auto", "flash_<wbr>attention", "#7 MetalKSampler",
    "uses the Apple GPU · metal_flash 1.9x sub_quad",
    "Timed on this machine", "flash_attention: metal_flash 10.0 ms, sub_quad 21.0 ms: metal_flash runs", "Apple GPU</span>"]) {
    assert.ok(html.indexOf(later) > details, later);
  }
  assert.match(html, /data-feature="FP8 models"/);
  assert.match(html, new RegExp(`>${FEATURE_CHIPS.mixed.label}</span>`));
  assert.match(html, /gemv: self-check case 0 failed: &lt;x&gt;/);        // a failure's reason, escaped
  assert.match(html, /<span title="k">&lt;b&gt;<\/span>/);
  assert.doesNotMatch(html, /<script>/);
  assert.doesNotMatch(html, /MPS tensors|mps_available<|probe/);            // the probe keys only as tooltips
  assert.match(renderStatusHTML({ summary: macSummary }, { detailsOpen: true }), /<details class="comfy-metal-details" open>/);
  // nothing saved, nothing to do: no empty sections
  const bare = renderStatusHTML({ summary: { verdict: "No Apple GPU here", saved: [], todo: [], features: [], machine: [] } });
  assert.doesNotMatch(bare, /What Comfy Metal saved|What to do/);
  assert.deepEqual(measuredLines(undefined), []);
});

test("names wrap after underscores; the force switch reflects the setting", () => {
  assert.equal(wrapName("sampler_dpmpp_2m<b>"), "sampler_<wbr>dpmpp_<wbr>2m&lt;b&gt;");
  assert.match(renderStatusHTML({ summary: macSummary, force_reference: true }), /class="comfy-metal-force" checked/);
  assert.doesNotMatch(renderStatusHTML({ summary: macSummary, force_reference: false }), /comfy-metal-force" checked/);
});

test("the status node's report from its UI output", () => {
  assert.equal(reportText({ text: ["Kernels", "softmax reference"] }), "Kernels\nsoftmax reference");
  assert.equal(reportText({ text: "one" }), "one");
  assert.equal(reportText(undefined), "");
});

test("errors and loading", () => {
  assert.match(renderStatusHTML({ error: "boom <x>" }), /Status unavailable: boom &lt;x&gt;/);
  assert.match(renderStatusHTML(null), /Loading/);
  assert.equal(escapeHtml(`a&"'`), "a&amp;&quot;&#39;");
});

test("model folders a pack node names but its list lacks are found from properties.models", () => {
  const pack = packNodeSet({ pack_nodes: ["MetalMoETextEncoderLoader", "MetalFP8ModelLoader"] });
  const entry = { name: "Qwen3-30B-A3B-Instruct-2507/", url: "https://huggingface.co/Qwen/Qwen3-30B-A3B-Instruct-2507",
    directory: "text_encoders" };
  const moe = { type: "MetalMoETextEncoderLoader", title: "Load MoE Text Encoder (Metal)",
    widgets: [{ value: entry.name, options: { values: ["(put a model folder in ...)"] } }], properties: { models: [entry] } };
  const file = { type: "MetalFP8ModelLoader", widgets: [{ value: "a.safetensors", options: { values: [] } }],
    properties: { models: [{ name: "a.safetensors", url: "u", directory: "diffusion_models" }] } };
  assert.deepEqual(missingModelFolders([moe, file], pack), [{ ...entry, node: "Load MoE Text Encoder (Metal)" }]);
  const installed = { ...moe, widgets: [{ value: entry.name, options: { values: [entry.name] } }] };
  assert.deepEqual(missingModelFolders([installed], pack), []);
  assert.deepEqual(missingModelFolders([{ ...moe, type: "OtherPackLoader" }], pack), []);   // not the pack's
  assert.deepEqual(missingModelFolders([moe], null), []);
});

function fakeCtx() {
  const calls = [];
  return {
    calls, font: "10px serif", fillStyle: "#000", textBaseline: "alphabetic", textAlign: "start",
    measureText(t) { return { width: t.length * 6 }; },
    beginPath() { calls.push(["beginPath"]); },
    roundRect(...a) { calls.push(["roundRect", ...a]); },
    rect(...a) { calls.push(["rect", ...a]); },
    fill() { calls.push(["fill", this.fillStyle]); },
    fillText(t, x, y) { calls.push(["fillText", t, x, y, this.fillStyle]); },
  };
}

test("TextBadge draws like an LGraphBadge and restores the context", () => {
  const ctx = fakeCtx();
  const b = new TextBadge({ text: "Metal", fgColor: "#fff", bgColor: "#2e7d32", padding: 5, height: 18 });
  assert.equal(b.visible, true);
  assert.equal(b.getWidth(ctx), 5 * 6 + 10);
  b.draw(ctx, 100, -25);
  assert.deepEqual(ctx.calls.find((c) => c[0] === "roundRect"), ["roundRect", 100, -25, 40, 18, 4]);
  assert.deepEqual(ctx.calls.find((c) => c[0] === "fill"), ["fill", "#2e7d32"]);
  assert.deepEqual(ctx.calls.find((c) => c[0] === "fillText"), ["fillText", "Metal", 105, -15, "#fff"]);
  assert.equal(ctx.font, "10px serif");
  assert.equal(ctx.fillStyle, "#000");
  assert.deepEqual(b.boundingRect, [100, -25, 40, 18]);
  const empty = new TextBadge({ text: "" });
  assert.equal(empty.visible, false);
  assert.equal(empty.getWidth(ctx), 0);
  const before = ctx.calls.length;
  empty.draw(ctx, 0, 0);
  assert.equal(ctx.calls.length, before);
});

test("poller fetches while running, stops cleanly and reports errors", async () => {
  const timers = [];
  const setTimer = (fn) => { timers.push(fn); return timers.length; };
  const cleared = [];
  const clearTimer = (id) => cleared.push(id);
  const seen = [];
  const errors = [];
  let n = 0;
  const poller = createPoller({
    fetchMemory: async () => { n += 1; if (n === 2) throw new Error("down"); return { in_use: n }; },
    onUpdate: (m) => seen.push(m.in_use), onError: (e) => errors.push(e.message), setTimer, clearTimer,
  });
  assert.equal(poller.start(), true);
  assert.equal(poller.start(), false);
  await new Promise((r) => setImmediate(r));
  assert.deepEqual(seen, [1]);
  timers.shift()();
  await new Promise((r) => setImmediate(r));
  assert.deepEqual(errors, ["down"]);
  timers.shift()();
  await new Promise((r) => setImmediate(r));
  assert.deepEqual(seen, [1, 3]);
  assert.equal(poller.stop(), true);
  assert.equal(poller.running, false);
  assert.equal(cleared.length, 1);
  assert.equal(poller.stop(), false);
  // a tick scheduled before stop() does nothing afterwards
  const pending = timers.shift();
  pending?.();
  await new Promise((r) => setImmediate(r));
  assert.deepEqual(seen, [1, 3]);
  assert.equal(n, 3);
});
