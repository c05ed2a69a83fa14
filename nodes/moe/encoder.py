"""Nodes: MetalMoETextEncoderLoader (-> CLIP), MetalPromptEnhancer (-> STRING), MetalMoEExpertsPatch.

The loader loads a Qwen3-MoE (or Qwen2-MoE) model with the pack's own implementation (nodes/moe/qwen3/,
sync-free experts on the shared MoE kernels) and returns a ComfyUI `comfy.sd.CLIP` built from a clip
target (so CLIPTextEncode, CLIPSetLastLayer and ComfyUI's model management work): the conditioning is
the hidden states of a chosen layer, [batch, tokens, hidden]. On Macs the model goes on the GPU by
default (ComfyUI puts text encoders on the CPU there). Without ComfyUI (tests, scripts) the loader
returns `MoEClip`, a small object with the same methods CLIPTextEncode calls.

MetalMoEExpertsPatch routes the experts of ComfyUI's own MoE text encoders (GPT-OSS / Lens) through
the sync-free grouped path (experts_patch.py).
"""
from __future__ import annotations

import logging

import torch

from . import qwen3 as qwen3_moe

log = logging.getLogger("comfy_metal")

TOKEN_KEY = "qwen3moe"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------- device and dtype

def resolve_device(device: str) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    try:
        import comfy.model_management as mm

        return mm.get_torch_device()
    except ImportError:
        pass
    if torch.backends.mps.is_available():
        return torch.device("mps")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


# ------------------------------------------------------------------------------- backend records

# The registry's kernels the MoE model can run: router, per-pair and grouped experts, dense GEMV.
MOE_NODE_KERNELS = ("moe_route", "moe_experts_gemm", "moe_grouped_gemm", "gemv")


def recording_kernels(node_class: str | None):
    """Record the backends of the MoE kernels that run inside the block (nodes/status)."""
    from ..status import recording_kernels as record

    return record(node_class, MOE_NODE_KERNELS)


# --------------------------------------------------------------------------- CLIP building blocks

class MoETokenizer:
    """ComfyUI tokenizer interface over the model's tokenizer.json (tokenizer_data carries it)."""

    def __init__(self, embedding_directory=None, tokenizer_data=None):
        data = tokenizer_data or {}
        self.tokenizer: qwen3_moe.Tokenizer = data["comfy_metal_moe_tokenizer"]
        self.template = data.get("comfy_metal_moe_template", "raw")
        self.system_prompt = data.get("comfy_metal_moe_system_prompt", "")
        self.pad_id = (self.tokenizer.eos_ids() or [0])[0]

    def text_for(self, text: str) -> str:
        if self.template == "chat":
            return self.tokenizer.apply_chat_template(text, self.system_prompt or None)
        return text

    def tokenize_with_weights(self, text: str, return_word_ids=False, **kwargs):
        ids = self.tokenizer.encode(self.text_for(text))
        if not ids:
            ids = [self.pad_id]
        if return_word_ids:
            return {TOKEN_KEY: [[(t, 1.0, 0) for t in ids]]}
        return {TOKEN_KEY: [[(t, 1.0) for t in ids]]}

    def untokenize(self, token_weight_pair):
        return [(p, self.tokenizer.decode([p[0]], skip_special_tokens=False)) for p in token_weight_pair]

    def state_dict(self):
        return {}


def _model_class():
    class MoETextModel(torch.nn.Module):
        """cond_stage_model for comfy.sd.CLIP: the loaded LM plus the layer selection."""

        def __init__(self, device=None, dtype=None, model_options=None):
            super().__init__()
            opts = model_options or {}
            loaded: qwen3_moe.LoadedMoE = opts["comfy_metal_moe"]
            self.lm = loaded.model
            self.moe_config = loaded.config
            self.default_layer = int(opts.get("comfy_metal_moe_layer", -1))
            self.layer = self.default_layer
            self.dtypes = {self.lm.dtype}
            self.disable_offload = True          # a plain ModelPatcher: whole-model moves
            self.execution_device = None

        def set_clip_options(self, options):
            if "layer" in options and options["layer"] is not None:
                self.layer = int(options["layer"])
            self.execution_device = options.get("execution_device", self.execution_device)

        def reset_clip_options(self):
            self.layer = self.default_layer
            self.execution_device = None

        def encode_token_weights(self, token_weight_pairs):
            with recording_kernels(None):     # runs inside CLIPTextEncode: the record goes to that node
                return encode_tokens(self.lm, token_weight_pairs, self.layer, self.execution_device)

        def load_sd(self, sd):
            return [], list(sd.keys())

    return MoETextModel


MoETextModel = _model_class()


def layer_capture(layer: int, num_layers: int):
    """(capture key, last layer to run) for a layer choice: -1 = final normed hidden state,
    other negatives count from the end like CLIPSetLastLayer (-2 = output of layer L-2), >= 0 = layer i."""
    if layer == -1:
        return -1, None
    idx = num_layers + layer if layer < 0 else layer
    if not 0 <= idx < num_layers:
        raise ValueError(f"layer {layer} is out of range for a model with {num_layers} layers "
                         f"(use -1 for the final normed state, -{num_layers}..-2 or 0..{num_layers - 1})")
    return idx, idx


