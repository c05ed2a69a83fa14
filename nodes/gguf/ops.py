"""GGUF weights in ComfyUI layers: the FP8 op set (nodes/fp8/ops.py), extended with ggml block formats.

`GGUFTensor` carries one quantised tensor of a GGUF file from the reader to the layer that loads it:
its data are the file's bytes (uint8, memory-mapped), its `.shape` is the logical shape, so ComfyUI's
model detection reads the architecture from it as from any state dict.

`make_gguf_ops(...)` builds the custom_operations class: each layer of the FP8 op set (Linear, Conv,
Embedding) gains the GGUF mixin below through the FP8 layers' `_load_quantized_weight` hook. A GGUF
layer keeps its blocks as a uint8 parameter (ComfyUI's memory manager counts those bytes: the true
quantised size) with `weight_format = "gguf"`, so everything the op set builds on a quantised weight
applies unchanged: the forward paths (`quantized_linear`, ...), LoRA and hook patches on the dequantised
weight (MetalFP8ModelPatcher), and weight accounting. Linear forward: M <= GEMV_MAX_M rows -> `gguf_gemv`
(the fused Metal kernel reads the
blocks; on MPS only where the dispatch's measured choice, when it offers one, timed it faster);
larger M -> `gguf_dequantize` to the compute dtype + the platform matmul. Embeddings gather
the byte rows of the looked-up tokens and dequantise only those.
"""
from __future__ import annotations

import math

import torch

from ...metal_kernels.linear import GEMV_MAX_M
from ..fp8.ops import FP8LayerError, make_fp8_ops

GGUF_FORMAT = "gguf"        # the layers' weight_format for a GGUF weight
RUN_KERNELS = ["gguf_dequantize", "gguf_gemv"]


def _kernels():
    from ... import metal_kernels as mk

    return mk.gguf_dequantize, mk.gguf_gemv, mk.GGUF_QUANTS


class GGUFTensor(torch.Tensor):
    """A quantised GGUF tensor: the file's block bytes (uint8), whose `.shape` is the logical shape.

    Tensor ops see the bytes (`nbytes`, `numel()` are those of the blocks: what ComfyUI's memory
    manager counts). Moves and copies (`to`, `detach`, `clone`, ...) keep the class and its
    quantisation, so it can be a layer's parameter and survive `model.to(device)`; every other op
    returns plain bytes. The layers' kernels read the bytes through `raw()`."""

    @staticmethod
    def __new__(cls, raw: torch.Tensor, qtype: str, shape, name: str = ""):
        t = torch.Tensor._make_subclass(cls, raw, False)
        t.gguf_qtype = qtype
        t.gguf_shape = torch.Size(int(s) for s in shape)
        t.gguf_name = name
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = next((a for a in args if isinstance(a, GGUFTensor)), None)
        if src is not None and getattr(src, "gguf_qtype", None) is None:
            src = None
        # Code that reads a weight directly instead of calling its layer (ComfyUI's CLIP reads its
        # position embedding with cast_to: `w.to(dtype)`, or `empty_like(w, dtype)` + `copy_(w)`)
        # gets the dequantised values, never the bytes.
        if src is not None and func is torch.empty_like:
            dtype = kwargs.get("dtype")
            if dtype is not None and dtype.is_floating_point:
                return torch.empty(src.gguf_shape, dtype=dtype, device=kwargs.get("device") or src.device)
        if func is torch.Tensor.copy_ and len(args) >= 2 and isinstance(args[1], GGUFTensor) \
                and not isinstance(args[0], GGUFTensor) and args[0].is_floating_point():
            dst = args[0]
            with torch._C.DisableTorchFunctionSubclass():
                return dst.copy_(dequantize_tensor(args[1], dst.dtype, dst.device))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if src is None or not isinstance(out, torch.Tensor) or isinstance(out, GGUFTensor):
            return out
        if func in _KEEP_CLASS or func in _CONVERT:
            if out.is_floating_point():          # a conversion to a float dtype: the values
                return dequantize_tensor(src, out.dtype, out.device)
            if out.shape == src.raw().shape:
                return GGUFTensor(out, src.gguf_qtype, src.gguf_shape, src.gguf_name)
        return out

    @property
    def shape(self):
        return self.gguf_shape

    @property
    def ndim(self):
        return len(self.gguf_shape)

    def size(self, dim=None):
        return self.gguf_shape if dim is None else self.gguf_shape[dim]

    def dim(self):
        return len(self.gguf_shape)

    def logical_numel(self) -> int:
        return math.prod(self.gguf_shape)

    def raw(self) -> torch.Tensor:
        """The block bytes as a plain uint8 tensor (no copy)."""
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.as_subclass(self, torch.Tensor)

    def __repr__(self):
        return f"GGUFTensor({self.gguf_qtype}, shape={list(self.gguf_shape)}, {self.raw().nbytes} bytes)"

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = GGUFTensor(self.raw().clone(), self.gguf_qtype, self.gguf_shape, self.gguf_name)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, proto):
        return (GGUFTensor, (self.raw(), self.gguf_qtype, tuple(self.gguf_shape), self.gguf_name))


