// Comfy Metal in the ComfyUI frontend:
//  * a badge on each of the pack's nodes (the node classes the status route lists as the pack's) with
//    the backend its kernels used on the last run: Metal, Emulator, Reference (click it for the reason), Mixed;
//  * a "Metal" sidebar tab (or a floating panel on frontends without sidebar tabs): a one-line verdict
//    in plain words (is the Apple GPU used, for what, how much faster), what the pack saved, what to do,
//    device memory in use against the recommended maximum (polled while a prompt runs), and under a
//    collapsed "Details" the switch, what runs where, the timings, the last node runs and the probe;
//  * the setting "Comfy Metal: force reference kernels" (POST /comfy_metal/settings, this server
//    process only), also as a switch in the tab;
//  * the Comfy Metal Status node shows the same verdict (its UI output) in a read-only text box;
//  * a toast when a loaded workflow names a model folder that is not installed (the frontend's
//    Missing Models list shows only files), with where to download it.
// Data: GET /comfy_metal/status, GET /comfy_metal/memory, websocket event "comfy_metal.backend".
// ComfyUI's `app` and `api`: the frontend's documented globals (window.comfyAPI), else the legacy
// /scripts/ modules (older frontends; newer ones serve them as shims of the same globals).
import {
  BACKEND_EVENT, ROUTES, TextBadge, applyBackendRecord, applyStatusNodes, badgeFor,
  createBackendState, createPoller, isPackNode, memoryBarHTML, missingModelFolders, packNodeSet, recordForNode,
  renderStatusHTML, reportText,
} from "./lib/status_model.js";

const { app } = globalThis.comfyAPI?.app ?? (await import("../../scripts/app.js"));
const { api } = globalThis.comfyAPI?.api ?? (await import("../../scripts/api.js"));

const SETTING_ID = "ComfyMetal.ForceReference";
const STATUS_NODE = "MetalStatus";
const STATUS_NODE_SIZE = [460, 330];   // its verdict and short list, wrapped, without scrolling
const state = createBackendState();
let lastStatus = null;
let lastMemory = null;
const panels = new Set();
let packNodes = null;          // the pack's node classes (status route), null until the first status
const unsorted = new Set();    // nodes created before that list arrived

async function getJSON(route, options) {
  const res = await api.fetchApi(route, options);
  let body = null;
  try {
    body = await res.json();
  } catch {
    body = null;
  }
  if (!res.ok) throw new Error(body?.error ?? `${route}: HTTP ${res.status}`);
  return body;
}

function redrawCanvas() {
  app.graph?.setDirtyCanvas?.(true, false);
  app.canvas?.setDirty?.(true, false);
}

function renderPanels() {
  for (const el of [...panels]) {
    // The sidebar may render into a container it attaches later: forget a panel only once it has
    // been in the document and left it.
    if (el.isConnected) el.dataset.mounted = "1";
    else if (el.dataset.mounted === "1") {
      panels.delete(el);
      continue;
    }
    const status = lastStatus && lastMemory && !lastStatus.error ? { ...lastStatus, memory: lastMemory } : lastStatus;
    const body = el.querySelector(".comfy-metal-body");
    const detailsOpen = !!body.querySelector("details.comfy-metal-details")?.open;   // kept open across refreshes
    body.innerHTML = renderStatusHTML(status, { detailsOpen });
  }
}

function renderMemory() {
  for (const el of panels) {
    const mem = el.querySelector(".comfy-metal-memory");
    if (mem && lastMemory) mem.outerHTML = memoryBarHTML(lastMemory);
  }
}

async function refreshStatus() {
  try {
    lastStatus = await getJSON(ROUTES.status);
    lastMemory = lastStatus.memory ?? lastMemory;
    applyStatusNodes(state, lastStatus);
    const listed = packNodeSet(lastStatus);
    if (listed) {
      packNodes = listed;
      for (const node of unsorted) considerNode(node);
      unsorted.clear();
    }
    redrawCanvas();
  } catch (err) {
    lastStatus = { error: String(err?.message ?? err) };
  }
  renderPanels();
  return lastStatus;
}

