"""Small random models and FP8 checkpoint writers for the FP8 loading tests (plain module: `import fp8_models`).

Weights are filled explicitly (ComfyUI layers skip init). Files are written in the formats real FP8
checkpoints use: plain float8, "scaled fp8" (scaled_fp8 marker + scale_weight), ComfyUI comfy_quant
(per-layer JSON tensors, tensorwise or per-row weight_scale, float8 or uint8 storage).
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from comfy_metal.metal_kernels.dtypes import FP8_DTYPES as FP8

FMAX = {"e4m3fn": 448.0, "e5m2": 57344.0}


class TinyNet(torch.nn.Module):
    """Embedding -> LayerNorm -> Linear -> GELU -> Linear, plus a Conv2d head, built from an op set."""

    def __init__(self, ops, vocab=50, d=64, hidden=160, out=48, dtype=None):
        super().__init__()
        self.embed = ops.Embedding(vocab, d, dtype=dtype)
        self.norm = ops.LayerNorm(d, dtype=dtype)
        self.fc1 = ops.Linear(d, hidden, dtype=dtype)
        self.fc2 = ops.Linear(hidden, out, bias=False, dtype=dtype)
        self.conv = ops.Conv2d(3, 8, 3, padding=1, dtype=dtype)

    def forward(self, ids):
        h = self.embed(ids, out_dtype=torch.float32) if _accepts_out_dtype(self.embed) else self.embed(ids)
        h = self.norm(h.float())
        return self.fc2(torch.nn.functional.gelu(self.fc1(h)))


def _accepts_out_dtype(m):
    return hasattr(m, "quantized_embedding")


def tiny_state(vocab=50, d=64, hidden=160, out=48, seed=0, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return {
        "embed.weight": r(vocab, d),
        "norm.weight": (1 + 0.1 * torch.randn(d, generator=g)).to(dtype),
        "norm.bias": r(d, s=0.1),
        "fc1.weight": r(hidden, d, s=d ** -0.5),
        "fc1.bias": r(hidden, s=0.1),
        "fc2.weight": r(out, hidden, s=hidden ** -0.5),
        "conv.weight": r(8, 3, 3, 3, s=0.3),
        "conv.bias": r(8, s=0.1),
    }


def quantize_ref(w: torch.Tensor, fmt="e4m3fn", rowwise=False, pow2=False):
    """Independent amax quantization (torch's own saturating cast), (float8 q, float32 scale). pow2: the
    scale rounded up to a power of two, so that every dequantized value is exact in bf16, and in fp16 for
    scales of 2^-15 and up (amax >= 0.014)."""
    wf = w.float()
    amax = wf.abs().amax(dim=tuple(range(1, wf.dim())), keepdim=True) if rowwise else wf.abs().amax()
    scale = (amax / FMAX[fmt]).clamp_min(1e-12)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (wf / scale).clamp(-FMAX[fmt], FMAX[fmt]).to(FP8[fmt])
    return q, (scale.reshape(-1) if rowwise else scale.reshape(()))


def dequant_ref(q, scale):
    s = scale.float()
    if s.numel() > 1:
        s = s.reshape(-1, *([1] * (q.dim() - 1)))
    return q.float() * s


def fp8_layers(sd: dict, include=None) -> list[str]:
    """Weight keys to store in FP8 (2-D+ .weight tensors except norms)."""
    keys = [k for k, v in sd.items() if k.endswith(".weight") and v.dim() >= 2 and "norm" not in k]
    return [k for k in keys if include is None or k in include]


def write_fp8(path, sd: dict, kind="comfy_quant", fmt="e4m3fn", rowwise=False, layers=None,
              uint8_storage=False, prefix="") -> dict:
    """Write `sd` with its FP8 layers quantized in file format `kind`; returns the dequantized
    float32 tensors the file represents (the oracle)."""
    layers = fp8_layers(sd) if layers is None else layers
    out, expect = {}, {}
    qlayers = {}
    for k, v in sd.items():
        if k not in layers:
            out[prefix + k] = v.contiguous()
            expect[k] = v.float()
            continue
        layer = k[: -len(".weight")]
        if kind == "plain":
            q = v.float().clamp(-FMAX[fmt], FMAX[fmt]).to(FP8[fmt])
            out[prefix + k] = q
            expect[k] = q.float()
            continue
        q, scale = quantize_ref(v, fmt, rowwise)
        expect[k] = dequant_ref(q, scale)
        if kind == "scaled_fp8":
            out[prefix + k] = q
            out[prefix + layer + ".scale_weight"] = scale.reshape(-1) if rowwise else scale.reshape(1)
            out[prefix + layer + ".scale_input"] = torch.ones(1)
        elif kind == "comfy_quant":
            out[prefix + k] = q.view(torch.uint8) if uint8_storage else q
            out[prefix + layer + ".weight_scale"] = scale.reshape(-1, 1) if rowwise else scale
            out[prefix + layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": f"float8_{fmt}"}).encode()),
                                                                dtype=torch.uint8)
            qlayers[prefix + layer] = {"format": f"float8_{fmt}"}
        else:
            raise ValueError(kind)
    if kind == "scaled_fp8":
        out[prefix + "scaled_fp8"] = torch.empty(0, dtype=FP8[fmt])
    meta = {}
    save_file(out, str(path), metadata=meta)
    return expect


def fill_module_(module: torch.nn.Module, seed=0, std=0.05):
    """Explicit random weights for a module built with ComfyUI layers (which skip init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.is_meta:
                continue
            if name.endswith("norm.weight") or name.endswith("scale") or ".norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.05 * torch.randn(p.shape, generator=g))
            else:
                fan = p.shape[-1] if p.dim() >= 2 else 1
                p.copy_(torch.randn(p.shape, generator=g) * (std if p.dim() < 2 else fan ** -0.5))
    return module


def dequantized_file(fmt_mod, path, rest_dtype=torch.float32) -> dict:
    """An FP8 file's weights dequantized to fp32 with torch's own casts (the loader's decode is not
    used); `fmt_mod` is the pack's nodes/fp8/formats.py module (for reading the file's layout). The other
    tensors in `rest_dtype` (None: as stored, e.g. a big bf16 embedding, and the dtype ComfyUI reads
    the encoder's dtype from)."""
    out = {}
    with fmt_mod.open_checkpoint(path) as ck:
        for key in ck.model_keys():
            if key in ck.layers:
                w, scale, _ = ck.fp8_weight(key)
                out[key] = dequant_ref(w, scale)
            else:
                t = ck.tensor(key)
                out[key] = t if rest_dtype is None else t.to(rest_dtype)
    return out


def pack_module(loader_mod, name: str):
    """The pack's module `name` (e.g. "nodes.fp8.ops") as ComfyUI loaded it, beside `loader_mod`."""
    import importlib

    return importlib.import_module(loader_mod.__name__.split(".nodes.")[0] + "." + name)
