"""The status routes on ComfyUI's server (GET /comfy_metal/status, /memory; POST /comfy_metal/settings,
the only write) and what they return."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from .records import _lock, _prompt_server, dispatch_state, loaded_models, node_backends

log = logging.getLogger("comfy_metal")

ROUTE_PREFIX = "/comfy_metal"
BACKEND_ENV = "COMFY_METAL_BACKEND"

_UNSET = object()
_saved_backend_env: Any = _UNSET  # COMFY_METAL_BACKEND before force_reference was switched on


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
    show as "pending" until their first use or the MetalStatus node, which runs on the executor.
    `summary` is the same in plain words (summary.py), which the Metal tab shows."""
    from .. import NODE_CLASS_MAPPINGS
    from .summary import plain_summary

    with _lock:
        nodes = {k: dict(v) for k, v in node_backends.items()}
    payload = {
        **dispatch_state(run_pending=False),
        "force_reference": force_reference_enabled(),
        "node_backends": nodes,
        "memory": memory_info(),
        "loaded_models": loaded_models(),
        "pack_nodes": list(NODE_CLASS_MAPPINGS),     # the frontend badges exactly these node classes
    }
    payload["summary"] = plain_summary(payload)
    return payload


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