const poller = createPoller({
  fetchMemory: () => getJSON(ROUTES.memory),
  onUpdate: (memory) => {
    lastMemory = memory;
    renderMemory();
  },
  onError: (err) => console.warn("[comfy_metal] memory poll failed:", err),
  intervalMs: 1000,
});

function stopPolling() {
  if (poller.stop()) refreshStatus();
}

function injectStyle() {
  if (document.getElementById("comfy-metal-style")) return;
  const style = document.createElement("style");
  style.id = "comfy-metal-style";
  style.textContent = `
    .comfy-metal-panel { padding: 8px 10px; font-size: 12px; overflow: auto; height: 100%; box-sizing: border-box; }
    .comfy-metal-panel h4 { margin: 10px 0 4px; font-size: 12px; }
    .comfy-metal-table { border-collapse: collapse; width: 100%; table-layout: fixed; overflow-wrap: anywhere; }
    .comfy-metal-table td:last-child, .comfy-metal-table th:last-child { width: 38%; }
    .comfy-metal-verdict { font-weight: 600; font-size: 13px; margin: 4px 0 8px; line-height: 1.35; }
    .comfy-metal-saved, .comfy-metal-todo, .comfy-metal-measured { margin: 2px 0 6px; padding-left: 16px; }
    .comfy-metal-details { margin-top: 10px; }
    .comfy-metal-details > summary { cursor: pointer; font-weight: 600; }
    .comfy-metal-switch { display: flex; gap: 6px; align-items: center; cursor: pointer; margin: 4px 0; }
    .comfy-metal-group { margin: 4px 0 6px; }
    .comfy-metal-group-head { display: flex; gap: 6px; align-items: baseline; flex-wrap: wrap; }
    .comfy-metal-group-head strong { display: inline-block; }
    .comfy-metal-group-head strong::first-letter { text-transform: uppercase; }
    .comfy-metal-names { margin: 2px 0 0; opacity: .7; font-family: ui-monospace, Menlo, monospace; font-size: 10px; }
    .comfy-metal-small { font-size: 11px; }
    .comfy-metal-table td, .comfy-metal-table th { border-bottom: 1px solid rgba(127,127,127,.25); padding: 2px 4px; text-align: left; vertical-align: top; }
    .comfy-metal-chip { border-radius: 4px; padding: 0 5px; white-space: nowrap; }
    .comfy-metal-muted { opacity: .7; margin: 2px 0; }
    .comfy-metal-error { color: #e57373; }
    .comfy-metal-memory-track { height: 8px; border-radius: 4px; background: rgba(127,127,127,.3); overflow: hidden; }
    .comfy-metal-memory-fill { height: 100%; background: #2e7d32; }
    .comfy-metal-memory[data-level=warn] .comfy-metal-memory-fill { background: #f2b233; }
    .comfy-metal-memory[data-level=high] .comfy-metal-memory-fill { background: #c62828; }
    .comfy-metal-float { position: fixed; right: 12px; bottom: 12px; width: 420px; max-height: 60vh; z-index: 1000;
      background: var(--comfy-menu-bg, #222); color: var(--fg-color, #ddd); border: 1px solid #555; border-radius: 6px; }
    .comfy-metal-toggle { position: fixed; right: 12px; bottom: 12px; z-index: 1001; }
  `;
  document.head.appendChild(style);
}

function buildPanel(container) {
  injectStyle();
  const el = document.createElement("div");
  el.className = "comfy-metal-panel";
  el.innerHTML = `<div style="display:flex;gap:6px;align-items:center">
      <strong style="flex:1">Comfy Metal</strong><button class="comfy-metal-refresh">Refresh</button></div>
    <div class="comfy-metal-body"></div>`;
  el.querySelector(".comfy-metal-refresh").addEventListener("click", () => refreshStatus());
  // the force-reference switch (re-rendered with the body): the same setting as in Settings
  el.addEventListener("change", (event) => {
    if (event.target?.classList?.contains("comfy-metal-force")) setForceReference(!!event.target.checked);
  });
  container.appendChild(el);
  panels.add(el);
  renderPanels();
  refreshStatus();
  return el;
}

