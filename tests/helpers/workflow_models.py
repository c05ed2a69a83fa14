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

Sets with a CLIP-G (sd3, hidream): ComfyUI tells CLIP-G from CLIP-L by the key
`text_model.encoder.layers.30.mlp.fc1.weight`, so the tiny CLIP-G keeps its 32 layers. ComfyUI's long-CLIP
handling (text_encoders/long_clipl.py) gives the CLIP-L *and* the CLIP-G of a set the same `model_config`
entry, so one config (CLIP_LG: widths only) serves both and each keeps its JSON's depth (CLIP-L 12, CLIP-G
32); `shrink_text_encoders(..., clip_g=True)` selects it. SD3 pads the CLIP-L/G output to 4096 and
concatenates it with the T5 output, so its T5 keeps d_model 4096 (T5XXL_SD3, with a shorter vocabulary);
HiDream sends a file to its T5 by the key of block 23 (T5XXL_24 keeps 24 blocks). Llama-3.1-8B (HiDream's
fourth encoder): ComfyUI's Llama2 with a tiny `llama_model_config` (head_dim is fixed at 128 by ComfyUI's
config class) and the real vocabulary (128256 rows: the Llama-3 tokenizer's ids go up to there).
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
# sets with a CLIP-G: one config for CLIP-L and CLIP-G (ComfyUI gives both the same model_config), no depth
CLIP_LG = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, projection_dim=32)
# SD3 concatenates CLIP-L/G (padded to 4096 wide) with the T5 output: d_model stays 4096. The first 8192 of
# the 32128 embedding rows (64 MiB in bf16 instead of 251 MiB) cover the ids ComfyUI's T5 tokenizer gives
# common English words (the tests' prompts stay under 7000); a rarer word fails loudly (index out of range).
T5XXL_SD3 = dict(T5XXL, d_model=4096, num_layers=1, vocab_size=8192)
T5XXL_24 = dict(T5XXL, num_layers=24)                 # HiDream finds its T5 by block 23
LLAMA3_8B = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
LLAMA3_VOCAB = 128256                                 # what HiDream's encoder sets (ComfyUI's Llama-3 tokenizer)
# Qwen2.5-VL-7B's text part (Qwen-Image's encoder): ComfyUI finds it by the k_proj bias of 512 rows (4 KV heads
# of 128); the real vocabulary (the Qwen2.5 tokenizer's ids go up to 151664)
QWEN25_7B = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4)
QWEN25_7B_256 = dict(QWEN25_7B, hidden_size=256, intermediate_size=256)   # every Linear row whole K-quant blocks
# Qwen3-0.6B (Anima's encoder; Z-Image's Qwen3-4B is the same architecture wider): ComfyUI finds it by its q_norm
# and its width of 1024, which stays; no chat template, so the first 32768 embedding rows cover the ids the
# Qwen2 tokenizer gives English words (a rarer word fails loudly: index out of range)
QWEN3_06B = dict(hidden_size=1024, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=32768)
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


def tiny_text_encoder_configs(clip_g: bool = False, t5xxl: dict = T5XXL, qwen25_7b: dict = QWEN25_7B) -> dict:
    """The model_options entries that shrink ComfyUI's text encoders. clip_g: the set has a CLIP-G (sd3,
    hidream; CLIP-L and CLIP-G then share CLIP_LG). t5xxl: the T5-XXL config (T5XXL, T5XXL_SD3, T5XXL_24).
    qwen25_7b: the Qwen2.5-VL-7B text config (QWEN25_7B, QWEN25_7B_256)."""
    # "model_config": ComfyUI's long-CLIP handling (text_encoders/long_clipl.py) rebuilds
    # clip_l_model_config / clip_g_model_config from it (adding max_position_embeddings from the file)
    # whenever a CLIP-L or CLIP-G is loaded.
    clip = CLIP_LG if clip_g else CLIP_L
    return {"model_config": dict(clip), "clip_l_model_config": dict(clip), "clip_g_model_config": dict(CLIP_LG),
            "t5xxl_model_config": dict(t5xxl), "umt5xxl_model_config": dict(UMT5XXL),
            "llama_model_config": dict(LLAMA3_8B), "qwen25_7b_model_config": dict(qwen25_7b),
            "qwen3_06b_model_config": dict(QWEN3_06B)}


