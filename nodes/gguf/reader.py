"""Reading GGUF files into state dicts for ComfyUI, through the `gguf` package (llama.cpp's reader).

The file is memory-mapped. Quantised tensors become `GGUFTensor`s (the file's block bytes, logical
`.shape`); F32/F16/BF16 tensors are plain tensors viewing the file. Everything that can be wrong with
a file is reported as `GGUFFileError` naming the file and, where there is one, the tensor.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from .ops import GGUFTensor

PLAIN_TYPES = ("F32", "F16", "BF16")
# general.architecture values of diffusion models in GGUF files (ComfyUI-GGUF's converter writes these)
IMAGE_ARCHS = ("flux", "sd1", "sdxl", "sd3", "aura", "hidream", "cosmos", "ltxv", "hyvid", "wan", "lumina2",
               "qwen_image", "chroma", "hunyuan_video")
# text encoders whose llama.cpp tensor names this loader maps to ComfyUI's (Hugging Face) names
T5_ARCHS = ("t5", "t5encoder")
LLAMA_ARCHS = ("llama", "qwen2", "qwen2vl", "qwen3")
TEXT_ARCHS = T5_ARCHS + LLAMA_ARCHS


class GGUFFileError(RuntimeError):
    """A GGUF file that cannot be loaded; the message names the file, the tensor and what was expected."""


def _supported_text() -> str:
    from ... import metal_kernels as mk

    return ", ".join(list(mk.GGUF_QUANTS) + list(PLAIN_TYPES))


def _reader_class():
    import gguf

    class NamingReader(gguf.GGUFReader):
        """gguf.GGUFReader that builds the tensors one at a time, so a failure names its tensor."""

        def _build_tensors(self, start_offs, fields):
            built, names = [], set()
            size = len(self.data)
            for field in fields:
                name = str(bytes(field.parts[1]), encoding="utf-8", errors="replace")
                if name in names:
                    raise GGUFFileError(f"tensor {name} appears twice")
                names.add(name)
                raw_type = int(field.parts[4][0])
                try:
                    qtype = gguf.GGMLQuantizationType(raw_type)
                except ValueError:
                    raise GGUFFileError(f"tensor {name} has ggml type number {raw_type}, which the gguf package "
                                        f"does not know; supported: {_supported_text()}") from None
                dims = [int(d) for d in field.parts[3]]
                bs, ts = gguf.GGML_QUANT_SIZES[qtype]
                n = int(np.prod(dims)) if dims else 1
                end = int(start_offs + field.parts[5][0]) + n * ts // bs
                if end > size:
                    raise GGUFFileError(f"tensor {name} ({qtype.name}, shape {list(reversed(dims))}) needs bytes up to "
                                        f"{end}, but the file has only {size} bytes: the file is truncated "
                                        f"(an interrupted download?)")
                try:
                    super()._build_tensors(start_offs, [field])
                except Exception as e:
                    raise GGUFFileError(f"tensor {name} ({qtype.name}, shape {list(reversed(dims))}): {e}") from e
                built.extend(self.tensors)
            self.tensors = built

    return NamingReader


def _field_str(reader, key):
    import gguf

    field = reader.get_field(key)
    if field is None:
        return None
    if field.types != [gguf.GGUFValueType.STRING]:
        return None
    return str(bytes(field.parts[field.data[-1]]), encoding="utf-8")


def _orig_shape(reader, name):
    """ComfyUI-GGUF's converter keeps the shape of tensors it reshaped in `comfy.gguf.orig_shape.<name>`."""
    field = reader.get_field(f"comfy.gguf.orig_shape.{name}")
    if field is None:
        return None
    return tuple(int(field.parts[i][0]) for i in field.data)


class GGUFFile:
    """An opened GGUF file: `arch`, `tensors` (gguf ReaderTensor list), `name`, `path`."""

    def __init__(self, path):
        self.path = str(path)
        self.name = os.path.basename(self.path)
        if not os.path.isfile(self.path):
            raise GGUFFileError(f"{self.name}: no such file ({self.path})")
        size = os.path.getsize(self.path)
        try:
            # copy-on-write map: nothing is ever written to the file, and tensors viewing it are writable
            # (the MSL emulator copies every bound buffer back after a launch)
            self.reader = _reader_class()(self.path, "c")
        except GGUFFileError as e:
            raise GGUFFileError(f"{self.name}: {e}") from e
        except Exception as e:
            raise GGUFFileError(f"{self.name}: not a readable GGUF file ({size} bytes; truncated or not GGUF?): "
                                f"{type(e).__name__}: {e}") from e
        self.arch = _field_str(self.reader, "general.architecture")
        self.tensors = list(self.reader.tensors)

    def qtype_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def describe(self) -> str:
        counts = ", ".join(f"{k} x{v}" for k, v in sorted(self.qtype_counts().items()))
        return f"{self.name} (GGUF, architecture {self.arch or 'unset'}, {len(self.tensors)} tensors: {counts})"

    def state_dict(self, key_map=None) -> dict:
        """name -> GGUFTensor (quantised) or a plain tensor (F32/F16/BF16), keys passed through key_map."""
        from ... import metal_kernels as mk

        sd = {}
        for t in self.tensors:
            qname = t.tensor_type.name
            shape = _orig_shape(self.reader, t.name) or tuple(int(d) for d in reversed(t.shape.tolist()))
            data = torch.from_numpy(t.data)                     # a view of the memory map
            if qname in ("F32", "F16"):
                value = data.reshape(shape)
            elif qname == "BF16":
                value = data.view(torch.uint8).reshape(-1).view(torch.bfloat16).reshape(shape)
            elif qname in mk.GGUF_QUANTS:
                bs, ts = mk.GGUF_QUANTS[qname]
                n = int(np.prod(shape)) if shape else 1
                if n % bs or data.numel() != n // bs * ts:
                    raise GGUFFileError(f"{self.name}: tensor {t.name} ({qname}) has {data.numel()} bytes, which "
                                        f"does not hold the {n} values of shape {list(shape)}")
                value = GGUFTensor(data, qname, shape, t.name)
            else:
                raise GGUFFileError(f"{self.name}: tensor {t.name} is stored as {qname}, which this loader cannot "
                                    f"dequantise; supported: {_supported_text()}")
            key = t.name if key_map is None else key_map(t.name)
            sd[key] = value
        return sd


