"""The pack's own Qwen3-MoE (and Qwen2-MoE) language model, for text encoding and prompt enhancing.

Architecture as in transformers' Qwen3MoeForCausalLM: grouped-query attention with q/k RMSNorm and
RoPE, sparse MoE blocks (softmax router, top-k, norm_topk_prob) with an optional Qwen2-MoE style
shared expert, dense MLP layers where `mlp_only_layers` / `decoder_sparse_step` say so. The experts
run through `metal_kernels.moe.moe_experts_forward` (sync-free grouped dispatch; FP8 banks stay FP8).

Loading: a Hugging Face folder (config.json + *.safetensors [+ index] + tokenizer.json), or a single
.safetensors file (config from its metadata "config", a config.json beside it, or inferred from the
tensor shapes with Qwen3 defaults; tokenizer from a tokenizer.json beside it or an embedded
"tokenizer_json" byte tensor). Weights: fp32/bf16/fp16, FP8 with a per-tensor or per-row scale
(`weight_scale` / `scale_weight`; ComfyUI's `comfy_quant` markers as `fp8_quantize.quantize_file`
writes them are accepted), or FP8 with 128x128 block scales (`weight_scale_inv`, decoded at load).
Imports nothing from ComfyUI.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..metal_kernels import dispatch as kernel_dispatch
from ..metal_kernels import moe as moe_kernels

try:  # the shared single-row GEMV (FP8/bf16), for decode-time dense layers on the GPU
    from ..metal_kernels.linear import GEMV_MAX_M, gemv
except ImportError:  # pragma: no cover - older kernel module
    gemv, GEMV_MAX_M = None, 0

log = logging.getLogger("comfy_metal")

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
FP8_DTYPES = {getattr(torch, "float8_e4m3fn", None): "e4m3fn", getattr(torch, "float8_e5m2", None): "e5m2"}


class ModelLoadError(ValueError):
    """A model folder or file that cannot be loaded; the message names the file and what is wrong."""


# ------------------------------------------------------------------------------------------ config

@dataclasses.dataclass
class MoEConfig:
    model_type: str = "qwen3_moe"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    shared_expert_intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    qk_norm: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: Any = None
    eos_token_id: Any = None

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "MoEConfig":
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} (architectures {archs}) is not supported; "
                f"this loader handles {', '.join(SUPPORTED_MODEL_TYPES)} (Qwen3-MoE / Qwen2-MoE)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = (rope.get("rope_type") or rope.get("type") or "default") if isinstance(rope, dict) else "default"
        if rope_type not in ("default",):
            raise ModelLoadError(f"{source}: rope type {rope_type!r} is not supported (only default RoPE)")
        theta = d.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (silu)")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            cfg = cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d.get("intermediate_size", 0)),
                moe_intermediate_size=int(d["moe_intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or hidden // heads),
                num_experts=int(d.get("num_experts", d.get("num_local_experts", 0))),
                num_experts_per_tok=int(d["num_experts_per_tok"]),
                norm_topk_prob=bool(d.get("norm_topk_prob", model_type == "qwen3_moe")),
                decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 0) or 0),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta if theta is not None else 10000.0),
                attention_bias=bool(d.get("attention_bias", model_type == "qwen2_moe")),
                qk_norm=model_type == "qwen3_moe",
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: required field {e.args[0]!r} is missing") from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{source}: a size field has an invalid value ({e})") from None
        if cfg.num_experts < 1 or not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ModelLoadError(f"{source}: num_experts={cfg.num_experts} and num_experts_per_tok="
                                 f"{cfg.num_experts_per_tok} are not a valid MoE configuration")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ModelLoadError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                 f"num_key_value_heads={cfg.num_key_value_heads}")
        return cfg

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        if e is None:
            return []
        return [int(x) for x in (e if isinstance(e, (list, tuple)) else [e])]


# ------------------------------------------------------------------------------------------ layers

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _linear(i, o, bias=False):
    m = nn.Linear(i, o, bias=bias, device="meta")
    m.weight.requires_grad_(False)
    if bias:
        m.bias.requires_grad_(False)
    return m


def _lin(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """A dense layer: the single-row GEMV kernel for a few rows where it runs as a kernel (Metal, or
    the emulator), else F.linear."""
    if gemv is not None and x.numel() <= GEMV_MAX_M * x.shape[-1] and \
            kernel_dispatch.choose(gemv.spec, x.device)[0] != "reference":
        return gemv(x, layer.weight, getattr(layer, "bias", None))
    return F.linear(x, layer.weight, getattr(layer, "bias", None))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KVCache:
    """Preallocated per-layer key/value buffers [B, H_kv, max_len, D]; writes at host-known positions."""

    def __init__(self, cfg: MoEConfig, batch: int, max_len: int, device, dtype):
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len

    def update(self, layer: int, k, v, start: int):
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions is full (needs {end})")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = _linear(cfg.hidden_size, self.h * self.d, b)
        self.k_proj = _linear(cfg.hidden_size, self.hkv * self.d, b)
        self.v_proj = _linear(cfg.hidden_size, self.hkv * self.d, b)
        self.o_proj = _linear(self.h * self.d, cfg.hidden_size, False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, cache: KVCache | None, start: int):
        B, S, _ = x.shape
        q = _lin(x, self.q_proj).view(B, S, self.h, self.d)
        k = _lin(x, self.k_proj).view(B, S, self.hkv, self.d)
        v = _lin(x, self.v_proj).view(B, S, self.hkv, self.d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer, k, v, start)
        rep = self.h // self.hkv
        if rep > 1:  # expand, not repeat_interleave (which is a host sync without output_size)
            T = k.shape[2]
            k = k[:, :, None].expand(B, self.hkv, rep, T, self.d).reshape(B, self.h, T, self.d)
            v = v[:, :, None].expand(B, self.hkv, rep, T, self.d).reshape(B, self.h, T, self.d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return _lin(o.transpose(1, 2).reshape(B, S, self.h * self.d), self.o_proj)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = _linear(hidden, inter)
        self.up_proj = _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)

    def forward(self, x):
        return _lin(F.silu(_lin(x, self.gate_proj)) * _lin(x, self.up_proj), self.down_proj)


class SparseMoE(nn.Module):
    """Router + expert banks: gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I].
    FP8 banks are uint8 bytes with `fmt` and per-expert fp32 scales."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.norm = E, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = _linear(H, E)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H, device="meta"), requires_grad=False)
        self.down = nn.Parameter(torch.empty(E, H, I, device="meta"), requires_grad=False)
        self.register_buffer("gate_up_scale", None)   # buffers: move with the module (ModelPatcher)
        self.register_buffer("down_scale", None)
        self.fmt = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(H, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = _linear(H, 1)
        else:
            self.shared_expert = None

    def forward(self, x):
        B, S, H = x.shape
        flat = x.reshape(-1, H)
        logits = _lin(flat, self.gate)
        weights, experts = moe_kernels.moe_route(logits, self.top_k, norm=self.norm)
        weights = weights.to(logits.dtype)
        out = moe_kernels.moe_experts_forward(flat, experts, weights, self.gate_up, self.down,
                                              activation="silu_glu", gate_up_scale=self.gate_up_scale,
                                              down_scale=self.down_scale, fmt=self.fmt)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(_lin(flat, self.shared_expert_gate)) * self.shared_expert(flat)
        return out.view(B, S, H)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = SparseMoE(cfg) if cfg.is_sparse(layer) else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeLM(nn.Module):
    """Decoder-only MoE language model. forward() returns per-layer hidden states and/or logits."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size)

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    @property
    def device(self):
        return self.embed_tokens.weight.device

    def rope(self, positions: torch.Tensor, dtype):
        """cos, sin [1 or B, 1, S, D] for integer positions [B, S] (fp32 math, like transformers)."""
        d = self.config.head_dim
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                             device=positions.device) / d))
        freqs = positions[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def forward(self, input_ids, attention_mask=None, cache: KVCache | None = None, start: int = 0,
                capture=None, stop_at: int | None = None, logits: str | None = None):
        """input_ids [B, S]; attention_mask [B, start+S] (1 = keep) or None; cache + start for generation.
        capture: None, "all" or a set of layer indices -> out["hidden_states"][i] = raw output of layer i
        (index -1 = final normed state). stop_at: last layer to run. logits: None, "last" or "all".
        """
        B, S = input_ids.shape
        dev = input_ids.device
        x = F.embedding(input_ids, self.embed_tokens.weight)
        dtype = x.dtype
        positions = torch.arange(start, start + S, device=dev)[None]
        cos, sin = self.rope(positions, dtype)
        total = start + S
        neg = torch.finfo(dtype).min
        causal = torch.ones(S, total, dtype=torch.bool, device=dev).tril(diagonal=start)
        keep = causal[None, None]
        if attention_mask is not None:
            keep = keep & attention_mask[:, None, None, :total].to(torch.bool)
        mask = torch.zeros(keep.shape, dtype=dtype, device=dev).masked_fill(~keep, neg)
        out: dict[str, Any] = {"hidden_states": {}}
        want_all = capture == "all"
        n_layers = len(self.layers) if stop_at is None else min(len(self.layers), stop_at + 1)
        if want_all or (capture and "embed" in capture):
            out["hidden_states"]["embed"] = x
        for i in range(n_layers):
            x = self.layers[i](x, cos, sin, mask, cache, start)
            if want_all or (capture and i in capture):
                out["hidden_states"][i] = x
        if n_layers == len(self.layers):
            normed = self.norm(x)
            out["last_hidden_state"] = normed
            if want_all or (capture and -1 in capture):
                out["hidden_states"][-1] = normed
            if logits:
                h = normed[:, -1:] if logits == "last" else normed
                out["logits"] = _lin(h, self.lm_head if self.lm_head is not None else self.embed_tokens)
        return out

    # -------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 64, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, eos_ids=(), on_token=None) -> list[int]:
        """Generate token ids after `input_ids` [1, S] with a KV cache. temperature 0 = greedy.
        One host sync per token: reading the sampled id (to stop at EOS and return the ids)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError("generate: input_ids must be [1, S]")
        S = input_ids.shape[1]
        cache = KVCache(self.config, 1, S + max_new_tokens, self.device, self.dtype)
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.device).manual_seed(int(seed))
        eos = set(int(e) for e in eos_ids)
        ids: list[int] = []
        logits = self(input_ids, cache=cache, start=0, logits="last")["logits"][:, -1]
        for step in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_p, gen)            # [1] on device
            tok = int(nxt.item())                                          # the one sync per token
            if tok in eos:
                break
            ids.append(tok)
            if on_token is not None:
                on_token(step, tok)
            if step + 1 == max_new_tokens:
                break
            logits = self(nxt.view(1, 1), cache=cache, start=S + step, logits="last")["logits"][:, -1]
        return ids


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator=None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V] on the device, without host syncs.
    temperature <= 0: argmax. Else nucleus (top-p) sampling via the exponential-race trick
    (argmax of p / Exp(1) samples from p) with `generator` for reproducibility."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        cum = sp.cumsum(dim=-1)
        sp = sp.masked_fill(cum - sp > top_p, 0.0)        # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)