def shrink_text_encoders(monkeypatch, comfy_sd, clip_g: bool = False, t5xxl: dict = T5XXL,
                         qwen25_7b: dict = QWEN25_7B) -> None:
    """Every text encoder ComfyUI builds during the test uses the tiny configs above."""
    original = comfy_sd.load_text_encoder_state_dicts

    def load_text_encoder_state_dicts(state_dicts=[], embedding_directory=None, clip_type=None,
                                      model_options={}, **kwargs):
        opts = {**tiny_text_encoder_configs(clip_g, t5xxl, qwen25_7b), **(model_options or {})}
        if clip_type is None:
            return original(state_dicts, embedding_directory, model_options=opts, **kwargs)
        return original(state_dicts, embedding_directory, clip_type, model_options=opts, **kwargs)

    monkeypatch.setattr(comfy_sd, "load_text_encoder_state_dicts", load_text_encoder_state_dicts)


# ---------------------------------------------------------------------------- helpers

def _bf16(sd: dict) -> dict:
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}


def _fill(module, seed, std=0.05):
    return fm.fill_module_(module, seed=seed, std=std)


def write_scaled_fp8(path: pathlib.Path, sd: dict, metadata: dict | None = None, rest_dtype=torch.bfloat16,
                     pow2_scales: bool = False) -> None:
    """The "fp8_scaled" layout of Comfy-Org's repackaged FP8 files: float8_e4m3fn Linear weights with a
    per-tensor `scale_weight` each, the `scaled_fp8` marker tensor; embeddings, norms, biases in `rest_dtype`.
    pow2_scales: power-of-two scales (the weights are then exact in bf16/fp16, so an oracle that stores the
    dequantized weights in half precision holds exactly the weights the FP8 file does)."""
    fp8 = {k for k in fm.fp8_layers(sd) if sd[k].dim() == 2 and not any(s in k for s in ("embed", "shared.",
                                                                                          "relative_attention"))}
    out = {}
    for k, v in sd.items():
        if k in fp8:
            q, scale = fm.quantize_ref(v.float(), pow2=pow2_scales)
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

def _clip_state_dict(config_name: str, over: dict, seed: int) -> dict:
    import comfy.clip_model
    import comfy.ops
    import comfy.sd1_clip

    cfg_path = pathlib.Path(comfy.sd1_clip.__file__).parent / config_name
    config = {**json.loads(cfg_path.read_text()), **over}
    net = comfy.clip_model.CLIPTextModel(config, torch.float32, "cpu", comfy.ops.manual_cast)
    _fill(net, seed, std=0.02)
    return {k: v.detach() for k, v in net.state_dict().items()}


def clip_l_state_dict(seed=5, over: dict = CLIP_L) -> dict:
    """CLIP-L (ComfyUI's sd1_clip_config.json; CLIP_L: 2 layers, CLIP_LG: the JSON's 12)."""
    return _clip_state_dict("sd1_clip_config.json", over, seed)


def clip_g_state_dict(seed=9) -> dict:
    """CLIP-G (ComfyUI's clip_config_bigg.json: 32 layers, gelu) at CLIP_LG's widths."""
    return _clip_state_dict("clip_config_bigg.json", CLIP_LG, seed)


def t5_state_dict(config_name: str, over: dict, seed=6, dtype=torch.float32) -> dict:
    """T5 weights in `dtype` (bf16 for the 4096-wide SD3 T5, whose embedding is the big part)."""
    import comfy.ops
    import comfy.text_encoders.t5

    cfg_path = pathlib.Path(comfy.text_encoders.t5.__file__).parent / config_name
    config = {**json.loads(cfg_path.read_text()), **over}
    net = comfy.text_encoders.t5.T5(config, dtype, "cpu", comfy.ops.manual_cast)
    _fill(net, seed, std=0.05)
    return {k: v.detach() for k, v in net.state_dict().items()}


