"""Block-quantized (comfy_quant NVFP4, MXFP8, INT8, W4A8, W4A4) weights in the FP8 op set's layers.

The FP8 op set (nodes/fp8/ops.py) puts these mixins in front of its Linear and Embedding layers. A layer
whose state dict carries the `comfy_metal_quant` marker (nodes/quant/formats.py) keeps the file's tensors
as they are: the packed weight as a uint8 parameter and its scales as buffers (weight_scale,
weight_scale_2, weight_codebook, pre_quant_scale), so ComfyUI's memory manager counts the true stored size
and `model.to(device)` moves them. It marks itself active to the FP8 machinery (weight_format = "comfy_quant"),
so LoRA and hook patches (MetalFP8ModelPatcher) apply to its dequantised weight at forward time.

Linear forward (x in the compute dtype, times pre_quant_scale where the file has one):
  * weight-only, the pack's kernels: M <= 8 rows -> `quant_gemv` on the stored bytes (on MPS only where
    the measured choice timed it faster than dequantise + matmul), larger M -> `quant_dequantize` to the
    compute dtype + the platform matmul. ConvRot-rotated layouts (w4a8, w4a4, int8 with convrot) rotate
    the activation instead of the weight: x @ W.T == rotate_activation(x) @ W_stored.T.
  * INT8, W4A8 and W4A4 off MPS: ComfyUI's own path, its QuantizedTensor through comfy_kitchen's INT8
    matmul (activations quantized, `_int_mm`). MPS has no `_int_mm`: there these run weight-only.
  * With a LoRA / weight hook: the weight dequantised in its original basis, patched, platform matmul.
`quant_paths(model)` reports which path the layers took (the node badge and log say it).
"""
from __future__ import annotations

import math

import torch

from ..fp8.ops import GEMV_MAX_M, FP8LayerError
from .formats import FILE_KEYS, QUANT_MARKER, marker_tensor, read_marker

QUANT_TAG = "comfy_quant"                 # the layers' weight_format for a block-quantized weight
INT8_FAMILY = ("int8", "w4a8", "w4a4")    # where ComfyUI's own path quantizes activations (_int_mm)
RUN_KERNELS = ["quant_dequantize", "quant_gemv"]
WEIGHT_ONLY = "weight-only"               # the pack's kernels
COMFY_PATH = "comfy_kitchen int8"         # ComfyUI's QuantizedTensor path
# comfy_kitchen layout of each format (ComfyUI's QUANT_ALGOS) for ComfyUI's own path
COMFY_LAYOUT = {"int8": "TensorWiseINT8Layout", "w4a8": "AsymW4A8Int8Layout", "w4a4": "TensorCoreConvRotW4A4Layout"}


def _kernels():
    from ...metal_kernels import quant

    return quant


def weight_only(device) -> bool:
    """Whether the INT8 family runs weight-only on `device` (the pack's kernels), not ComfyUI's own INT8
    matmul: on MPS, which has no `_int_mm`."""
    return torch.device(device).type == "mps"


def _comfy_quant_ops():
    """ComfyUI's comfy.quant_ops when comfy_kitchen is there (inside ComfyUI), else None."""
    try:
        import comfy.quant_ops as cq
    except Exception:
        return None
    return cq if getattr(cq, "_CK_AVAILABLE", False) else None


