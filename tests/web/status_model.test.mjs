// node --test tests/web   (node >= 20; run from pytest by tests/test_web_logic.py)
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  BACKEND_STYLES, TextBadge, applyBackendRecord, applyStatusNodes, badgeFor, badgeForNode,
  capabilityRows, createBackendState, createPoller, escapeHtml, formatBytes, isPackNode, packNodeSet,
  kernelCapability, kernelGroups, kernelRows, measuredSpeedups, memoryBar, memoryBarHTML, recordForNode,
  renderStatusHTML, reportText, summaryLine, wrapName,
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

test("capability and kernel rows", () => {
  assert.deepEqual(capabilityRows({ mps_available: false, torch: "2.13.0", mps_recommended_max_memory: null }),
    [["mps_available", "no"], ["torch", "2.13.0"], ["mps_recommended_max_memory", "n/a"]]);
  const rows = kernelRows({ softmax: { backend: "metal", device: "mps", reason: "passed" }, a: { backend: "reference" } });
  assert.deepEqual(rows.map((r) => r.name), ["a", "softmax"]);
  assert.equal(rows[1].label, "Metal");
  assert.equal(rows[0].reason, "");
});

test("summary line: kernels on Metal, backends, measured speedups", () => {
  assert.equal(summaryLine({ kernels: {} }), "0 of 0 kernels on Metal · measured speedups: none yet");
  assert.equal(summaryLine({ kernels: { a: { backend: "metal" }, b: { backend: "metal" }, c: { backend: "reference" } } }),
    "2 of 3 kernels on Metal · backends: Metal 2, Reference 1 · measured speedups: none yet");
  assert.equal(summaryLine({ kernels: { a: { backend: "reference" } }, force_reference: true }),
    "0 of 1 kernels on Metal · backends: Reference 1 · measured speedups: none yet · reference forced");
  assert.match(summaryLine({ kernels: { a: { backend: "pending" }, b: { backend: "emulator" } } }),
    /0 of 2 kernels on Metal · backends: Emulator 1, Pending 1/);
  // dispatch.measured_records(): the choice against its fastest rival, per kernel and choice
  const measured = [
    { kernel: "attention", choice: "metal", times_ms: { metal: 1.0, sdpa: 2.0, math: 5.0 }, shape_class: [1, 64] },
    { kernel: "attention", choice: "metal", times_ms: { metal: 2.0, sdpa: 3.0 }, shape_class: [1, 128] },
    { kernel: "gemv", choice: "decode_matmul", times_ms: { decode_matmul: 1.0, gemv: 1.25 }, shape_class: [4] },
    { kernel: "broken", choice: "x", times_ms: { x: 1.0 } },
  ];
  assert.deepEqual(measuredSpeedups(measured), [
    "attention: metal 1.5-2.0x faster than sdpa (2 shapes)", "gemv: decode_matmul 1.3x faster than gemv (1 shape)"]);
  assert.match(summaryLine({ kernels: { a: { backend: "metal" } }, measured }),
    /1 of 1 kernels on Metal · backends: Metal 1 · measured: attention: metal 1\.5-2\.0x faster than sdpa \(2 shapes\); gemv/);
  assert.deepEqual(measuredSpeedups(undefined), []);
});

