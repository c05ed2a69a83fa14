"""The pack's attention as a ComfyUI attention function.

`metal_flash_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
skip_output_reshape=False, **kwargs)` has the signature of ComfyUI's attention functions
(comfy/ldm/modules/attention.py) and both of its layouts:

* skip_reshape=False: q (B, Lq, H*D), k/v (B, Lk, Hk*D); skip_reshape=True: (B, H, L, D).
* skip_output_reshape=False: out (B, Lq, H*D); True: (B, H, Lq, D).
* kwargs: `scale`, `enable_gqa` (k/v with fewer heads), `transformer_options` and the rest ignored.
* masks as ComfyUI passes them: bool (True = attend) or additive, 2-D (Lq, Lk), 3-D (B, Lq, Lk),
  4-D broadcast over batch and heads.

Which attention runs (decided per call, logged once per reason):
* on MPS, mode "auto": for each shape class (dtype, head dim, length buckets, mask, GQA) the Metal
  kernel and ComfyUI's own attention (sub-quad, or SDPA with --use-pytorch-cross-attention) are
  timed once on this machine (metal_kernels.dispatch.measured_choice: batches of calls between syncs;
  the decision is saved, so a later start does not time it again) and the kernel is used only where
  more than 5% faster than ComfyUI's. A kernel that failed its self-check is never used.
* mode "always" (or COMFY_METAL_BACKEND=emulator): the pack's attention on every device (Metal on
  MPS, the MSL emulator with COMFY_METAL_BACKEND=emulator, else the chunked pure-torch reference).
* on CPU/CUDA in "auto": ComfyUI's own attention; the pack never replaces it unless asked.
* anything the kernel does not cover (another dtype, head dim > 256, dropout/causal arguments, a
  mask it cannot broadcast) goes to ComfyUI's own function.
* correctness before speed: on MPS, where ComfyUI's function would build a score matrix of 2^31
  elements or more (MPS computes those silently wrong: long Wan/Hunyuan videos through SDPA, or
  sub-quad's query chunks on Macs with much free memory), the pack's attention runs whatever the
  measurement says: the kernel never holds more than a tile of scores.

`register()` adds it to ComfyUI's registry as "metal_flash" (`get_attention_function`).
ComfyUI is imported only inside functions.
"""
from __future__ import annotations

import functools
import logging
import math
import os

import torch

from ...metal_kernels import attention as attention_kernels
from ...metal_kernels import dispatch, probe

log = logging.getLogger("comfy_metal")

REGISTRY_NAME = "metal_flash"
KERNEL = "flash_attention"
MODES = ("auto", "always")
UNSUPPORTED_KWARGS = ("is_causal", "causal", "dropout_p", "attn_bias")
_logged: set = set()
# Why the last calls did what they did: reason -> count (for the status route and tests).
fallback_reasons: dict[str, int] = {}
last_choice: dict[str, str] = {}


def _log_once(reason: str, level=logging.INFO) -> None:
    fallback_reasons[reason] = fallback_reasons.get(reason, 0) + 1
    if reason not in _logged:
        _logged.add(reason)
        log.log(level, "comfy_metal: attention: %s", reason)


def comfy_attention():
    """The attention function ComfyUI itself would use on this device (its `optimized_attention`)."""
    import comfy.ldm.modules.attention as attention

    return attention.optimized_attention


def _comfy_name(fn) -> str:
    name = getattr(fn, "__name__", "comfy")
    return name[len("attention_"):] if name.startswith("attention_") else name


def to_heads(q, k, v, heads: int, skip_reshape: bool, enable_gqa: bool):
    """(B, H, L, D) views of ComfyUI's q, k, v (no copies)."""
    if skip_reshape:
        return q, k, v
    b, lq, inner = q.shape
    if inner % heads:
        raise ValueError(f"query width {inner} is not divisible by {heads} heads")
    d = inner // heads
    kh = k.shape[-1] // d if enable_gqa else heads
    vh = v.shape[-1] // d if enable_gqa else heads
    q4 = q.view(b, lq, heads, d).transpose(1, 2)
    k4 = k.reshape(b, k.shape[1], kh, d).transpose(1, 2)
    v4 = v.reshape(b, v.shape[1], vh, d).transpose(1, 2)
    return q4, k4, v4


