"""Loading FP8 models into ComfyUI and saving them back (the nodes are in nodes.py).

The loaders read the file memory-mapped (formats.py), hand ComfyUI a state dict whose FP8 weights
are zero-copy views of the file (plus their float32 scales), and build the model with
`model_options["custom_operations"]` = the FP8 op set (ops.py), wrapped in MetalFP8ModelPatcher so
LoRAs apply to the decoded weights at forward time. ComfyUI's own model detection, sampling and
memory management do the rest.
"""
from __future__ import annotations

import inspect
import logging
import os
import time

import torch

from ..quant.formats import LOAD_MODES as QUANT_LOAD_MODES
from ..quant.formats import QuantFileError, quantize_entries
from ..quant.formats import state_entries as quant_state_entries
from ..quant.ops import RUN_KERNELS as QUANT_KERNELS
from ..quant.ops import QUANT_TAG, path_note, quant_formats, quant_modules
from ..quant.ops import weight_bytes as quant_weight_bytes
from .formats import ST_DTYPES, CheckpointError, open_checkpoint
from .ops import (RUN_KERNELS, FP8LayerError, fp8_modules, make_fp8_ops, record_quantized, storage_dtype, weight_bytes,
                  wrap_patcher)
from .quantize import (LayerError, QuantSummary, atomic_save, carried_metadata, comfy_quant_entries, keep_reason,
                           quant_metadata, quantize, relative_error)

log = logging.getLogger("comfy_metal")

WEIGHT_MODES = ["auto", "e4m3fn tensorwise", "e4m3fn rowwise", *QUANT_LOAD_MODES]
SAVE_MODES = ["e4m3fn tensorwise", "e4m3fn rowwise"]
COMPUTE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class FP8LoadError(RuntimeError):
    """Loading failed; the message names the file and what went wrong."""


# ------------------------------------------------------------------------------------------------
# State dicts
# ------------------------------------------------------------------------------------------------

def build_state_dict(ck, weight_mode: str = "auto") -> tuple[dict, QuantSummary | None]:
    """The state dict handed to ComfyUI: FP8 weights as zero-copy float8 views plus `<layer>.weight_scale`,
    other tensors as views of the file. With a quantizing weight mode, high-precision Linear weights
    are quantized one at a time (never a full-precision copy of the model)."""
    if weight_mode not in WEIGHT_MODES:
        raise ValueError(f"weight mode {weight_mode!r} is not one of {WEIGHT_MODES}")
    quant = weight_mode != "auto"
    rowwise = weight_mode.endswith("rowwise")
    block = weight_mode in QUANT_LOAD_MODES
    summary = QuantSummary(weight_mode if block else "e4m3fn", rowwise) if quant else None
    sd: dict[str, torch.Tensor] = {}
    for key in ck.model_keys():
        if key in ck.quant_layers:          # packed weight, its scales and the marker, as stored
            sd.update(quant_state_entries(ck, ck.quant_layers[key]))
            continue
        if key in ck.layers:
            w, scale, fmt = ck.fp8_weight(key)
            sd[key] = w
            if scale is not None:
                if not key.endswith(".weight"):
                    raise CheckpointError(f"{ck.name}: tensor {key} has a scale but is not a .weight")
                sd[key[: -len("weight")] + "weight_scale"] = scale
            continue
        if quant:
            entry = ck.entries[key]
            reason = keep_reason(key, tuple(entry.shape), ST_DTYPES[entry.dtype])
            if reason is None:
                t = ck.read_copy(key)      # not the memory map: its pages would stay resident
                if block:                  # NVFP4 / INT8 with ComfyUI's own quantizer
                    try:
                        entries, rel, mx = quantize_entries(key, t, weight_mode)
                    except QuantFileError as e:
                        raise FP8LoadError(f"{ck.name}: {e}") from None
                    summary.add(key, LayerError("", tuple(t.shape), rel, mx))
                    sd.update(entries)
                    continue
                q, scale = quantize(t, "e4m3fn", rowwise)
                summary.add(key, relative_error(t, q, scale, "e4m3fn"))
                sd[key] = q
                sd[key[: -len("weight")] + "weight_scale"] = scale
                continue
            summary.kept[key] = reason
        sd[key] = ck.tensor(key)
    return sd, summary