# llama.cpp's T5 tensor names -> ComfyUI's (Hugging Face) names; applied as substring replacements.
_T5_NAMES = (
    ("enc.blk.", "encoder.block."), ("dec.blk.", "decoder.block."), ("enc.output_norm", "encoder.final_layer_norm"),
    ("token_embd", "shared"),
    (".attn_q.", ".layer.0.SelfAttention.q."), (".attn_k.", ".layer.0.SelfAttention.k."),
    (".attn_v.", ".layer.0.SelfAttention.v."), (".attn_o.", ".layer.0.SelfAttention.o."),
    (".attn_rel_b.", ".layer.0.SelfAttention.relative_attention_bias."),
    (".attn_norm.", ".layer.0.layer_norm."), (".ffn_norm.", ".layer.1.layer_norm."),
    (".ffn_gate.", ".layer.1.DenseReluDense.wi_0."), (".ffn_up.", ".layer.1.DenseReluDense.wi_1."),
    (".ffn_down.", ".layer.1.DenseReluDense.wo."),
)


def t5_key(name: str) -> str:
    for a, b in _T5_NAMES:
        name = name.replace(a, b)
    return name


# llama.cpp's decoder (Llama / Qwen2 / Qwen2-VL / Qwen3) tensor names -> Hugging Face's.
_LLAMA_NAMES = (
    ("token_embd.", "model.embed_tokens."), ("output_norm.", "model.norm."), ("output.", "lm_head."),
    ("blk.", "model.layers."), (".attn_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
    (".attn_q_norm.", ".self_attn.q_norm."), (".attn_k_norm.", ".self_attn.k_norm."),
    (".attn_q.", ".self_attn.q_proj."), (".attn_k.", ".self_attn.k_proj."), (".attn_v.", ".self_attn.v_proj."),
    (".attn_output.", ".self_attn.o_proj."),
    (".ffn_gate.", ".mlp.gate_proj."), (".ffn_up.", ".mlp.up_proj."), (".ffn_down.", ".mlp.down_proj."),
)


def llama_key(name: str) -> str:
    for a, b in _LLAMA_NAMES:
        if a.endswith(".") and not a.startswith(".") and name.startswith(a):
            name = b + name[len(a):]
        elif a.startswith("."):
            name = name.replace(a, b)
    return name


def unpermute_rows(t, n_head: int):
    """Undo llama.cpp's rotary row order of a Llama q/k projection (its converter interleaves the two
    halves of every head): rows of a plain tensor, or of a GGUFTensor's blocks (rows are whole blocks)."""
    raw = t.raw() if isinstance(t, GGUFTensor) else t
    n = raw.shape[0]
    if n % (2 * n_head):
        raise GGUFFileError(f"tensor {getattr(t, 'gguf_name', '?')}: {n} rows do not split into {n_head} heads")
    rest = raw.shape[1:]
    out = raw.reshape(n_head, n // n_head // 2, 2, *rest).transpose(1, 2).reshape(n, *rest).contiguous()
    if isinstance(t, GGUFTensor):
        return GGUFTensor(out, t.gguf_qtype, t.gguf_shape, t.gguf_name)
    return out


def _field_int(reader, key):
    field = reader.get_field(key)
    return None if field is None else int(field.parts[field.data[-1]][0])


def llama_state_dict(f: "GGUFFile") -> dict:
    """A llama.cpp-named decoder's state dict in Hugging Face names (q/k rows restored for Llama)."""
    sd = f.state_dict(llama_key)
    if f.arch == "llama":
        heads = _field_int(f.reader, "llama.attention.head_count")
        kv_heads = _field_int(f.reader, "llama.attention.head_count_kv") or heads
        if not heads:
            raise GGUFFileError(f"{f.name}: a Llama text encoder without llama.attention.head_count metadata")
        for k in list(sd):
            if k.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                sd[k] = unpermute_rows(sd[k], heads)
            elif k.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                sd[k] = unpermute_rows(sd[k], kv_heads)
    return sd


def uses_llama_cpp_names(f: GGUFFile) -> bool:
    return any(t.name.startswith(("blk.", "enc.blk.", "token_embd")) for t in f.tensors)
