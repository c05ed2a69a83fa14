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

// The capability a kernel belongs to, from its .metal source file (the status route's `source`), else
// from its name's first word.
export const CAPABILITY_LABELS = Object.freeze({
  fp8: "FP8", linear: "FP8 Linear (GEMV)", sampling: "Sampling", vae: "VAE", moe: "MoE", softmax: "Softmax",
  attention: "Attention", gguf: "GGUF",
});

export function kernelCapability(name, kernel) {
  const source = typeof kernel?.source === "string" ? kernel.source : "";
  const stem = source ? source.replace(/^.*\//, "").replace(/\.metal$/, "") : String(name).split("_")[0];
  return CAPABILITY_LABELS[stem] ?? (stem ? stem[0].toUpperCase() + stem.slice(1) : "Other");
}

// The kernels grouped by capability (groups and names sorted): {capability, rows, reason, backend}, where
// `reason` / `backend` are set when every kernel of the group shares them (stated once for the group),
// and `common` is the reason every kernel shares (stated once above all groups; groups then omit it).
export function kernelGroups(kernels) {
  const rows = kernelRows(kernels).map((r) => ({ ...r, capability: kernelCapability(r.name, kernels[r.name]) }));
  const byCap = new Map();
  for (const r of rows) {
    if (!byCap.has(r.capability)) byCap.set(r.capability, []);
    byCap.get(r.capability).push(r);
  }
  const shared = (list, key) => (list.length && list.every((r) => r[key] === list[0][key]) ? list[0][key] : null);
  const common = rows.length > 1 ? shared(rows, "reason") : null;
  const groups = [...byCap.entries()].sort(([a], [b]) => a.localeCompare(b)).map(([capability, list]) => ({
    capability, rows: list, backend: shared(list, "backend"),
    reason: common === null ? shared(list, "reason") : null,
  }));
  return { common: common || null, groups };
}

// "kernel: choice 1.8x faster than sdpa (3 shapes)" per measured kernel and choice, from the status
// route's `measured` (dispatch.measured_records(): {kernel, choice, times_ms, shape_class, device}).
export function measuredSpeedups(measured) {
  if (!Array.isArray(measured) || measured.length === 0) return [];
  const by = new Map();
  for (const m of measured) {
    const times = m?.times_ms ?? {};
    const chosen = Number(times[m?.choice]);
    const others = Object.entries(times).filter(([n, t]) => n !== m.choice && Number.isFinite(Number(t)));
    if (!m?.kernel || !Number.isFinite(chosen) || chosen <= 0 || others.length === 0) continue;
    const [runnerUp, t] = others.sort((a, b) => a[1] - b[1])[0];
    const key = `${m.kernel}\u0000${m.choice}\u0000${runnerUp}`;
    if (!by.has(key)) by.set(key, { kernel: m.kernel, choice: m.choice, versus: runnerUp, ratios: [] });
    by.get(key).ratios.push(Number(t) / chosen);
  }
  return [...by.values()].sort((a, b) => a.kernel.localeCompare(b.kernel) || a.choice.localeCompare(b.choice))
    .map(({ kernel, choice, versus, ratios }) => {
      const lo = Math.min(...ratios), hi = Math.max(...ratios);
      const x = lo.toFixed(1) === hi.toFixed(1) ? `${lo.toFixed(1)}x` : `${lo.toFixed(1)}-${hi.toFixed(1)}x`;
      const shapes = ratios.length === 1 ? "1 shape" : `${ratios.length} shapes`;
      return `${kernel}: ${choice} ${x} faster than ${versus} (${shapes})`;
    });
}

// The first line of the tab: backends in use, kernels on Metal, measured speedups (once dispatch has
// measured a choice on this machine).
export function summaryLine(status) {
  const rows = kernelRows(status?.kernels);
  const counts = new Map();
  for (const r of rows) counts.set(r.label, (counts.get(r.label) ?? 0) + 1);
  const backends = [...counts.entries()].sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]))
    .map(([label, n]) => `${label} ${n}`).join(", ");
  const onMetal = rows.filter((r) => r.backend === "metal").length;
  const parts = [`${onMetal} of ${rows.length} kernels on Metal`];
  if (backends) parts.push(`backends: ${backends}`);
  const speedups = measuredSpeedups(status?.measured);
  parts.push(speedups.length ? `measured: ${speedups.join("; ")}` : "measured speedups: none yet");
  if (status?.force_reference) parts.push("reference forced");
  return parts.join(" · ");
}