class QuantWeightMixin:
    """State and load / dequantise logic of a block-quantized layer (put before the FP8 layer mixins)."""

    quant_fmt: str | None = None
    quant_shape: tuple | None = None       # the logical (N, K)
    quant_group: int = 0                   # w4a8: values per s_rel
    quant_rot: int = 0                     # ConvRot group size, 0 if not rotated
    quant_info: dict | None = None         # the marker: format names, file tensor name, comfy_quant JSON
    quant_last_path: str | None = None
    quant_comfy_path = False               # op sets built for ComfyUI: its own INT8 path off MPS

    def _quant_buffer(self, name: str, t: torch.Tensor | None) -> None:
        self._buffers.pop(name, None)
        self.__dict__.pop(name, None)
        if t is None:
            setattr(self, name, None)
        else:
            self.register_buffer(name, t)

    def _load_packed_weight(self, w, scale, state_dict, prefix) -> bool:
        marker = state_dict.pop(prefix + QUANT_MARKER, None)
        if marker is None:
            return super()._load_packed_weight(w, scale, state_dict, prefix)
        info = read_marker(marker)
        scale2 = state_dict.pop(prefix + "weight_scale_2", None)
        codebook = state_dict.pop(prefix + "weight_codebook", None)
        pqs = state_dict.pop(prefix + "pre_quant_scale", None)
        fmt, group, rot = info["format"], int(info.get("group_size") or 0), int(info.get("convrot") or 0)
        shape = tuple(self._fp8_expected_shape())
        source = self._fp8_source or "checkpoint"
        name = f"{type(self).__name__} {prefix.rstrip('.')}"
        tensor = info.get("tensor") or prefix + "weight"
        if len(shape) != 2:
            raise FP8LayerError(f"{source}: tensor {tensor} is {info.get('comfy_format')}, but the architecture's "
                                f"{name} has a {len(shape)}-D weight; these formats hold 2-D weights")
        quant = _kernels()
        lay = quant.quant_layout(fmt, shape, group)
        if tuple(w.shape) != lay["qdata"]:
            raise FP8LayerError(f"{source}: tensor {tensor} ({info.get('comfy_format')}) has shape {list(w.shape)}, "
                                f"but the architecture's {name} of shape {list(shape)} needs {list(lay['qdata'])}")
        if pqs is not None and tuple(pqs.shape) != (shape[1],):
            raise FP8LayerError(f"{source}: tensor {prefix}pre_quant_scale has shape {list(pqs.shape)}; expected "
                                f"[{shape[1]}] (one per input feature of {name})")
        try:       # the kernels' own checks of every part against the shape
            quant.check_weight(w, fmt, scale, scale2, codebook, shape=shape, group_size=group,
                               what=f"{source}: tensor {tensor}")
        except (TypeError, ValueError) as e:
            raise FP8LayerError(str(e)) from None
        self.weight_format = QUANT_TAG
        self.quant_fmt, self.quant_shape, self.quant_group, self.quant_rot = fmt, tuple(shape), group, rot
        self.quant_info = info
        self.weight = torch.nn.Parameter(w if w.dtype == torch.uint8 else w.view(torch.uint8), requires_grad=False)
        if scale is not None and scale.element_size() == 1:
            scale = scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)
        elif scale is not None:
            scale = scale.float()
        self._quant_buffer("weight_scale", scale)
        self._quant_buffer("weight_scale_2", None if scale2 is None else scale2.float())
        self._quant_buffer("weight_codebook", None if codebook is None else codebook.float())
        self._quant_buffer("pre_quant_scale", pqs)
        return True

    def _quant(self) -> bool:
        return self.weight_format == QUANT_TAG and self.quant_fmt is not None

    def _quant_parts(self, device) -> tuple:
        """(qdata, scale, scale2, codebook) on `device`."""
        out = []
        for t in (self.weight, self.weight_scale, getattr(self, "weight_scale_2", None),
                  getattr(self, "weight_codebook", None)):
            if t is not None and t.device != device:
                t = t.to(device, non_blocking=True)
            out.append(t)
        return tuple(out)

    def quant_dequantized(self, device, dtype, stored_basis: bool = False) -> torch.Tensor:
        """The weight dequantised to `dtype` on `device`: in its original basis, or as stored (rotated)."""
        quant = _kernels()
        q, s, s2, cb = self._quant_parts(torch.device(device))
        kw = {"shape": self.quant_shape, "group_size": self.quant_group, "out_dtype": dtype}
        if stored_basis:
            return quant.quant_dequantize(q, self.quant_fmt, s, s2, cb, **kw)
        return quant.dequantize_weight(q, self.quant_fmt, s, s2, cb, convrot=self.quant_rot, **kw)

    def decoded_weight(self, device=None, dtype=torch.float32, apply_patches=True) -> torch.Tensor:
        if not self._quant():
            return super().decoded_weight(device, dtype, apply_patches)
        device = torch.device(device) if device is not None else self.weight.device
        out = self.quant_dequantized(device, dtype)
        if apply_patches:
            for f in self._weight_functions():
                out = f(out)
        return out

    def quant_file_tensors(self, name: str) -> dict:
        """The layer's tensors as a comfy_quant file stores them (ComfyUI's names and dtypes), on the CPU."""
        info = self.quant_info or {}
        fmt = self.quant_fmt
        e4m3, e8m0 = getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e8m0fnu", None)

        def as_stored(t, code):
            t = t.detach().to("cpu")
            return t.view(code) if code is not None and t.dtype == torch.uint8 else t

        weight_dtype = {"nvfp4": None, "mxfp8": e4m3}.get(fmt, torch.int8)
        scale_dtype = {"nvfp4": e4m3, "mxfp8": e8m0, "w4a8": e4m3}.get(fmt)
        out = {f"{name}.weight": as_stored(self.weight, weight_dtype)}
        keys = FILE_KEYS[fmt]
        for part, t, code in (("scale", self.weight_scale, scale_dtype),
                              ("scale2", getattr(self, "weight_scale_2", None), None),
                              ("codebook", getattr(self, "weight_codebook", None), None)):
            if t is not None:
                out[f"{name}.{keys[part]}"] = as_stored(t, code)
        if getattr(self, "pre_quant_scale", None) is not None:
            out[f"{name}.pre_quant_scale"] = self.pre_quant_scale.detach().to("cpu")
        out[f"{name}.comfy_quant"] = marker_tensor(info.get("conf") or {"format": info.get("comfy_format")})
        return {k: v.contiguous() for k, v in out.items()}

    def quant_comfy_tensor(self, device, dtype):
        """This weight as ComfyUI's own QuantizedTensor (its _load_quantized_module's layout parameters)."""
        cq = _comfy_quant_ops()
        q, s, s2, cb = self._quant_parts(torch.device(device))
        fmt, conf = self.quant_fmt, (self.quant_info or {}).get("conf") or {}
        layout = COMFY_LAYOUT[fmt]
        if fmt == "int8":
            extra = {"scale": s, "convrot": bool(self.quant_rot), "convrot_groupsize": self.quant_rot or 256}
        elif fmt == "w4a8":
            extra = {"scale": s.view(torch.float8_e4m3fn) if s.dtype == torch.uint8 else s, "s_channel": s2,
                     "codebook": cb, "group_size": self.quant_group, "convrot_groupsize": self.quant_rot}
        else:
            extra = {"scale": s, "convrot_groupsize": self.quant_rot, "quant_group_size": 64,
                     "linear_dtype": conf.get("linear_dtype", (conf.get("params") or {}).get("linear_dtype", "int4"))}
        params = cq.get_layout_class(layout).Params(**extra, orig_dtype=dtype, orig_shape=self.quant_shape)
        return cq.QuantizedTensor(q.view(torch.int8), layout, params)