function showReason(record) {
  const badge = badgeFor(record);
  if (!badge) return;
  const toast = app.extensionManager?.toast;
  if (toast?.add) toast.add({ severity: record.backend === "metal" ? "info" : "warn", summary: `Comfy Metal: ${badge.text}`, detail: badge.tooltip, life: 8000 });
  else console.info(`[comfy_metal] ${badge.tooltip}`);
}

function attachBadge(node) {
  if (node.__comfyMetalBadge) return;
  node.__comfyMetalBadge = true;
  const nodeClass = () => node.comfyClass ?? node.type;
  // One badge object per node, refreshed from the latest record on every draw.
  const badge = new TextBadge({ text: "" });
  badge.onClick = () => showReason(recordForNode(state, node.id, nodeClass()));
  const getBadge = () => {
    const look = badgeFor(recordForNode(state, node.id, nodeClass()));
    return Object.assign(badge, look ?? { text: "", tooltip: "" });
  };
  if (Array.isArray(node.badges)) {
    node.badges.push(getBadge);
    return;
  }
  // Older frontends without node badges: draw it in the title bar ourselves.
  const onDrawForeground = node.onDrawForeground;
  node.onDrawForeground = function (ctx, ...rest) {
    const r = onDrawForeground?.apply(this, [ctx, ...rest]);
    const badge = getBadge();
    if (badge.visible) {
      const titleHeight = globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
      badge.draw(ctx, this.size[0] - badge.getWidth(ctx) - 6, -titleHeight + (titleHeight - badge.height) / 2);
    }
    return r;
  };
}

// From the tab's switch: through ComfyUI's setting (its onChange posts it, and Settings shows it), or
// straight to the route on frontends without the settings API.
async function setForceReference(value) {
  const settings = app.extensionManager?.setting;
  if (typeof settings?.set === "function" && typeof settings?.get === "function") {
    if (settings.get(SETTING_ID) !== value) {
      await settings.set(SETTING_ID, value);
      return;
    }
  }
  await postForceReference(value);
}

// The status node: a read-only text box that shows the report of its last run.
function reportWidget(node) {
  let widget = node.widgets?.find((w) => w.name === "report");
  if (widget) return widget;
  const ComfyWidgets = globalThis.comfyAPI?.widgets?.ComfyWidgets;
  if (typeof ComfyWidgets?.STRING !== "function") return null;
  widget = ComfyWidgets.STRING(node, "report", ["STRING", { multiline: true }], app).widget;
  const el = widget.element;
  if (el) {
    el.readOnly = true;
    el.placeholder = "Queue this node to see whether the Apple GPU is used here, and for what.";
    Object.assign(el.style, { fontFamily: "system-ui, sans-serif", fontSize: "11px", whiteSpace: "pre-wrap" });
  }
  widget.serialize = false;                       // not saved in the workflow,
  if (widget.options) widget.options.serialize = false;   // nor sent as an input of the prompt
  return widget;
}

function setupStatusNode(nodeType) {
  const onNodeCreated = nodeType.prototype.onNodeCreated;
  nodeType.prototype.onNodeCreated = function (...args) {
    const r = onNodeCreated?.apply(this, args);
    reportWidget(this);
    this.setSize?.([Math.max(this.size?.[0] ?? 0, STATUS_NODE_SIZE[0]), Math.max(this.size?.[1] ?? 0, STATUS_NODE_SIZE[1])]);
    return r;
  };
  const onExecuted = nodeType.prototype.onExecuted;
  nodeType.prototype.onExecuted = function (output, ...rest) {
    const r = onExecuted?.apply(this, [output, ...rest]);
    const widget = reportWidget(this);
    if (widget) widget.value = reportText(output);
    redrawCanvas();
    return r;
  };
}

async function postForceReference(value) {
  try {
    const body = await getJSON(ROUTES.settings, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ force_reference: !!value }),
    });
    if (lastStatus && !lastStatus.error) lastStatus.force_reference = body.force_reference;
    refreshStatus();
  } catch (err) {
    console.warn("[comfy_metal] could not change the kernel setting:", err);
  }
}

