"""Reading FP8 checkpoints: validate a .safetensors file and describe which weights are FP8.

Formats read (all memory-mapped through `safetensors.safe_open`, nothing is copied):
  * plain float8 weights (F8_E4M3 / F8_E5M2 tensors, no scale: scale 1);
  * "scaled fp8" files: a `scaled_fp8` marker tensor (any prefix) and per-layer `<layer>.scale_weight`
    (and `<layer>.scale_input`, which weight-only compute does not need);
  * ComfyUI's per-layer quantization metadata: `<layer>.comfy_quant` uint8 JSON tensors and/or the
    `_quantization_metadata` JSON in the file header, format float8_e4m3fn / float8_e5m2 with a
    tensorwise (scalar) or per-row ((N,) or (N, 1)) `<layer>.weight_scale`; the weight may be stored
    as native float8 or as uint8 bytes;
  * the block formats of ComfyUI's QUANT_ALGOS in the same metadata (nvfp4, mxfp8, int8_tensorwise,
    asym_w4a8_int8, convrot_w4a4): each layer's tensors are described and checked by nodes/quant/formats.py
    (`quant_layers`: weight key -> QuantLayer).
Formats ComfyUI itself does not read (comfy_kitchen's svdquant_w4a4, awq_w4a16) and unknown ones raise
`UnsupportedQuantFormat`, which names the format, the layer and what is supported.

Every problem with the file is a `CheckpointError` (a ValueError) whose message names the file, the
tensor, what was expected and what was found.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct

import torch

# FP8 format name <-> torch dtype; comfy_quant "format" strings -> our short format names.
from ...metal_kernels.dtypes import FORMAT_OF_DTYPE, FP8_DTYPES, QUANT_FORMAT_NAME
from ..quant.formats import BLOCK_FORMATS, QuantFileError, QuantLayer, describe_layer, formats_text

__all__ = ["CheckpointError", "UnsupportedQuantFormat", "CheckpointMissing", "FP8Layer", "QuantLayer", "Checkpoint",
           "open_checkpoint", "read_header", "FP8_DTYPES", "FORMAT_OF_DTYPE", "SUPPORTED_FORMATS_TEXT",
           "is_fp8_dtype", "QUANT_FORMAT_NAME"]

SUPPORTED_FORMATS_TEXT = (
    "plain float8_e4m3fn / float8_e5m2 weights, 'scaled fp8' files (scaled_fp8 marker + scale_weight), and "
    "ComfyUI comfy_quant / _quantization_metadata layers of format float8_e4m3fn or float8_e5m2 with a "
    f"tensorwise or per-row weight_scale, or {formats_text()}")

# comfy_kitchen layouts that ComfyUI v0.33 does not read (not in its QUANT_ALGOS)
KNOWN_UNSUPPORTED = {"svdquant_w4a4": "SVDQuant W4A4 (which ComfyUI v0.33 does not read either)",
                     "awq_w4a16": "AWQ W4A16 (which ComfyUI v0.33 does not read either)"}

# safetensors dtype strings -> torch dtypes (only those this torch build has).
_ST_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                   "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                   "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
                   "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
ST_DTYPES = {k: getattr(torch, v) for k, v in _ST_DTYPE_NAMES.items() if hasattr(torch, v)}
# One-byte codes this torch has no dtype for (MXFP8's e8m0 block scales before torch 2.7): read as bytes.
BYTE_CODES = {k for k in ("F8_E8M0",) if k not in ST_DTYPES}
ST_DTYPES.update({k: torch.uint8 for k in BYTE_CODES})
_FLOAT_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in FORMAT_OF_DTYPE


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names file, tensor, expected and found."""


class CheckpointMissing(CheckpointError, FileNotFoundError):
    pass


class UnsupportedQuantFormat(CheckpointError):
    pass


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str           # safetensors dtype string
    shape: tuple
    begin: int           # byte offsets inside the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass
class FP8Layer:
    """One FP8 weight: `weight_key` holds the bytes, `scale_key` (or None: scale 1) the float scale."""

    weight_key: str
    fmt: str                       # "e4m3fn" | "e5m2"
    scale_key: str | None
    source: str                    # "plain" | "scaled_fp8" | "comfy_quant"
    input_scale_key: str | None = None
    rowwise: bool = False


def _short(path) -> str:
    return os.path.basename(str(path))