class QuantLinearMixin(QuantWeightMixin):
    def quantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        if not self._quant():
            return super().quantized_linear(x)
        dtype = self._compute_dtype(x)
        if x.dtype != dtype:
            x = x.to(dtype)
        pqs = getattr(self, "pre_quant_scale", None)
        if pqs is not None:                       # ModelOpt AWQ smoothing, as ComfyUI applies it
            x = x * pqs.to(device=x.device, dtype=dtype)
        N, K = self.quant_shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K)
        bias = self._fp8_bias(x.device, dtype)
        if self._weight_functions():
            self.quant_last_path = "dequantised (patched)"
            y = torch.nn.functional.linear(x2, self.decoded_weight(x.device, dtype), bias)
        elif self.quant_comfy_path and self.quant_fmt in INT8_FAMILY and not weight_only(x.device) \
                and _comfy_quant_ops() is not None:
            self.quant_last_path = COMFY_PATH
            y = torch.nn.functional.linear(x2, self.quant_comfy_tensor(x.device, dtype), bias)
        else:
            self.quant_last_path = WEIGHT_ONLY
            y = self._weight_only_linear(x2, bias, dtype)
        return y.reshape(*lead, N)

    def _weight_only_linear(self, x2, bias, dtype):
        quant = _kernels()
        N, K = self.quant_shape
        M = x2.shape[0]
        xr = quant.rotate_activation(x2, self.quant_rot) if self.quant_rot else x2

        def via_matmul():
            return torch.nn.functional.linear(xr, self.quant_dequantized(x2.device, dtype, stored_basis=True), bias)

        if not 0 < M <= GEMV_MAX_M:
            return via_matmul()
        q, s, s2, cb = self._quant_parts(x2.device)

        def via_gemv():
            return quant.quant_gemv(xr.contiguous(), q, self.quant_fmt, s, s2, cb, bias, shape=self.quant_shape,
                                    group_size=self.quant_group)

        from ...metal_kernels import dispatch

        if not dispatch.measuring_enabled(x2.device):
            return via_gemv()
        key = (M, N, K, self.quant_fmt, str(dtype).replace("torch.", ""))
        choice = dispatch.measured_choice("quant_gemv", key, {"dequantize+matmul": via_matmul, "gemv": via_gemv},
                                          x2.device)
        return via_gemv() if choice == "gemv" else via_matmul()


