"""A sync-free MoE experts operation for ComfyUI's own MoE text encoders (GPT-OSS / Lens).

ComfyUI builds its expert banks with `operations.MoEExperts` (comfy/ops.py: a 3-D [E, out, in] weight
bank, optional [E, out] bias, optional quantized weights) and runs them from the encoder's experts
module (`GptOssExperts.forward`) in a Python loop over the experts that were hit, with a host sync
(`nonzero`, `.item()`) per expert.

This module provides:
* `make_operations(quant_config, compute_dtype)`: ComfyUI's `mixed_precision_ops` with `MoEExperts`
  replaced by a subclass that keeps ComfyUI's loading / state_dict / `expert_linear` behaviour and adds
  `grouped_linear(xs, sorted_experts, offsets)` and `pair_linear(x, pair_experts, x_div)`: all pairs
  in one sync-free call (torch._grouped_mm, or the pack's per-pair / grouped Metal kernel, FP8 banks
  read as FP8 on MPS). Hand it in as `model_options["custom_operations"]`.
* `experts_forward(experts, hidden_states, router_indices, routing_weights)`: the experts module's
  forward without host syncs: group pairs by expert on the device, grouped matmuls, the module's own
  gate activation (`_apply_gate`), combine with the routing weights.
* `object_patches(model)` / `patch_clip(clip)`: ModelPatcher object patches that route every
  GPT-OSS style experts module's `forward` through `experts_forward` (the loop lives in that module,
  so swapping the op alone cannot remove its syncs).

ComfyUI is imported only inside functions.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch

from ...metal_kernels import moe as moe_kernels
from ...metal_kernels.dtypes import QUANT_FORMAT_NAME

log = logging.getLogger("comfy_metal")

# The registry kernels the sync-free experts path can call (torch._grouped_mm records none).
EXPERTS_KERNELS = ("moe_experts_gemm", "moe_grouped_gemm")



@contextlib.contextmanager
def _bank(module, input: torch.Tensor):
    """(weight tensor or FP8 bytes, fmt, scale, bias) of a MoEExperts bank on input's device, cast
    the way ComfyUI's own expert_linear casts it (offload-aware). Quantized formats other than
    FP8 with a per-tensor / per-expert scale are dequantized to the input dtype."""
    import comfy.ops

    with comfy.ops.CastBiasWeightContext(module, input, offloadable=True) as (weight, bias):
        fmt, scale = None, None
        if type(weight).__name__ == "QuantizedTensor":
            qfmt = getattr(module, "quant_format", None)
            if qfmt in QUANT_FORMAT_NAME and getattr(weight, "_qdata", None) is not None:
                fmt = QUANT_FORMAT_NAME[qfmt]
                data = weight._qdata
                scale = getattr(weight._params, "scale", None)
                weight = data if data.dtype == torch.uint8 else data.view(torch.uint8)
            else:
                weight = weight.dequantize().to(input.dtype)
        elif weight.dtype != input.dtype and weight.dtype in (torch.float32, torch.float16, torch.bfloat16):
            weight = weight.to(input.dtype)
        if bias is not None:
            bias = bias.to(device=input.device)
        yield weight, fmt, scale, bias


class SyncFreeExpertsMixin:
    """Methods added to ComfyUI's MoEExperts (works on the stock class too, via the functions below)."""

    def grouped_linear(self, xs, sorted_experts, offsets):
        return grouped_linear(self, xs, sorted_experts, offsets)

    def pair_linear(self, x, pair_experts, x_div: int = 1):
        return pair_linear(self, x, pair_experts, x_div)


def grouped_linear(module, xs, sorted_experts, offsets):
    """Rows xs [P, in] sorted by expert through their expert's weight (+ bias) -> fp32/compute [P, out]."""
    with _bank(module, xs) as (weight, fmt, scale, bias):
        return moe_kernels.moe_grouped_linear(xs, sorted_experts, offsets, weight, scale, bias, fmt, xs.dtype)


