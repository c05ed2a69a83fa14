"""Tiny random models of the real architectures, under the file names the example workflows expect
(plain module: `import workflow_models`). Needs ComfyUI imported (the `comfyui` fixture): the
diffusion models and VAEs are ComfyUI's own classes at tiny widths and depth, weights filled
explicitly (ComfyUI layers skip init), so ComfyUI's own detection (model_detection, comfy.sd.VAE,
detect_te_model) recognises them.

Text encoders: ComfyUI builds CLIP-L / T5-XXL / UMT5-XXL from fixed JSON configs (billions of
parameters for the T5s), whatever the file holds. The only size knob ComfyUI has is the
`<model_name>_model_config` entry of the text encoder's model_options (sd1_clip.SDClipModel merges it
into the JSON config). `tiny_text_encoder_configs()` gives those entries and
`shrink_text_encoders(monkeypatch, comfy_sd)` adds them to the model_options of every
`comfy.sd.load_text_encoder_state_dicts` call for the duration of a test: the nodes, the
tokenizers (ComfyUI's own tokenizer files) and the encoder classes are the real ones; only widths and
depth shrink. The UMT5 file keeps 24 blocks and d_ff 10240 because ComfyUI's single-file detection
reads exactly those (`encoder.block.23.layer.1.DenseReluDense.wi_1.weight`, 10240 rows).
"""
from __future__ import annotations

import io
import json
import pathlib

import torch
from safetensors.torch import save_file

import fp8_models as fm

# ---------------------------------------------------------------------------- sizes

CLIP_L = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2, projection_dim=32)
T5XXL = dict(d_model=32, d_ff=64, d_kv=16, num_heads=2, num_layers=2)
UMT5_VOCAB = 320
UMT5XXL = dict(d_model=16, d_ff=10240, d_kv=8, num_heads=2, num_layers=24, vocab_size=UMT5_VOCAB)

# Flux-dev shaped (guidance embedding), context = tiny T5 width, vector = tiny CLIP-L width.
FLUX_CFG = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=CLIP_L["hidden_size"],
                context_in_dim=T5XXL["d_model"], hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1,
                depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
                guidance_embed=True, txt_ids_dims=[])
# Wan 2.2 14B T2V shaped (the Wan 2.1 architecture, t2v, 16 latent channels); heads = dim // 128.
WAN_CFG = dict(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=128, ffn_dim=64, freq_dim=256,
               text_dim=UMT5XXL["d_model"], out_dim=16, num_heads=1, num_layers=1)
# Wan 2.2 TI2V 5B shaped (48 latent channels): the quantize-and-save source. Real text width (4096): the
# file needs no "config" metadata, which a saved copy would not carry.
WAN22_5B_CFG = dict(WAN_CFG, in_dim=48, out_dim=48, text_dim=4096)


def tiny_text_encoder_configs() -> dict:
    # "model_config": ComfyUI's long-CLIP handling (text_encoders/long_clipl.py) rebuilds
    # clip_l_model_config from it (adding max_position_embeddings from the file) whenever a CLIP-L is loaded.
    return {"model_config": dict(CLIP_L), "clip_l_model_config": dict(CLIP_L), "t5xxl_model_config": dict(T5XXL),
            "umt5xxl_model_config": dict(UMT5XXL)}


def shrink_text_encoders(monkeypatch, comfy_sd) -> None:
    """Every text encoder ComfyUI builds during the test uses the tiny configs above."""
    original = comfy_sd.load_text_encoder_state_dicts

    def load_text_encoder_state_dicts(state_dicts=[], embedding_directory=None, clip_type=None,
                                      model_options={}, **kwargs):
        opts = {**tiny_text_encoder_configs(), **(model_options or {})}
        if clip_type is None:
            return original(state_dicts, embedding_directory, model_options=opts, **kwargs)
        return original(state_dicts, embedding_directory, clip_type, model_options=opts, **kwargs)

    monkeypatch.setattr(comfy_sd, "load_text_encoder_state_dicts", load_text_encoder_state_dicts)


# ---------------------------------------------------------------------------- helpers

