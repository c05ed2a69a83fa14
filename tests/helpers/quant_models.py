"""comfy_quant block-format checkpoints written by ComfyUI's own quantizers (plain module: `import quant_models`).

Each VARIANT quantizes a state dict's Linear weights with ComfyUI's registered layouts (comfy.quant_ops:
`QuantizedTensor.from_float`, i.e. comfy_kitchen's quantize_nvfp4 / quantize_mxfp8 / quantize_int8_* /
quantize_w4a8_int8_weight / quantize_convrot_w4a4_weight) and serialises each layer the way ComfyUI's
own `_quantized_weight_state_dict` does: the layout's state_dict tensors plus a `<layer>.comfy_quant`
JSON tensor. The oracle file holds every layer as ComfyUI's own QuantizedTensor.dequantize() gives it.
Needs ComfyUI importable (the `comfyui` fixture) and comfy_kitchen.
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file


def _convrot(K: int) -> int:
    return 256 if K % 256 == 0 else 64 if K % 64 == 0 else 0


# variant -> (comfy_quant format, layout, from_float kwargs(K), comfy_quant JSON extras(K), bits a weight)
VARIANTS = {
    "nvfp4": ("nvfp4", "TensorCoreNVFP4Layout", lambda K: {}, lambda K: {}, 4.5),
    "mxfp8": ("mxfp8", "TensorCoreMXFP8Layout", lambda K: {}, lambda K: {}, 8.25),
    "int8_tensorwise": ("int8_tensorwise", "TensorWiseINT8Layout", lambda K: {}, lambda K: {}, 8.0),
    "int8_rowwise_convrot": ("int8_tensorwise", "TensorWiseINT8Layout",
                             lambda K: {"per_channel": True, "convrot": True, "convrot_groupsize": _convrot(K)},
                             lambda K: {"convrot": True, "convrot_groupsize": _convrot(K)}, 8.0),
    "asym_w4a8_int8": ("asym_w4a8_int8", "AsymW4A8Int8Layout", lambda K: {"convrot_groupsize": _convrot(K)},
                       lambda K: {"group_size": 16, "convrot_groupsize": _convrot(K)}, 4.5),
    "convrot_w4a4": ("convrot_w4a4", "TensorCoreConvRotW4A4Layout", lambda K: {"convrot_groupsize": _convrot(K)},
                     lambda K: {"convrot_groupsize": _convrot(K)}, 4.0),
}
ROTATED = ("int8_rowwise_convrot", "asym_w4a8_int8", "convrot_w4a4")


def quantizable(variant: str, key: str, shape, skip=()) -> bool:
    """A 2-D Linear weight the variant can hold (K a multiple of 64 where rotated), outside `skip`."""
    if not key.endswith(".weight") or len(shape) != 2 or any(s in key for s in skip):
        return False
    N, K = shape
    if variant in ROTATED:
        return _convrot(K) > 0
    return K % 16 == 0


def write_comfy_quant(path, sd: dict, variant: str, skip=(), oracle_path=None, metadata=None,
                      comfyui=True) -> list[str]:
    """Write `sd` (float tensors) with its quantizable Linear weights in `variant`; the rest as stored.
    `oracle_path`: also write every tensor as ComfyUI dequantizes it (float32). comfyui=False: comfy_kitchen's
    own layouts (the ones ComfyUI's subclass; no ComfyUI needed). Returns the quantized layers."""
    if comfyui:
        import comfy.quant_ops as cq
    else:
        import comfy_kitchen.tensor as cq

    fmt, layout, kwargs, extras, _ = VARIANTS[variant]
    out, oracle, layers = {}, {}, []
    for key, t in sd.items():
        if not quantizable(variant, key, tuple(t.shape), skip):
            out[key] = oracle[key] = t.contiguous()
            continue
        layer = key[: -len(".weight")]
        K = t.shape[1]
        qt = cq.QuantizedTensor.from_float(t.float(), layout, **kwargs(K))
        out.update({k: v.contiguous() for k, v in qt.state_dict(key).items()})
        conf = {"format": fmt, **extras(K)}
        out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        oracle[key] = qt.dequantize().float().contiguous()
        layers.append(layer)
    save_file(out, str(path), metadata=metadata or {})
    if oracle_path is not None:
        save_file(oracle, str(oracle_path), metadata=metadata or {})
    return layers
