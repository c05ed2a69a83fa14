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
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ....metal_kernels import dispatch as kernel_dispatch
from ....metal_kernels import moe as moe_kernels

try:  # the shared single-row GEMV (FP8/bf16), for decode-time dense layers on the GPU
    from ....metal_kernels.linear import GEMV_MAX_M, gemv
except ImportError:  # pragma: no cover - older kernel module
    gemv, GEMV_MAX_M = None, 0

log = logging.getLogger("comfy_metal")

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


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
