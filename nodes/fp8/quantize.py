"""Quantize bf16/fp16/fp32 weights to FP8 (amax scaling, saturating, per tensor or per row), decide
which layers stay in high precision, summarise the error, and save in ComfyUI's comfy_quant format.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile

import torch

from ...metal_kernels.fp8 import FP8_MAX
from .formats import FP8_DTYPES, FORMAT_OF_DTYPE, CheckpointError

# Layers that stay in high precision: the first and last projections and embeddings, norms,
# modulation-free small layers. Matched against the weight key (dots and underscores included).
KEEP_PATTERNS = [
    r"(^|\.)(img_in|txt_in|time_in|vector_in|guidance_in|context_in|x_embedder|t_embedder|y_embedder|"
    r"patch_embedding|patch_embed|pos_embed|time_embedding|time_projection|text_embedding|img_emb|"
    r"final_layer|proj_out|norm_out|head|lm_head|conv_in|conv_out|embed_tokens|shared|wte|wpe|"
    r"token_embedding|position_embedding|embeddings)(\.|$)",
    r"norm", r"embed", r"(^|\.)bias$",
]
MIN_QUANT_ELEMENTS = 16384     # smaller matrices stay as they are
MIN_QUANT_DIM = 16


def keep_reason(key: str, shape, dtype: torch.dtype) -> str | None:
    """Why `key` stays in high precision, or None if it should be quantized."""
    if not key.endswith(".weight"):
        return "not a weight"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {dtype}"
    if len(shape) != 2:
        return f"{len(shape)}-D (only Linear weights are quantized)"
    for pat in KEEP_PATTERNS:
        if re.search(pat, key):
            return "first/last projection, embedding or norm"
    numel = shape[0] * shape[1]
    if numel < MIN_QUANT_ELEMENTS or min(shape) < MIN_QUANT_DIM:
        return f"small ({shape[0]}x{shape[1]})"
    return None


def compute_scale(w: torch.Tensor, fmt: str = "e4m3fn", rowwise: bool = False) -> torch.Tensor:
    """amax / FP8 max, float32; () for tensorwise, (N,) for rowwise. All-zero rows get scale 1."""
    a = w.detach().abs()
    if rowwise:
        amax = a.reshape(a.shape[0], -1).amax(dim=1).float()
    else:
        amax = a.amax().float()
    scale = amax / FP8_MAX[fmt]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # Keep 1/scale finite in float32 (subnormal amax).
    return scale.clamp_min(torch.finfo(torch.float32).tiny * FP8_MAX[fmt])


def quantize(w: torch.Tensor, fmt: str = "e4m3fn", rowwise: bool = False,
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(native float8 weight, float32 scale) with w ~= decode(q) * scale. Saturating, round-to-nearest-even."""
    from ... import metal_kernels as mk

    if fmt not in FP8_DTYPES:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {sorted(FP8_DTYPES)}")
    if scale is None:
        scale = compute_scale(w, fmt, rowwise)
    q = mk.fp8_encode(w, fmt, scale)
    return q.view(FP8_DTYPES[fmt]), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, fmt: str | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from ... import metal_kernels as mk

    fmt = fmt or FORMAT_OF_DTYPE[q.dtype]
    return mk.fp8_decode(q, fmt, scale, out_dtype=dtype)


@dataclasses.dataclass
class LayerError:
    key: str
    shape: tuple
    rel_error: float      # ||w - dq|| / ||w||
    max_abs: float


def relative_error(w: torch.Tensor, q: torch.Tensor, scale, fmt) -> LayerError:
    wf = w.float()
    dq = dequantize(q, scale, fmt, torch.float32)
    diff = wf - dq
    denom = wf.norm().item()
    return LayerError("", tuple(w.shape), diff.norm().item() / denom if denom > 0 else 0.0,
                      diff.abs().max().item() if diff.numel() else 0.0)


