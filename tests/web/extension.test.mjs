// The extension entry (web/comfy_metal.js) against fake ComfyUI `app`/`api` modules: it is copied
// into a temporary tree shaped like ComfyUI's served paths (/extensions/<pack>/, /scripts/).
import assert from "node:assert/strict";
import { cp, mkdir, mkdtemp, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath, pathToFileURL } from "node:url";

const WEB = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../web");

const FAKE_APP = `
export const app = {
  extensions: [],
  dirty: 0,
  nodesById: new Map(),
  graph: { setDirtyCanvas() { app.dirty += 1; }, getNodeById(id) { return app.nodesById.get(id) ?? null; } },
  sidebarTabs: [],
  extensionManager: { registerSidebarTab(tab) { app.sidebarTabs.push(tab); } },
  registerExtension(ext) { this.extensions.push(ext); },
};
`;
const FAKE_API = `
export const api = new EventTarget();
api.requests = [];
api.responses = {};
api.fetchApi = async (route, options = {}) => {
  api.requests.push({ route, options });
  const body = api.responses[route] ?? { error: "no fake response" };
  return { ok: !body.error, status: body.error ? 500 : 200, json: async () => body };
};
api.emit = (type, detail) => api.dispatchEvent(new CustomEvent(type, { detail }));
`;

// `globals`: provide app/api as the current frontend does (window.comfyAPI) and serve no /scripts/
// modules, so the legacy import path would fail; else only the legacy /scripts/ modules exist.
async function loadExtension({ globals = false } = {}) {
  const root = await mkdtemp(path.join(tmpdir(), "comfy-metal-web-"));
  await mkdir(path.join(root, "fakes"), { recursive: true });
  await writeFile(path.join(root, "fakes", "app.js"), FAKE_APP);
  await writeFile(path.join(root, "fakes", "api.js"), FAKE_API);
  await writeFile(path.join(root, "package.json"), JSON.stringify({ type: "module" }));
  if (!globals) await cp(path.join(root, "fakes"), path.join(root, "scripts"), { recursive: true });
  const ext = path.join(root, "extensions", "comfy-metal");
  await cp(WEB, ext, { recursive: true });
  const dir = globals ? "fakes" : "scripts";
  const { app } = await import(pathToFileURL(path.join(root, dir, "app.js")).href);
  const { api } = await import(pathToFileURL(path.join(root, dir, "api.js")).href);
  globalThis.comfyAPI = globals ? { app: { app }, api: { api } } : undefined;
  api.responses["/comfy_metal/status"] = {
    capabilities: { mps_available: false }, backend_setting: "auto", force_reference: false,
    kernels: { softmax: { backend: "reference", reason: "cpu", device: "cpu" } }, last_backend: {},
    node_backends: { MetalLoader: { node_id: null, node_class: "MetalLoader", backend: "metal", kernels: {}, time: 1 } },
    memory: { device: "cpu", in_use: 1, recommended_max: 2 },
    pack_nodes: ["MetalKSampler", "MetalLoader", "MetalStatus"],
  };
  api.responses["/comfy_metal/settings"] = { force_reference: true, backend_setting: "reference" };
  await import(pathToFileURL(path.join(ext, "comfy_metal.js")).href);
  return { app, api };
}

const tick = () => new Promise((r) => setImmediate(r));