def pair_linear(module, x, pair_experts, x_div: int = 1):
    """Unsorted pairs: row p = expert pair_experts[p] applied to x[p // x_div] (one kernel dispatch)."""
    with _bank(module, x) as (weight, fmt, scale, bias):
        return moe_kernels.moe_experts_gemm(x, pair_experts, weight, scale, bias, x_div=x_div, fmt=fmt)


def experts_forward(experts, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                    routing_weights: torch.Tensor) -> torch.Tensor:
    """GptOssExperts.forward without host syncs (same inputs, same [N, H] result)."""
    N, H = hidden_states.shape
    K = router_indices.shape[-1]
    E = experts.num_experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if N == 0:
        return hidden_states.new_zeros((0, H))
    flat_e = router_indices.reshape(-1)
    if N * K <= moe_kernels.DECODE_MAX_PAIRS and moe_kernels._gemm_backend(hidden_states.device) != "reference":
        h = pair_linear(gate_up, hidden_states, flat_e, x_div=K)
        h = experts._apply_gate(h.to(hidden_states.dtype))
        y = pair_linear(down, h, flat_e)
    else:
        order, sorted_e, offsets = moe_kernels.moe_group(router_indices, E)
        xs = hidden_states.index_select(0, order // K)
        h = grouped_linear(gate_up, xs, sorted_e, offsets)
        h = experts._apply_gate(h.to(hidden_states.dtype))
        ys = grouped_linear(down, h, sorted_e, offsets)
        y = torch.empty((N * K, H), dtype=ys.dtype, device=hidden_states.device)
        y.index_copy_(0, order, ys)
    y = y.to(hidden_states.dtype).view(N, K, H) * routing_weights.reshape(N, K, 1).to(hidden_states.dtype)
    return y.sum(dim=1)


@functools.lru_cache(maxsize=None)
def _operations_class(base):
    class MetalMoEOps(base):
        class MoEExperts(SyncFreeExpertsMixin, base.MoEExperts):
            pass

    MetalMoEOps.__name__ = f"MetalMoE{base.__name__}"
    return MetalMoEOps


def make_operations(quant_config: dict | None = None, compute_dtype=torch.bfloat16, full_precision_mm: bool = True):
    """ComfyUI's mixed_precision_ops for `quant_config` with the sync-free MoEExperts (custom_operations)."""
    import comfy.ops

    base = comfy.ops.mixed_precision_ops(quant_config or {}, compute_dtype, full_precision_mm=full_precision_mm)
    return _operations_class(base)


def _is_experts_module(m) -> bool:
    return (hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "_apply_gate")
            and hasattr(m, "num_experts") and hasattr(m.gate_up_proj, "bank_resident"))


def object_patches(model: torch.nn.Module) -> dict:
    """{module path + '.forward': sync-free forward} for every GPT-OSS style experts module in `model`."""
    out = {}
    for name, m in model.named_modules():
        if _is_experts_module(m):
            out[f"{name}.forward" if name else "forward"] = functools.partial(experts_forward, m)
    return out


def patch_clip(clip):
    """A clone of a ComfyUI CLIP whose MoE experts run sync-free (ModelPatcher object patches)."""
    patches = object_patches(clip.cond_stage_model)
    if not patches:
        return clip
    clip = clip.clone()
    for key, fn in patches.items():
        clip.patcher.add_object_patch(key, fn)
    # The experts run later inside a core node (CLIPTextEncode): their kernels' backends go to that
    # node's badge through forward hooks on the encoder (nodes/status; no record when the
    # unpatched clone, sharing the model, runs none of them).
    from ..status import record_forward_kernels

    record_forward_kernels(clip.cond_stage_model, EXPERTS_KERNELS)
    log.info("comfy_metal: %d MoE experts modules run through the sync-free grouped path", len(patches))
    return clip