def _bf16(sd: dict) -> dict:
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}


def _fill(module, seed, std=0.05):
    return fm.fill_module_(module, seed=seed, std=std)


def write_scaled_fp8(path: pathlib.Path, sd: dict, metadata: dict | None = None, rest_dtype=torch.bfloat16) -> None:
    """The "fp8_scaled" layout of Comfy-Org's repackaged FP8 files: float8_e4m3fn Linear weights with a
    per-tensor `scale_weight` each, the `scaled_fp8` marker tensor; embeddings, norms, biases in `rest_dtype`."""
    fp8 = {k for k in fm.fp8_layers(sd) if sd[k].dim() == 2 and not any(s in k for s in ("embed", "shared.",
                                                                                          "relative_attention"))}
    out = {}
    for k, v in sd.items():
        if k in fp8:
            q, scale = fm.quantize_ref(v.float())
            out[k] = q
            out[k[: -len(".weight")] + ".scale_weight"] = scale.reshape(1)
        else:
            out[k] = v.to(rest_dtype) if v.is_floating_point() else v
    out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file({k: t.contiguous() for k, t in out.items()}, str(path), metadata=metadata or {})


# llama.cpp's names for T5 encoder tensors (how city96's t5-v1_1-xxl-encoder-gguf files name them).
_T5_TO_LLAMA_CPP = (
    ("encoder.block.", "enc.blk."), ("encoder.final_layer_norm", "enc.output_norm"), ("shared", "token_embd"),
    (".layer.0.SelfAttention.relative_attention_bias.", ".attn_rel_b."),
    (".layer.0.SelfAttention.q.", ".attn_q."), (".layer.0.SelfAttention.k.", ".attn_k."),
    (".layer.0.SelfAttention.v.", ".attn_v."), (".layer.0.SelfAttention.o.", ".attn_o."),
    (".layer.0.layer_norm.", ".attn_norm."), (".layer.1.layer_norm.", ".ffn_norm."),
    (".layer.1.DenseReluDense.wi_0.", ".ffn_gate."), (".layer.1.DenseReluDense.wi_1.", ".ffn_up."),
    (".layer.1.DenseReluDense.wo.", ".ffn_down."),
)


def write_gguf_q8_0(path: pathlib.Path, sd: dict, arch: str, llama_cpp_t5_names: bool = False) -> None:
    """A GGUF file as ComfyUI-GGUF's converters write them: 2-D weights whose rows are whole 32-value
    blocks in Q8_0 (the gguf package's quantiser), everything else F32."""
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), arch)
    for k, v in sd.items():
        name = k
        if llama_cpp_t5_names:
            for a, b in _T5_TO_LLAMA_CPP:
                name = name.replace(a, b)
        a = v.detach().float().contiguous().numpy()
        if k.endswith(".weight") and v.dim() == 2 and v.shape[-1] % 32 == 0 and "norm" not in k:
            raw = quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------- diffusion models

def flux_state_dict(seed=1) -> dict:
    import comfy.ldm.flux.model
    import comfy.ops

    net = comfy.ldm.flux.model.Flux(**FLUX_CFG, dtype=torch.float32, operations=comfy.ops.manual_cast)
    _fill(net, seed)
    return {k: v.detach() for k, v in net.state_dict().items()}


def wan_state_dict(cfg=WAN_CFG, seed=2) -> dict:
    import comfy.ldm.wan.model
    import comfy.ops

    net = comfy.ldm.wan.model.WanModel(**cfg, dtype=torch.float32, operations=comfy.ops.manual_cast)
    _fill(net, seed)
    return {k: v.detach() for k, v in net.state_dict().items()}


def wan_metadata(cfg=WAN_CFG) -> dict:
    # ComfyUI's Wan detection reads the width, depth, channels from the tensors; text_dim (4096 in
    # the real models) from the file's "config" metadata (model_detection: metadata["config"]).
    return {"config": json.dumps({"transformer": {"text_dim": cfg["text_dim"]}})}


# ---------------------------------------------------------------------------- VAEs

