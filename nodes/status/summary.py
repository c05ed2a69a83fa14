"""The pack's state in plain words, for people: a one-line verdict (is the Apple GPU used, for what, how much
faster it measured), what the pack saved, what to do where something can be done, and the details in words.
The Metal tab (web/lib/status_model.js renders it) and the Comfy Metal Status node show the same text; the
status route keeps the raw data beside it for tools.

`plain_summary` reads a status payload (routes.status_payload, or the Status node's): `capabilities`,
`backend_setting`, `force_reference`, `kernels`, `forced_kernels`, `measured`, `memory`, `loaded_models`.
"""
from __future__ import annotations

from ..common.report import human_bytes

# What each kernel source file does, as a user calls it; the order the verdict lists them in. The softmax
# kernel is the Status node's probe, no feature.
FEATURES = (("attention", "attention"), ("fp8", "FP8 models"), ("linear", "FP8 models"),
            ("gguf", "GGUF models"), ("quant", "NVFP4 / MXFP8 / INT8 models"), ("sampling", "sampling"), ("vae", "the low-memory VAE"),
            ("moe", "MoE text encoders"), ("softmax", "the Status node's self-test"))
FEATURE_OF = dict(FEATURES)
PROBE = "the Status node's self-test"
# The candidates of a measured choice that are the pack's own code (the others: PyTorch's or ComfyUI's).
PACK_CHOICES = {"metal", "metal_flash", "gemv"}

# The capability probe in words (probe.capabilities keys).
MACHINE = {
    "torch": "PyTorch version",
    "python": "Python version",
    "platform": "System",
    "mps_available": "Apple GPU",
    "cuda_available": "NVIDIA GPU",
    "native_fp8_e4m3fn_on_mps": "FP8 numbers on the Apple GPU itself (torch 2.15 or newer)",
    "native_fp8_e5m2_on_mps": "FP8 e5m2 numbers on the Apple GPU itself",
    "float8_dtypes": "FP8 number types in this PyTorch",
    "F.scaled_mm": "FP8 matrix multiply in PyTorch (F.scaled_mm)",
    "torch._scaled_mm": "older FP8 matrix multiply (torch._scaled_mm)",
    "torch._grouped_mm": "grouped matrix multiply for MoE experts (torch._grouped_mm)",
    "torch.mps.compile_shader": "PyTorch can compile Metal code (torch.mps.compile_shader)",
    "mps_pad_is_safe": "padding of large tensors is safe on the Apple GPU (torch 2.15 or newer)",
    "mps_recommended_max_memory": "memory the Apple GPU may use",
}

STATE_WORDS = {
    "metal": "uses the Apple GPU",
    "pending": "checked on the Apple GPU the first time a node uses it",
    "emulator": "runs in the Metal emulator (a test mode, slow)",
    "failed": "plain PyTorch code (its check failed on this Mac)",
    "forced": "plain PyTorch code (switched off by Force reference kernels)",
    "cpu": "plain PyTorch code (no Apple GPU here)",
    "cuda": "plain PyTorch code, on the NVIDIA GPU",
}


def _version(text: str) -> tuple[int, int]:
    try:
        major, minor = str(text).split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def kernel_state(kernel: dict, forced: bool) -> str:
    """One of STATE_WORDS for a kernel's backend on its device."""
    backend, device = kernel.get("backend"), kernel.get("device")
    if backend in ("metal", "pending", "emulator"):
        return backend
    if forced or str(kernel.get("reason", "")).startswith("forced"):
        return "forced"
    if device == "mps":
        return "failed"
    return "cuda" if device == "cuda" else "cpu"


def _times(record: dict) -> tuple[float, float] | None:
    """(the chosen candidate's time, the best other one's) of a measured choice, or None."""
    times = {k: float(v) for k, v in (record.get("times_ms") or {}).items()}
    chosen = times.pop(record.get("choice"), None)
    if chosen is None or chosen <= 0 or not times:
        return None
    return chosen, min(times.values())


def _ratio_text(ratios: list[float]) -> str:
    lo, hi = min(ratios), max(ratios)
    return f"{lo:.1f}×" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f}×"


