"""The one home of the dtype names the kernels and the pack use.

MSL_TYPE: torch float dtype -> the MSL type name in entry-point suffixes (`sampler_lincomb_half`, ...);
DTYPE_OF_MSL the other way round.
FP8_DTYPES / FORMAT_OF_DTYPE: FP8 format name ("e4m3fn", "e5m2") <-> torch dtype (None where this torch
lacks it); QUANT_FORMAT_NAME: ComfyUI's comfy_quant format string -> our format name.
MSL_KIND: torch float dtype -> its run-time type code in the kernels (MSL_KIND_FLOAT, _HALF, _BFLOAT).
"""
from __future__ import annotations

import torch

from .source import define

MSL_TYPE = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}
DTYPE_OF_MSL = {name: dtype for dtype, name in MSL_TYPE.items()}

FP8_DTYPES = {"e4m3fn": getattr(torch, "float8_e4m3fn", None), "e5m2": getattr(torch, "float8_e5m2", None)}
FORMAT_OF_DTYPE = {dtype: name for name, dtype in FP8_DTYPES.items() if dtype is not None}
QUANT_FORMAT_NAME = {f"float8_{name}": name for name in FP8_DTYPES}

# The same three float types as the run-time codes of kernels that pick a type per call (a bias or an
# output read or written once per value: see include/io.h), emitted into the MSL source as MSL_KIND_*.
MSL_KIND = {dtype: define(f"MSL_KIND_{name.upper()}", i) for i, (dtype, name) in enumerate(MSL_TYPE.items())}
