"""The comfy_quant block formats of a checkpoint: which tensors make up each quantized layer, checked
against each other before anything is built (the layer checks them against the architecture).

ComfyUI v0.33 reads these `comfy_quant` formats (QUANT_ALGOS in comfy/quant_ops.py) and stores them as
comfy_kitchen's layouts serialise them:
  nvfp4            <l>.weight U8 (Np, Kp/2), <l>.weight_scale F8_E4M3 swizzled block scales,
                   <l>.weight_scale_2 F32 tensor scale, optional <l>.input_scale, <l>.pre_quant_scale
  mxfp8            <l>.weight F8_E4M3 (Np, Kp), <l>.weight_scale F8_E8M0 swizzled block scales
  int8_tensorwise  <l>.weight I8 (N, K), <l>.weight_scale F32 (one, or one a row); "convrot": true adds a
                   Hadamard rotation of "convrot_groupsize" (default 256) columns
  asym_w4a8_int8   <l>.weight I8 (N, K/2), <l>.weight_s_rel F8_E4M3 or F32 (N, K/group_size),
                   <l>.weight_s_channel F32 (N,), optional <l>.weight_codebook F32 (16,); "group_size"
                   (default 16), "convrot_groupsize" (default 256)
  convrot_w4a4     <l>.weight I8 (N, K/2), <l>.weight_scale F32 (N,); "convrot_groupsize" (default 256)
(F8_* tensors may be stored as U8 bytes.) Each becomes a `QuantLayer`; `state_entries` gives the tensors
handed to ComfyUI under fixed names, with a small JSON marker (`<l>.comfy_metal_quant`) the pack's layers
take them by. Every problem is a CheckpointError naming the file, the tensor, what was expected and what
was found.
"""
from __future__ import annotations

import dataclasses
import json

import torch

from ...metal_kernels.quant import quant_layout

QUANT_MARKER = "comfy_metal_quant"
# comfy_quant format -> the kernels' format name
BLOCK_FORMATS = {"nvfp4": "nvfp4", "mxfp8": "mxfp8", "int8_tensorwise": "int8", "asym_w4a8_int8": "w4a8",
                 "convrot_w4a4": "w4a4"}
# Where each part is stored in the file (suffix after the layer name) and in the state dict handed to ComfyUI.
FILE_KEYS = {
    "nvfp4": {"scale": "weight_scale", "scale2": "weight_scale_2"},
    "mxfp8": {"scale": "weight_scale"},
    "int8": {"scale": "weight_scale"},
    "w4a8": {"scale": "weight_s_rel", "scale2": "weight_s_channel", "codebook": "weight_codebook"},
    "w4a4": {"scale": "weight_scale"},
}
OPTIONAL = {"input_scale", "pre_quant_scale"}          # nvfp4 (ModelOpt): read (pre_quant_scale) or ignored
STATE_KEYS = {"scale": "weight_scale", "scale2": "weight_scale_2", "codebook": "weight_codebook",
              "pre_quant_scale": "pre_quant_scale"}
BITS = {"nvfp4": "4.5", "mxfp8": "8.25", "int8": "8", "w4a8": "4.5", "w4a4": "4"}


class QuantFileError(ValueError):
    """Raised with the file's name by the caller's error type (formats.CheckpointError)."""


@dataclasses.dataclass
class QuantLayer:
    layer: str                      # the layer's name in the file
    comfy_format: str               # as in the file: "nvfp4", "int8_tensorwise", ...
    fmt: str                        # the kernels' name: nvfp4, mxfp8, int8, w4a8, w4a4
    keys: dict                      # part ("weight", "scale", "scale2", "codebook", "pre_quant_scale") -> file key
    group_size: int = 0             # w4a8: values per s_rel
    convrot: int = 0                # ConvRot group size (0: not rotated)
    conf: dict = dataclasses.field(default_factory=dict)      # the layer's comfy_quant JSON as stored

    @property
    def weight_key(self) -> str:
        return self.keys["weight"]

    def marker(self) -> dict:
        return {"format": self.fmt, "comfy_format": self.comfy_format, "group_size": self.group_size,
                "convrot": self.convrot, "tensor": self.weight_key, "conf": self.conf}

    def aux_keys(self) -> list[str]:
        return [k for part, k in self.keys.items() if part != "weight"]


def marker_tensor(info: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(info).encode()), dtype=torch.uint8)


def read_marker(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.to(torch.uint8).tolist()).decode())