def flux_vae_state_dict(seed=3) -> dict:
    """ae.safetensors shape: the KL decoder with 16 latent channels (decoder width 32 instead of 128).
    ComfyUI reads the decoder width from decoder.conv_in; the (unused) encoder stays unloaded."""
    import comfy.ldm.modules.diffusionmodules.model as m

    dec = m.Decoder(ch=32, out_ch=3, ch_mult=[1, 2, 4, 4], num_res_blocks=2, attn_resolutions=[], dropout=0.0,
                    resamp_with_conv=True, in_channels=3, resolution=256, z_channels=16)
    _fill(dec, seed, std=0.02)
    return {"decoder." + k: v.detach() for k, v in dec.state_dict().items()}


def wan21_vae_state_dict(seed=4) -> dict:
    """wan_2.1_vae.safetensors shape (dim 8 instead of 96): ComfyUI reads dim from decoder.head.0.gamma."""
    import comfy.ldm.wan.vae

    vae = comfy.ldm.wan.vae.WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                   temperal_downsample=[False, True, True], image_channels=3, conv_out_channels=3)
    _fill(vae, seed, std=0.02)
    return {k: v.detach() for k, v in vae.state_dict().items()}


# ---------------------------------------------------------------------------- text encoders

def clip_l_state_dict(seed=5) -> dict:
    import comfy.clip_model
    import comfy.ops
    import comfy.sd1_clip

    cfg_path = pathlib.Path(comfy.sd1_clip.__file__).parent / "sd1_clip_config.json"
    config = {**json.loads(cfg_path.read_text()), **CLIP_L}
    net = comfy.clip_model.CLIPTextModel(config, torch.float32, "cpu", comfy.ops.manual_cast)
    _fill(net, seed, std=0.02)
    return {k: v.detach() for k, v in net.state_dict().items()}


def t5_state_dict(config_name: str, over: dict, seed=6) -> dict:
    import comfy.ops
    import comfy.text_encoders.t5

    cfg_path = pathlib.Path(comfy.text_encoders.t5.__file__).parent / config_name
    config = {**json.loads(cfg_path.read_text()), **over}
    net = comfy.text_encoders.t5.T5(config, torch.float32, "cpu", comfy.ops.manual_cast)
    _fill(net, seed, std=0.05)
    return {k: v.detach() for k, v in net.state_dict().items()}


def tiny_spiece_model(vocab_size=UMT5_VOCAB) -> bytes:
    """A sentencepiece model (what real UMT5 files embed as the `spiece_model` tensor), trained on a few
    sentences, with UMT5's special ids: pad 0, eos 1, unk 2."""
    import sentencepiece as spm

    words = ("a cat sits on the red mat under a blue sky photo of painting big small dog walks in the "
             "rain city street night light video camera moves slowly forest river mountain sunset").split()
    lines = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 4
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, pad_id=0, eos_id=1, unk_id=2,
                                   bos_id=-1, hard_vocab_limit=False, minloglevel=2)
    return buf.getvalue()


# ---------------------------------------------------------------------------- Qwen3-MoE

MOE_CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=64, hidden_size=32,
                  intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                  max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, mlp_only_layers=[1],
                  decoder_sparse_step=1, hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16")


def qwen3_moe_state_dict(cfg=MOE_CONFIG, seed=8) -> dict:
    """Random Qwen3-MoE weights under Hugging Face's tensor names (per-expert keys, as released)."""
    g = torch.Generator().manual_seed(seed)
    H, V, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nq, nkv, E, I, Id = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"],
                         cfg["moe_intermediate_size"], cfg["intermediate_size"])

    def r(*shape, s=0.15):
        return torch.randn(*shape, generator=g) * s

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": r(V, H, s=0.5), "model.norm.weight": norm(H), "lm_head.weight": r(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": r(nq * d, H), p + "self_attn.k_proj.weight": r(nkv * d, H),
                   p + "self_attn.v_proj.weight": r(nkv * d, H), p + "self_attn.o_proj.weight": r(H, nq * d),
                   p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
                   p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)})
        if i in cfg["mlp_only_layers"]:
            sd.update({p + "mlp.gate_proj.weight": r(Id, H), p + "mlp.up_proj.weight": r(Id, H),
                       p + "mlp.down_proj.weight": r(H, Id)})
            continue
        sd[p + "mlp.gate.weight"] = r(E, H, s=0.5)
        for e in range(E):
            sd.update({f"{p}mlp.experts.{e}.gate_proj.weight": r(I, H), f"{p}mlp.experts.{e}.up_proj.weight": r(I, H),
                       f"{p}mlp.experts.{e}.down_proj.weight": r(H, I)})
    return sd