app.registerExtension({
  name: "comfy_metal.status",
  settings: [
    {
      id: SETTING_ID,
      category: ["Comfy Metal", "Kernels", "Force reference"],
      name: "Comfy Metal: force reference kernels",
      tooltip: "Run every Comfy Metal kernel with its pure-PyTorch reference (COMFY_METAL_BACKEND=reference) in this ComfyUI server process. For troubleshooting; slower on Macs.",
      type: "boolean",
      defaultValue: false,
      onChange: (value, oldValue) => {
        // On page load onChange reports the stored value: only a stored "on" is sent, so a server
        // started with COMFY_METAL_BACKEND=reference is not switched back by a default "off".
        if (oldValue === undefined && !value) return;
        if (value === oldValue) return;
        postForceReference(value);
      },
    },
  ],

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name === STATUS_NODE) setupStatusNode(nodeType);
  },

  async setup() {
    api.addEventListener(BACKEND_EVENT, (event) => {
      if (applyBackendRecord(state, event.detail)) {
        // core nodes running Metal kernels (e.g. KSampler with a *_metal sampler) get a badge too
        const id = event.detail.node_id;
        const node = id == null ? null : (app.graph?.getNodeById?.(Number(id)) ?? app.graph?.getNodeById?.(id));
        if (node) attachBadge(node);
        redrawCanvas();
        if (lastStatus && !lastStatus.error) {
          const key = event.detail.node_id ?? event.detail.node_class;
          lastStatus.node_backends = { ...(lastStatus.node_backends ?? {}), [key]: event.detail };
          renderPanels();
        }
      }
    });
    api.addEventListener("execution_start", () => poller.start());
    api.addEventListener("executing", (event) => {
      if (event.detail === null || event.detail?.node === null) stopPolling();
      else poller.start();
    });
    for (const name of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(name, stopPolling);
    }

    const sidebar = app.extensionManager;
    if (typeof sidebar?.registerSidebarTab === "function") {
      sidebar.registerSidebarTab({
        id: "comfy-metal",
        icon: "pi pi-bolt",
        title: "Metal",
        tooltip: "Comfy Metal: kernels, capabilities, memory",
        type: "custom",
        render: (container) => buildPanel(container),
      });
    } else {
      injectStyle();
      const button = document.createElement("button");
      button.className = "comfy-metal-toggle";
      button.textContent = "Metal";
      let floating = null;
      button.addEventListener("click", () => {
        if (floating) {
          floating.remove();
          floating = null;
          return;
        }
        floating = document.createElement("div");
        floating.className = "comfy-metal-float";
        document.body.appendChild(floating);
        buildPanel(floating);
      });
      document.body.appendChild(button);
    }
    refreshStatus();
  },

  nodeCreated(node) {
    considerNode(node);
  },

  async afterConfigureGraph() {
    if (packNodes === null) await refreshStatus();
    warnMissingFolders(app.graph?.nodes ?? []);
  },
});

// A loaded workflow's pack node names a model folder that is not installed: say which and where to get it
// (the frontend lists missing files, not folders; the loader's validation says the same when queued).
function warnMissingFolders(nodes) {
  const toast = app.extensionManager?.toast;
  for (const m of missingModelFolders(nodes.map((n) => ({ type: n.comfyClass ?? n.type, title: n.title,
    widgets: n.widgets, properties: n.properties })), packNodes)) {
    const detail = `${m.node} needs the model folder ${m.name}: download every file of ${m.url} into ` +
      `ComfyUI/models/${m.directory}/${m.name}, then press R.`;
    if (toast?.add) toast.add({ severity: "warn", summary: "Comfy Metal: a model folder is missing", detail });
    else console.info(`[comfy_metal] ${detail}`);
  }
}

// A pack node gets its badge; a node created before the pack's node list is known waits for it.
function considerNode(node) {
  if (packNodes === null) unsorted.add(node);
  else if (isPackNode(node.comfyClass ?? node.type, packNodes)) attachBadge(node);
}

// For the headless browser test and for debugging from the console.
globalThis.comfyMetal = { state, refreshStatus, get lastStatus() { return lastStatus; }, poller, attachBadge };
