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

export function formatValue(v) {
  if (v === true) return "yes";
  if (v === false) return "no";
  if (v == null) return "n/a";
  return String(v);
}

export function capabilityRows(capabilities) {
  return Object.entries(capabilities ?? {}).map(([k, v]) => [k, formatValue(v)]);
}

export function kernelRows(kernels) {
  return Object.entries(kernels ?? {})
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([name, k]) => ({ name, backend: k.backend, device: k.device ?? "", reason: k.reason ?? "",
      label: styleFor(k.backend).label }));
}

export function statusSummary(status) {
  const rows = kernelRows(status?.kernels);
  if (rows.length === 0) return "No kernels registered";
  const fast = rows.filter((r) => r.backend === "metal" || r.backend === "emulator").length;
  const pending = rows.filter((r) => r.backend === "pending").length;
  const setting = status?.force_reference ? " (reference forced)" : "";
  if (pending === rows.length) return `${rows.length} kernels not self-checked yet (each checks at first use)${setting}`;
  const waiting = pending ? `; ${pending} not self-checked yet` : "";
  if (pending === 0 && fast === rows.length) return `All ${rows.length} kernels on ${rows.every((r) => r.backend === "metal") ? "Metal" : "Metal/emulator"}${setting}`;
  if (fast === 0 && pending === 0) return `All ${rows.length} kernels on the reference${setting}`;
  return `${fast} of ${rows.length} kernels on Metal${waiting}${setting}`;
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

// The panel's body for a status payload (all text escaped).
export function renderStatusHTML(status) {
  if (!status) return `<p class="comfy-metal-muted">Loading…</p>`;
  if (status.error) return `<p class="comfy-metal-error">Status unavailable: ${escapeHtml(status.error)}</p>`;
  const chipFor = (b) => (b ? `<span class="comfy-metal-chip" style="background:${b.bgColor};color:${b.fgColor}">${escapeHtml(b.text)}</span>` : "");
  const detail = (text) => (text ? `<div class="comfy-metal-muted comfy-metal-small">${escapeHtml(text)}</div>` : "");
  // Two columns (the sidebar is narrow): the device and reason go under the name.
  const kernels = kernelRows(status.kernels).map((r) => {
    const s = styleFor(r.backend);
    return [escapeHtml(r.name) + detail([r.device, r.reason].filter(Boolean).join(" · ")),
      chipFor({ text: r.label, bgColor: s.bgColor, fgColor: s.fgColor })];
  });
  const nodes = Object.values(status.node_backends ?? {})
    .sort((a, b) => (b.time ?? 0) - (a.time ?? 0))
    .map((r) => [`#${escapeHtml(r.node_id ?? "—")} ${escapeHtml(r.node_class ?? "")}` + detail(r.reason),
      chipFor(badgeFor(r))]);
  const caps = capabilityRows(status.capabilities).map(([k, v]) => [escapeHtml(k), escapeHtml(v)]);
  return [
    `<p class="comfy-metal-summary">${escapeHtml(statusSummary(status))}</p>`,
    `<p class="comfy-metal-muted">COMFY_METAL_BACKEND=${escapeHtml(status.backend_setting ?? "auto")}</p>`,
    `<h4>Memory</h4>`, memoryBarHTML(status.memory),
    `<h4>Kernels</h4>`, table(["kernel", "backend"], kernels),
    nodes.length ? `<h4>Last node runs</h4>` + table(["node", "backend"], nodes) : "",
    `<h4>Capabilities</h4>`, table(["probe", "value"], caps),
  ].join("\n");
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
