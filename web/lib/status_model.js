// Pure logic of the Comfy Metal frontend: badge text and colour from a backend record, the
// status panel's HTML from the /comfy_metal/status payload, the memory bar, and a poller with
// injected timers. No DOM, no ComfyUI imports: tested with `node --test tests/web`.
// (ComfyUI loads every .js under web/ as an extension module; this one only exports.)

export const BACKEND_EVENT = "comfy_metal.backend";
export const ROUTES = Object.freeze({
  status: "/comfy_metal/status",
  memory: "/comfy_metal/memory",
  settings: "/comfy_metal/settings",
});

// Badge look per overall backend (nodes/status: summarize_backends).
export const BACKEND_STYLES = Object.freeze({
  metal: { label: "Metal", fgColor: "#ffffff", bgColor: "#2e7d32" },
  emulator: { label: "Emulator", fgColor: "#ffffff", bgColor: "#1565c0" },
  reference: { label: "Reference", fgColor: "#1a1a1a", bgColor: "#f2b233" },
  mixed: { label: "Mixed", fgColor: "#ffffff", bgColor: "#c2571a" },
  none: { label: "no kernels", fgColor: "#dddddd", bgColor: "#555555" },
  // /comfy_metal/status: an MPS kernel whose self-check has not run yet (it runs at first use)
  pending: { label: "Pending", fgColor: "#1a1a1a", bgColor: "#b0bec5" },
});

// The pack's node classes from the status route's `pack_nodes` (the pack's NODE_CLASS_MAPPINGS), or null
// when the payload has none (an error, or not loaded yet).
export function packNodeSet(status) {
  return Array.isArray(status?.pack_nodes) ? new Set(status.pack_nodes) : null;
}

// A node class of this pack: listed by the pack itself, not guessed from a name prefix (another pack's
// node can be called "Metal..." too).
export function isPackNode(className, packNodes) {
  return typeof className === "string" && packNodes instanceof Set && packNodes.has(className);
}

export function styleFor(backend) {
  return BACKEND_STYLES[backend] ?? { label: String(backend ?? "?"), fgColor: "#ffffff", bgColor: "#555555" };
}

// {text, tooltip, fgColor, bgColor} for a node's last record, or null (no badge) without one.
export function badgeFor(record) {
  if (!record || typeof record !== "object" || !record.backend) return null;
  const style = styleFor(record.backend);
  const lines = [`Last run: ${style.label}`];
  if (record.note) lines.push(record.note);
  if (record.reason) lines.push(record.reason);
  const kernels = Object.entries(record.kernels ?? {}).sort(([a], [b]) => a.localeCompare(b));
  for (const [name, k] of kernels) {
    const where = k.device ? ` on ${k.device}` : "";
    lines.push(`${name}: ${k.backend}${where}${k.reason ? ` (${k.reason})` : ""}`);
  }
  // a measured choice (e.g. "metal_flash 1.9x sub_quad", nodes/status record_node_backend's note)
  const text = record.note ? `${style.label} · ${record.note}` : style.label;
  return { text, tooltip: lines.join("\n"), fgColor: style.fgColor, bgColor: style.bgColor };
}

// Latest record per node id and per node class, fed by websocket events and the status route.
export function createBackendState() {
  return { byId: new Map(), byClass: new Map() };
}

export function applyBackendRecord(state, record) {
  if (!record || typeof record !== "object" || !record.backend) return false;
  if (record.node_id != null) state.byId.set(String(record.node_id), record);
  if (record.node_class) state.byClass.set(String(record.node_class), record);
  return true;
}

// Seed from GET /comfy_metal/status's node_backends ({key: record}), oldest first.
export function applyStatusNodes(state, status) {
  const records = Object.values(status?.node_backends ?? {}).sort((a, b) => (a.time ?? 0) - (b.time ?? 0));
  let n = 0;
  for (const r of records) n += applyBackendRecord(state, r) ? 1 : 0;
  return n;
}