test("extension registers, badges pack nodes from events, and posts the setting", async () => {
  const { app, api } = await loadExtension();
  assert.equal(app.extensions.length, 1);
  const ext = app.extensions[0];
  assert.equal(ext.name, "comfy_metal.status");
  const setting = ext.settings.find((s) => s.id === "ComfyMetal.ForceReference");
  assert.equal(setting.name, "Comfy Metal: force reference kernels");
  assert.equal(setting.type, "boolean");

  await ext.setup();
  await tick();
  assert.equal(app.sidebarTabs.length, 1);
  assert.equal(app.sidebarTabs[0].type, "custom");
  assert.equal(typeof app.sidebarTabs[0].render, "function");
  assert.ok(api.requests.some((r) => r.route === "/comfy_metal/status"));

  // Only pack nodes (the status route's list) get a badge; it is empty until the node ran.
  const sampler = { id: 7, comfyClass: "MetalKSampler", badges: [] };
  const core = { id: 8, comfyClass: "KSampler", badges: [] };
  const loader = { id: 9, comfyClass: "MetalLoader", badges: [] };
  const other = { id: 10, comfyClass: "MetalFromAnotherPack", badges: [] };
  ext.nodeCreated(sampler);
  ext.nodeCreated(core);
  ext.nodeCreated(loader);
  ext.nodeCreated(other);
  assert.equal(core.badges.length, 0);
  assert.equal(other.badges.length, 0);
  assert.equal(sampler.badges.length, 1);
  assert.equal(sampler.badges[0]().visible, false);
  // seeded from the status route's class-only record
  assert.equal(loader.badges[0]().text, "Metal");

  const dirty = app.dirty;
  api.emit("comfy_metal.backend", { node_id: "7", node_class: "MetalKSampler", backend: "reference",
    reason: "forced by COMFY_METAL_BACKEND/COMFY_METAL_REFERENCE", kernels: {}, time: 2 });
  const badge = sampler.badges[0]();
  assert.equal(badge.text, "Reference");
  assert.match(badge.tooltip, /forced by COMFY_METAL_BACKEND/);
  assert.ok(app.dirty > dirty);

  // A core node whose run used Metal kernels (record without a class) gets a badge on the event.
  const ksampler = { id: 12, comfyClass: "KSampler", badges: [] };
  app.nodesById.set(12, ksampler);
  ext.nodeCreated(ksampler);
  assert.equal(ksampler.badges.length, 0);
  api.emit("comfy_metal.backend", { node_id: "12", node_class: null, backend: "metal", reason: "ok", kernels: {}, time: 3 });
  api.emit("comfy_metal.backend", { node_id: "12", node_class: null, backend: "metal", reason: "ok", kernels: {}, time: 4 });
  assert.equal(ksampler.badges.length, 1);
  assert.equal(ksampler.badges[0]().text, "Metal");

  // Memory is polled while a prompt runs, and not after it finished.
  api.responses["/comfy_metal/memory"] = { device: "cpu", in_use: 5, recommended_max: 10 };
  const before = api.requests.filter((r) => r.route === "/comfy_metal/memory").length;
  api.emit("execution_start", { prompt_id: "p" });
  await tick();
  assert.equal(api.requests.filter((r) => r.route === "/comfy_metal/memory").length, before + 1);
  api.emit("execution_success", { prompt_id: "p" });
  assert.equal(globalThis.comfyMetal.poller.running, false);

  // The stored "off" at page load is not sent; switching on is.
  setting.onChange(false, undefined);
  await tick();
  assert.equal(api.requests.filter((r) => r.route === "/comfy_metal/settings").length, 0);
  setting.onChange(true, false);
  await tick();
  const posts = api.requests.filter((r) => r.route === "/comfy_metal/settings");
  assert.equal(posts.length, 1);
  assert.equal(posts[0].options.method, "POST");
  assert.deepEqual(JSON.parse(posts[0].options.body), { force_reference: true });
});