def uncovered_reason(q4, k4, v4, mask, kwargs) -> str | None:
    """Why the pack's attention cannot take this call (None when it can)."""
    if q4.dtype not in attention_kernels.MSL_TYPE:
        return f"dtype {q4.dtype} is not covered (float32, float16, bfloat16)"
    if not (q4.dtype == k4.dtype == v4.dtype):
        return f"mixed dtypes q {q4.dtype}, k {k4.dtype}, v {v4.dtype}"
    if q4.shape[-1] > attention_kernels.DMAX:
        return f"head dim {q4.shape[-1]} > {attention_kernels.DMAX}"
    bad = [key for key in UNSUPPORTED_KWARGS if kwargs.get(key)]
    if bad:
        return f"argument(s) {', '.join(bad)} are not covered"
    if k4.shape[1] == 0 or q4.shape[1] % k4.shape[1]:
        return f"{q4.shape[1]} query heads over {k4.shape[1]} key heads"
    try:
        attention_kernels._prepare(q4, k4, v4, mask, None)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


MPS_MAX_SCORES = probe.MPS_MAX_SCORE_ELEMENTS
SDPA_FULL_MATRIX_ROWS = 8     # PyTorch's MPS SDPA builds the whole Lq x Lk matrix above this many query rows


def platform_score_elements(comfy_name: str, q4, k4) -> int:
    """The largest score matrix (elements) ComfyUI's attention `comfy_name` builds for (B, H, L, D)
    inputs: sub-quad's (batch x heads, query chunk, key chunk), chosen the way ComfyUI chooses it
    (the largest query chunk of 4096..256 whose fp32-sized scores, x4, fit the free memory, with all
    keys; otherwise 512 queries against sqrt(Lk) keys); SDPA's whole matrix above 8 query rows;
    the whole matrix for any other function (a safe upper bound)."""
    bh, lq, lk = q4.shape[0] * q4.shape[1], q4.shape[-2], k4.shape[-2]
    if comfy_name == "sub_quad":
        try:
            import comfy.model_management as mm
            free = mm.get_free_memory(q4.device, True)[0]
        except Exception:                  # no ComfyUI memory query: assume the largest chunk
            free = float("inf")
        nbytes = 4 if q4.dtype == torch.float32 else 2
        for chunk in (4096, 2048, 1024, 512, 256):
            if free / (bh * nbytes * chunk * 4.0) >= lk:
                return bh * min(chunk, lq) * lk
        return bh * min(512, lq) * max(int(math.sqrt(lk)), 1)
    if comfy_name == "pytorch" and lq <= SDPA_FULL_MATRIX_ROWS:
        return 0
    return bh * lq * lk


_recorded: set = set()


def _record_for_badge(key, note: str | None, ran_kernel: bool) -> None:
    """Once per (executing node, key): a record for the node's badge (the attention runs inside a core
    node, e.g. KSampler), with the measured choice as its note."""
    from ..status import records

    node_id = records._current_node_id()
    if (node_id, key) in _recorded:
        return
    _recorded.add((node_id, key))
    records.record_node_backend(None, [KERNEL] if ran_kernel else [], note=note)


def measured_note(record: dict, comfy_name: str) -> str:
    """"metal_flash 1.9x sub_quad" (the kernel won) or "sub_quad (metal_flash 1.3x slower)"."""
    t = record["times_ms"]
    ours, theirs = t.get(REGISTRY_NAME), t.get(comfy_name)
    if not ours or not theirs:
        return f"{record['choice']} ({record['reason']})"
    if record["choice"] == REGISTRY_NAME:
        return f"{REGISTRY_NAME} {theirs / ours:.1f}x {comfy_name}"
    return f"{comfy_name} ({REGISTRY_NAME} {ours / theirs:.1f}x slower)"


def _emulator_asked() -> bool:
    return os.environ.get("COMFY_METAL_BACKEND", "").strip().lower() == "emulator"