// The record for a graph node: by its id first, else the latest of its class (records made
// without an executing context only know the class).
export function recordForNode(state, nodeId, nodeClass) {
  if (nodeId != null && state.byId.has(String(nodeId))) {
    const r = state.byId.get(String(nodeId));
    // a record without a class (kernels run inside a core node, e.g. a Metal sampler in KSampler)
    // belongs to whatever node has that id
    if (!nodeClass || !r.node_class || r.node_class === nodeClass) return r;
  }
  const r = nodeClass ? state.byClass.get(String(nodeClass)) : undefined;
  return r && r.node_id == null ? r : null;
}

export function formatBytes(n) {
  if (n == null || !Number.isFinite(Number(n))) return "n/a";
  let v = Number(n);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return i === 0 ? `${Math.trunc(v)} B` : `${v.toFixed(1)} ${units[i]}`;
}

// {fraction in [0,1] | null, label, level: ok|warn|high|unknown} for a /comfy_metal/memory payload.
export function memoryBar(memory) {
  const used = Number(memory?.in_use);
  const max = Number(memory?.recommended_max);
  const device = memory?.device ?? "?";
  if (!Number.isFinite(used) || memory?.in_use == null) {
    return { fraction: null, label: `${device}: memory unknown`, level: "unknown" };
  }
  if (!Number.isFinite(max) || max <= 0 || memory?.recommended_max == null) {
    return { fraction: null, label: `${device}: ${formatBytes(used)} in use`, level: "unknown" };
  }
  const fraction = Math.min(1, Math.max(0, used / max));
  const level = fraction >= 0.9 ? "high" : fraction >= 0.75 ? "warn" : "ok";
  const pct = Math.round((used / max) * 100);
  let label = `${device}: ${formatBytes(used)} of ${formatBytes(max)} recommended max (${pct}%)`;
  if (memory.driver_allocated != null) label += `, driver ${formatBytes(memory.driver_allocated)}`;
  return { fraction, label, level };
}

export function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function table(headers, rows) {
  const head = headers.map((h) => `<th>${escapeHtml(h)}</th>`).join("");
  const body = rows.map((r) => `<tr>${r.map((c) => `<td>${c}</td>`).join("")}</tr>`).join("");
  return `<table class="comfy-metal-table"><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}

export function memoryBarHTML(memory) {
  const bar = memoryBar(memory);
  const pct = bar.fraction == null ? 0 : Math.round(bar.fraction * 1000) / 10;
  return `<div class="comfy-metal-memory" data-level="${bar.level}">` +
    `<div class="comfy-metal-memory-track"><div class="comfy-metal-memory-fill" style="width:${pct}%"></div></div>` +
    `<div class="comfy-metal-memory-label">${escapeHtml(bar.label)}</div></div>`;
}

// A kernel name that may wrap after each "_" (long names wrap at word boundaries, not mid-word).
export function wrapName(name) {
  return escapeHtml(name).replace(/_/g, "_<wbr>");
}

// The chip of a feature's state (nodes/status/summary.py STATE_WORDS keys), in words.
export const FEATURE_CHIPS = Object.freeze({
  metal: { label: "Apple GPU", style: "metal" },
  pending: { label: "checked at first use", style: "pending" },
  emulator: { label: "emulator", style: "emulator" },
  mixed: { label: "partly", style: "mixed" },
  failed: { label: "PyTorch: check failed", style: "mixed" },
  forced: { label: "PyTorch: switched off", style: "reference" },
  cpu: { label: "PyTorch", style: "reference" },
  cuda: { label: "PyTorch", style: "reference" },
});

function chip(label, backendStyle) {
  const s = styleFor(backendStyle);
  return `<span class="comfy-metal-chip" style="background:${s.bgColor};color:${s.fgColor}">${escapeHtml(label)}</span>`;
}

function list(items, cls) {
  if (!Array.isArray(items) || items.length === 0) return "";
  return `<ul class="${cls}">${items.map((t) => `<li>${escapeHtml(t)}</li>`).join("")}</ul>`;
}

// The force-reference switch (the same setting as Settings > Comfy Metal).
export function forceSwitchHTML(status) {
  const on = status?.force_reference ? " checked" : "";
  return `<label class="comfy-metal-switch" title="Run every part of Comfy Metal with its plain PyTorch code ` +
    `in this ComfyUI server, to tell whether a problem comes from the Metal code; the same switch as Settings &gt; ` +
    `Comfy Metal">` +
    `<input type="checkbox" class="comfy-metal-force"${on}> Force reference kernels (plain PyTorch code)</label>`;
}