def _pow4(g: int) -> bool:
    return g >= 4 and g & (g - 1) == 0 and (g.bit_length() - 1) % 2 == 0


def _int_conf(conf: dict, name: str, default: int, what: str) -> int:
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    value = conf.get(name, params.get(name, default))
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise QuantFileError(f"{what}: {name} {value!r} is not an integer") from None
    return value


def describe_layer(entries: dict, layer: str, comfy_format: str, conf: dict, origin: str) -> QuantLayer:
    """The QuantLayer of `layer` (format `comfy_format`) from the file's header entries (key -> TensorEntry),
    checked: every part present, of the stored dtype, with shapes that fit each other."""
    fmt = BLOCK_FORMATS[comfy_format]
    what = f"{comfy_format} layer {layer} ({origin})"
    wkey = f"{layer}.weight"
    if wkey not in entries:
        raise QuantFileError(f"{origin} lists layer {layer} as {comfy_format}, but the file has no tensor {wkey}")
    keys = {"weight": wkey}
    for part, suffix in FILE_KEYS[fmt].items():
        key = f"{layer}.{suffix}"
        if key in entries:
            keys[part] = key
    for name in OPTIONAL:
        if f"{layer}.{name}" in entries:
            keys[name] = f"{layer}.{name}"
    w = entries[wkey]
    if len(w.shape) != 2:
        raise QuantFileError(f"tensor {wkey} ({what}) has shape {list(w.shape)}; expected a 2-D (rows, bytes) "
                             "weight (ComfyUI stores these formats for Linear layers, and INT8 for embeddings)")
    rows, cols = w.shape
    want_w = {"nvfp4": ("U8",), "mxfp8": ("F8_E4M3", "U8")}.get(fmt, ("I8", "U8"))
    if w.dtype not in want_w:
        raise QuantFileError(f"tensor {wkey} ({what}) has dtype {w.dtype}; expected {' or '.join(want_w)}")
    layer_info = QuantLayer(layer, comfy_format, fmt, keys, conf=dict(conf))
    K = cols * 2 if fmt in ("nvfp4", "w4a8", "w4a4") else cols

    def need(part, meaning):
        if part not in keys:
            raise QuantFileError(f"{what} has no tensor {layer}.{FILE_KEYS[fmt][part]} ({meaning}); "
                                 f"expected it next to {wkey}")
        return entries[keys[part]]

    def check(entry, dtypes, shape, meaning, want=None):
        """`shape`: the allowed shapes, or a number of values (any shape holding them; `want` says which)."""
        if entry.dtype not in dtypes:
            raise QuantFileError(f"tensor {entry.name} ({meaning} of {what}) has dtype {entry.dtype}; expected "
                                 f"{' or '.join(dtypes)}")
        numel = 1
        for s in entry.shape:
            numel *= s
        if isinstance(shape, int) and numel != shape or not isinstance(shape, int) and tuple(entry.shape) not in shape:
            want = want or (f"{shape} value(s)" if isinstance(shape, int) else " or ".join(str(list(s)) for s in shape))
            raise QuantFileError(f"tensor {entry.name} ({meaning} of {what}, a [{rows}, {cols}] weight) has shape "
                                 f"{list(entry.shape)}; expected {want}")

    floats = ("F32", "F16", "BF16")
    if fmt in ("nvfp4", "mxfp8"):
        block = 16 if fmt == "nvfp4" else 32
        if rows % block or K % block:
            raise QuantFileError(f"tensor {wkey} ({what}) holds [{rows}, {K}] values; {comfy_format} stores rows and "
                                 f"columns padded to whole {block}-value blocks (a multiple of {block})")
        lay = quant_layout(fmt, (rows, K))
        sdt = ("F8_E4M3", "U8") if fmt == "nvfp4" else ("F8_E8M0", "U8")
        srows, scols = lay["scale"]
        check(need("scale", "its block scales"), sdt, srows * scols, "block scales",
              f"{[srows, scols]} ({srows * scols} values: one per {block} in cuBLAS's swizzled 128x4 tiles)")
        if fmt == "nvfp4":
            check(need("scale2", "the tensor scale weight_scale_2"), floats, 1, "tensor scale")
    elif fmt == "int8":
        check(need("scale", "its scale"), floats, ((), (1,), (rows,), (rows, 1)), "scale (one, or one a row)")
        if conf.get("convrot", (conf.get("params") or {}).get("convrot", False)):
            layer_info.convrot = _int_conf(conf, "convrot_groupsize", 256, what)
    else:
        layer_info.convrot = _int_conf(conf, "convrot_groupsize", 256, what)
        if fmt == "w4a8":
            g = layer_info.group_size = _int_conf(conf, "group_size", 16, what)
            try:
                quant_layout("w4a8", (rows, K), g)
            except ValueError as e:
                raise QuantFileError(f"tensor {wkey} ({what}): {e}") from None
            check(need("scale", "its group scales s_rel"), ("F8_E4M3", "U8", "F32"), ((rows, K // g),),
                  f"group scales (one per {g} values)")
            check(need("scale2", "its channel scales s_channel"), ("F32",), ((rows,),), "channel scales")
            if "codebook" in keys:
                check(entries[keys["codebook"]], ("F32",), ((16,),), "codebook")
            if f"{layer}.weight_correction" in entries:
                raise QuantFileError(f"tensor {layer}.weight_correction: {what} is asymmetric (a correction term), "
                                     "which ComfyUI v0.33 does not read either; expected a symmetric W4A8 layer")
        else:
            check(need("scale", "its row scales"), floats, ((rows,), (rows, 1)), "row scales")
    if layer_info.convrot:
        g = layer_info.convrot
        if not _pow4(g) or K % g:
            raise QuantFileError(f"tensor {wkey} ({what}): ConvRot group size {g} must be a power of 4 dividing the "
                                 f"{K} columns")
    return layer_info


def state_entries(ck, q: QuantLayer) -> dict:
    """The state-dict tensors of one quantized layer, zero-copy views of the file: weight, the parts under
    STATE_KEYS names, and the JSON marker."""
    out = {q.weight_key: ck.tensor(q.weight_key)}
    for part, key in q.keys.items():
        if part in STATE_KEYS:
            out[f"{q.layer}.{STATE_KEYS[part]}"] = ck.tensor(key)
    out[f"{q.layer}.{QUANT_MARKER}"] = marker_tensor(q.marker())
    return out


def formats_text() -> str:
    return ", ".join(f"{name} ({BITS[fmt]} bits a weight)" for name, fmt in BLOCK_FORMATS.items())


# Quantize-on-load weight modes -> (comfy_quant format, ComfyUI layout)
LOAD_MODES = {"nvfp4": ("nvfp4", "TensorCoreNVFP4Layout"),
              "int8 tensorwise": ("int8_tensorwise", "TensorWiseINT8Layout")}


def quantize_entries(key: str, t: torch.Tensor, mode: str) -> tuple[dict, float, float]:
    """One high-precision Linear weight quantized with ComfyUI's own quantizer for `mode` (comfy.quant_ops, i.e.
    comfy_kitchen's quantize_nvfp4 / quantize_int8_tensorwise): (state-dict entries as a file would hold them,
    with the marker; relative error; max abs error). Needs ComfyUI (and comfy_kitchen, its requirement)."""
    try:
        import comfy.quant_ops as cq
    except ImportError as e:
        raise QuantFileError(f"weight mode {mode!r} quantizes with ComfyUI's own quantizers, which are not "
                             f"importable here: {e}") from None
    comfy_format, layout = LOAD_MODES[mode]
    if not getattr(cq, "_CK_AVAILABLE", False):
        raise QuantFileError(f"weight mode {mode!r} needs comfy_kitchen (one of ComfyUI's requirements), which "
                             "ComfyUI could not import")
    wf = t.float()
    qt = cq.QuantizedTensor.from_float(wf, layout)
    diff = wf - qt.dequantize().float()
    denom = wf.norm().item()
    rel = diff.norm().item() / denom if denom > 0 else 0.0
    layer = key[: -len(".weight")]
    stored = qt.state_dict(key)
    parts = FILE_KEYS[BLOCK_FORMATS[comfy_format]].items()
    keys = {"weight": key, **{part: f"{layer}.{suffix}" for part, suffix in parts if f"{layer}.{suffix}" in stored}}
    q = QuantLayer(layer, comfy_format, BLOCK_FORMATS[comfy_format], keys, conf={"format": comfy_format})
    out = {key: stored[key]}
    for part, k in keys.items():
        if part in STATE_KEYS:
            out[f"{layer}.{STATE_KEYS[part]}"] = stored[k]
    out[f"{layer}.{QUANT_MARKER}"] = marker_tensor(q.marker())
    return out, rel, diff.abs().max().item() if diff.numel() else 0.0