def read_header(path) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """Parse and validate the safetensors header: (entries, metadata, data section start).

    Checks what a memory map would only find out later (or crash on): a truncated file, a header that
    is not JSON, unknown dtypes, data offsets that do not match the shape or run past the end."""
    path = os.fspath(path)
    name = _short(path)
    if not os.path.exists(path):
        raise CheckpointMissing(f"{path}: file not found")
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: is a folder, expected a .safetensors file")
    size = os.path.getsize(path)
    if size < 8:
        raise CheckpointError(f"{name}: truncated or not a safetensors file: {size} bytes, expected at least 8")
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        if hlen > size - 8 or hlen > 100 * 2**20:
            raise CheckpointError(f"{name}: corrupt or truncated safetensors header: header length {hlen} bytes, "
                                  f"but the file has {size} bytes")
        raw = f.read(hlen)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name}: corrupt safetensors header (expected a JSON object): {e}") from None
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + hlen
    data_size = size - data_start
    entries = {}
    for key, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
            begin, end = int(begin), int(end)
            if any(s < 0 for s in shape):
                raise ValueError("negative dimension")
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{name}: tensor {key}: corrupt header entry {info!r} "
                                  "(expected dtype, shape and data_offsets)") from None
        if dtype not in ST_DTYPES:
            raise CheckpointError(f"{name}: tensor {key} has dtype {dtype}, which torch {torch.__version__} cannot "
                                  f"load; expected one of {', '.join(sorted(ST_DTYPES))}")
        numel = 1
        for s in shape:
            numel *= s
        want = numel * ST_DTYPES[dtype].itemsize
        if end - begin != want or begin < 0:
            raise CheckpointError(f"{name}: tensor {key}: corrupt header: dtype {dtype} shape {list(shape)} needs "
                                  f"{want} bytes, data_offsets give {end - begin}")
        if end > data_size:
            raise CheckpointError(f"{name}: truncated file: tensor {key} ends at byte {data_start + end}, but the file "
                                  f"has only {size} bytes (expected at least {data_start + end})")
        entries[key] = TensorEntry(key, dtype, shape, begin, end)
    return entries, dict(metadata), data_start


