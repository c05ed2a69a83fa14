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

ComfyUI modules are only touched when they are already imported (`"server" in sys.modules`); this
module imports nothing of ComfyUI and touches no GPU at import.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger("comfy_metal")

ROUTE_PREFIX = "/comfy_metal"
BACKEND_EVENT = "comfy_metal.backend"
BACKEND_ENV = "COMFY_METAL_BACKEND"

_lock = threading.Lock()
# node id (or class name when the id is unknown) -> the latest record for it.
node_backends: dict[str, dict] = {}
# Every record in order (bounded), for run summaries: read with records_since(index).
history: collections.deque = collections.deque(maxlen=4096)
_history_count = 0

_UNSET = object()
_saved_backend_env: Any = _UNSET  # COMFY_METAL_BACKEND before force_reference was switched on


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


def record_node_backend(node_class: str | None, kernels, node_id: str | None = None) -> dict | None:
    """Record which backend the kernels `kernels` (names) used in this node's last run.

    Reads `metal_kernels.dispatch.last_backend`; call it at the end of the node function. The node
    id is taken from ComfyUI's executing context when not given. Code that runs inside a core node
    (e.g. a sampler function called by KSampler) passes node_class=None: the record then belongs to
    whichever node is executing, by id. Never raises (returns None on an internal problem, logged at
    debug level).
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
def recording_kernels(node_class: str | None, kernels):
    """Record (for the node badge) the backends of those of `kernels` that run inside the block.

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
            record_node_backend(node_class, ran)


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


# --------------------------------------------------------------------------------------------
# Memory and status
# --------------------------------------------------------------------------------------------

def _device_kind() -> str:
    import torch

    from ...metal_kernels.probe import mps_available

    if mps_available():
        return "mps"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def memory_info() -> dict:
    """Device memory now: bytes in use by tensors, allocated by the driver, recommended maximum.

    MPS: torch.mps current/driver allocated and recommended_max_memory. CUDA: allocated/reserved and
    the device's total memory. CPU: this process's RSS against the machine's RAM (psutil).
    """
    import torch

    device = _device_kind()
    out: dict[str, Any] = {"device": device, "in_use": None, "driver_allocated": None,
                           "recommended_max": None, "process_rss": None, "system_total": None,
                           "system_available": None}
    try:
        import psutil

        vm = psutil.virtual_memory()
        out["process_rss"] = psutil.Process().memory_info().rss
        out["system_total"], out["system_available"] = vm.total, vm.available
    except Exception:
        pass
    try:
        if device == "mps":
            out["in_use"] = int(torch.mps.current_allocated_memory())
            out["driver_allocated"] = int(torch.mps.driver_allocated_memory())
            out["recommended_max"] = int(torch.mps.recommended_max_memory())
        elif device == "cuda":
            index = torch.cuda.current_device()
            out["in_use"] = int(torch.cuda.memory_allocated(index))
            out["driver_allocated"] = int(torch.cuda.memory_reserved(index))
            out["recommended_max"] = int(torch.cuda.get_device_properties(index).total_memory)
        else:
            out["in_use"] = out["process_rss"]
            out["recommended_max"] = out["system_total"]
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def force_reference_enabled() -> bool:
    return os.environ.get(BACKEND_ENV, "").strip().lower() == "reference"


def set_force_reference(enabled: bool) -> bool:
    """Force the reference kernels in this process (COMFY_METAL_BACKEND=reference) or restore the
    previous setting. Takes effect on the next kernel call. Returns the new state."""
    global _saved_backend_env
    with _lock:
        if enabled:
            if _saved_backend_env is _UNSET:
                _saved_backend_env = os.environ.get(BACKEND_ENV)
            os.environ[BACKEND_ENV] = "reference"
        else:
            previous = None if _saved_backend_env is _UNSET else _saved_backend_env
            _saved_backend_env = _UNSET
            if previous is None or previous.strip().lower() == "reference":
                os.environ.pop(BACKEND_ENV, None)  # "off" means: not forced, whatever it was before
            else:
                os.environ[BACKEND_ENV] = previous
    log.info("comfy_metal: %s", "reference kernels forced for this process" if enabled
             else f"kernel backend restored to {os.environ.get(BACKEND_ENV, 'auto')}")
    return force_reference_enabled()


def status_payload() -> dict:
    """Everything the panel shows; call it off the event loop. It runs no MPS work (the route's worker
    thread would race the prompt ComfyUI is executing on the GPU): MPS kernels not self-checked yet
    show as "pending" until their first use or the MetalStatus node, which runs on the executor."""
    from ... import metal_kernels
    from ...metal_kernels import dispatch
    from .. import NODE_CLASS_MAPPINGS

    status = metal_kernels.status(run_pending=False)
    with _lock:
        nodes = {k: dict(v) for k, v in node_backends.items()}
    return {
        "capabilities": status["capabilities"],
        "backend_setting": status["backend_setting"],
        "force_reference": force_reference_enabled(),
        "kernels": {name: {"backend": k["backend"], "reason": k["reason"], "device": k["device"]}
                    for name, k in status["kernels"].items()},
        "last_backend": dict(dispatch.last_backend),
        "node_backends": nodes,
        "memory": memory_info(),
        "pack_nodes": list(NODE_CLASS_MAPPINGS),     # the frontend badges exactly these node classes
    }