// The measured choices in a line each: "flash_attention: metal_flash 10 ms, sub_quad 21 ms: metal_flash runs".
export function measuredLines(measured) {
  if (!Array.isArray(measured)) return [];
  return measured.filter((m) => m?.kernel && m?.times_ms).map((m) => {
    const times = Object.entries(m.times_ms).map(([n, t]) => `${n} ${Number(t).toPrecision(3)} ms`).join(", ");
    return `${m.kernel}: ${times}: ${m.choice} runs`;
  });
}

// The Metal tab's body for a status payload (all text escaped): the verdict first, then what the pack saved,
// what to do and the memory bar; the switch, the features with their kernels, the measured choices, the last
// node runs and the capability probe in a collapsed "Details" (`detailsOpen` keeps it open across refreshes).
// The words come from the server (status.summary: nodes/status/summary.py), the same as the Status node's.
export function renderStatusHTML(status, { detailsOpen = false } = {}) {
  if (!status) return `<p class="comfy-metal-muted">Loading…</p>`;
  if (status.error) return `<p class="comfy-metal-error">Status unavailable: ${escapeHtml(status.error)}</p>`;
  const s = status.summary ?? {};
  const saved = list(s.saved, "comfy-metal-saved");
  const todo = list(s.todo, "comfy-metal-todo");
  const features = (s.features ?? []).map((f) => {
    const c = FEATURE_CHIPS[f.state] ?? { label: f.state, style: "none" };
    const failed = (f.failed ?? []).map((x) => `<div class="comfy-metal-muted comfy-metal-small">${wrapName(x.kernel)}: ` +
      `${escapeHtml(x.reason)}</div>`).join("");
    return `<div class="comfy-metal-group" data-feature="${escapeHtml(f.feature)}">` +
      `<div class="comfy-metal-group-head"><strong>${escapeHtml(f.feature)}</strong> ${chip(c.label, c.style)}</div>` +
      `<div class="comfy-metal-small">${escapeHtml(f.words)}</div>${failed}` +
      `<div class="comfy-metal-names">${(f.kernels ?? []).map(wrapName).join(", ")}</div></div>`;
  }).join("");
  const nodes = (s.runs ?? []).map((r) => [wrapName(r.node) +
    `<div class="comfy-metal-muted comfy-metal-small">${escapeHtml([r.words, r.note].filter(Boolean).join(" · "))}</div>`,
  chip(styleFor(r.backend).label, r.backend)]);
  const machine = (s.machine ?? []).map((r) => [`<span title="${escapeHtml(r.key)}">${escapeHtml(r.label)}</span>`,
    escapeHtml(r.value)]);
  const measured = measuredLines(status.measured);
  return [
    `<p class="comfy-metal-verdict">${escapeHtml(s.verdict ?? "")}</p>`,
    saved ? `<h4>What Comfy Metal saved</h4>${saved}` : "",
    todo ? `<h4>What to do</h4>${todo}` : "",
    `<h4>Memory</h4>`, memoryBarHTML(status.memory),
    `<details class="comfy-metal-details"${detailsOpen ? " open" : ""}><summary>Details</summary>`,
    forceSwitchHTML(status),
    `<p class="comfy-metal-muted">${escapeHtml(s.backend ?? "")}</p>`,
    `<h4>What runs where</h4><div class="comfy-metal-groups">${features}</div>`,
    measured.length ? `<h4>Timed on this machine</h4>${list(measured, "comfy-metal-measured")}` : "",
    nodes.length ? `<h4>Last node runs</h4>` + table(["node", "ran on"], nodes) : "",
    `<h4>This machine</h4>`, table(["", ""], machine),
    `</details>`,
  ].join("\n");
}