test("extension takes app/api from window.comfyAPI, and badges nodes created before the status arrived", async () => {
  const { app, api } = await loadExtension({ globals: true });
  try {
    assert.equal(app.extensions.length, 1);
    const ext = app.extensions[0];
    const early = { id: 1, comfyClass: "MetalStatus", badges: [] };
    const core = { id: 2, comfyClass: "KSampler", badges: [] };
    ext.nodeCreated(early);      // a saved workflow's nodes load before the first status
    ext.nodeCreated(core);
    assert.equal(early.badges.length, 0);
    await ext.setup();
    await tick();
    assert.ok(api.requests.some((r) => r.route === "/comfy_metal/status"));
    assert.equal(early.badges.length, 1);
    assert.equal(core.badges.length, 0);

    // The status node: a read-only report box (not saved, not sent), filled from its UI output, and a
    // default size that fits its title.
    const made = [];
    globalThis.comfyAPI.widgets = { ComfyWidgets: { STRING(node, name, spec) {
      const widget = { name, value: "", options: {}, element: { style: {} }, spec };
      node.widgets = [...(node.widgets ?? []), widget];
      made.push(widget);
      return { widget };
    } } };
    class StatusNode {
      constructor() { this.size = [200, 60]; }
      setSize(size) { this.size = size; }
    }
    await ext.beforeRegisterNodeDef(StatusNode, { name: "MetalStatus" });
    class OtherNode {}
    await ext.beforeRegisterNodeDef(OtherNode, { name: "KSampler" });
    assert.equal(OtherNode.prototype.onExecuted, undefined);
    const node = new StatusNode();
    node.onNodeCreated();
    assert.equal(made.length, 1);
    assert.equal(made[0].element.readOnly, true);
    assert.equal(made[0].element.style.whiteSpace, "pre-wrap");      // the short report wraps in the node
    assert.equal(made[0].serialize, false);
    assert.equal(made[0].options.serialize, false);
    assert.ok(node.size[0] >= 440 && node.size[1] >= 300, node.size);
    node.onExecuted({ text: ["Kernels (COMFY_METAL_BACKEND=auto)", "softmax  reference"] });
    assert.equal(made[0].value, "Kernels (COMFY_METAL_BACKEND=auto)\nsoftmax  reference");
    assert.equal(made.length, 1);   // the same box on every run

    // The tab's force-reference switch goes through ComfyUI's setting (Settings shows the same value).
    const stored = new Map();
    app.extensionManager.setting = { get: (id) => stored.get(id) ?? false,
      set: async (id, v) => { stored.set(id, v); } };
    const container = { children: [], appendChild(el) { this.children.push(el); } };
    const listeners = {};
    globalThis.document = {
      getElementById: () => null, head: { appendChild() {} },
      createElement: () => ({ style: {}, dataset: {}, isConnected: true,
        set innerHTML(v) { this._html = v; }, get innerHTML() { return this._html; },
        querySelector: (sel) => (sel === ".comfy-metal-body" ? { innerHTML: "", querySelector: () => null }
          : { addEventListener() {} }),
        addEventListener: (type, fn) => { listeners[type] = fn; } }),
    };
    app.sidebarTabs[0].render(container);
    listeners.change({ target: { classList: { contains: (c) => c === "comfy-metal-force" }, checked: true } });
    await tick();
    assert.equal(stored.get("ComfyMetal.ForceReference"), true);

    // A loaded workflow naming a model folder that is not installed: one warning toast with where to get it.
    const toasts = [];
    app.extensionManager.toast = { add: (t) => toasts.push(t) };
    const folder = { name: "Big-MoE/", url: "https://huggingface.co/org/Big-MoE", directory: "text_encoders" };
    app.graph.nodes = [
      { comfyClass: "MetalLoader", title: "Load MoE", properties: { models: [folder] },
        widgets: [{ value: "Big-MoE/", options: { values: ["(put a model folder in ...)"] } }] },
      { comfyClass: "KSampler", properties: { models: [folder] }, widgets: [{ value: "Big-MoE/", options: { values: [] } }] },
    ];
    await ext.afterConfigureGraph();
    assert.equal(toasts.length, 1);
    assert.equal(toasts[0].severity, "warn");
    assert.equal(toasts[0].detail, "Load MoE needs the model folder Big-MoE/: download every file of " +
      "https://huggingface.co/org/Big-MoE into ComfyUI/models/text_encoders/Big-MoE/, then press R.");
  } finally {
    delete globalThis.document;
    delete globalThis.comfyAPI;
  }
});