def _call_with_supported(fn, *args, **kwargs):
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def _resolve_compute_dtype(choice: str, device, params: int = 0, text_encoder: bool = False):
    import comfy.model_management as mm

    if choice not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype {choice!r} is not one of {list(COMPUTE_DTYPES)}")
    dtype = COMPUTE_DTYPES[choice]
    if dtype is not None:
        return dtype
    if text_encoder:
        return None  # ComfyUI's own choice for text encoders
    return _call_with_supported(mm.unet_dtype, device=device, model_params=params,
                                supported_dtypes=[torch.bfloat16, torch.float16, torch.float32])


def _fp8_storage(device, ck) -> torch.dtype | None:
    """uint8 when the load device cannot hold the file's FP8 dtypes natively (MPS before torch 2.15)."""
    fmts = {layer.fmt for layer in ck.layers.values()} or {"e4m3fn"}
    for fmt in fmts:
        if storage_dtype(device, fmt) == torch.uint8:
            return torch.uint8
    return None


def _wrap_errors(path, fn, *args, **kwargs):
    name = os.path.basename(str(path))
    try:
        return fn(*args, **kwargs)
    except (CheckpointError, FP8LayerError, FP8LoadError, FileExistsError):
        raise
    except RuntimeError as e:
        if "size mismatch" in str(e) or "shape" in str(e):
            raise FP8LoadError(f"{name}: the file does not match the detected architecture: {e}") from e
        raise


def load_diffusion_model(path, weight_mode="auto", compute_dtype="auto", model_options=None):
    """MODEL (a MetalFP8ModelPatcher) from a diffusion model file."""
    import comfy.model_management as mm
    import comfy.sd

    t0 = time.perf_counter()
    ck = open_checkpoint(path)
    log.info("comfy_metal: loading %s", ck.describe())
    sd, summary = build_state_dict(ck, weight_mode)
    if summary is not None:
        log.info("comfy_metal: %s: %s", ck.name, summary.text())
    opts = dict(model_options or {})
    load_device = opts.get("load_device") or mm.get_torch_device()
    params = sum(t.numel() for t in sd.values())
    dtype = _resolve_compute_dtype(compute_dtype, load_device, params)
    opts["custom_operations"] = make_fp8_ops(ck.name, dtype, _fp8_storage(load_device, ck))
    if dtype is not None:
        opts["dtype"] = dtype
    fn = comfy.sd.load_diffusion_model_state_dict
    patcher = _wrap_errors(path, _call_with_supported, fn, sd, model_options=opts, metadata=ck.metadata,
                           disable_dynamic=True)
    if patcher is None:
        raise FP8LoadError(f"{ck.name}: ComfyUI could not detect the model type of this file "
                           f"({len(ck.entries)} tensors, first keys {list(ck.entries)[:3]})")
    patcher = wrap_patcher(patcher)
    patcher.cached_patcher_init = None
    remember_source(patcher.model, ck)
    stats = weight_bytes(patcher.model)
    log.info("comfy_metal: %s loaded in %.2fs: %d FP8 layers, %.3f bytes per FP8 weight, %.1f MiB total",
             ck.name, time.perf_counter() - t0, stats["fp8_layers"], stats["bytes_per_fp8_weight"],
             stats["total_bytes"] / 2**20)
    log_quant_layers(ck.name, patcher.model, load_device)
    record_quantized(patcher.model, ck.name)
    return patcher


def quant_note(model, device) -> str | None:
    """What the block-quantized (comfy_quant NVFP4, MXFP8, INT8, W4) layers of `model` run on `device`, or None."""
    formats = {m.quant_fmt for _, m in quant_modules(model)}
    return path_note(formats, device) if formats else None


def log_quant_layers(name: str, model, device) -> None:
    stats = quant_weight_bytes(model)
    if stats["quant_weights"]:
        counts = ", ".join(f"{n} {fmt}" for fmt, n in sorted(quant_formats(model).items()))
        log.info("comfy_metal: %s: block-quantized layers %s at %.3f bits a weight (%.1f MiB); %s", name, counts,
                 stats["bits_per_quant_weight"], stats["quant_bytes"] / 2**20, quant_note(model, device))


def text_encoder_options(model_options, device: str, compute_dtype: str):
    """(model_options, compute dtype or None) for a text encoder on `device`: "gpu" is ComfyUI's torch device
    (the Apple GPU on a Mac, where ComfyUI itself would pick the CPU), "cpu" keeps it on the CPU."""
    import comfy.model_management as mm

    opts = dict(model_options or {})
    if device == "cpu":
        opts["load_device"] = opts["offload_device"] = torch.device("cpu")
    elif device == "gpu":
        opts.setdefault("load_device", mm.get_torch_device())
        opts.setdefault("offload_device", mm.text_encoder_offload_device())
    else:
        raise ValueError(f"device {device!r} is not gpu or cpu")
    dtype = _resolve_compute_dtype(compute_dtype, opts["load_device"], text_encoder=True)
    if dtype is not None:
        opts["dtype"] = dtype
    return opts, dtype