# ------------------------------------------------------------------------------------------ loading

class _TensorSource:
    """Lazy access to tensors spread over one or more safetensors files."""

    def __init__(self, files: list[pathlib.Path]):
        from safetensors import safe_open

        self.where: dict[str, pathlib.Path] = {}
        self.handles = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:
                raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
            self.handles[f] = h
            self.metadata.update(h.metadata() or {})
            for k in h.keys():
                self.where[k] = f

    def __contains__(self, key):
        return key in self.where

    def keys(self):
        return self.where.keys()

    def get(self, key) -> torch.Tensor:
        return self.handles[self.where[key]].get_tensor(key)

    def shape(self, key):
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())

    def file(self, key) -> str:
        return str(self.where.get(key, "?"))


class _DictSource:
    """_TensorSource over an in-memory state dict (bench, tests, conversions)."""

    def __init__(self, sd: dict, name: str = "<state dict>"):
        self.sd, self.metadata, self.handles = sd, {}, {name: None}
        self.name = name

    def __contains__(self, key):
        return key in self.sd

    def keys(self):
        return self.sd.keys()

    def get(self, key):
        return self.sd[key]

    def shape(self, key):
        return tuple(self.sd[key].shape)

    def file(self, key):
        return self.name


def from_state_dict(sd: dict, config: dict, device="cpu", dtype=torch.float32) -> Qwen3MoeLM:
    """Build the model from an in-memory state dict (HF names; per-expert or fused expert keys)."""
    cfg = MoEConfig.from_dict(config, "<config>")
    return build_model(_DictSource(sd), cfg, dtype, torch.device(device), "<state dict>")