# --------------------------------------------------------------------------------------------
# aiohttp handlers
# --------------------------------------------------------------------------------------------

def _json(data, status: int = 200):
    from aiohttp import web

    import json

    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, default=str))


async def handle_status(request):
    loop = asyncio.get_running_loop()
    try:
        payload = await loop.run_in_executor(None, status_payload)
    except Exception as e:  # never take the server down; tell the panel why
        log.warning("comfy_metal: status failed: %s", e)
        return _json({"error": f"{type(e).__name__}: {e}"}, status=500)
    return _json(payload)


async def handle_memory(request):
    try:
        return _json(memory_info())
    except Exception as e:
        return _json({"error": f"{type(e).__name__}: {e}"}, status=500)


async def handle_settings(request):
    try:
        body = await request.json()
    except Exception:
        return _json({"error": "expected a JSON object like {\"force_reference\": true}"}, status=400)
    if not isinstance(body, dict) or not isinstance(body.get("force_reference"), bool):
        return _json({"error": "expected a JSON object like {\"force_reference\": true}; "
                               "force_reference must be true or false"}, status=400)
    state = set_force_reference(body["force_reference"])
    return _json({"force_reference": state, "backend_setting": os.environ.get(BACKEND_ENV, "auto")})


ROUTES = (("GET", ROUTE_PREFIX + "/status", handle_status),
          ("GET", ROUTE_PREFIX + "/memory", handle_memory),
          ("POST", ROUTE_PREFIX + "/settings", handle_settings))


def add_routes(routes) -> None:
    """Add the pack's routes to an aiohttp RouteTableDef (ComfyUI's PromptServer.routes)."""
    for method, path, handler in ROUTES:
        routes.route(method, path)(handler)


def register_with_comfyui() -> bool:
    """Add the routes to ComfyUI's running PromptServer (once). False outside ComfyUI."""
    instance = _prompt_server()
    routes = getattr(instance, "routes", None)
    if routes is None or getattr(instance, "_comfy_metal_routes", False):
        return False
    try:
        add_routes(routes)
        instance._comfy_metal_routes = True
        return True
    except Exception as e:
        log.warning("comfy_metal: could not add the status routes to ComfyUI's server: %s", e)
        return False


register_with_comfyui()

# --------------------------------------------------------------------------------------------
# A diagnostic node
# --------------------------------------------------------------------------------------------

def status_report(status: dict, probe_backend: dict | None = None) -> str:
    """Plain-text tables of a status payload (as `doctor` prints them)."""
    from ..common.report import Table, human_bytes

    caps = Table("Capabilities", ["probe", "value"])
    for key, value in status["capabilities"].items():
        caps.add(key, value)
    kernels = Table(f"Kernels (COMFY_METAL_BACKEND={status['backend_setting']})",
                    ["kernel", "device", "backend", "reason"])
    for name, k in status["kernels"].items():
        kernels.add(name, k["device"], k["backend"], k["reason"])
    mem = status.get("memory") or {}
    lines = [f"Memory ({mem.get('device')}): {human_bytes(mem.get('in_use'))} in use, "
             f"recommended max {human_bytes(mem.get('recommended_max'))}"]
    if probe_backend:
        lines.append(f"This node's probe call: {probe_backend['backend']} ({probe_backend['reason']})")
    return "\n\n".join([kernels.render(), caps.render(), "\n".join(lines)])


class MetalStatus:
    """Runs a probe kernel on ComfyUI's device (so the badge shows what this machine gets), the
    pending kernel self-checks, and reports the capability probe and each kernel's backend."""

    CATEGORY = "Comfy Metal"
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)
    FUNCTION = "report"
    OUTPUT_NODE = True
    DESCRIPTION = ("Comfy Metal status: which kernels run as Metal on this machine and why the others "
                   "use the PyTorch reference, the capability probe, and device memory.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # the answer depends on settings and state: always run

    def report(self):
        import torch

        from ... import metal_kernels

        try:
            import comfy.model_management

            device = comfy.model_management.get_torch_device()
        except Exception:
            device = torch.device("cpu")
        metal_kernels.softmax(torch.linspace(-1.0, 1.0, 24, device=device).reshape(3, 8))
        record = record_node_backend("MetalStatus", ["softmax"])
        payload = {**metal_kernels.status(device), "memory": memory_info()}
        text = status_report(payload, record)
        return {"ui": {"text": [text]}, "result": (text,)}


NODE_CLASS_MAPPINGS = {"MetalStatus": MetalStatus}
NODE_DISPLAY_NAME_MAPPINGS = {"MetalStatus": "Comfy Metal Status"}