def load_text_encoder(path, clip_type="stable_diffusion", device="gpu", compute_dtype="auto", model_options=None):
    """CLIP from a text encoder file, or from several (a list of paths: ComfyUI's Dual/Triple/QuadrupleCLIPLoader
    sets such as CLIP-L + T5 for Flux), their FP8 weights kept FP8; FP8 and bf16/fp16 files can be mixed."""
    paths = list(path) if isinstance(path, (list, tuple)) else [path]
    cks = [open_checkpoint(p) for p in paths]
    sds = []
    for ck in cks:
        log.info("comfy_metal: loading text encoder %s", ck.describe())
        sds.append(build_state_dict(ck, "auto")[0])
    path = paths[0] if len(paths) == 1 else ", ".join(os.path.basename(str(p)) for p in paths)
    opts, dtype = text_encoder_options(model_options, device, compute_dtype)
    storage = next((st for st in (_fp8_storage(opts["load_device"], ck) for ck in cks) if st is not None), None)
    opts["custom_operations"] = make_fp8_ops(", ".join(ck.name for ck in cks), dtype, storage)
    clip = build_text_encoder(path, sds, clip_type, opts, RUN_KERNELS + QUANT_KERNELS)
    log_quant_layers(", ".join(ck.name for ck in cks), clip.cond_stage_model, opts["load_device"])
    return clip


def build_text_encoder(path, sds: list, clip_type: str, opts: dict, run_kernels):
    """ComfyUI's CLIP from state dicts built with a custom op set (`opts`), on the pack's patcher; the encoder
    runs later inside a core node (CLIPTextEncode), so its kernels' backends go to that node's badge through
    forward hooks on the encoder (nodes/status). `path` names the file(s) in errors."""
    import comfy.sd
    import folder_paths

    from ..status import record_forward_kernels

    ctype = getattr(comfy.sd.CLIPType, str(clip_type).upper(), None)
    if ctype is None:
        raise ValueError(f"unknown text encoder type {clip_type!r}")
    clip = _wrap_errors(path, _call_with_supported, comfy.sd.load_text_encoder_state_dicts, sds,
                        embedding_directory=folder_paths.get_folder_paths("embeddings"), clip_type=ctype,
                        model_options=opts, disable_dynamic=True)
    clip.patcher = wrap_patcher(clip.patcher)
    clip.patcher.cached_patcher_init = None
    record_forward_kernels(clip.cond_stage_model, run_kernels)
    record_quantized(clip.cond_stage_model, os.path.basename(str(path)))
    return clip


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------

# Attribute of the loaded BaseModel (shared by every clone of its patcher) describing the file it
# came from: {"name", "dtypes": {file key: torch dtype of the non-FP8 tensors}, "metadata": header}.
SOURCE_ATTR = "comfy_metal_source"
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def remember_source(model, ck) -> None:
    """Keep what the saver needs of the source file on the model: per-key dtypes, header metadata."""
    dtypes = {k: ST_DTYPES[ck.entries[k].dtype] for k in ck.model_keys()
              if k not in ck.layers and ck.entries[k].dtype in ST_DTYPES}
    setattr(model, SOURCE_ATTR, {"name": ck.name, "dtypes": dtypes, "metadata": dict(ck.metadata)})


class _SourceDtypes:
    """Looks a state-dict key up in the source file's keys (which may carry a prefix ComfyUI strips)."""

    def __init__(self, dtypes: dict | None):
        self.dtypes = dtypes or {}
        self.prefix: str | None = None

    def get(self, key: str):
        if key in self.dtypes:
            return self.dtypes[key]
        if self.prefix is None:
            hit = next((k for k in self.dtypes if k.endswith("." + key)), None)
            if hit is None:
                return None
            self.prefix = hit[: -len(key)]
        return self.dtypes.get(self.prefix + key)


def _save_dtype(t: torch.Tensor, src_dtype, model_dtype) -> tuple[torch.dtype, str]:
    """(dtype to write a non-FP8 tensor in, which rule chose it)."""
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.dtype, "kept as stored"
    if src_dtype is not None and src_dtype.is_floating_point and src_dtype not in (torch.float8_e4m3fn,
                                                                                   torch.float8_e5m2):
        return src_dtype, "the source file's dtype"
    if t.dtype in _HALF_DTYPES:
        return t.dtype, "the model's storage dtype"
    if model_dtype in _HALF_DTYPES:
        return model_dtype, "the model's storage dtype"
    return torch.bfloat16, "bfloat16 (float32 in memory, source dtype unknown)"


