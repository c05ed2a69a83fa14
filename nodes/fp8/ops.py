"""ComfyUI operations that keep weights in FP8, and the ModelPatcher that applies LoRAs to them.

`make_fp8_ops(...)` builds (inside ComfyUI, lazily: it subclasses `comfy.ops.manual_cast`) the class
passed as `model_options["custom_operations"]`. Its Linear / Conv / Embedding layers keep an FP8
weight (native float8 on CPU/CUDA and MPS >= torch 2.15, uint8 bytes on older MPS) with its float32
scale (tensorwise () or per-row (N,)) as module state, so ComfyUI's memory accounting
(`module_size` = bytes of the state dict) sees 1 byte a weight.

Linear forward: M <= GEMV_MAX_M rows -> `metal_kernels.gemv` reads the FP8 weight directly (on
MPS only where `dispatch.measured_choice` timed it faster than decode + matmul for that shape); larger
M -> `metal_kernels.fp8_decode` to the compute dtype (the input's dtype) + the platform matmul. Conv and embedding weights decode the same way (an embedding decodes only the looked-up rows).

LoRA: `MetalFP8ModelPatcher` (a `comfy.model_patcher.ModelPatcher`) does not rewrite FP8 weights;
for a patched FP8 weight it installs ComfyUI's own `LowVramPatch` on the layer, which the forward
applies to the decoded weight (`comfy.lora.calculate_weight`) -- no re-quantization, no bf16 copy.
Modules without an FP8 weight behave exactly like `comfy.ops.manual_cast`.

ComfyUI's block formats (comfy_quant NVFP4, MXFP8, INT8, W4A8, W4A4) are taken by the mixins of
nodes/quant/ops.py in front of Linear and Embedding (their state dict carries a marker,
`_load_packed_weight`); the same patcher, forward hooks and accounting apply to them.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ...metal_kernels.linear import GEMV_MAX_M
from ..quant.formats import QUANT_MARKER, read_marker
from .formats import FORMAT_OF_DTYPE, CheckpointError, is_fp8_dtype

log = logging.getLogger("comfy_metal")

FP8_FORMATS = ("e4m3fn", "e5m2")
_BYTE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


class FP8LayerError(CheckpointError):
    """A tensor that does not fit the layer it is loaded into."""


def _kernels():
    from ... import metal_kernels as mk

    return mk.fp8_decode, mk.gemv


def _dispatch():
    from ...metal_kernels import dispatch

    return dispatch



def storage_dtype(device, fmt: str) -> torch.dtype:
    """How FP8 weights are held for a model whose load device is `device`."""
    from ...metal_kernels.probe import fp8_storage_dtype

    return fp8_storage_dtype(torch.device(device), fmt)


def to_storage(w: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """View FP8 bytes (native float8 or uint8) as `dtype` (uint8 or the native float8). Zero-copy."""
    if w.dtype == dtype:
        return w
    return w.view(dtype)


def decode_fp8(data: torch.Tensor, fmt: str, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Decode an FP8 weight of any rank (per-row scale on dim 0) to `dtype`."""
    fp8_decode, _ = _kernels()
    if data.dim() == 2 or data.dim() <= 1 and (scale is None or scale.numel() == 1):
        return fp8_decode(data, fmt, scale, out_dtype=dtype)
    flat = data.reshape(data.shape[0], -1) if data.dim() else data.reshape(1, 1)
    return fp8_decode(flat, fmt, scale, out_dtype=dtype).reshape(data.shape)