@dataclasses.dataclass
class QuantSummary:
    fmt: str
    rowwise: bool
    errors: list = dataclasses.field(default_factory=list)
    kept: dict = dataclasses.field(default_factory=dict)     # key -> reason

    def _what(self) -> str:
        return "FP8" if self.fmt in ("e4m3fn", "e5m2") else "comfy_quant"

    def add(self, key, err: LayerError):
        err.key = key
        self.errors.append(err)

    def text(self, top: int = 5) -> str:
        if not self.errors:
            return (f"{self._what()} quantization ({self.fmt}): no layer quantized; {len(self.kept)} kept in high "
                    "precision")
        rel = sorted(e.rel_error for e in self.errors)
        mean = sum(rel) / len(rel)
        med = rel[len(rel) // 2]
        worst = sorted(self.errors, key=lambda e: -e.rel_error)[:top]
        scale = "block scales" if self.fmt == "nvfp4" else "per-row scale" if self.rowwise else "per-tensor scale"
        lines = [f"{self._what()} quantization ({self.fmt}, {scale}): "
                 f"{len(self.errors)} layers quantized, {len(self.kept)} kept in high precision; relative error "
                 f"mean {mean:.3%}, median {med:.3%}, max {rel[-1]:.3%}"]
        for e in worst:
            lines.append(f"  {e.key} {list(e.shape)}: {e.rel_error:.3%}")
        return "\n".join(lines)


def comfy_quant_tensor(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def comfy_quant_entries(layer: str, q: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> dict:
    """The tensors ComfyUI's comfy_quant format stores for one FP8 layer."""
    out = {f"{layer}.weight": q.view(FP8_DTYPES[fmt]).contiguous()}
    if scale is None:
        scale = torch.ones((), dtype=torch.float32)
    scale = scale.float()
    # Per-row scales as (N, 1) so that ComfyUI's dequantize (q * scale) broadcasts per row.
    out[f"{layer}.weight_scale"] = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)
    out[f"{layer}.comfy_quant"] = comfy_quant_tensor({"format": f"float8_{fmt}"})
    return out


def atomic_save(tensors: dict, path: str, metadata: dict | None = None, overwrite: bool = False) -> str:
    """Write a .safetensors file through a temp file in the same folder.

    Never replaces an existing file unless `overwrite`: the final step is exclusive (a hard link of
    the finished temp file, which fails if another writer created `path` meanwhile; an O_EXCL create
    and copy where the file system has no hard links). With `overwrite`, os.replace."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(path) and not overwrite:  # fail before the work; the final step checks again
        raise FileExistsError(f"{path} already exists; not overwriting it (enable overwrite to replace it)")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=folder)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata or {})
        if overwrite:
            os.replace(tmp, path)
        else:
            _publish_exclusive(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return path


def _publish_exclusive(tmp: str, path: str) -> None:
    """Make the finished `tmp` appear at `path` only if nothing is there (FileExistsError otherwise)."""
    exists = f"{path} already exists (another writer created it); not overwriting it"
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise FileExistsError(exists) from None
    except OSError:  # no hard links here (some FUSE / network / FAT file systems): exclusive create + copy
        pass
    try:
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    except FileExistsError:
        raise FileExistsError(exists) from None
    try:
        with os.fdopen(out, "wb") as dst, open(tmp, "rb") as src:
            shutil.copyfileobj(src, dst, 16 << 20)
    except BaseException:
        os.unlink(path)  # ours: created above by O_EXCL
        raise


# Header metadata of a source file that describes its old quantization; a saved file gets its own.
STALE_METADATA_KEYS = ("_quantization_metadata", "comfy_metal")


def carried_metadata(metadata: dict | None) -> dict:
    """The source file's header metadata to carry into a re-quantized copy (model detection may need
    it, e.g. Wan's "config"), minus the stale quantization keys."""
    return {k: str(v) for k, v in (metadata or {}).items() if k not in STALE_METADATA_KEYS}


def quant_metadata(layers: dict[str, str | dict]) -> dict:
    """Header metadata listing the quantized layers (ComfyUI's _quantization_metadata): an FP8 format name,
    or a block-quantized layer's comfy_quant JSON."""
    return {"_quantization_metadata": json.dumps(
        {"format_version": "1.0", "layers": {k: fmt if isinstance(fmt, dict) else {"format": f"float8_{fmt}"}
                                             for k, fmt in layers.items()}})}


def quantize_file(src: str, dst: str, fmt: str = "e4m3fn", rowwise: bool = False, overwrite: bool = False,
                  keep=keep_reason) -> QuantSummary:
    """Quantize a bf16/fp16/fp32 .safetensors file to a comfy_quant FP8 file, one layer at a time."""
    from .formats import open_checkpoint

    if os.path.abspath(src) == os.path.abspath(dst):
        raise FileExistsError(f"{dst} is the source file; choose another output name")
    summary = QuantSummary(fmt, rowwise)
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, str] = {}
    with open_checkpoint(src) as ck:
        meta = carried_metadata(ck.metadata)
        if ck.layers or ck.quant_layers:
            raise CheckpointError(f"{ck.name}: already has {len(ck.layers) + len(ck.quant_layers)} quantized weights; "
                                  "quantize a bf16/fp16/fp32 file")
        for key in ck.model_keys():
            t = ck.read_copy(key)
            reason = keep(key, tuple(t.shape), t.dtype)
            if reason is not None:
                summary.kept[key] = reason
                out[key] = t
                continue
            q, scale = quantize(t, fmt, rowwise)
            summary.add(key, relative_error(t, q, scale, fmt))
            layer = key[: -len(".weight")]
            out.update(comfy_quant_entries(layer, q, scale, fmt))
            layers[layer] = fmt
    meta.update(quant_metadata(layers))
    atomic_save(out, dst, meta, overwrite=overwrite)
    return summary


def fp8_error_bound(fmt: str) -> float:
    """Relative rounding error bound of a normal FP8 value (half an ulp): 2^-(mantissa bits + 1)."""
    return {"e4m3fn": 2.0 ** -4, "e5m2": 2.0 ** -3}[fmt]