test("kernels group by capability with a shared reason stated once", () => {
  const cpu = "Metal runs only on MPS tensors (this call is on cpu)";
  const kernels = {
    fp8_decode: { backend: "reference", reason: cpu, device: "cpu", source: "fp8.metal" },
    sampler_euler_step: { backend: "reference", reason: cpu, device: "cpu", source: "sampling.metal" },
    sampler_heun_step: { backend: "reference", reason: cpu, device: "cpu", source: "sampling.metal" },
    gemv: { backend: "reference", reason: cpu, device: "cpu", source: "linear.metal" },
  };
  const { common, groups } = kernelGroups(kernels);
  assert.equal(common, cpu);
  assert.deepEqual(groups.map((g) => [g.capability, g.rows.length, g.backend, g.reason]),
    [["FP8", 1, "reference", null], ["FP8 Linear (GEMV)", 1, "reference", null], ["Sampling", 2, "reference", null]]);
  const html = renderStatusHTML({ kernels, capabilities: {} });
  assert.equal(html.split(cpu.replace("(", "").slice(0, 30)).length - 1, 1, "the shared reason appears once");
  assert.match(html, /All kernels: Metal runs only on MPS/);
  assert.ok(html.indexOf("Sampling") < html.indexOf("Capabilities"));
  // on a Mac: a group with its own reason, and a kernel that differs from its group keeps its chip and reason
  const mac = {
    sampler_euler_step: { backend: "metal", reason: "passed its self-check", device: "mps", source: "sampling.metal" },
    sampler_heun_step: { backend: "metal", reason: "passed its self-check", device: "mps", source: "sampling.metal" },
    vae_pad: { backend: "reference", reason: "MPS pad is safe here: the platform op", device: "mps", source: "vae.metal" },
    vae_blend_accumulate: { backend: "metal", reason: "passed its self-check", device: "mps", source: "vae.metal" },
  };
  const g = kernelGroups(mac);
  assert.equal(g.common, null);
  assert.deepEqual(g.groups.map((x) => [x.capability, x.backend, x.reason]),
    [["Sampling", "metal", "passed its self-check"], ["VAE", null, null]]);
  const macHtml = renderStatusHTML({ kernels: mac, capabilities: {} });
  assert.match(macHtml, /vae_<wbr>pad<\/span> <span class="comfy-metal-chip"[^>]*>Reference<\/span>/);
  assert.match(macHtml, /MPS pad is safe here/);
  assert.equal(kernelCapability("attention_fwd", {}), "Attention");
  assert.equal(kernelCapability("x", { source: "metal_kernels/gguf.metal" }), "GGUF");
  assert.equal(kernelCapability("newcap_k", {}), "Newcap");
});

test("names wrap after underscores; the force switch reflects the setting", () => {
  assert.equal(wrapName("sampler_dpmpp_2m<b>"), "sampler_<wbr>dpmpp_<wbr>2m&lt;b&gt;");
  assert.match(renderStatusHTML({ kernels: {}, force_reference: true }), /class="comfy-metal-force" checked/);
  assert.doesNotMatch(renderStatusHTML({ kernels: {}, force_reference: false }), /comfy-metal-force" checked/);
  const html = renderStatusHTML({ kernels: {} });
  assert.ok(html.indexOf("comfy-metal-summary") < html.indexOf("comfy-metal-force"), "the summary line comes first");
});

test("the status node's report from its UI output", () => {
  assert.equal(reportText({ text: ["Kernels", "softmax reference"] }), "Kernels\nsoftmax reference");
  assert.equal(reportText({ text: "one" }), "one");
  assert.equal(reportText(undefined), "");
});

test("panel HTML shows kernels, nodes, capabilities and escapes text", () => {
  const html = renderStatusHTML({
    capabilities: { mps_available: false, "<b>": "<script>" },
    backend_setting: "auto",
    kernels: { softmax: { backend: "reference", device: "cpu", reason: "Metal runs only on MPS tensors (<cpu>)" } },
    node_backends: { 7: refRecord },
    memory: { device: "cpu", in_use: 1024, recommended_max: 4096 },
  });
  assert.match(html, /0 of 1 kernels on Metal/);
  assert.match(html, /softmax/);
  assert.match(html, /MetalKSampler/);
  assert.match(html, /\(&lt;cpu&gt;\)/);
  assert.match(html, /&lt;script&gt;/);
  assert.doesNotMatch(html, /<script>/);
  assert.match(html, /width:25%/);
  assert.match(renderStatusHTML({ error: "boom <x>" }), /Status unavailable: boom &lt;x&gt;/);
  assert.match(renderStatusHTML(null), /Loading/);
  assert.equal(escapeHtml(`a&"'`), "a&amp;&quot;&#39;");
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