def _plain_decode(t: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """An FP8 tensor that is not a quantized layer weight (a bias, a norm): to float32 once at load."""
    fmt = FORMAT_OF_DTYPE.get(t.dtype)
    if fmt is None:
        return t
    return decode_fp8(t, fmt, scale, torch.float32)


class FP8WeightMixin:
    """State and load/decode logic shared by the FP8 Linear, Conv and Embedding layers."""

    weight_format: str | None = None   # "e4m3fn" / "e5m2" (or "gguf": nodes/gguf); None: a plain weight
    fp8_lora_patch = None          # a comfy LowVramPatch installed by MetalFP8ModelPatcher
    fp8_hook_patch = None          # weight-hook patches (scheduled LoRA), applied after it
    _fp8_source = ""               # file name, for error messages (set on the ops class)
    _fp8_storage: torch.dtype | None = None   # uint8 to force bytes; None: keep native float8

    def _fp8_expected_shape(self) -> tuple:
        raise NotImplementedError

    def _load_quantized_weight(self, w) -> bool:
        """Hook for op sets that extend this one with other quantised formats (nodes/gguf): take `w`
        (already checked against the expected shape) and return True, or return False."""
        return False

    def _load_packed_weight(self, w, scale, state_dict, prefix) -> bool:
        """Hook for block-quantized weights whose stored shape is not the logical one (nodes/quant: their
        state dict carries a marker); layers without that mixin refuse a marked weight."""
        marker = state_dict.pop(prefix + QUANT_MARKER, None)
        if marker is not None:
            info = read_marker(marker)
            raise FP8LayerError(f"{self._fp8_source or 'checkpoint'}: tensor {info.get('tensor')} is "
                                f"{info.get('comfy_format')}, but it belongs to a {type(self).__name__} "
                                f"({prefix.rstrip('.')}); ComfyUI stores these formats for Linear layers (and INT8 "
                                "for embeddings) only")
        return False

    def _fp8_hp_dtype(self, found: torch.dtype) -> torch.dtype:
        dtype = getattr(self, "_fp8_param_dtype", None)
        if dtype is None or dtype in _BYTE_DTYPES:
            return found if found.is_floating_point and found not in _BYTE_DTYPES else torch.float32
        return dtype

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        w = state_dict.pop(prefix + "weight", None)
        scale = state_dict.pop(prefix + "weight_scale", None)
        bias = state_dict.pop(prefix + "bias", None)
        for extra in ("input_scale", "scale_weight", "scale_input", "comfy_quant"):
            state_dict.pop(prefix + extra, None)
        expected = self._fp8_expected_shape()
        if w is None:
            missing_keys.append(prefix + "weight")
        elif self._load_packed_weight(w, scale, state_dict, prefix):
            pass                            # a block-quantized weight (nodes/quant), stored shape != logical
        else:
            if tuple(w.shape) != tuple(expected):
                raise FP8LayerError(
                    f"{self._fp8_source or 'checkpoint'}: tensor {prefix}weight has shape {list(w.shape)}, but the model "
                    f"architecture expects {list(expected)} for {type(self).__name__} {prefix.rstrip('.')}")
            if is_fp8_dtype(w.dtype):
                fmt = FORMAT_OF_DTYPE[w.dtype]
                self.set_fp8_weight(w, fmt, scale)
            elif self._load_quantized_weight(w):
                pass                        # another block format (GGUF) took it
            else:
                if scale is not None:
                    w = w.float() * scale.float().reshape(-1, *([1] * (w.dim() - 1)))
                self.weight_format = None
                self.weight = torch.nn.Parameter(w.to(self._fp8_hp_dtype(w.dtype)), requires_grad=False)
                self._buffers.pop("weight_scale", None)
        if bias is not None:
            want = (expected[0],)
            if tuple(bias.shape) != want:
                raise FP8LayerError(f"{self._fp8_source or 'checkpoint'}: tensor {prefix}bias has shape "
                                    f"{list(bias.shape)}, but the model architecture expects {list(want)}")
            bias = _plain_decode(bias)
            self.bias = torch.nn.Parameter(bias.to(self._fp8_hp_dtype(bias.dtype)), requires_grad=False)
        elif getattr(self, "bias", None) is not None and self.bias.is_meta:
            missing_keys.append(prefix + "bias")
        # Anything else under this prefix is not ours.
        for key in list(state_dict):
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                unexpected_keys.append(key)

    def set_fp8_weight(self, w: torch.Tensor, fmt: str, scale: torch.Tensor | None) -> None:
        if scale is not None:
            scale = scale.float()
            if scale.numel() == 1:
                scale = scale.reshape(())
            elif scale.numel() == w.shape[0]:
                scale = scale.reshape(w.shape[0])
            else:
                raise FP8LayerError(f"{self._fp8_source or 'checkpoint'}: the scale of a {list(w.shape)} weight has "
                                    f"{scale.numel()} values; expected 1 (tensorwise) or {w.shape[0]} (one per row)")
            if scale.is_meta:
                raise FP8LayerError("scale on the meta device")
        self.weight_format = fmt
        store = self._fp8_storage or w.dtype
        self.weight = torch.nn.Parameter(to_storage(w, fmt, store), requires_grad=False)
        if scale is None:
            self._buffers.pop("weight_scale", None)
            self.__dict__.pop("weight_scale", None)
            self.weight_scale = None
        else:
            self._buffers.pop("weight_scale", None)
            self.__dict__.pop("weight_scale", None)
            self.register_buffer("weight_scale", scale)

    # -- forward helpers ---------------------------------------------------------------------------

    def quantized_active(self) -> bool:
        w = getattr(self, "weight", None)
        return self.weight_format is not None and w is not None and w.dtype in _BYTE_DTYPES and not w.is_meta

    def _weight_functions(self) -> list:
        fns = list(getattr(self, "weight_function", []) or [])
        patch = self.fp8_lora_patch
        if patch is not None and not any(getattr(f, "key", None) == getattr(patch, "key", object()) for f in fns):
            fns.insert(0, patch)
        if self.fp8_hook_patch is not None:
            fns.insert(1 if patch is not None and fns and fns[0] is patch else 0, self.fp8_hook_patch)
        return fns

    def _fp8_bytes_scale(self, device):
        w = self.weight
        if w.device != device:
            w = w.to(device, non_blocking=True)
        scale = getattr(self, "weight_scale", None)
        if scale is not None and scale.device != device:
            scale = scale.to(device, non_blocking=True)
        return w, scale

    def _fp8_bias(self, device, dtype):
        b = getattr(self, "bias", None)
        if b is None:
            return None
        b = b.to(device=device, dtype=dtype, non_blocking=True)
        for f in getattr(self, "bias_function", []) or []:
            b = f(b)
        return b

    def decoded_weight(self, device=None, dtype=torch.float32, apply_patches=True) -> torch.Tensor:
        """The weight decoded to `dtype` on `device`, with LoRA/weight patches applied."""
        device = torch.device(device) if device is not None else self.weight.device
        w, scale = self._fp8_bytes_scale(device)
        out = decode_fp8(w, self.weight_format, scale, dtype)
        if apply_patches:
            for f in self._weight_functions():
                out = f(out)
        return out

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if x.is_floating_point() and x.dtype not in _BYTE_DTYPES:
            return x.dtype
        return self._fp8_hp_dtype(torch.float32)


class FP8LinearMixin(FP8WeightMixin):
    def _fp8_init(self, in_features, out_features, bias, device, dtype):
        torch.nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self._fp8_param_dtype = dtype
        # Meta: nothing is allocated before the checkpoint's tensors are assigned.
        self.weight = torch.nn.Parameter(torch.empty((out_features, in_features), device="meta",
                                                     dtype=dtype or torch.float32), requires_grad=False)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_features, device="meta", dtype=dtype or torch.float32),
                                           requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.weight_scale = None

    def _fp8_expected_shape(self):
        return (self.out_features, self.in_features)

    def quantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        fp8_decode, gemv = _kernels()
        dtype = self._compute_dtype(x)
        if x.dtype != dtype:
            x = x.to(dtype)
        K = self.in_features
        lead = x.shape[:-1]
        x2 = x.reshape(-1, K)
        M = x2.shape[0]
        bias = self._fp8_bias(x.device, dtype)
        fns = self._weight_functions()
        if 0 < M <= GEMV_MAX_M and not fns:
            w, scale = self._fp8_bytes_scale(x.device)

            def via_gemv():
                return gemv(x2.contiguous(), w, bias, fmt=self.weight_format, scale=scale, out_dtype=dtype)

            dispatch = _dispatch()
            if not dispatch.measuring_enabled(x.device):
                y = via_gemv()
            else:  # on MPS: GEMV only where measured faster than decode + the platform matmul
                def via_matmul():
                    return torch.nn.functional.linear(x2, self.decoded_weight(x.device, dtype), bias)

                key = (M, self.out_features, K, self.weight_format, str(dtype).replace("torch.", ""))
                choice = dispatch.measured_choice("gemv", key, {"decode+matmul": via_matmul, "gemv": via_gemv},
                                                  x.device)
                y = via_gemv() if choice == "gemv" else via_matmul()
        else:
            w = self.decoded_weight(x.device, dtype)
            y = torch.nn.functional.linear(x2, w, bias)
        return y.reshape(*lead, self.out_features)