@torch.no_grad()
def encode_tokens(lm: qwen3_moe.Qwen3MoeLM, token_weight_pairs, layer: int, device=None):
    """ComfyUI encode_token_weights: (cond [B, S, H], pooled None, {"attention_mask"} if padded).
    Runs where the model's weights are (ComfyUI's ModelPatcher has put them on the load device)."""
    batches = token_weight_pairs[TOKEN_KEY] if isinstance(token_weight_pairs, dict) else token_weight_pairs
    ids_list = [[int(t[0]) for t in b] for b in batches]
    S = max(len(x) for x in ids_list)
    ids = torch.zeros((len(ids_list), S), dtype=torch.long)
    mask = torch.zeros((len(ids_list), S), dtype=torch.long)
    for i, x in enumerate(ids_list):
        ids[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, :len(x)] = 1
    padded = bool((mask == 0).any())
    ids, mask_d = ids.to(lm.device), mask.to(lm.device)
    key, stop = layer_capture(layer, len(lm.layers))
    out = lm(ids, attention_mask=mask_d if padded else None, capture={key}, stop_at=stop)
    cond = out["hidden_states"][key]
    extra = {"attention_mask": mask_d} if padded else {}
    return cond, None, extra


class MoEClip:
    """The methods of comfy.sd.CLIP that CLIPTextEncode and the prompt enhancer use, for runs without
    ComfyUI. Conditioning format: [[cond, {"pooled_output": None, ...}]]."""

    def __init__(self, loaded: qwen3_moe.LoadedMoE, layer: int = -1, template: str = "raw", system_prompt: str = ""):
        self.cond_stage_model = MoETextModel(model_options={"comfy_metal_moe": loaded, "comfy_metal_moe_layer": layer})
        self.tokenizer = MoETokenizer(tokenizer_data=_tokenizer_data(loaded, template, system_prompt))
        self.layer_idx = None
        self.load_device = loaded.model.device

    def clone(self):
        n = MoEClip.__new__(MoEClip)
        n.__dict__.update(self.__dict__)
        return n

    def clip_layer(self, layer_idx):
        self.layer_idx = layer_idx

    def tokenize(self, text, return_word_ids=False, **kwargs):
        return self.tokenizer.tokenize_with_weights(text, return_word_ids, **kwargs)

    def load_model(self, tokens=None):
        return self

    def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False):
        m = self.cond_stage_model
        m.reset_clip_options()
        if self.layer_idx is not None:
            m.set_clip_options({"layer": self.layer_idx})
        cond, pooled, extra = m.encode_token_weights(tokens)
        if return_dict:
            return {"cond": cond, "pooled_output": pooled, **extra}
        return (cond, pooled) if return_pooled else cond

    def encode_from_tokens_scheduled(self, tokens, unprojected=False, add_dict=None, show_pbar=True):
        d = self.encode_from_tokens(tokens, return_pooled=True, return_dict=True)
        cond = d.pop("cond")
        d.update(add_dict or {})
        return [[cond, d]]

    def encode(self, text):
        return self.encode_from_tokens(self.tokenize(text))


def _tokenizer_data(loaded, template, system_prompt):
    return {"comfy_metal_moe_tokenizer": loaded.tokenizer, "comfy_metal_moe_template": template,
            "comfy_metal_moe_system_prompt": system_prompt}


def make_clip(loaded: qwen3_moe.LoadedMoE, layer: int = -1, template: str = "raw", system_prompt: str = "",
              offload_device: torch.device | None = None):
    """A comfy.sd.CLIP when ComfyUI is importable, else a MoEClip."""
    try:
        import comfy.sd
    except ImportError:
        return MoEClip(loaded, layer, template, system_prompt)

    class Target:
        params = {}
        clip = MoETextModel
        tokenizer = MoETokenizer

    dev = loaded.model.device
    model_options = {"comfy_metal_moe": loaded, "comfy_metal_moe_layer": layer, "load_device": dev,
                     "offload_device": offload_device or torch.device("cpu"), "initial_device": dev,
                     "dtype": loaded.model.dtype}
    return comfy.sd.CLIP(target=Target, tokenizer_data=_tokenizer_data(loaded, template, system_prompt),
                         model_options=model_options)


def underlying_moe(clip):
    """(Qwen3MoeLM, MoETokenizer) of a CLIP made by MetalMoETextEncoderLoader, else a clear error."""
    model = getattr(clip, "cond_stage_model", None)
    lm = getattr(model, "lm", None)
    tok = getattr(clip, "tokenizer", None)
    if not isinstance(lm, qwen3_moe.Qwen3MoeLM) or not hasattr(tok, "tokenizer"):
        raise ValueError("MetalPromptEnhancer needs a CLIP from the MetalMoETextEncoderLoader node "
                         f"(got {type(model).__name__ if model is not None else type(clip).__name__})")
    return lm, tok