class Checkpoint:
    """A validated, memory-mapped safetensors file plus the FP8 layout of its weights.

    `tensor(key)` returns a zero-copy view of the file. `layers` maps each FP8 weight key to its
    `FP8Layer`; `aux_keys` are the scale/marker/metadata tensors that are not model weights."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.name = _short(self.path)
        self.entries, self.metadata, self.data_start = read_header(self.path)
        self.file_size = os.path.getsize(self.path)
        from safetensors import safe_open

        try:
            self._handle = safe_open(self.path, framework="pt", device="cpu")
        except Exception as e:  # safetensors' own checks (overlapping offsets, ...)
            raise CheckpointError(f"{self.name}: safetensors could not open the file: {e}") from None
        self.layers: dict[str, FP8Layer] = {}
        self.quant_layers: dict[str, QuantLayer] = {}
        self.aux_keys: set[str] = set()
        self.quant_source = "none"
        self._detect()

    # -- access ---------------------------------------------------------------------------------

    def close(self):
        self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def model_keys(self) -> list[str]:
        """The keys of model tensors (weights, biases, norms), without scales and markers."""
        return [k for k in self.entries if k not in self.aux_keys]

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.entries:
            raise CheckpointError(f"{self.name}: has no tensor {key}")
        if self._handle is None:
            raise CheckpointError(f"{self.name}: the file was closed")
        if self.entries[key].dtype in BYTE_CODES:
            return self.read_copy(key)
        try:
            return self._handle.get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{self.name}: tensor {key} could not be read: {e}") from None

    def read_copy(self, key: str) -> torch.Tensor:
        """The tensor read with plain file reads into a private buffer (not the memory map), so that
        no file pages stay mapped (resident) after the caller drops it: for tensors that are
        converted (quantized) and discarded one at a time."""
        entry = self.entries.get(key)
        if entry is None:
            raise CheckpointError(f"{self.name}: has no tensor {key}")
        buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        if entry.nbytes:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + entry.begin)
                got = f.readinto(memoryview(buf.numpy()))
            if got != entry.nbytes:
                raise CheckpointError(f"{self.name}: tensor {key}: read {got} bytes, expected {entry.nbytes} "
                                      "(file truncated while loading?)")
        return buf.view(ST_DTYPES[entry.dtype]).reshape(entry.shape)

    def fp8_weight(self, key: str) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        """(native float8 weight, float32 scale of shape () or (N,) or None, fmt) for an FP8 layer."""
        layer = self.layers[key]
        w = self.tensor(key)
        if w.dtype == torch.uint8:
            w = w.view(FP8_DTYPES[layer.fmt])
        scale = self.scale(layer, w.shape) if layer.scale_key else None
        return w, scale, layer.fmt

    def scale(self, layer: FP8Layer, weight_shape) -> torch.Tensor:
        s = self.tensor(layer.scale_key)
        rows = weight_shape[0] if len(weight_shape) else 1
        if s.dtype not in _FLOAT_SCALE_DTYPES:
            raise CheckpointError(f"{self.name}: tensor {layer.scale_key} (scale of {layer.weight_key}) has dtype "
                                  f"{s.dtype}, expected float32, float16 or bfloat16")
        s = s.float()
        if s.numel() == 1:
            return s.reshape(())
        if s.numel() == rows and (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):
            return s.reshape(rows)
        raise CheckpointError(f"{self.name}: tensor {layer.scale_key} (scale of {layer.weight_key}, shape "
                              f"{list(weight_shape)}) has shape {list(s.shape)}, expected one value (tensorwise) "
                              f"or {rows} (one per row)")

    # -- format detection -----------------------------------------------------------------------

    def _json_tensor(self, key) -> dict:
        t = self.tensor(key)
        try:
            conf = json.loads(t.view(torch.uint8).numpy().tobytes())
            if not isinstance(conf, dict):
                raise ValueError("not an object")
            return conf
        except (ValueError, UnicodeDecodeError, RuntimeError) as e:
            raise CheckpointError(f"{self.name}: tensor {key} should hold the layer's quantization JSON: {e}") from None

    def _add_quant_layer(self, layer_name: str, conf: dict, origin: str):
        fmt_name = conf.get("format")
        wkey = f"{layer_name}.weight"
        if fmt_name in BLOCK_FORMATS:
            try:
                q = describe_layer(self.entries, layer_name, fmt_name, conf, origin)
            except QuantFileError as e:
                raise CheckpointError(f"{self.name}: {e}") from None
            self.quant_layers[q.weight_key] = q
            self.aux_keys.update(q.aux_keys())
            return
        if fmt_name not in QUANT_FORMAT_NAME:
            what = KNOWN_UNSUPPORTED.get(fmt_name, f"unknown format {fmt_name!r}")
            raise UnsupportedQuantFormat(
                f"{self.name}: layer {layer_name} ({origin}) is quantized as {what}, which Comfy Metal cannot compute; "
                f"supported: {SUPPORTED_FORMATS_TEXT}")
        if wkey not in self.entries:
            raise CheckpointError(f"{self.name}: {origin} lists layer {layer_name}, but the file has no tensor {wkey}")
        fmt = QUANT_FORMAT_NAME[fmt_name]
        entry = self.entries[wkey]
        want = {"e4m3fn": "F8_E4M3", "e5m2": "F8_E5M2"}[fmt]
        if entry.dtype not in (want, "U8"):
            raise CheckpointError(f"{self.name}: tensor {wkey} is listed as {fmt_name} but has dtype {entry.dtype}; "
                                  f"expected {want} (or U8 bytes)")
        skey = f"{layer_name}.weight_scale"
        ikey = f"{layer_name}.input_scale"
        if skey in self.entries:
            self.aux_keys.add(skey)
        if ikey in self.entries:
            self.aux_keys.add(ikey)
        rows = entry.shape[0] if entry.shape else 1
        rowwise = skey in self.entries and self._numel(skey) == rows and rows > 1
        self.layers[wkey] = FP8Layer(wkey, fmt, skey if skey in self.entries else None, "comfy_quant",
                                     ikey if ikey in self.entries else None, rowwise)

    def _numel(self, key):
        n = 1
        for s in self.entries[key].shape:
            n *= s
        return n

    def _detect(self):
        qmeta = self.metadata.get("_quantization_metadata")
        cq_keys = [k for k in self.entries if k.endswith(".comfy_quant")]
        markers = [k for k in self.entries if k == "scaled_fp8" or k.endswith(".scaled_fp8")]
        if qmeta is not None or cq_keys:
            self.quant_source = "comfy_quant"
            if qmeta is not None:
                try:
                    layers = json.loads(qmeta)["layers"]
                    if not isinstance(layers, dict):
                        raise ValueError("layers is not an object")
                except (ValueError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{self.name}: header metadata _quantization_metadata is not valid "
                                          f"(expected JSON with a 'layers' object): {e}") from None
                for layer_name, conf in layers.items():
                    if not isinstance(conf, dict):
                        raise CheckpointError(f"{self.name}: _quantization_metadata layer {layer_name}: expected an "
                                              f"object like {{\"format\": \"float8_e4m3fn\"}}, found {conf!r}")
                    self._add_quant_layer(layer_name, conf, "_quantization_metadata")
            for key in cq_keys:
                self.aux_keys.add(key)
                layer_name = key[: -len(".comfy_quant")]
                conf = self._json_tensor(key)
                self._add_quant_layer(layer_name, conf, f"tensor {key}")
        elif markers:
            self.quant_source = "scaled_fp8"
            self.aux_keys.update(markers)
            marker_dtype = self.entries[markers[0]].dtype
            default_fmt = "e5m2" if marker_dtype == "F8_E5M2" else "e4m3fn"
            for key, entry in self.entries.items():
                if key.endswith(".scale_weight"):
                    layer_name = key[: -len(".scale_weight")]
                    wkey = f"{layer_name}.weight"
                    self.aux_keys.add(key)
                    if wkey not in self.entries:
                        raise CheckpointError(f"{self.name}: tensor {key} has no matching weight {wkey}")
                    wdtype = self.entries[wkey].dtype
                    if wdtype == "F8_E4M3":
                        fmt = "e4m3fn"
                    elif wdtype == "F8_E5M2":
                        fmt = "e5m2"
                    elif wdtype == "U8":
                        fmt = default_fmt
                    else:
                        # A scale_weight next to a high-precision weight: the scale is folded in already
                        # in some exporters; others keep the layer unquantized. Only FP8 bytes get scaled.
                        continue
                    ikey = f"{layer_name}.scale_input"
                    if ikey in self.entries:
                        self.aux_keys.add(ikey)
                    rows = self.entries[wkey].shape[0] if self.entries[wkey].shape else 1
                    self.layers[wkey] = FP8Layer(wkey, fmt, key, "scaled_fp8",
                                                 ikey if ikey in self.entries else None,
                                                 self._numel(key) == rows and rows > 1)
                elif key.endswith(".scale_input"):
                    self.aux_keys.add(key)
        # Plain float8 tensors not described above: weights with scale 1.
        for key, entry in self.entries.items():
            if key in self.layers or key in self.aux_keys or key in self.quant_layers:
                continue
            if entry.dtype in ("F8_E4M3", "F8_E5M2"):
                if self.quant_source == "none":
                    self.quant_source = "plain"
                fmt = "e4m3fn" if entry.dtype == "F8_E4M3" else "e5m2"
                self.layers[key] = FP8Layer(key, fmt, None, "plain")

    # -- summaries --------------------------------------------------------------------------------

    def describe(self) -> str:
        n = len(self.layers)
        fmts = sorted({layer.fmt for layer in self.layers.values()})
        rows = sum(1 for layer in self.layers.values() if layer.rowwise)
        counts: dict[str, int] = {}
        for q in self.quant_layers.values():
            counts[q.comfy_format] = counts.get(q.comfy_format, 0) + 1
        block = "".join(f", {c} {name}" for name, c in sorted(counts.items()))
        return (f"{self.name}: {len(self.entries)} tensors, {n} FP8 ({'/'.join(fmts) or '-'}, source "
                f"{self.quant_source}, {rows} per-row scaled){block}, {self.file_size / 2**20:.1f} MiB")

    def high_precision_dtypes(self) -> dict[torch.dtype, int]:
        counts: dict[torch.dtype, int] = {}
        for key in self.model_keys():
            if key in self.layers or key in self.quant_layers:
                continue
            d = ST_DTYPES[self.entries[key].dtype]
            if d.is_floating_point:
                counts[d] = counts.get(d, 0) + self._numel(key)
        return counts


def open_checkpoint(path) -> Checkpoint:
    return Checkpoint(path)
