"""Loading a Qwen3-MoE / Qwen2-MoE model: a Hugging Face folder or one .safetensors file (bf16 or FP8),
the config inferred from the tensors where there is none, and tiny random models for tests."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib

import torch
from torch import nn

from ....metal_kernels.dtypes import FORMAT_OF_DTYPE
from .model import DenseMLP, MoEConfig, ModelLoadError, Qwen3MoeLM, RMSNorm, SparseMoE
from .tokenizer import Tokenizer

log = logging.getLogger("comfy_metal")

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
        want = f"float8_{FORMAT_OF_DTYPE[t.dtype]}" if t.dtype in FORMAT_OF_DTYPE else None
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
        if t.dtype in FORMAT_OF_DTYPE:
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
        if first.dtype in FORMAT_OF_DTYPE and self._scale_of(keys[0])[0] != "block":
            fmt = FORMAT_OF_DTYPE[first.dtype]
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