def llama3_state_dict(seed=10) -> dict:
    """Llama-3.1-8B (HiDream's fourth text encoder): ComfyUI's Llama2 at LLAMA3_8B's sizes."""
    import comfy.ops
    import comfy.text_encoders.llama

    net = comfy.text_encoders.llama.Llama2({**LLAMA3_8B, "vocab_size": LLAMA3_VOCAB}, torch.float32, "cpu",
                                           comfy.ops.manual_cast)
    _fill(net, seed, std=0.05)
    return {k: v.detach() for k, v in net.state_dict().items()}


def qwen25_7b_text_state_dict(seed=11, cfg: dict = QWEN25_7B) -> dict:
    """Qwen2.5-VL-7B's text part (the `model.*` tensors of ComfyUI's Qwen25_7BVLI, whose vision tower a
    text encoder file does not carry) at `cfg`'s sizes, with q/k/v biases."""
    import comfy.ops
    import comfy.text_encoders.llama as llama

    net = llama.Llama2_(llama.Qwen25_7BVLI_Config(**cfg), device="cpu", dtype=torch.float32,
                        ops=comfy.ops.manual_cast)
    _fill(net, seed, std=0.05)
    return {"model." + k: v.detach() for k, v in net.state_dict().items()}


def qwen3_06b_state_dict(seed=13) -> dict:
    """Qwen3-0.6B (ComfyUI's Qwen3_06B: q_norm / k_norm, no biases) at QWEN3_06B's sizes."""
    import comfy.ops
    import comfy.text_encoders.llama as llama

    net = llama.Qwen3_06B(dict(QWEN3_06B), torch.float32, "cpu", comfy.ops.manual_cast)
    _fill(net, seed, std=0.05)
    return {k: v.detach() for k, v in net.state_dict().items()}


# Llama-3's pre-tokenizer split (its tokenizer.json's Split regex, which ComfyUI's BPE tokenizer implements)
LLAMA3_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def use_llama3_tokenizer_stand_in(monkeypatch, folder: pathlib.Path) -> bool:
    """ComfyUI reads the Llama-3 tokenizer (HiDream, HunyuanVideo) from its own
    comfy/text_encoders/llama_tokenizer/tokenizer.json, which the ComfyUI archive the tests use lacks (an empty
    file: too large for the archive). When it is missing or empty, ComfyUI's LlamaTokenizerFast.from_pretrained
    reads, for that folder only and for the test's duration, a stand-in tokenizer.json written to `folder`:
    byte-level BPE (the 256 byte tokens as ids 0..255, no merges) with Llama-3's pre-tokenizer and its real
    special tokens and ids (128000 <|begin_of_text|> ... from ComfyUI's own tokenizer_config.json), prepending
    <|begin_of_text|> as Llama-3 does. ComfyUI's own tokenizer code runs on it. Returns True when the stand-in
    is in use, False when ComfyUI has the real file (then nothing is patched)."""
    import comfy.text_encoders.bpe_tokenizer as bpe

    real = pathlib.Path(bpe.__file__).resolve().parent / "llama_tokenizer"
    if (real / "tokenizer.json").is_file() and (real / "tokenizer.json").stat().st_size > 0:
        return False
    config = json.loads((real / "tokenizer_config.json").read_text())
    special = [{"id": int(i), "content": t["content"], "special": True}
               for i, t in config["added_tokens_decoder"].items()]
    byte_chars = bpe._bytes_to_unicode()   # ComfyUI's byte -> character table of byte-level BPE
    tokenizer = {"model": {"type": "BPE", "vocab": {c: b for b, c in byte_chars.items()}, "merges": []},
                 "added_tokens": special,
                 "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                     {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}}, {"type": "ByteLevel"}]},
                 "post_processor": {"type": "TemplateProcessing", "single": [
                     {"SpecialToken": {"id": config["bos_token"], "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}}]}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    original = bpe.LlamaTokenizerFast.from_pretrained

    def from_pretrained(path, **kwargs):
        if pathlib.Path(path).resolve() == real:
            path = str(folder)
        return original(path, **kwargs)

    monkeypatch.setattr(bpe.LlamaTokenizerFast, "from_pretrained", staticmethod(from_pretrained))
    return True


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