class FP8ConvMixin(FP8WeightMixin):
    def _fp8_expected_shape(self):
        return (self.out_channels, self.in_channels // self.groups, *self.kernel_size)

    def quantized_conv(self, x, *args, **kwargs):
        dtype = self._compute_dtype(x)
        if x.dtype != dtype:
            x = x.to(dtype)
        w = self.decoded_weight(x.device, dtype)
        return self._conv_forward(x, w, self._fp8_bias(x.device, dtype), *args, **kwargs)


class FP8EmbeddingMixin(FP8WeightMixin):
    def _fp8_expected_shape(self):
        return (self.num_embeddings, self.embedding_dim)

    def quantized_embedding(self, ids: torch.Tensor, out_dtype=None) -> torch.Tensor:
        dtype = out_dtype or self._fp8_hp_dtype(torch.float32)
        if self._weight_functions() or self.max_norm is not None:
            w = self.decoded_weight(ids.device, dtype)
            return torch.nn.functional.embedding(ids, w, self.padding_idx, self.max_norm, self.norm_type,
                                                 self.scale_grad_by_freq, self.sparse)
        fp8_decode, _ = _kernels()
        w, scale = self._fp8_bytes_scale(ids.device)
        flat = ids.reshape(-1)
        rows = w.view(torch.uint8).index_select(0, flat)       # gather bytes, decode only these rows
        if scale is not None and scale.numel() > 1:
            scale = scale.index_select(0, flat)
        out = fp8_decode(rows, self.weight_format, scale, out_dtype=dtype)
        return out.reshape(*ids.shape, self.embedding_dim)


class DecodeFP8OnLoadMixin:
    """For layers kept in high precision (norms, ...): FP8 tensors in the file are decoded at load."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("weight", "bias"):
            key = prefix + name
            t = state_dict.get(key)
            if t is not None and is_fp8_dtype(t.dtype):
                scale = state_dict.pop(prefix + f"{name}_scale", None)
                state_dict[key] = _plain_decode(t, scale)
        state_dict.pop(prefix + "weight_scale", None)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class _TorchOps:
    """Plain torch layers, the base of the standalone op set (no ComfyUI: tests, benchmarks)."""

    Linear = torch.nn.Linear
    Conv1d = torch.nn.Conv1d
    Conv2d = torch.nn.Conv2d
    Conv3d = torch.nn.Conv3d
    Embedding = torch.nn.Embedding
    LayerNorm = torch.nn.LayerNorm
    GroupNorm = torch.nn.GroupNorm


def make_fp8_ops(source: str = "", compute_dtype: torch.dtype | None = None,
                 storage: torch.dtype | None = None, standalone: bool = False):
    """The custom_operations class for one load.

    source: file name for error messages; storage: torch.uint8 to hold FP8 as bytes (MPS before
    torch 2.15), None to keep the file's native float8 dtype. standalone=True builds the same
    layers on plain torch.nn classes (no ComfyUI needed); otherwise they subclass
    comfy.ops.manual_cast (ComfyUI must be importable)."""
    if standalone:
        base = _TorchOps
        run_every_op = None
    else:
        import comfy.ops

        base = comfy.ops.manual_cast
        run_every_op = getattr(comfy.ops, "run_every_op", None)

    def _tick():
        if run_every_op is not None:
            run_every_op()

    from ..quant.ops import QuantEmbeddingMixin, QuantLinearMixin

    class Linear(QuantLinearMixin, FP8LinearMixin, base.Linear):
        _fp8_source = source
        _fp8_storage = storage
        quant_comfy_path = not standalone

        def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
            self._fp8_init(in_features, out_features, bias, device, dtype)

        def reset_parameters(self):
            return None

        def forward(self, *args, **kwargs):
            if self.quantized_active():
                _tick()
                return self.quantized_linear(*args, **kwargs)
            return super().forward(*args, **kwargs)

    def conv_class(conv_base):
        class Conv(FP8ConvMixin, conv_base):
            _fp8_source = source
            _fp8_storage = storage

            def reset_parameters(self):
                return None

            def forward(self, *args, **kwargs):
                if self.quantized_active():
                    _tick()
                    return self.quantized_conv(*args, **kwargs)
                return super().forward(*args, **kwargs)

        Conv.__name__ = Conv.__qualname__ = conv_base.__name__
        return Conv

    class Embedding(QuantEmbeddingMixin, FP8EmbeddingMixin, base.Embedding):
        _fp8_source = source
        _fp8_storage = storage

        def reset_parameters(self):
            self.bias = None
            return None

        def _fp8_expected_shape(self):
            return (self.num_embeddings, self.embedding_dim)

        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            self._fp8_param_dtype = getattr(self, "weight_comfy_model_dtype", None) or (
                self.weight.dtype if self.weight is not None else None)
            return FP8EmbeddingMixin._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)

        def forward(self, input, *args, **kwargs):
            if self.quantized_active():
                _tick()
                return self.quantized_embedding(input, kwargs.get("out_dtype", args[0] if args else None))
            if standalone:
                out_dtype = kwargs.pop("out_dtype", None)
                y = super().forward(input)
                return y if out_dtype is None else y.to(out_dtype)
            return super().forward(input, *args, **kwargs)

    attrs: dict[str, Any] = {"Linear": Linear, "Embedding": Embedding, "fp8_source": source,
                             "fp8_compute_dtype": compute_dtype, "fp8_storage": storage}
    for name in ("Conv1d", "Conv2d", "Conv3d"):
        if hasattr(base, name):
            attrs[name] = conv_class(getattr(base, name))
    for name in ("LayerNorm", "GroupNorm", "RMSNorm", "BatchNorm2d", "ConvTranspose1d", "ConvTranspose2d"):
        if hasattr(base, name):
            cls = type(name, (DecodeFP8OnLoadMixin, getattr(base, name)), {})
            attrs[name] = cls
    ops = type("MetalFP8Ops", (base,), attrs)
    # Conv layers: the weight is allocated by torch in __init__ (small next to Linear layers) and
    # replaced at load; give them the param dtype so high-precision loads keep it.
    for name in ("Conv1d", "Conv2d", "Conv3d"):
        if name in attrs:
            _wrap_conv_init(attrs[name])
    return ops


def _wrap_conv_init(cls):
    orig = cls.__init__

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self._fp8_param_dtype = kwargs.get("dtype")

    cls.__init__ = __init__


def is_fp8_module(m) -> bool:
    return isinstance(m, FP8WeightMixin) and m.quantized_active()


def fp8_modules(model: torch.nn.Module):
    for name, m in model.named_modules():
        if is_fp8_module(m):
            yield name, m


def weight_bytes(model: torch.nn.Module) -> dict:
    """Bytes held by FP8 layers (weights + scales), their element count, and the rest (block-quantized
    layers: nodes/quant/ops.weight_bytes)."""
    fp8_bytes = fp8_elems = layers = 0
    for _, m in fp8_modules(model):
        if m.weight_format not in FP8_FORMATS:
            continue
        fp8_bytes += m.weight.nbytes + (m.weight_scale.nbytes if m.weight_scale is not None else 0)
        fp8_elems += m.weight.numel()
        layers += 1
    total = sum(t.nbytes for t in model.state_dict().values())
    return {"fp8_bytes": fp8_bytes, "fp8_weights": fp8_elems, "fp8_layers": layers, "total_bytes": total,
            "bytes_per_fp8_weight": fp8_bytes / fp8_elems if fp8_elems else float("nan")}


def quantized_memory(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes the model's weights take, bytes they would take with its quantized layers, FP8, GGUF or a
    comfy_quant block format, in bf16): what the pack's loaders save, for the status displays."""
    held = sum(t.nbytes for t in model.state_dict().values())
    as_bf16 = held
    for _, m in fp8_modules(model):
        own = sum(t.nbytes for t in (m.weight, m.weight_scale, getattr(m, "weight_scale_2", None),
                                     getattr(m, "weight_codebook", None)) if t is not None)
        shape = getattr(m, "quant_shape", None) or getattr(m, "gguf_shape", None) or m.weight.shape
        as_bf16 += 2 * math.prod(shape) - own
    return held, as_bf16


def record_quantized(model: torch.nn.Module, name: str) -> None:
    """Tell the status displays (nodes/status) about a model a loader made with quantized layers."""
    from ..status import record_loaded_model

    if any(True for _ in fp8_modules(model)):
        record_loaded_model(model, name, *quantized_memory(model))


# ------------------------------------------------------------------------------------------------
# ModelPatcher
# ------------------------------------------------------------------------------------------------

_PATCHER_CLASS = None


def patcher_class():
    """MetalFP8ModelPatcher, built once (ComfyUI must be importable)."""
    global _PATCHER_CLASS
    if _PATCHER_CLASS is not None:
        return _PATCHER_CLASS
    import comfy.lora
    import comfy.model_patcher as mp
    import comfy.utils

    class MetalFP8ModelPatcher(mp.ModelPatcher):
        """Applies weight patches (LoRA) to FP8 layers at forward time on the decoded weight."""

        def _fp8_op(self, key):
            parts = key.rsplit(".", 1)
            if len(parts) != 2 or parts[1] != "weight":
                return None
            try:
                op = comfy.utils.get_attr(self.model, parts[0])
            except AttributeError:
                return None
            return op if is_fp8_module(op) else None

        def patch_weight_to_device(self, key, device_to=None, *args, **kwargs):
            op = self._fp8_op(key)
            if op is None:
                return super().patch_weight_to_device(key, device_to, *args, **kwargs)
            return_weight = kwargs.get("return_weight", args[1] if len(args) > 1 else False)
            if key not in self.patches:
                op.fp8_lora_patch = None
                return op.weight
            if return_weight:
                w = op.decoded_weight(device_to, torch.float32, apply_patches=False)
                return comfy.lora.calculate_weight(self.patches[key], w, key)
            op.fp8_lora_patch = mp.LowVramPatch(key, self.patches)
            return None

        def unpatch_model(self, device_to=None, unpatch_weights=True):
            if unpatch_weights:
                for m in self.model.modules():
                    if isinstance(m, FP8WeightMixin):
                        m.fp8_lora_patch = None
            return super().unpatch_model(device_to, unpatch_weights)

        def patch_hook_weight_to_device(self, hooks, combined_patches, key, original_weights, memory_counter):
            op = self._fp8_op(key)
            if op is None:
                return super().patch_hook_weight_to_device(hooks, combined_patches, key, original_weights,
                                                           memory_counter)
            if key not in combined_patches:
                return
            op.fp8_hook_patch = _HookPatch(key, combined_patches[key], original_weights.pop(key, None))

        def unpatch_hooks(self, *args, **kwargs):
            for m in self.model.modules():
                if isinstance(m, FP8WeightMixin):
                    m.fp8_hook_patch = None
            return super().unpatch_hooks(*args, **kwargs)

        def cleanup(self):
            # Once per sampling run: CFGGuider.outer_sample calls it after the run (in its finally),
            # inside the executing KSampler-like node. The FP8 kernels ran in that core node, so the
            # badge record goes to it (node_class None: the executing node's id). Not per layer.
            super().cleanup()
            record_fp8_run(self.model)

    class _HookPatch:
        """Hook (scheduled) weight patches of an FP8 layer, applied to the decoded weight."""

        def __init__(self, key, patches, original):
            self.key, self.patches, self.original = key, patches, original

        def __call__(self, weight):
            kwargs = {"original_weights": {self.key: self.original}} if self.original is not None else {}
            return comfy.lora.calculate_weight(self.patches, weight, self.key, intermediate_dtype=weight.dtype,
                                               **kwargs)

    _PATCHER_CLASS = MetalFP8ModelPatcher
    return MetalFP8ModelPatcher


RUN_KERNELS = ["fp8_decode", "gemv"]


def record_fp8_run(model) -> None:
    """Badge record for the node in which an FP8 model just ran (never raises)."""
    try:
        formats = {m.weight_format for m in model.modules() if is_fp8_module(m)}
        if formats:
            from ..quant.ops import QUANT_TAG, quant_paths
            from ..quant.ops import RUN_KERNELS as QUANT_KERNELS
            from ..status import record_node_backend

            kernels = list(RUN_KERNELS) if formats & set(FP8_FORMATS) else []
            if "gguf" in formats:            # GGUF layers (nodes/gguf) run their own kernels
                kernels += ["gguf_dequantize", "gguf_gemv"]
            note = None
            if QUANT_TAG in formats:         # block-quantized layers (nodes/quant): their kernels, their path
                kernels += QUANT_KERNELS
                paths = quant_paths(model)
                note = ", ".join(f"{n} layers {p}" for p, n in sorted(paths.items())) or None
            record_node_backend(None, kernels, note=note)
    except Exception as e:  # a badge must never break sampling
        log.debug("comfy_metal: FP8 run record failed: %s", e)


def wrap_patcher(patcher):
    """A MetalFP8ModelPatcher sharing `patcher`'s model (ComfyUI built the stock one)."""
    cls = patcher_class()
    if isinstance(patcher, cls):
        return patcher
    n = cls(patcher.model, patcher.load_device, patcher.offload_device, patcher.model_size(),
            weight_inplace_update=getattr(patcher, "weight_inplace_update", False))
    for attr in ("cached_patcher_init", "model_options", "patches", "object_patches", "is_clip", "hook_mode"):
        if hasattr(patcher, attr):
            setattr(n, attr, getattr(patcher, attr))
    return n