class QuantEmbeddingMixin(QuantWeightMixin):
    def quantized_embedding(self, ids: torch.Tensor, out_dtype=None) -> torch.Tensor:
        if not self._quant():
            return super().quantized_embedding(ids, out_dtype)
        dtype = out_dtype or self._fp8_hp_dtype(torch.float32)
        if self.quant_fmt != "int8" or self._weight_functions() or self.max_norm is not None:
            w = self.decoded_weight(ids.device, dtype)
            return torch.nn.functional.embedding(ids, w, self.padding_idx, self.max_norm, self.norm_type,
                                                 self.scale_grad_by_freq, self.sparse)
        # INT8: dequantise only the looked-up rows (comfy_kitchen's dequantize_int8_embedding)
        quant = _kernels()
        q, s, _, _ = self._quant_parts(ids.device)
        flat = ids.reshape(-1)
        rows = q.index_select(0, flat)
        if s.numel() > 1:
            s = s.reshape(-1).index_select(0, flat)
        K = self.quant_shape[1]
        out = quant.dequantize_weight(rows, "int8", s, shape=(flat.numel(), K), convrot=self.quant_rot,
                                      out_dtype=dtype)
        return out.reshape(*ids.shape, K)


def quant_modules(model: torch.nn.Module):
    for name, m in model.named_modules():
        if isinstance(m, QuantWeightMixin) and m._quant() and m.weight is not None and not m.weight.is_meta:
            yield name, m


def weight_bytes(model: torch.nn.Module) -> dict:
    """Bytes of the block-quantized layers (packed weights + every scale), their logical weight count, and
    the whole state dict."""
    q_bytes = q_elems = 0
    for _, m in quant_modules(model):
        q_bytes += sum(t.nbytes for t in (m.weight, m.weight_scale, getattr(m, "weight_scale_2", None),
                                          getattr(m, "weight_codebook", None)) if t is not None)
        q_elems += math.prod(m.quant_shape)
    total = sum(t.nbytes for t in model.state_dict().values())
    return {"quant_bytes": q_bytes, "quant_weights": q_elems, "total_bytes": total,
            "bits_per_quant_weight": 8 * q_bytes / q_elems if q_elems else float("nan")}


def quant_formats(model: torch.nn.Module) -> dict[str, int]:
    """comfy_quant format name -> layers."""
    out: dict[str, int] = {}
    for _, m in quant_modules(model):
        name = (m.quant_info or {}).get("comfy_format", m.quant_fmt)
        out[name] = out.get(name, 0) + 1
    return out


def path_note(formats, device, comfy_path: bool = True) -> str:
    """What the block-quantized layers of `formats` (kernel names) run on `device`, in words (comfy_path: the
    layers would take ComfyUI's own INT8 path where there is one)."""
    device = torch.device(device)
    int8 = sorted(f for f in formats if f in INT8_FAMILY)
    parts = []
    if int8:
        if weight_only(device) or not comfy_path or _comfy_quant_ops() is None:
            parts.append(f"{'/'.join(int8)} weight-only on {device.type} (quant_gemv <= {GEMV_MAX_M} rows, "
                         "quant_dequantize + matmul above; no _int_mm)")
        else:
            parts.append(f"{'/'.join(int8)} through ComfyUI's own INT8 matmul (comfy_kitchen) on {device.type}")
    floats = sorted(f for f in formats if f not in INT8_FAMILY)
    if floats:
        parts.append(f"{'/'.join(floats)} weight-only (quant_gemv <= {GEMV_MAX_M} rows, quant_dequantize + "
                     "matmul above)")
    return "; ".join(parts)


def quant_paths(model: torch.nn.Module) -> dict[str, int]:
    """The path each block-quantized layer took at its last call (WEIGHT_ONLY, COMFY_PATH, ...) -> layers."""
    out: dict[str, int] = {}
    for _, m in quant_modules(model):
        if m.quant_last_path:
            out[m.quant_last_path] = out.get(m.quant_last_path, 0) + 1
    return out


__all__ = ["QUANT_TAG", "QuantWeightMixin", "QuantLinearMixin", "QuantEmbeddingMixin", "quant_modules", "weight_bytes",
           "quant_formats", "quant_paths", "path_note", "weight_only", "RUN_KERNELS"]
