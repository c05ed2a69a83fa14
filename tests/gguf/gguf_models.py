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


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: the rows of a Llama q/k projection (weight or bias)
    reordered per head from Hugging Face's rotary layout (two halves) to llama.cpp's (interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def exact_in_half_q8_0(a: np.ndarray) -> np.ndarray:
    """`a` with every 32-value block scaled (by less than 1.42x) so that its largest magnitude is 127 * 2^e:
    Q8_0's fp16 scale is then the power of two 2^e and every dequantised value (2^e times an int8) is exact
    in fp16 and bf16, so a loader that stores the dequantised weights in half precision (ComfyUI's stock
    text encoder path) holds exactly the weights the Q8_0 file does."""
    blocks = a.reshape(-1, 32).astype(np.float32)
    amax = np.abs(blocks).max(1, keepdims=True)
    target = 127 * np.exp2(np.round(np.log2(np.where(amax > 0, amax, 127) / 127)))
    return (blocks * np.where(amax > 0, target / np.where(amax > 0, amax, 1), 1)).reshape(a.shape)


def write_llama_cpp_text_encoder(path, sd: dict, arch: str, qtype: str, heads: tuple[int, int] | None = None,
                                 permute_qk: bool = False, exact_in_half: bool = False,
                                 extra_tensors=None) -> tuple[dict, int]:
    """A text encoder in Hugging Face names (Llama / Qwen decoders: model.layers.N.self_attn.q_proj ...; T5:
    encoder.block.N.layer.0.SelfAttention.q ...) written as llama.cpp's convert_hf_to_gguf.py writes it:
    tensor names from the gguf package's own name map for `arch`, the q/k rows permuted (permute_qk: Llama;
    Qwen2/Qwen3 keep Hugging Face's order), 2-D weights whose rows are whole blocks quantised (the embedding
    too), norms and biases F32, heads = (head count, KV head count) as metadata.
    Returns (Hugging Face name -> the values the file holds, dequantised by the gguf package and in Hugging
    Face's row order; number of quantised tensors). Quantisation is per row, so quantising the unpermuted
    weight gives the same rows as quantising the permuted one: checked for every permuted tensor.
    exact_in_half (Q8_0): the weights are first snapped with exact_in_half_q8_0. extra_tensors: llama.cpp
    name -> array written F32 as is (tensors the converter makes up, such as Llama-3.1's rope_freqs)."""
    blocks = [int(p) for k in sd for a, p in zip(k.split("."), k.split(".")[1:]) if a in ("layers", "block")]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], 1 + max(blocks))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1 + max(blocks))
    n_head, n_head_kv = heads or (None, None)
    if heads:
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    values, nq = {}, 0
    for key, t in sd.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"the gguf package has no llama.cpp name for {key} ({arch})")
        a = t.detach().float().contiguous().numpy()
        permute = None
        if permute_qk and ".self_attn.q_proj." in key:
            permute = (n_head, n_head)
        elif permute_qk and ".self_attn.k_proj." in key:
            permute = (n_head, n_head_kv)
        if quantisable(key, t, qtype):
            if exact_in_half:
                assert qtype == "Q8_0", qtype
                a = exact_in_half_q8_0(a)
            stored = llama_cpp_permute(a, *permute) if permute else a
            raw = quantize(stored, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=Q[qtype])
            hf_order = np_dequantize(quantize(a, qtype), Q[qtype]).reshape(t.shape)
            if permute:
                assert np.array_equal(np_dequantize(raw, Q[qtype]).reshape(t.shape),
                                      llama_cpp_permute(hf_order, *permute)), key
            if exact_in_half:
                assert np.array_equal(hf_order.astype(np.float16).astype(np.float32), hf_order), key
            values[key] = torch.from_numpy(hf_order.copy())
            nq += 1
        else:
            w.add_tensor(name, llama_cpp_permute(a, *permute) if permute else a)
            values[key] = torch.from_numpy(a.copy())
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values, nq