def feature_groups(payload: dict) -> list[dict]:
    """Per feature (FEATURES order): its name, state (the kernels' common state, or "mixed"), the state in words,
    the kernels per state (`counts`), its kernels, those that failed their check, and what was measured:
    `speedups` (how many times faster the pack's code was, per size timed) and `kept` (sizes where PyTorch's or
    ComfyUI's own code was faster and runs instead)."""
    forced = bool(payload.get("force_reference")) or payload.get("backend_setting") == "reference"
    by_feature: dict[str, list] = {}
    for name, k in sorted((payload.get("kernels") or {}).items()):
        stem = str(k.get("source") or name).rsplit("/", 1)[-1].removesuffix(".metal").split("_")[0]
        by_feature.setdefault(FEATURE_OF.get(stem, stem), []).append((name, kernel_state(k, forced), k))
    measured: dict[str, list] = {}
    for record in payload.get("measured") or []:
        measured.setdefault(record.get("kernel"), []).append(record)
    order = list(dict.fromkeys(label for _, label in FEATURES))
    groups = []
    for feature in sorted(by_feature, key=lambda f: (order.index(f) if f in order else len(order), f)):
        kernels = by_feature[feature]
        counts: dict[str, int] = {}
        for _, state, _ in kernels:
            counts[state] = counts.get(state, 0) + 1
        speedups, kept = [], 0
        for name, _, _ in kernels:
            for record in measured.get(name, []):
                t = _times(record)
                if t is None:
                    continue
                if record["choice"] in PACK_CHOICES:
                    speedups.append(t[1] / t[0])
                else:
                    kept += 1
        if len(counts) == 1:
            (state,) = counts
            words = STATE_WORDS[state]
        else:
            state = "mixed"
            words = "; ".join(f"{n} of {len(kernels)} parts: {STATE_WORDS[s]}" for s, n in sorted(counts.items()))
        groups.append({"feature": feature, "state": state, "counts": counts, "words": words,
                       "kernels": [n for n, _, _ in kernels],
                       "failed": [{"kernel": n, "reason": k.get("reason", "")} for n, s, k in kernels if s == "failed"],
                       "speedups": speedups, "kept": kept})
    return groups


def _in_use(group: dict) -> bool:
    """The feature runs the pack's GPU code somewhere (and timing did not hand every size to PyTorch)."""
    return bool(group["counts"].get("metal")) and not (group["kept"] and not group["speedups"])