def model_state_for_saving(diffusion_model: torch.nn.Module, quantize_mode: str = "e4m3fn tensorwise",
                           source_dtypes: dict | None = None, model_dtype: torch.dtype | None = None):
    """(tensors, layers, summary, dtype_rules): FP8 layers as stored, other 2D Linear weights quantized per
    the rules (models without FP8 layers), every other tensor in `_save_dtype`'s dtype: the source
    file's (`source_dtypes`, by key), else the storage dtype, else bf16. dtype_rules counts
    (rule, dtype) -> tensors."""
    from .formats import FP8_DTYPES

    fp8 = dict(fp8_modules(diffusion_model))
    rowwise = quantize_mode.endswith("rowwise")
    summary = QuantSummary("e4m3fn", rowwise)
    src = _SourceDtypes(source_dtypes)
    rules: dict[tuple[str, torch.dtype], int] = {}
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, str] = {}

    def plain(key, t):
        dtype, rule = _save_dtype(t, src.get(key), model_dtype)
        rules[(rule, dtype)] = rules.get((rule, dtype), 0) + 1
        tensors[key] = t.to(dtype)

    for name, m in fp8.items():
        if m.weight_format == QUANT_TAG:          # a block-quantized layer: as the file stored it
            tensors.update(m.quant_file_tensors(name))
            layers[name] = (m.quant_info or {}).get("conf") or {"format": m.quant_info["comfy_format"]}
            if m.bias is not None:
                plain(f"{name}.bias", m.bias.detach().to("cpu"))
            continue
        w = m.weight.detach().to("cpu").view(FP8_DTYPES[m.weight_format])
        scale = m.weight_scale.detach().to("cpu") if m.weight_scale is not None else None
        tensors.update(comfy_quant_entries(name, w, scale, m.weight_format))
        layers[name] = m.weight_format
        if m.bias is not None:
            plain(f"{name}.bias", m.bias.detach().to("cpu"))
    quantize_rest = not fp8
    for key, t in diffusion_model.state_dict().items():
        layer = key.rsplit(".", 1)[0]
        if layer in fp8:
            continue
        t = t.detach().to("cpu")
        if quantize_rest and keep_reason(key, tuple(t.shape), t.dtype) is None:
            q, scale = quantize(t, "e4m3fn", rowwise)
            summary.add(key, relative_error(t, q, scale, "e4m3fn"))
            tensors.update(comfy_quant_entries(layer, q, scale, "e4m3fn"))
            layers[layer] = "e4m3fn"
        else:
            plain(key, t)
    return tensors, layers, summary, rules


def _rules_text(rules: dict) -> str:
    parts = [f"{n} in {rule} ({str(dtype).replace('torch.', '')})" for (rule, dtype), n in sorted(
        rules.items(), key=lambda kv: -kv[1])]
    return "; ".join(parts) if parts else "none"


def save_model(model, path, overwrite=False, quantize_mode="e4m3fn tensorwise") -> tuple[str, QuantSummary]:
    dm = model.model.diffusion_model
    if getattr(model, "patches", None):
        log.warning("comfy_metal: the model has %d patched weights (LoRA); they are not baked into the saved file",
                    len(model.patches))
    source = getattr(model.model, SOURCE_ATTR, None) or {}
    model_dtype = None
    get_dtype = getattr(model.model, "get_dtype", None)
    if callable(get_dtype):
        try:
            model_dtype = get_dtype()
        except Exception:
            model_dtype = None
    tensors, layers, summary, rules = model_state_for_saving(dm, quantize_mode, source.get("dtypes"), model_dtype)
    meta = carried_metadata(source.get("metadata"))
    meta.update(quant_metadata(layers))
    meta["comfy_metal"] = "MetalFP8SaveModel"
    log.info("comfy_metal: saving %s: %d FP8 layers; non-FP8 tensors: %s; metadata from %s: %s",
             os.path.basename(str(path)), len(layers), _rules_text(rules),
             source.get("name") or "(source file unknown)",
             ", ".join(sorted(k for k in meta if k not in ("_quantization_metadata", "comfy_metal"))) or "none")
    atomic_save(tensors, path, meta, overwrite=overwrite)
    return path, summary