def write_qwen3_moe_folder(folder: pathlib.Path, seed=8) -> pathlib.Path:
    """A Hugging Face style folder: config.json, tokenizer.json, model.safetensors (bf16)."""
    import moe_testutil

    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "model.safetensors").exists():
        (folder / "config.json").write_text(json.dumps(MOE_CONFIG, indent=1))
        (folder / "tokenizer.json").write_text(moe_testutil.tiny_tokenizer_json(MOE_CONFIG["vocab_size"]))
        save_file(_bf16(qwen3_moe_state_dict(seed=seed)), str(folder / "model.safetensors"))
    return folder


# ---------------------------------------------------------------------------- placement

def place_models(comfyui, names: dict) -> dict:
    """Write every tiny model a workflow set needs. `names` maps a role to the file name the
    workflows use: flux_fp8, flux_gguf, flux_bf16? (absent ok), clip_l, t5xxl, t5xxl_gguf, umt5xxl, flux_vae, wan_high, wan_low,
    wan_vae, wan5b_fp16, moe_folder. Returns {role: path}. Files that exist are kept (session reuse)."""
    out = {}

    def target(kind, name):
        p = comfyui.models_dir(kind) / name
        out_role = p
        return out_role

    def write(role, kind, fn):
        if role not in names:
            return
        p = target(kind, names[role])
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            fn(p)
        out[role] = p

    write("flux_fp8", "diffusion_models", lambda p: write_scaled_fp8(p, flux_state_dict()))
    write("flux_gguf", "diffusion_models", lambda p: write_gguf_q8_0(p, flux_state_dict(), "flux"))
    write("wan_high", "diffusion_models", lambda p: write_scaled_fp8(p, wan_state_dict(seed=21), wan_metadata()))
    write("wan_low", "diffusion_models", lambda p: write_scaled_fp8(p, wan_state_dict(seed=22), wan_metadata()))
    write("wan5b_fp16", "diffusion_models",
          lambda p: save_file({k: v.to(torch.float16).contiguous() for k, v in wan_state_dict(WAN22_5B_CFG, 23).items()},
                              str(p)))
    write("clip_l", "text_encoders", lambda p: save_file(_bf16(clip_l_state_dict()), str(p)))
    # the T5 / UMT5 files have the layout of the real *_fp8_e4m3fn_scaled files (ComfyUI converts it itself)
    write("t5xxl", "text_encoders", lambda p: write_scaled_fp8(p, t5_state_dict("t5_config_xxl.json", T5XXL)))
    write("t5xxl_gguf", "text_encoders",
          lambda p: write_gguf_q8_0(p, t5_state_dict("t5_config_xxl.json", T5XXL), "t5encoder", llama_cpp_t5_names=True))

    def umt5(p):
        sd = t5_state_dict("umt5_config_xxl.json", UMT5XXL, seed=7)
        sd["spiece_model"] = torch.frombuffer(bytearray(tiny_spiece_model()), dtype=torch.uint8)
        write_scaled_fp8(p, sd, rest_dtype=torch.float32)  # fp32 rest: bf16 matmuls are slow on CPUs

    write("umt5xxl", "text_encoders", umt5)
    write("flux_vae", "vae", lambda p: save_file(_bf16(flux_vae_state_dict()), str(p)))
    write("wan_vae", "vae", lambda p: save_file(_bf16(wan21_vae_state_dict()), str(p)))
    if "moe_folder" in names:
        folder = comfyui.models_dir("text_encoders") / names["moe_folder"].rstrip("/")
        out["moe_folder"] = write_qwen3_moe_folder(folder)
    comfyui.refresh_models()
    return out