def _listing(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def verdict(payload: dict, groups: list[dict]) -> str:
    caps = payload.get("capabilities") or {}
    features = [g for g in groups if g["feature"] != PROBE]
    if not caps.get("mps_available"):
        if payload.get("backend_setting") == "emulator":
            return ("No Apple GPU here: the Metal code runs in the emulator, a test mode much slower than plain "
                    "PyTorch")
        where = "an NVIDIA GPU, no Apple GPU" if caps.get("cuda_available") else "no Apple GPU"
        return (f"{where[0].upper()}{where[1:]} here: Comfy Metal runs its plain PyTorch code, so workflows work "
                "but are not sped up")
    if payload.get("force_reference") or payload.get("backend_setting") == "reference":
        return "Apple GPU found, but Comfy Metal's GPU code is switched off: its nodes run plain PyTorch code"
    if not caps.get("torch.mps.compile_shader"):
        return "Apple GPU found, but this PyTorch cannot compile Metal code: Comfy Metal's nodes run plain PyTorch code"
    used = [g for g in features if _in_use(g)]
    if used:
        text = "Apple GPU: in use for " + _listing([g["feature"] for g in used])
        best = max(used, key=lambda g: max(g["speedups"], default=0.0))
        if best["speedups"]:
            text += f"; {max(best['speedups']):.1f}× faster {best['feature']} measured"
        return text
    if any(g["counts"].get("pending") for g in features):
        return ("Apple GPU found: Comfy Metal checks its GPU code against plain PyTorch the first time each node "
                "runs (nothing has run yet)")
    if any(g["kept"] for g in features):
        return "Apple GPU found: plain PyTorch was measured faster here for everything that ran, so it runs"
    return "Apple GPU found, but Comfy Metal's GPU code failed its checks: its nodes run plain PyTorch code"


def saved(payload: dict, groups: list[dict]) -> list[str]:
    """What the pack saved: the memory of the quantized models loaded, the measured speedups."""
    out = []
    models = payload.get("loaded_models") or []
    for m in models:
        out.append(f"{m['name']}: {human_bytes(m['held_bytes'])} in memory, where bf16 would take "
                   f"{human_bytes(m['bf16_bytes'])}")
    if len(models) > 1:
        held = sum(m["held_bytes"] for m in models)
        full = sum(m["bf16_bytes"] for m in models)
        out.insert(0, f"{len(models)} quantized models: {human_bytes(held)} in memory instead of {human_bytes(full)} "
                      f"({human_bytes(full - held)} saved)")
    for g in groups:
        if g["speedups"]:
            n = len(g["speedups"])
            out.append(f"{g['feature'][0].upper()}{g['feature'][1:]}: {_ratio_text(g['speedups'])} faster than "
                       f"PyTorch's own code, measured on this machine ({n} size{'s' if n > 1 else ''})")
    return out


def todo(payload: dict, groups: list[dict]) -> list[str]:
    """What the user can do, where something can be done."""
    caps = payload.get("capabilities") or {}
    out = []
    torch_version = str(caps.get("torch", "?"))
    if not caps.get("mps_available"):
        if payload.get("backend_setting") == "emulator":
            out.append("Unset COMFY_METAL_BACKEND=emulator and restart ComfyUI: the emulator is for testing the "
                       "Metal code")
        else:
            out.append("Here, pick ComfyUI's own samplers (the names without _metal): the _metal samplers only pay "
                       "off on an Apple GPU")
        return out + _memory_todo(payload)
    if payload.get("force_reference") or payload.get("backend_setting") == "reference":
        out.append("Turn off Force reference kernels (under Details, or Settings > Comfy Metal), or unset "
                   "COMFY_METAL_BACKEND=reference, to use the Apple GPU")
    if _version(torch_version) < (2, 15):
        out.append(f"PyTorch {torch_version.split('+')[0]}: upgrade to 2.15 or newer (pip install --upgrade torch) for "
                   "FP8 numbers on the Apple GPU itself and its fixes for large tensors")
    if payload.get("forced_kernels"):
        out.append(f"COMFY_METAL_REFERENCE={','.join(payload['forced_kernels'])} keeps those parts on plain PyTorch "
                   "code: unset it and restart ComfyUI to use the Apple GPU for them")
    failed = [f["kernel"] for g in groups for f in g["failed"]]
    if failed:
        parts = "1 part of the Metal code failed its check on this Mac and runs" if len(failed) == 1 else \
            f"{len(failed)} parts of the Metal code failed their check on this Mac and run"
        out.append(f"{parts} plain PyTorch code instead: please report it with the output of python -m comfy_metal "
                   "doctor")
    return out + _memory_todo(payload)


def _memory_todo(payload: dict) -> list[str]:
    mem = payload.get("memory") or {}
    used, most = mem.get("in_use"), mem.get("recommended_max")
    if used and most and used / most >= 0.9:
        return [f"Memory is nearly full ({human_bytes(used)} of {human_bytes(most)}): use a smaller (GGUF) model, "
                "or lower the memory budget of VAE Decode (Low Memory, Metal)"]
    return []


def machine(payload: dict) -> list[dict]:
    """The capability probe in words: {label, value, key}."""
    rows = []
    for key, value in (payload.get("capabilities") or {}).items():
        if key == "mps_recommended_max_memory":
            shown = human_bytes(value) if value else "n/a"
        elif isinstance(value, bool):
            shown = "yes" if value else "no"
        else:
            shown = "n/a" if value is None else str(value)
        rows.append({"label": MACHINE.get(key, key), "value": shown, "key": key})
    return rows


def backend_words(payload: dict) -> str:
    setting = payload.get("backend_setting") or "auto"
    words = {"auto": "automatic: the Apple GPU where its code passed its check and is faster",
             "metal": "the Apple GPU wherever its code passed its check",
             "reference": "plain PyTorch code everywhere", "emulator": "the Metal emulator (testing)"}
    return f"Kernel choice: {words.get(setting, setting)} (COMFY_METAL_BACKEND={setting})"


def node_runs(payload: dict) -> list[dict]:
    """The last run of each node that used the pack's code (newest first): {node, backend, words, note}."""
    forced = bool(payload.get("force_reference")) or payload.get("backend_setting") == "reference"
    out = []
    for r in sorted((payload.get("node_backends") or {}).values(), key=lambda r: -(r.get("time") or 0)):
        states = sorted({kernel_state(k, forced) for k in (r.get("kernels") or {}).values()})
        words = "; ".join(STATE_WORDS[st] for st in states) or "no Comfy Metal code ran"
        node = f"#{r['node_id']} " if r.get("node_id") is not None else ""
        out.append({"node": node + (r.get("node_class") or "(a ComfyUI node)"), "backend": r.get("backend"),
                    "words": words, "note": r.get("note")})
    return out


def plain_summary(payload: dict) -> dict:
    """{verdict, saved, todo, features, runs, machine, backend}: the status payload in plain words."""
    groups = feature_groups(payload)
    return {"verdict": verdict(payload, groups), "saved": saved(payload, groups), "todo": todo(payload, groups),
            "features": groups, "runs": node_runs(payload), "machine": machine(payload),
            "backend": backend_words(payload)}


def short_report(summary: dict, memory: dict | None = None,
                 more: str = "The Metal tab (lightning icon, left) has the details.") -> str:
    """The summary as a few short lines that fit a node: the verdict, what it saved, what to do, one line per
    state of the features, memory, then `more` (where the details are)."""
    lines = [summary["verdict"] + "."]
    if summary["saved"]:
        lines += ["", "What Comfy Metal saved:"] + [f"- {s}" for s in summary["saved"]]
    if summary["todo"]:
        lines += ["", "What to do:"] + [f"- {s}" for s in summary["todo"]]
    lines.append("")
    by_words: dict[str, list[str]] = {}
    for g in summary["features"]:
        if g["feature"] != PROBE:
            by_words.setdefault(g["words"], []).append(g["feature"])
    for words, features in by_words.items():
        lines.append(f"- {_listing(features)[0].upper()}{_listing(features)[1:]}: {words}")
    mem = memory or {}
    if mem.get("in_use") is not None:
        of = f" of {human_bytes(mem['recommended_max'])}" if mem.get("recommended_max") else ""
        lines.append(f"- Memory: {human_bytes(mem['in_use'])} in use{of}")
    if more:
        lines += ["", more]
    return "\n".join(lines)