// Model folders a pack node names that its list does not offer (the frontend's Missing Models list shows only
// files): [{name, url, directory, node}] from each node's `properties.models` entries (the workflows' format).
// `nodes`: [{type, title, widgets: [{value, options: {values}}], properties}].
export function missingModelFolders(nodes, packNodes) {
  const out = [];
  for (const node of nodes ?? []) {
    if (!isPackNode(node?.type, packNodes)) continue;
    for (const entry of node.properties?.models ?? []) {
      if (typeof entry?.name !== "string" || !entry.name.endsWith("/")) continue;
      const widget = (node.widgets ?? []).find((w) => w?.value === entry.name);
      const values = widget?.options?.values;
      if (widget && Array.isArray(values) && !values.includes(entry.name)) {
        out.push({ name: entry.name, url: entry.url, directory: entry.directory, node: node.title ?? node.type });
      }
    }
  }
  return out;
}

// The Comfy Metal Status node's report from its UI output ({"ui": {"text": [...]}} arrives in the
// frontend's `executed` message as {text: [...]}).
export function reportText(output) {
  const text = output?.text;
  if (Array.isArray(text)) return text.map(String).join("\n");
  return typeof text === "string" ? text : "";
}

// A node badge with LGraphBadge's drawing interface (visible, height, getWidth(ctx), draw(ctx, x, y)),
// so it can go into node.badges without importing litegraph.
export class TextBadge {
  constructor({ text = "", fgColor = "#ffffff", bgColor = "#555555", tooltip = "", fontSize = 11,
    padding = 5, height = 18, cornerRadius = 4, onClick = undefined } = {}) {
    Object.assign(this, { text, fgColor, bgColor, tooltip, fontSize, padding, height, cornerRadius, onClick });
    this.xOffset = 0;
    this.yOffset = 0;
    this._boundingRect = [0, 0, 0, 0];
  }

  get boundingRect() {
    return this._boundingRect;
  }

  get visible() {
    return (this.text?.length ?? 0) > 0;
  }

  getWidth(ctx) {
    if (!this.visible) return 0;
    const saved = ctx.font;
    ctx.font = `${this.fontSize}px sans-serif`;
    const w = ctx.measureText(this.text).width;
    ctx.font = saved;
    return w + this.padding * 2;
  }

  draw(ctx, x, y) {
    if (!this.visible) return;
    const { font, fillStyle, textBaseline, textAlign } = ctx;
    const w = this.getWidth(ctx);
    this._boundingRect.splice(0, 4, x, y, w, this.height);
    ctx.font = `${this.fontSize}px sans-serif`;
    ctx.fillStyle = this.bgColor;
    ctx.beginPath();
    if (ctx.roundRect) ctx.roundRect(x, y, w, this.height, this.cornerRadius);
    else ctx.rect(x, y, w, this.height);
    ctx.fill();
    ctx.fillStyle = this.fgColor;
    ctx.textBaseline = "middle";
    ctx.textAlign = "left";
    ctx.fillText(this.text, x + this.padding, y + this.height / 2 + 1);
    Object.assign(ctx, { font, fillStyle, textBaseline, textAlign });
  }
}

export function badgeForNode(state, nodeId, nodeClass, extra = {}) {
  const b = badgeFor(recordForNode(state, nodeId, nodeClass));
  return new TextBadge(b ? { ...b, ...extra } : { text: "" });
}

// Polls `fetchMemory()` every `intervalMs` between start() and stop(); `onUpdate(memory)` gets
// each answer, `onError(err)` each failure. Timers are injected (setTimeout/clearTimeout).
export function createPoller({ fetchMemory, onUpdate, onError = () => {}, intervalMs = 1000,
  setTimer = setTimeout, clearTimer = clearTimeout }) {
  let timer = null;
  let running = false;
  let generation = 0;
  async function tick(gen) {
    if (!running || gen !== generation) return;
    try {
      const memory = await fetchMemory();
      if (running && gen === generation) onUpdate(memory);
    } catch (err) {
      if (running && gen === generation) onError(err);
    }
    if (running && gen === generation) timer = setTimer(() => tick(gen), intervalMs);
  }
  return {
    start() {
      if (running) return false;
      running = true;
      generation += 1;
      tick(generation);
      return true;
    },
    stop() {
      if (!running) return false;
      running = false;
      generation += 1;
      if (timer !== null) clearTimer(timer);
      timer = null;
      return true;
    },
    get running() {
      return running;
    },
  };
}
