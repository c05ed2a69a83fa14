"""Node: Comfy Metal Status (the Metal tab's verdict on the node; the doctor's tables in its output)."""
from __future__ import annotations

from .records import dispatch_state, loaded_models, record_node_backend
from .routes import force_reference_enabled, memory_info
from .summary import plain_summary, short_report

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
    tables = [kernels.render(), caps.render()]
    if status.get("measured"):
        tables.append(measured_table(status["measured"]).render())
    mem = status.get("memory") or {}
    lines = [f"Memory ({mem.get('device')}): {human_bytes(mem.get('in_use'))} in use, "
             f"recommended max {human_bytes(mem.get('recommended_max'))}"]
    if probe_backend:
        lines.append(f"This node's probe call: {probe_backend['backend']} ({probe_backend['reason']})")
    return "\n\n".join(tables + ["\n".join(lines)])


def measured_table(records: list[dict]):
    """The measured choices (kernel vs platform op, per shape class) as a table."""
    from ..common.report import Table

    t = Table("Measured choices (kept on this machine until its chip, macOS, torch or the pack changes)",
              ["kernel", "shape class", "device", "chosen", "times (ms)", "measured"])
    for r in records:
        times = ", ".join(f"{n} {ms:.3g}" for n, ms in r["times_ms"].items())
        when = "this run" if r.get("source", "measured") == "measured" else f"saved {r.get('measured_at') or ''}".strip()
        t.add(r["kernel"], " ".join(str(x) for x in r["shape_class"]), r["device"], r["choice"], times, when)
    return t


class MetalStatus:
    """Runs a probe kernel on ComfyUI's device (so the badge shows what this machine gets), the
    pending kernel self-checks, and reports the capability probe and each kernel's backend."""

    CATEGORY = "Comfy Metal"
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)
    FUNCTION = "report"
    OUTPUT_NODE = True
    DESCRIPTION = ("Comfy Metal status: whether the Apple GPU is used and for what, what the pack saved, what "
                   "to do; its output adds the doctor's tables (each kernel's backend and why, the capability "
                   "probe, device memory).")

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
        payload = {**dispatch_state(device, run_pending=True), "force_reference": force_reference_enabled(),
                   "memory": memory_info(), "loaded_models": loaded_models()}
        short = short_report(plain_summary(payload), payload["memory"])
        return {"ui": {"text": [short]}, "result": (short + "\n\n" + status_report(payload, record),)}


NODE_CLASS_MAPPINGS = {"MetalStatus": MetalStatus}
NODE_DISPLAY_NAME_MAPPINGS = {"MetalStatus": "Comfy Metal Status"}