_KEEP_CLASS = {torch.Tensor.detach, torch.Tensor.to, torch.Tensor.clone, torch.Tensor.cpu, torch.Tensor.contiguous,
               torch.Tensor.requires_grad_, torch.Tensor.pin_memory, torch.Tensor.share_memory_}
_CONVERT = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double, torch.Tensor.type,
            torch.Tensor.type_as}
if hasattr(torch.Tensor, "cuda"):
    _KEEP_CLASS.add(torch.Tensor.cuda)
if hasattr(torch.Tensor, "mps"):
    _KEEP_CLASS.add(torch.Tensor.mps)


def dequantize_tensor(t: GGUFTensor, dtype=torch.float32, device=None) -> torch.Tensor:
    """A GGUFTensor's values (its logical shape) in `dtype`."""
    dequant, _, quants = _kernels()
    _, ts = quants[t.gguf_qtype]
    raw = t.raw() if isinstance(t, GGUFTensor) else t
    if device is not None:
        raw = raw.to(device)
    return dequant(raw.reshape(-1, ts), t.gguf_qtype, out_dtype=dtype).reshape(t.gguf_shape)


class GGUFWeightMixin:
    """Put in front of an FP8 op-set layer: GGUF weights are taken by `_load_quantized_weight`."""

    gguf_qtype: str | None = None
    gguf_shape: tuple | None = None

    def _load_quantized_weight(self, w) -> bool:
        if not isinstance(w, GGUFTensor):
            return False
        _, _, quants = _kernels()
        if w.gguf_qtype not in quants:
            raise FP8LayerError(f"{self._fp8_source or 'checkpoint'}: tensor {w.gguf_name or '?'} is {w.gguf_qtype}, "
                                f"which is not supported; supported: {', '.join(quants)}, F32, F16, BF16")
        bs, ts = quants[w.gguf_qtype]
        shape = tuple(w.gguf_shape)
        raw = w.raw()
        # (rows, row_bytes) whenever the last dimension is whole blocks (every Linear): the GEMV reads
        # rows directly; otherwise (a reshaped tensor) the blocks as one flat run.
        if shape[-1] % bs == 0:
            raw = raw.reshape(math.prod(shape[:-1]), shape[-1] // bs * ts)
        else:
            raw = raw.reshape(-1, ts)
        self.weight_format = GGUF_FORMAT
        self.gguf_qtype = w.gguf_qtype
        self.gguf_shape = shape
        self.weight = torch.nn.Parameter(GGUFTensor(raw, w.gguf_qtype, shape, w.gguf_name), requires_grad=False)
        self._buffers.pop("weight_scale", None)
        self.__dict__.pop("weight_scale", None)
        self.weight_scale = None
        return True

    def _gguf(self) -> bool:
        return self.weight_format == GGUF_FORMAT and self.gguf_qtype is not None

    def _gguf_raw(self, device=None) -> torch.Tensor:
        """The weight's block bytes, (rows, row_bytes) uint8, on `device`."""
        w = self.weight
        raw = w.raw() if isinstance(w, GGUFTensor) else w
        return raw if device is None or raw.device == device else raw.to(device, non_blocking=True)

    def decoded_weight(self, device=None, dtype=torch.float32, apply_patches=True) -> torch.Tensor:
        if not self._gguf():
            return super().decoded_weight(device, dtype, apply_patches)
        dequant, _, _ = _kernels()
        device = torch.device(device) if device is not None else self.weight.device
        out = dequant(self._gguf_raw(device), self.gguf_qtype, out_dtype=dtype).reshape(self.gguf_shape)
        if apply_patches:
            for f in self._weight_functions():
                out = f(out)
        return out


class GGUFLinearMixin(GGUFWeightMixin):
    def quantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        if not self._gguf():
            return super().quantized_linear(x)
        _, gemv, _ = _kernels()
        dtype = self._compute_dtype(x)
        if x.dtype != dtype:
            x = x.to(dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        M = x2.shape[0]
        bias = self._fp8_bias(x.device, dtype)
        w = self._gguf_raw(x.device)

        def via_matmul():
            return torch.nn.functional.linear(x2, self.decoded_weight(x.device, dtype), bias)

        if 0 < M <= GEMV_MAX_M and not self._weight_functions() and w.shape[0] == self.out_features:
            def via_gemv():
                return gemv(x2.contiguous(), w, self.gguf_qtype, bias, out_dtype=dtype)

            y = via_gemv() if self._gemv_choice(x, M, dtype, via_matmul, via_gemv) == "gemv" else via_matmul()
        else:
            y = via_matmul()
        return y.reshape(*lead, self.out_features)

    def _gemv_choice(self, x, M, dtype, via_matmul, via_gemv) -> str:
        """The path of a call with <= 8 rows: the fused GEMV, or dequantise + matmul where the dispatch's
        measured choice (timed once per shape on MPS) found the GEMV slower."""
        from ...metal_kernels import dispatch

        if not dispatch.measuring_enabled(x.device):
            return "gemv"
        key = (M, self.out_features, self.in_features, self.gguf_qtype, str(dtype).replace("torch.", ""))
        return dispatch.measured_choice("gguf_gemv", key, {"dequantize+matmul": via_matmul, "gemv": via_gemv},
                                        x.device)


class GGUFEmbeddingMixin(GGUFWeightMixin):
    def quantized_embedding(self, ids: torch.Tensor, out_dtype=None) -> torch.Tensor:
        if not self._gguf():
            return super().quantized_embedding(ids, out_dtype)
        dtype = out_dtype or self._fp8_hp_dtype(torch.float32)
        w = self._gguf_raw(ids.device)
        if self._weight_functions() or self.max_norm is not None or w.shape[0] != self.num_embeddings:
            w = self.decoded_weight(ids.device, dtype)
            return torch.nn.functional.embedding(ids, w, self.padding_idx, self.max_norm, self.norm_type,
                                                 self.scale_grad_by_freq, self.sparse)
        dequant, _, _ = _kernels()
        rows = w.index_select(0, ids.reshape(-1))           # the byte rows of these tokens only
        return dequant(rows, self.gguf_qtype, out_dtype=dtype).reshape(*ids.shape, self.embedding_dim)


def make_gguf_ops(source: str = "", compute_dtype: torch.dtype | None = None, standalone: bool = False):
    """The custom_operations class for one GGUF load: the FP8 op set with GGUF-aware layers.
    source: the file name, for error messages. standalone=True: on plain torch.nn (no ComfyUI)."""
    base = make_fp8_ops(source, compute_dtype, None, standalone=standalone)
    attrs = {"Linear": type("Linear", (GGUFLinearMixin, base.Linear), {}),
             "Embedding": type("Embedding", (GGUFEmbeddingMixin, base.Embedding), {}),
             "gguf_source": source}
    for name in ("Conv1d", "Conv2d", "Conv3d"):
        conv = getattr(base, name, None)
        if conv is not None:
            attrs[name] = type(name, (GGUFWeightMixin, conv), {})
    return type("MetalGGUFOps", (base,), attrs)


def gguf_modules(model: torch.nn.Module):
    for name, m in model.named_modules():
        if isinstance(m, GGUFWeightMixin) and m._gguf() and m.weight is not None and not m.weight.is_meta:
            yield name, m


def weight_bytes(model: torch.nn.Module) -> dict:
    """Bytes of the GGUF-quantised layers, their logical weight count, and the whole state dict."""
    q_bytes = q_elems = 0
    for _, m in gguf_modules(model):
        q_bytes += m._gguf_raw().nbytes
        q_elems += math.prod(m.gguf_shape)
    total = sum(t.nbytes for t in model.state_dict().values())
    return {"gguf_bytes": q_bytes, "gguf_weights": q_elems, "total_bytes": total,
            "bytes_per_gguf_weight": q_bytes / q_elems if q_elems else float("nan")}