// The force-reference switch (the same setting as Settings > Comfy Metal).
export function forceSwitchHTML(status) {
  const on = status?.force_reference ? " checked" : "";
  return `<label class="comfy-metal-switch" title="Run every Comfy Metal kernel with its pure-PyTorch reference ` +
    `in this ComfyUI server (COMFY_METAL_BACKEND=reference); the same switch as Settings &gt; Comfy Metal">` +
    `<input type="checkbox" class="comfy-metal-force"${on}> Force reference kernels</label>`;
}

// The panel's body for a status payload (all text escaped).
export function renderStatusHTML(status) {
  if (!status) return `<p class="comfy-metal-muted">Loading…</p>`;
  if (status.error) return `<p class="comfy-metal-error">Status unavailable: ${escapeHtml(status.error)}</p>`;
  const chipFor = (b) => (b ? `<span class="comfy-metal-chip" style="background:${b.bgColor};color:${b.fgColor}">${escapeHtml(b.text)}</span>` : "");
  const chipOf = (backend) => {
    const s = styleFor(backend);
    return chipFor({ text: s.label, bgColor: s.bgColor, fgColor: s.fgColor });
  };
  const detail = (text) => (text ? `<div class="comfy-metal-muted comfy-metal-small">${escapeHtml(text)}</div>` : "");
  // Kernels by capability: a group's shared backend and reason once in its header, the names in a
  // wrapping list; a kernel that differs from its group keeps its own chip and reason.
  const { common, groups } = kernelGroups(status.kernels ?? {});
  const kernelHTML = groups.map((g) => {
    const names = g.rows.map((r) => {
      const own = g.backend === null ? ` ${chipOf(r.backend)}` : "";
      const why = g.reason === null && common === null && r.reason ? detail([r.device, r.reason].filter(Boolean).join(" · ")) : "";
      return `<li><span class="comfy-metal-name">${wrapName(r.name)}</span>${own}${why}</li>`;
    }).join("");
    const head = `<div class="comfy-metal-group-head"><strong>${escapeHtml(g.capability)}</strong> ` +
      `<span class="comfy-metal-muted">(${g.rows.length})</span> ${g.backend !== null ? chipOf(g.backend) : ""}</div>`;
    return `<div class="comfy-metal-group" data-capability="${escapeHtml(g.capability)}">${head}` +
      `${g.reason ? detail(g.reason) : ""}<ul class="comfy-metal-names">${names}</ul></div>`;
  }).join("");
  const nodes = Object.values(status.node_backends ?? {})
    .sort((a, b) => (b.time ?? 0) - (a.time ?? 0))
    .map((r) => [`#${escapeHtml(r.node_id ?? "—")} ${wrapName(r.node_class ?? "")}` + detail(r.reason),
      chipFor(badgeFor(r))]);
  const caps = capabilityRows(status.capabilities).map(([k, v]) => [wrapName(k), escapeHtml(v)]);
  return [
    `<p class="comfy-metal-summary">${escapeHtml(summaryLine(status))}</p>`,
    forceSwitchHTML(status),
    `<p class="comfy-metal-muted">COMFY_METAL_BACKEND=${escapeHtml(status.backend_setting ?? "auto")}</p>`,
    `<h4>Memory</h4>`, memoryBarHTML(status.memory),
    `<h4>Kernels</h4>`, common ? `<p class="comfy-metal-muted comfy-metal-common">All kernels: ${escapeHtml(common)}</p>` : "",
    `<div class="comfy-metal-groups">${kernelHTML}</div>`,
    nodes.length ? `<h4>Last node runs</h4>` + table(["node", "backend"], nodes) : "",
    `<h4>Capabilities</h4>`, table(["probe", "value"], caps),
  ].join("\n");
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