def metal_flash_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                          skip_output_reshape=False, *, comfy_metal_mode: str = "auto", **kwargs):
    """ComfyUI attention function (see the module docstring)."""
    fallback = comfy_attention()

    def comfy():
        # _inside_attn_wrapper: ComfyUI's wrapper then calls its function directly (no override loop)
        return fallback(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **{**kwargs, "_inside_attn_wrapper": True})

    device = q.device
    asked = comfy_metal_mode == "always" or (_emulator_asked() and device.type == "cpu")
    if not asked and not dispatch.measuring_enabled(device):
        _log_once(f"ComfyUI's attention on {device.type}: the pack's attention replaces it only on MPS "
                  f"(or with mode 'always')", logging.DEBUG)
        last_choice["choice"] = _comfy_name(fallback)
        return comfy()
    enable_gqa = bool(kwargs.get("enable_gqa", False))
    try:
        q4, k4, v4 = to_heads(q, k, v, heads, skip_reshape, enable_gqa)
    except (RuntimeError, ValueError) as e:
        _log_once(f"ComfyUI's attention: inputs not covered ({e})")
        return comfy()
    b = q4.shape[0]
    mask4 = mask          # ComfyUI's forms (2-D, 3-D = batch, 4-D) are flash_attention's
    why = uncovered_reason(q4, k4, v4, mask4, kwargs)
    if why is not None:
        _log_once(f"ComfyUI's attention ({_comfy_name(fallback)}): {why}")
        last_choice["choice"] = _comfy_name(fallback)
        return comfy()
    scale = kwargs.get("scale", None)

    def ours():
        out = attention_kernels.flash_attention(q4, k4, v4, mask=mask4, scale=scale)
        if skip_output_reshape:
            return out
        return out.transpose(1, 2).reshape(b, q4.shape[2], q4.shape[1] * q4.shape[3])

    if asked:
        last_choice["choice"] = REGISTRY_NAME
        out = ours()
        _record_for_badge(("asked", comfy_metal_mode), None, True)
        return out
    comfy_name = _comfy_name(fallback)
    backend, reason = dispatch.choose(dispatch.REGISTRY[KERNEL], device)
    scores = platform_score_elements(comfy_name, q4, k4)
    if scores >= MPS_MAX_SCORES:       # correctness first: the kernel, or its chunked reference
        _log_once(f"{REGISTRY_NAME} ({backend}) instead of {comfy_name}: {comfy_name} would build a score "
                  f"matrix of {scores / 2**30:.1f} G elements (2^31 or more comes out wrong on MPS)",
                  logging.WARNING)
        last_choice["choice"] = REGISTRY_NAME
        _record_for_badge(("correctness", comfy_name), f"{REGISTRY_NAME} (correct past 2^31 scores)",
                          backend == "metal")
        return ours()
    if backend != "metal":
        _log_once(f"ComfyUI's attention: the Metal kernel is not available ({reason})", logging.WARNING)
        last_choice["choice"] = comfy_name
        return comfy()
    shape_class = attention_kernels.attention_shape_class(q4, k4, mask4)
    # ComfyUI's own first: on a tie it is kept (the pack must be strictly faster to be used)
    choice = dispatch.measured_choice(KERNEL, shape_class, {comfy_name: comfy, REGISTRY_NAME: ours}, device)
    last_choice["choice"] = choice
    out = ours() if choice == REGISTRY_NAME else comfy()
    record = dispatch.measured.get((KERNEL, shape_class))
    if record is not None:
        _record_for_badge(shape_class, measured_note(record, comfy_name), choice == REGISTRY_NAME)
    return out


@functools.lru_cache(maxsize=None)
def attention_function(mode: str = "auto"):
    """The ComfyUI attention function for `mode` (one object per mode, so patches compare equal)."""
    if mode not in MODES:
        raise ValueError(f"attention mode must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return metal_flash_attention
    fn = functools.partial(metal_flash_attention, comfy_metal_mode=mode)
    functools.update_wrapper(fn, metal_flash_attention)
    return fn


def register() -> bool:
    """Register "metal_flash" in ComfyUI's attention registry (once; False when ComfyUI is absent)."""
    try:
        import comfy.ldm.modules.attention as attention
    except ImportError:
        return False
    registry = getattr(attention, "REGISTERED_ATTENTION_FUNCTIONS", None)
    if registry is not None and REGISTRY_NAME in registry:
        return True
    register_fn = getattr(attention, "register_attention_function", None)
    if register_fn is None:
        return False
    register_fn(REGISTRY_NAME, metal_flash_attention)
    return True


def patch_model(model, mode: str = "auto"):
    """A clone of a ComfyUI ModelPatcher whose attention is the pack's (ModelPatcher.set_model_optimized_attention)."""
    register()
    patched = model.clone()
    patched.set_model_optimized_attention(attention_function(mode))
    return patched
