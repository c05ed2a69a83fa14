"""GGUF test files from tiny random models (plain module: `import gguf_models`).

`write_gguf(path, sd, qtype, arch)` writes a state dict with gguf.GGUFWriter: 2-D+ weights whose rows are
whole blocks are quantised (Q8_0 / Q4_0 / ... with the gguf package's own quantisers; Q4_K with the
simple quantiser below, since the package has none), everything else F32. It returns the values the
file holds, dequantised by the gguf package (the oracle: the pack's dequantiser is not used)."""
from __future__ import annotations

import numpy as np
import torch

import gguf
from gguf.quants import dequantize as np_dequantize, quantize as np_quantize

Q = gguf.GGMLQuantizationType


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantiser (8 sub-blocks of 32 with 6-bit scale/min, 4-bit values): rows of 256*k."""
    rows = x.reshape(-1, 256).astype(np.float32)
    nb = rows.shape[0]
    sub = rows.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    hi = sub.max(-1)
    scale = (hi - lo) / 15.0
    offset = -lo
    d = (scale.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (offset.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin[:, None] > 0, np.rint(offset / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = d[:, None] * sc
        q = np.where(step[..., None] > 0, np.rint((sub + (dmin[:, None] * mn)[..., None]) / step[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(nb, 256)
    s = np.zeros((nb, 12), np.uint8)
    s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    qs = q.reshape(nb, 4, 2, 32)
    packed = (qs[:, :, 0, :] | (qs[:, :, 1, :] << 4)).reshape(nb, 128)
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(nb, 2),
                          dmin.astype(np.float16).view(np.uint8).reshape(nb, 2), s, packed], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 256 * 144)


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    if qtype == "Q4_K":
        return quantize_q4_k(x)
    return np_quantize(x.astype(np.float32), Q[qtype])


def quantisable(key: str, t: torch.Tensor, qtype: str) -> bool:
    bs = gguf.GGML_QUANT_SIZES[Q[qtype]][0]
    return key.endswith(".weight") and t.dim() == 2 and t.shape[-1] % bs == 0 and "norm" not in key


def write_gguf(path, sd: dict, qtype: str, arch: str = "flux", extra=None, skip=()) -> tuple[dict, int]:
    """Write `sd`; returns (the file's values as float32 tensors by key, number of quantised tensors)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_file_type(1)
    values, nq = {}, 0
    for key, t in sd.items():
        if key in skip:
            continue
        a = t.detach().float().contiguous().numpy()
        if quantisable(key, t, qtype):
            raw = quantize(a, qtype)
            w.add_tensor(key, raw, raw_shape=raw.shape, raw_dtype=Q[qtype])
            values[key] = torch.from_numpy(np_dequantize(raw, Q[qtype]).copy()).reshape(t.shape)
            nq += 1
        else:
            w.add_tensor(key, a)
            values[key] = torch.from_numpy(a.copy())
    for k, v in (extra or {}).items():
        w.add_string(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values, nq