@torch.no_grad()
def random_model(cfg: MoEConfig, device="cpu", dtype=torch.float32, expert_fmt: str | None = None,
                 seed: int = 0, std: float = 0.05) -> Qwen3MoeLM:
    """A model of `cfg` with random weights made directly on `device` (benchmarks; no checkpoint).
    expert_fmt "e4m3fn" / "e5m2": expert banks as random small FP8 bytes with per-expert scales."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    model = Qwen3MoeLM(cfg)
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if isinstance(mod, RMSNorm):
                t = torch.ones(p.shape, device=device, dtype=dtype)
            elif expert_fmt and isinstance(mod, SparseMoE) and name in ("gate_up", "down"):
                # bytes 0x00..0x3F (|v| <= 1.875 in e4m3, <= 2^-2 in e5m2) with a random sign
                t = torch.randint(0, 0x40, p.shape, device=device, dtype=torch.uint8, generator=gen)
                t |= (torch.randint(0, 2, p.shape, device=device, dtype=torch.uint8, generator=gen) << 7)
            else:
                t = torch.randn(p.shape, device=device, dtype=dtype, generator=gen).mul_(std)
            setattr(mod, name, nn.Parameter(t, requires_grad=False))
        if expert_fmt and isinstance(mod, SparseMoE):
            mod.fmt = expert_fmt
            mod.gate_up_scale = torch.full((cfg.num_experts,), std, device=device)
            mod.down_scale = torch.full((cfg.num_experts,), std, device=device)
    return model.eval()


def _find_prefix(src: _TensorSource) -> str:
    for p in ("model.", "model.language_model.", "language_model.model.", ""):
        if f"{p}embed_tokens.weight" in src:
            return p
    raise ModelLoadError(f"no embed_tokens.weight tensor found in {sorted(set(map(str, src.handles)))} "
                         "(expected a Qwen3-MoE checkpoint with keys like model.embed_tokens.weight)")


def infer_config(src: _TensorSource, where: str) -> dict:
    """A Qwen3-MoE (Qwen2-MoE without q/k norms) config dict from tensor shapes; Qwen3 defaults for what
    shapes cannot tell (top-k 8, rope theta 1e6, norm_topk_prob)."""
    p = _find_prefix(src)
    V, H = src.shape(f"{p}embed_tokens.weight")
    layers = 0
    while f"{p}layers.{layers}.input_layernorm.weight" in src:
        layers += 1
    sparse = [i for i in range(layers) if f"{p}layers.{i}.mlp.gate.weight" in src]
    if not sparse:
        raise ModelLoadError(f"{where}: no router tensor (layers.N.mlp.gate.weight); not a MoE checkpoint "
                             "this loader can infer (add a config.json)")
    qn = f"{p}layers.0.self_attn.q_norm.weight"
    d = src.shape(qn)[0] if qn in src else 128
    heads = src.shape(f"{p}layers.0.self_attn.q_proj.weight")[0] // d
    kv = src.shape(f"{p}layers.0.self_attn.k_proj.weight")[0] // d
    l0 = f"{p}layers.{sparse[0]}.mlp."
    E = src.shape(l0 + "gate.weight")[0]
    I = (src.shape(l0 + "experts.0.up_proj.weight")[0] if l0 + "experts.0.up_proj.weight" in src
         else src.shape(l0 + "experts.gate_up_proj")[1] // 2)
    dense = [i for i in range(layers) if i not in sparse]
    inter = src.shape(f"{p}layers.{dense[0]}.mlp.gate_proj.weight")[0] if dense else 0
    shared = (src.shape(l0 + "shared_expert.gate_proj.weight")[0]
              if l0 + "shared_expert.gate_proj.weight" in src else 0)
    return {"model_type": "qwen3_moe" if qn in src else "qwen2_moe", "vocab_size": V, "hidden_size": H,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
            "num_experts": E, "num_experts_per_tok": min(8, E), "moe_intermediate_size": I,
            "intermediate_size": inter, "mlp_only_layers": dense, "shared_expert_intermediate_size": shared,
            "norm_topk_prob": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
            "attention_bias": f"{p}layers.0.self_attn.q_proj.bias" in src,
            "tie_word_embeddings": "lm_head.weight" not in src and f"{p}lm_head.weight" not in src}


def _decode_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    s = scale_inv.float().repeat_interleave(block[0], 0, output_size=scale_inv.shape[0] * block[0])
    s = s.repeat_interleave(block[1], 1, output_size=scale_inv.shape[1] * block[1])
    return w.float() * s[:w.shape[0], :w.shape[1]]


class _Loader:
    def __init__(self, src: _TensorSource, cfg: MoEConfig, dtype: torch.dtype, where: str, block=None):
        self.src, self.cfg, self.dtype, self.where = src, cfg, dtype, where
        self.prefix = _find_prefix(src)
        self.used: set[str] = set()
        self.block = tuple(block or (128, 128))

    def _raw(self, key: str, shape: tuple) -> torch.Tensor:
        if key not in self.src:
            raise ModelLoadError(f"{self.where}: tensor {key} is missing (expected shape {list(shape)} from the config)")
        got = self.src.shape(key)
        if tuple(got) != tuple(shape):
            raise ModelLoadError(f"{self.src.file(key)}: tensor {key} has shape {list(got)}, expected {list(shape)} "
                                 f"from the config")
        self.used.add(key)
        t = self.src.get(key)
        self._check_comfy_quant(key, t)
        return t

    def _scale_of(self, key: str):
        """(kind, fp32 scale, its key) of an FP8 weight: "tensor" (a scalar or one per row) or "block"."""
        base = key[:-len("weight")] if key.endswith("weight") else key + "_"
        for name in (f"{base}weight_scale", f"{base}scale_weight", f"{key}_scale"):
            if name in self.src:
                self.used.add(name)
                return "tensor", self.src.get(name).float(), name
        if f"{base}weight_scale_inv" in self.src:
            self.used.add(f"{base}weight_scale_inv")
            return "block", self.src.get(f"{base}weight_scale_inv").float(), f"{base}weight_scale_inv"
        return None, None, None

    def _check_comfy_quant(self, key: str, t: torch.Tensor):
        """ComfyUI's comfy_quant marker beside a weight (fp8_quantize.quantize_file writes one per FP8
        layer): accepted when it names the weight's own FP8 format."""
        if not key.endswith(".weight"):
            return
        name = key[:-len("weight")] + "comfy_quant"
        if name not in self.src:
            return
        try:
            fmt = json.loads(bytes(self.src.get(name).tolist()).decode("utf-8")).get("format")
        except Exception as e:
            raise ModelLoadError(f"{self.src.file(name)}: tensor {name} is not a comfy_quant JSON marker ({e})") from None
        want = f"float8_{FP8_DTYPES[t.dtype]}" if t.dtype in FP8_DTYPES else None
        if fmt != want:
            raise ModelLoadError(f"{self.src.file(name)}: tensor {name} says format {fmt!r} but {key} is {t.dtype}; "
                                 "this loader reads float8_e4m3fn / float8_e5m2 comfy_quant layers")
        self.used.add(name)

    def _row_scales(self, key: str, s: torch.Tensor, name: str, rows: int) -> torch.Tensor:
        """A per-tensor scale as [1], a per-row scale ([N], [N, 1]) as [N]; anything else is an error."""
        if s.numel() == 1:
            return s.reshape(1)
        if s.numel() == rows and (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):
            return s.reshape(rows)
        raise ModelLoadError(f"{self.src.file(name)}: tensor {name} has shape {list(s.shape)}, expected a scalar "
                             f"or one scale per output row of {key} ([{rows}, 1])")

    def _decode(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """A tensor read by _raw in the compute dtype (FP8 decoded with its scale)."""
        if t.dtype in FP8_DTYPES:
            kind, s, name = self._scale_of(key)
            if kind == "block":
                return _decode_fp8_block(t, s, self.block).to(self.dtype)
            t = t.float()
            if s is not None:
                s = self._row_scales(key, s, name, t.shape[0] if t.dim() else 1)
                t = t * (s.reshape(()) if s.numel() == 1 else s.reshape((-1,) + (1,) * (t.dim() - 1)))
        elif not t.is_floating_point():
            raise ModelLoadError(f"{self.src.file(key)}: tensor {key} has dtype {t.dtype}, expected a float or FP8 dtype")
        return t.to(self.dtype)

    def dense(self, key: str, shape: tuple) -> torch.Tensor:
        """A non-expert tensor in the compute dtype (FP8 decoded with its scale)."""
        return self._decode(self._raw(key, shape), key)

    def expert_bank(self, keys: list[str], shape: tuple):
        """Stack per-expert tensors into a bank: (bank, fmt, scale or None). FP8 with per-tensor or per-row
        scales stays FP8 (uint8 bytes) with scale [E] (all per tensor) or [E, rows] (any per row);
        block-scaled FP8 is decoded to the compute dtype."""
        first = self._raw(keys[0], shape)
        if first.dtype in FP8_DTYPES and self._scale_of(keys[0])[0] != "block":
            fmt = FP8_DTYPES[first.dtype]
            bank = torch.empty((len(keys),) + tuple(shape), dtype=torch.uint8)
            scales = []
            for j, k in enumerate(keys):
                t = first if j == 0 else self._raw(k, shape)
                if t.dtype != first.dtype:
                    raise ModelLoadError(f"{self.src.file(k)}: tensor {k} has dtype {t.dtype}, expected {first.dtype} "
                                         "like the other experts")
                bank[j] = t.view(torch.uint8)
                _, s, name = self._scale_of(k)
                scales.append(torch.ones(1) if s is None else self._row_scales(k, s, name, shape[0]))
            if all(s.numel() == 1 for s in scales):
                return bank, fmt, torch.cat(scales)
            return bank, fmt, torch.stack([s.expand(shape[0]) for s in scales]).contiguous()
        bank = torch.empty((len(keys),) + tuple(shape), dtype=self.dtype)
        for j, k in enumerate(keys):
            bank[j] = self._decode(first if j == 0 else self._raw(k, shape), k)
        return bank, None, None


def build_model(src: _TensorSource, cfg: MoEConfig, dtype: torch.dtype, device, where: str,
                block=None) -> Qwen3MoeLM:
    model = Qwen3MoeLM(cfg)
    L = _Loader(src, cfg, dtype, where, block)
    p = L.prefix
    H, V, d = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    E, I = cfg.num_experts, cfg.moe_intermediate_size

    def put(module, name, tensor):
        t = tensor.to(device).contiguous()
        if t.data_ptr() % 64:  # safetensors data is only 8-byte aligned: own, aligned memory for vector loads
            t = t.clone()
        setattr(module, name, nn.Parameter(t, requires_grad=False))

    put(model.embed_tokens, "weight", L.dense(f"{p}embed_tokens.weight", (V, H)))
    put(model.norm, "weight", L.dense(f"{p}norm.weight", (H,)))
    if model.lm_head is not None:
        head = "lm_head.weight" if "lm_head.weight" in src else f"{p}lm_head.weight"
        put(model.lm_head, "weight", L.dense(head, (V, H)))
    for i, layer in enumerate(model.layers):
        lp = f"{p}layers.{i}."
        a = layer.self_attn
        for name, o, i_ in (("q_proj", cfg.num_attention_heads * d, H), ("k_proj", cfg.num_key_value_heads * d, H),
                            ("v_proj", cfg.num_key_value_heads * d, H), ("o_proj", H, cfg.num_attention_heads * d)):
            lin = getattr(a, name)
            put(lin, "weight", L.dense(f"{lp}self_attn.{name}.weight", (o, i_)))
            if lin.bias is not None:
                put(lin, "bias", L.dense(f"{lp}self_attn.{name}.bias", (o,)))
        if a.q_norm is not None:
            put(a.q_norm, "weight", L.dense(f"{lp}self_attn.q_norm.weight", (d,)))
            put(a.k_norm, "weight", L.dense(f"{lp}self_attn.k_norm.weight", (d,)))
        put(layer.input_layernorm, "weight", L.dense(f"{lp}input_layernorm.weight", (H,)))
        put(layer.post_attention_layernorm, "weight", L.dense(f"{lp}post_attention_layernorm.weight", (H,)))
        mlp = layer.mlp
        if isinstance(mlp, DenseMLP):
            Id = cfg.intermediate_size
            for name, shape in (("gate_proj", (Id, H)), ("up_proj", (Id, H)), ("down_proj", (H, Id))):
                put(getattr(mlp, name), "weight", L.dense(f"{lp}mlp.{name}.weight", shape))
            continue
        put(mlp.gate, "weight", L.dense(f"{lp}mlp.gate.weight", (E, H)))
        if f"{lp}mlp.experts.gate_up_proj" in src:          # fused banks (transformers v5 in-memory layout)
            gu = L.dense(f"{lp}mlp.experts.gate_up_proj", (E, 2 * I, H))
            dn = L.dense(f"{lp}mlp.experts.down_proj", (E, H, I))
            fmt, gs, ds = None, None, None
        else:
            g, gfmt, gsc = L.expert_bank([f"{lp}mlp.experts.{j}.gate_proj.weight" for j in range(E)], (I, H))
            u, ufmt, usc = L.expert_bank([f"{lp}mlp.experts.{j}.up_proj.weight" for j in range(E)], (I, H))
            dn, dfmt, ds = L.expert_bank([f"{lp}mlp.experts.{j}.down_proj.weight" for j in range(E)], (H, I))
            if not (gfmt == ufmt == dfmt):
                raise ModelLoadError(f"{where}: layer {i} mixes expert weight formats ({gfmt}, {ufmt}, {dfmt})")
            fmt = gfmt
            gs = gsc
            if fmt is not None and (gsc.dim() == 2 or usc.dim() == 2 or not torch.equal(gsc, usc)):
                # gate and up share one bank: one scale per expert output row [E, 2I]
                gs = torch.cat([s if s.dim() == 2 else s[:, None].expand(E, I) for s in (gsc, usc)],
                               dim=1).contiguous()
            gu = torch.cat([g, u], dim=1)
            del g, u
        mlp.gate_up = nn.Parameter(gu.to(device), requires_grad=False)
        mlp.down = nn.Parameter(dn.to(device), requires_grad=False)
        mlp.fmt = fmt
        mlp.gate_up_scale = gs.to(device) if gs is not None else None
        mlp.down_scale = ds.to(device) if ds is not None else None
        if mlp.shared_expert is not None:
            Is = cfg.shared_expert_intermediate_size
            for name, shape in (("gate_proj", (Is, H)), ("up_proj", (Is, H)), ("down_proj", (H, Is))):
                put(getattr(mlp.shared_expert, name), "weight", L.dense(f"{lp}mlp.shared_expert.{name}.weight", shape))
            put(mlp.shared_expert_gate, "weight", L.dense(f"{lp}mlp.shared_expert_gate.weight", (1, H)))
    unused = [k for k in src.keys() if k not in L.used and k.startswith(p + "layers.")
              and not k.endswith(("weight_scale", "scale_weight", "weight_scale_inv", "input_scale"))]
    if unused:
        raise ModelLoadError(f"{where}: {len(unused)} tensors do not belong to the configured model, e.g. "
                             f"{unused[:3]} (num_hidden_layers={cfg.num_hidden_layers}, num_experts={E}); "
                             "does config.json match the weights?")
    return model.eval()


# ------------------------------------------------------------------------------------------ tokenizer

class Tokenizer:
    """tokenizer.json (via `tokenizers`) + the chat template from tokenizer_config.json if present."""

    def __init__(self, tokenizer_json: str, tokenizer_config: dict | None = None, where: str = "tokenizer.json"):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tok = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:
            raise ModelLoadError(f"{where}: not a valid tokenizer.json ({e})") from None
        self.config = tokenizer_config or {}
        self.chat_template = self.config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str):
        return self.tok.token_to_id(token)

    def eos_ids(self) -> list[int]:
        out = []
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        for t in ([eos] if eos else []) + ["<|im_end|>", "<|endoftext|>"]:
            i = self.token_id(t)
            if i is not None and i not in out:
                out.append(i)
        return out

    def apply_chat_template(self, user: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        if self.chat_template:
            try:
                import jinja2

                env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
                return env.from_string(self.chat_template).render(
                    messages=messages, add_generation_prompt=True, enable_thinking=False,
                    bos_token="", eos_token="")
            except Exception as e:  # a template we cannot render: fall back to the plain Qwen one
                log.warning("comfy_metal: chat template failed to render (%s); using the plain Qwen template", e)
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + "<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------ entry

@dataclasses.dataclass
class LoadedMoE:
    model: Qwen3MoeLM
    tokenizer: Tokenizer
    config: MoEConfig
    source: str


def load(path: str | os.PathLike, device="cpu", dtype: torch.dtype = torch.float32) -> LoadedMoE:
    """Load a Qwen3-MoE model + tokenizer from a HF folder or a single .safetensors file."""
    path = pathlib.Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if path.is_dir():
        folder = path
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{folder}: no config.json (expected a Hugging Face model folder)")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{folder}: no *.safetensors weight files")
        src = _TensorSource(files)
        cfg_dict = _read_json(cfg_file)
    else:
        if path.suffix != ".safetensors":
            raise ModelLoadError(f"{path}: expected a .safetensors file or a model folder")
        folder = path.parent
        src = _TensorSource([path])
        if "config" in src.metadata:
            cfg_dict = json.loads(src.metadata["config"])
        elif (folder / "config.json").is_file():
            cfg_dict = _read_json(folder / "config.json")
        else:
            cfg_dict = infer_config(src, str(path))
            log.warning("comfy_metal: %s has no config (metadata or config.json beside it); inferred the shapes "
                        "and assumed Qwen3 defaults: top-%d routing, rope_theta %g, norm_topk_prob", path,
                        cfg_dict["num_experts_per_tok"], cfg_dict["rope_theta"])
    cfg_dict = cfg_dict.get("text_config", cfg_dict) if "text_config" in cfg_dict else cfg_dict
    cfg = MoEConfig.from_dict(cfg_dict, str(folder / "config.json") if path.is_dir() else str(path))
    tok_file = folder / "tokenizer.json"
    tok_cfg = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else None
    if tok_file.is_file():
        tokenizer = Tokenizer(tok_file.read_text(encoding="utf-8"), tok_cfg, str(tok_file))
    elif "tokenizer_json" in src:
        tokenizer = Tokenizer(bytes(src.get("tokenizer_json").tolist()).decode("utf-8"), tok_cfg, f"{path}:tokenizer_json")
    else:
        raise ModelLoadError(f"{folder}: no tokenizer.json (and no embedded tokenizer_json tensor in the weights)")
    qc = cfg_dict.get("quantization_config") or {}
    model = build_model(src, cfg, dtype, torch.device(device), str(path), qc.get("weight_block_size"))
    return LoadedMoE(model, tokenizer, cfg, str(path))


def _read_json(p: pathlib.Path) -> dict:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except Exception as e:
        raise ModelLoadError(f"{p}: not valid JSON ({e})") from None
