"""What the pack is doing, for the browser: server routes, per-node backend records, memory.

Routes (added to ComfyUI's own server when the pack is imported inside ComfyUI; same origin, JSON):

  GET  /comfy_metal/status    capability probe, COMFY_METAL_BACKEND, each kernel's backend and the
                              reason for it (in a worker thread, not on the event loop; no MPS work:
                              undecided MPS kernels show as "pending"), the last backend per kernel,
                              the per-node records, memory.
  GET  /comfy_metal/memory    device memory only (cheap; the frontend polls it during a run).
  POST /comfy_metal/settings  {"force_reference": true|false}: the ONLY write route. It sets (or
                              restores) COMFY_METAL_BACKEND=reference in this server process only;
                              nothing is written to disk and other processes are not affected.

Per-node backends: a node of the pack calls, at the end of its function,

    from .status import record_node_backend
    record_node_backend("MetalKSampler", ["sampler_euler_step", ...])

with the kernels it called. Code that runs inside a core node records for the executing node:
`recording_kernels(None, kernels)` around a block, or `record_forward_kernels(model, kernels)`
(forward hooks) on an encoder the pack loads or patches and CLIPTextEncode runs. The record
(backend per kernel + the dispatcher's reason) is kept for the status route and
`python -m comfy_metal run`'s summary, and sent to the browser as the websocket event
`comfy_metal.backend` (the node badge listens for it). Recording never raises.

The status displays (the routes, the Status node, the plain-words summary) read the kernel dispatcher's
state only through `dispatch_state`, and the quantized models the pack's loaders hold through
`loaded_models` (each loader calls `record_loaded_model`).

ComfyUI modules are only touched when they are already imported (`"server" in sys.modules`); this
module imports nothing of ComfyUI and touches no GPU at import.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import time
import weakref

log = logging.getLogger("comfy_metal")
BACKEND_EVENT = "comfy_metal.backend"

_lock = threading.Lock()
# node id (or class name when the id is unknown) -> the latest record for it.
node_backends: dict[str, dict] = {}
# Every record in order (bounded), for run summaries: read with records_since(index).
history: collections.deque = collections.deque(maxlen=4096)
_history_count = 0


# --------------------------------------------------------------------------------------------
# Per-node backend records
# --------------------------------------------------------------------------------------------

def _current_node_id() -> str | None:
    """The id of the node ComfyUI is executing (only if ComfyUI's executor is loaded)."""
    utils = sys.modules.get("comfy_execution.utils")
    getter = getattr(utils, "get_executing_context", None)
    if getter is None:
        return None
    try:
        ctx = getter()
    except Exception:
        return None
    node_id = getattr(ctx, "node_id", None) if ctx is not None else None
    return None if node_id is None else str(node_id)


def _kernel_reason(dispatch, name: str, backend: str) -> tuple[str, str | None]:
    """(reason, device) of the dispatcher's decision that produced `backend` for kernel `name`
    under the current environment settings."""
    env = dispatch._env_backend()
    forced = frozenset(dispatch._forced_reference())
    found: list[tuple[str, str]] = []
    with dispatch._lock:
        items = list(dispatch._decisions.items())
    for key, (b, reason) in items:
        if key[0] == name and key[2] == env and key[3] == forced and b == backend:
            found.append((key[1], reason))
    if not found:
        return "", None
    found.sort(key=lambda dr: {"mps": 0, "cuda": 1}.get(dr[0], 2))  # prefer the GPU decision
    return found[0][1], found[0][0]


def summarize_backends(kernels: dict[str, dict]) -> tuple[str, str]:
    """(overall backend, one-line reason) for a node from its kernels' {backend, reason}.

    metal / emulator when every kernel ran that way, reference when every kernel used the
    reference, mixed otherwise, none when no kernel ran.
    """
    backends = {k["backend"] for k in kernels.values() if k.get("backend")}
    if not backends:
        return "none", "no Comfy Metal kernel ran in this node"
    if backends == {"reference"}:
        reasons = sorted({k.get("reason") or "" for k in kernels.values()} - {""})
        return "reference", "; ".join(reasons) if reasons else "the reference kernels were used"
    if "reference" not in backends:
        overall = "emulator" if "emulator" in backends else "metal"
        return overall, "every kernel passed its self-check"
    fallback = sorted(f"{name}: {k.get('reason') or 'reference'}" for name, k in kernels.items()
                      if k.get("backend") == "reference")
    return "mixed", "reference for " + "; ".join(fallback)


def record_node_backend(node_class: str | None, kernels, node_id: str | None = None,
                        note: str | None = None) -> dict | None:
    """Record which backend the kernels `kernels` (names) used in this node's last run.

    Reads `metal_kernels.dispatch.last_backend`; call it at the end of the node function. The node
    id is taken from ComfyUI's executing context when not given. Code that runs inside a core node
    (e.g. a sampler function called by KSampler) passes node_class=None: the record then belongs to
    whichever node is executing, by id. `note`: a short text the badge shows after the backend (e.g.
    a measured choice: "metal_flash 1.9x sub_quad"). Never raises (returns None on an internal problem,
    logged at debug level).
    """
    global _history_count
    try:
        from ...metal_kernels import dispatch

        per_kernel: dict[str, dict] = {}
        for name in kernels or ():
            backend = dispatch.last_backend.get(name)
            if backend is None:
                continue
            reason, device = _kernel_reason(dispatch, name, backend)
            per_kernel[name] = {"backend": backend, "reason": reason, "device": device}
        backend, reason = summarize_backends(per_kernel)
        if node_id is None:
            node_id = _current_node_id()
        record = {"node_id": None if node_id is None else str(node_id),
                  "node_class": None if node_class is None else str(node_class),
                  "backend": backend, "reason": reason, "kernels": per_kernel, "time": time.time()}
        if note:
            record["note"] = str(note)
        with _lock:
            node_backends[record["node_id"] or record["node_class"] or "(unknown node)"] = record
            history.append(record)
            _history_count += 1
        _send_event(BACKEND_EVENT, record)
        return record
    except Exception as e:  # a status badge must never break a node
        log.debug("comfy_metal: could not record the backend of %s: %s", node_class, e)
        return None


@contextlib.contextmanager
def recording_kernels(node_class: str | None, kernels, note=None):
    """Record (for the node badge) the backends of those of `kernels` that run inside the block.
    `note`: the record's note (see record_node_backend), or a function giving it once the block is done.

    node_class None: the record belongs to the executing node, for code that runs inside a core node
    (a sampler inside KSampler, an encoder inside CLIPTextEncode). Only kernels called in the block
    are listed: their `last_backend` entries are set aside first and put back afterwards for those
    the block did not call. Never raises on its own account."""
    from ...metal_kernels import dispatch

    names = tuple(kernels)
    last = dispatch.last_backend
    before = {name: last.pop(name) for name in names if name in last}
    done = False
    try:
        yield
        done = True
    finally:
        ran = [name for name in names if name in last]
        for name, backend in before.items():
            last.setdefault(name, backend)
        if done:
            try:
                text = note() if callable(note) else note
            except Exception as e:       # a badge must never break a node
                log.debug("comfy_metal: badge note of %s: %s", node_class, e)
                text = None
            record_node_backend(node_class, ran, note=text)


class _ForwardRecorder:
    """State of `record_forward_kernels` on one model: the kernels it records, the forward nesting
    depth, and the `last_backend` entries set aside when the outermost hooked forward started."""

    def __init__(self, kernels):
        self.kernels: tuple = tuple(dict.fromkeys(kernels))
        self.depth = 0
        self.before: dict = {}

    def pre(self, module, args):
        try:
            self.depth += 1
            if self.depth == 1:
                from ...metal_kernels import dispatch

                last = dispatch.last_backend
                self.before = {name: last.pop(name) for name in self.kernels if name in last}
        except Exception as e:  # a badge must never break the encoder
            log.debug("comfy_metal: forward record (start) failed: %s", e)

    def post(self, module, args, output):
        try:
            self.depth = max(self.depth - 1, 0)
            if self.depth:
                return
            from ...metal_kernels import dispatch

            last = dispatch.last_backend
            ran = [name for name in self.kernels if name in last]
            for name, backend in self.before.items():
                last.setdefault(name, backend)
            self.before = {}
            if ran and output is not None:  # None: the forward raised (always_call) -> no record
                record_node_backend(None, ran)
        except Exception as e:
            log.debug("comfy_metal: forward record failed: %s", e)


RECORDER_ATTR = "_comfy_metal_forward_recorder"


def record_forward_kernels(model, kernels, depth: int = 2):
    """Record (for the badge of the node ComfyUI is executing, e.g. CLIPTextEncode) the backends of
    those of `kernels` that run inside a forward of `model`: what `recording_kernels(None, kernels)`
    does around a block, as PyTorch forward hooks, for models the pack builds or patches but a core
    node runs. Hooks go on `model` and its submodules down to `depth` levels (a text encoder's
    forward is often called on a child, e.g. SD1ClipModel.clip_l or Lens' gpt_oss.transformer);
    the outermost hooked forward makes one record, listing only the kernels that ran, and none when
    none ran. Registered once per model (a second call adds its kernels to the same record). Never
    raises; returns the recorder or None."""
    try:
        recorder = getattr(model, RECORDER_ATTR, None)
        if isinstance(recorder, _ForwardRecorder):
            recorder.kernels = tuple(dict.fromkeys(recorder.kernels + tuple(kernels)))
            return recorder
        recorder = _ForwardRecorder(kernels)
        level = [model]
        for d in range(depth + 1):
            for m in level:
                m.register_forward_pre_hook(recorder.pre)
                try:
                    m.register_forward_hook(recorder.post, always_call=True)
                except TypeError:  # torch without always_call
                    m.register_forward_hook(recorder.post)
            level = [c for m in level for c in m.children()] if d < depth else []
        object.__setattr__(model, RECORDER_ATTR, recorder)
        return recorder
    except Exception as e:
        log.debug("comfy_metal: could not add the forward record hooks: %s", e)
        return None


# --------------------------------------------------------------------------------------------
# The dispatcher's state and the loaded models, for the status displays
# --------------------------------------------------------------------------------------------

def dispatch_state(device=None, run_pending: bool = False) -> dict:
    """What the kernel dispatcher knows: the capability probe, COMFY_METAL_BACKEND, each kernel's backend and
    reason on `device` (default: the Apple GPU if there is one, else the CPU; run_pending: run the self-checks
    not run yet, which only ComfyUI's execution thread may do on MPS), the kernels COMFY_METAL_REFERENCE keeps
    on the reference, the last backend per kernel and the measured choices."""
    from ... import metal_kernels
    from ...metal_kernels import dispatch

    status = metal_kernels.status(device, run_pending=run_pending)
    return {
        "capabilities": status["capabilities"],
        "backend_setting": status["backend_setting"],
        # `source` (the .metal file) groups the kernels by what they do
        "kernels": {name: {"backend": k["backend"], "reason": k["reason"], "device": k["device"],
                           "source": k.get("source")} for name, k in status["kernels"].items()},
        "forced_kernels": sorted(dispatch._forced_reference()),
        "last_backend": dict(dispatch.last_backend),
        "measured": dispatch.measured_records(),
    }


# (weak reference to the model, its record), oldest first: a model ComfyUI frees drops out
_loaded: list[tuple] = []


def record_loaded_model(model, name: str, held_bytes: int, bf16_bytes: int) -> None:
    """Remember a model a loader of the pack made with quantized weights: `name` (its file or files), the bytes
    its weights take and what they would take with the quantized layers in bf16. Never raises."""
    try:
        entry = (weakref.ref(model), {"name": str(name), "held_bytes": int(held_bytes), "bf16_bytes": int(bf16_bytes)})
        with _lock:
            _loaded[:] = [e for e in _loaded if e[0]() is not None and e[0]() is not model] + [entry]
    except Exception as e:
        log.debug("comfy_metal: could not record the loaded model %s: %s", name, e)


def loaded_models() -> list[dict]:
    """The quantized models the pack's loaders made that are still alive, oldest first."""
    with _lock:
        _loaded[:] = [e for e in _loaded if e[0]() is not None]
        return [dict(record) for _, record in _loaded]


def records_since(index: int) -> tuple[list[dict], int]:
    """The records made after the `index`-th one, and the new index (for run summaries)."""
    with _lock:
        total = _history_count
        recent = list(history)
    missing = total - index
    return (recent[-missing:] if missing > 0 else []), total


def clear_records() -> None:
    global _history_count
    with _lock:
        node_backends.clear()
        history.clear()
        _history_count = 0
        _loaded.clear()


def _prompt_server():
    """ComfyUI's PromptServer instance, only if ComfyUI's server module is already loaded."""
    server = sys.modules.get("server")
    prompt_server = getattr(server, "PromptServer", None)
    return getattr(prompt_server, "instance", None)


def _send_event(event: str, data: dict) -> None:
    instance = _prompt_server()
    send = getattr(instance, "send_sync", None)
    if send is None:
        return
    try:
        send(event, data, getattr(instance, "client_id", None))
    except Exception as e:
        log.debug("comfy_metal: could not send %s: %s", event, e)
