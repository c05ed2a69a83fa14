"""The pack's Qwen3-MoE model against transformers' Qwen3MoeForCausalLM with the same random weights."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import moe_testutil  # noqa: E402
from comfy_metal.nodes.common import syncs as sync_count  # noqa: E402
from comfy_metal.nodes.moe import qwen3 as qwen3_moe  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3moe")
    hf = moe_testutil.make_qwen3_moe(folder)
    loaded = qwen3_moe.load(folder, device="cpu", dtype=torch.float32)
    return folder, hf, loaded


def _hf_layer_outputs(hf, ids):
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for layer in hf.model.layers]
    try:
        with torch.no_grad():
            res = hf(ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return res, outs


def test_hidden_states_match_transformers_every_layer(tiny):
    _, hf, loaded = tiny
    ids = torch.tensor([[5, 9, 17, 3, 40, 41, 7, 8, 22, 63, 1, 2, 30]])
    res, layer_outs = _hf_layer_outputs(hf, ids)
    with torch.no_grad():
        ours = loaded.model(ids, capture="all", logits="all")
    assert len(layer_outs) == loaded.config.num_hidden_layers
    torch.testing.assert_close(ours["hidden_states"]["embed"], res.hidden_states[0], atol=1e-4, rtol=0)
    for i, want in enumerate(layer_outs):
        err = (ours["hidden_states"][i] - want).abs().max().item()
        assert err < 1e-4, f"layer {i}: max abs error {err}"
    assert (ours["last_hidden_state"] - res.hidden_states[-1]).abs().max().item() < 1e-4
    assert (ours["logits"] - res.logits).abs().max().item() < 1e-4
    # the config really has both a dense and sparse layers, and routing spreads over many experts
    assert isinstance(loaded.model.layers[1].mlp, qwen3_moe.DenseMLP)
    assert isinstance(loaded.model.layers[0].mlp, qwen3_moe.SparseMoE)


def test_batch_with_padding_matches_unpadded(tiny):
    _, hf, loaded = tiny
    a = torch.tensor([[5, 9, 17, 3, 40, 41, 7, 8]])
    b = torch.tensor([[11, 12, 13, 14, 15]])
    batch = torch.zeros(2, 8, dtype=torch.long)
    batch[0] = a
    batch[1, :5] = b
    mask = torch.zeros(2, 8, dtype=torch.long)
    mask[0] = 1
    mask[1, :5] = 1
    with torch.no_grad():
        both = loaded.model(batch, attention_mask=mask)["last_hidden_state"]
        res_b = hf(b, output_hidden_states=True).hidden_states[-1]
    assert (both[1, :5] - res_b[0]).abs().max().item() < 1e-4


def test_greedy_generation_matches_transformers_32_tokens(tiny):
    _, hf, loaded = tiny
    ids = torch.tensor([[1, 4, 23, 24, 5, 6]])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
                           min_new_tokens=32)[0, ids.shape[1]:].tolist()
    got = loaded.model.generate(ids, max_new_tokens=32, temperature=0.0)
    assert len(want) == 32
    assert got == want
    assert len(set(got)) > 3  # a real sequence, not one repeated token


def test_generation_at_most_one_sync_per_token(tiny):
    _, _, loaded = tiny
    ids = torch.tensor([[1, 4, 23, 24, 5, 6]])
    for temperature, top_p in ((0.0, 1.0), (0.8, 0.9)):
        with sync_count.SyncCounter() as c:
            got = loaded.model.generate(ids, max_new_tokens=12, temperature=temperature, top_p=top_p, seed=3)
        assert len(got) == 12
        assert c.total <= 12, c.counts


def test_sampling_is_seeded(tiny):
    _, _, loaded = tiny
    ids = torch.tensor([[1, 4, 23, 24, 5, 6]])
    a = loaded.model.generate(ids, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    b = loaded.model.generate(ids, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    c = loaded.model.generate(ids, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=8)
    assert a == b
    assert a != c


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = {int(qwen3_moe.sample_next(logits, 1.0, 0.7, gen)) for _ in range(200)}
    assert seen == {0, 1}


def test_moe_layer_forward_has_no_host_syncs(tiny):
    _, _, loaded = tiny
    mlp = loaded.model.layers[0].mlp
    for T in (1, 40):  # decode path and sorted grouped path
        x = torch.randn(1, T, loaded.config.hidden_size)
        with sync_count.SyncCounter() as c:
            mlp(x)
        assert c.total == 0, c.counts


def test_single_safetensors_file_with_embedded_tokenizer(tiny, tmp_path):
    folder, hf, loaded = tiny
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    tok = (folder / "tokenizer.json").read_bytes()
    sd["tokenizer_json"] = torch.tensor(list(tok), dtype=torch.uint8)
    cfg = json.loads((folder / "config.json").read_text())
    path = tmp_path / "qwen3moe_single.safetensors"
    save_file(sd, str(path), metadata={"config": json.dumps(cfg)})
    single = qwen3_moe.load(path, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 3]])
    with torch.no_grad():
        a = single.model(ids)["last_hidden_state"]
        b = loaded.model(ids)["last_hidden_state"]
    assert torch.equal(a, b)
    assert single.tokenizer.encode("a cat") == loaded.tokenizer.encode("a cat")


def test_fp8_experts_match_dequantized_model(tiny, tmp_path):
    """FP8 (e4m3fn, per-tensor scale) expert weights stay FP8 and agree with the model whose weights
    are the same FP8 values decoded to fp32."""
    folder, _, _ = tiny
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    deq = {}
    for k, v in list(sd.items()):
        if ".experts." in k:
            scale = v.abs().max() / 448.0
            q = (v / scale).to(torch.float8_e4m3fn)
            sd[k] = q
            sd[k.replace(".weight", ".weight_scale")] = scale.reshape(())
            deq[k] = q.float() * scale
    f8 = tmp_path / "fp8"
    f8.mkdir()
    save_file(sd, str(f8 / "model.safetensors"))
    for name in ("config.json", "tokenizer.json"):
        (f8 / name).write_text((folder / name).read_text())
    ref_sd = {k: (deq.get(k, v)) for k, v in sd.items() if not k.endswith("weight_scale")}
    ref = tmp_path / "ref"
    ref.mkdir()
    save_file(ref_sd, str(ref / "model.safetensors"))
    for name in ("config.json", "tokenizer.json"):
        (ref / name).write_text((folder / name).read_text())
    m8 = qwen3_moe.load(f8, dtype=torch.float32)
    mr = qwen3_moe.load(ref, dtype=torch.float32)
    assert m8.model.layers[0].mlp.fmt == "e4m3fn" and m8.model.layers[0].mlp.gate_up.dtype == torch.uint8
    ids = torch.tensor([[5, 9, 17, 3, 40, 41, 7, 8, 22, 63, 1, 2, 30] * 3])
    with torch.no_grad():
        for n in (ids[:, :2], ids):  # decode path and prefill path
            a = m8.model(n)["last_hidden_state"]
            b = mr.model(n)["last_hidden_state"]
            assert (a - b).abs().max().item() < 1e-4


def test_bad_inputs_give_clear_errors(tiny, tmp_path):
    folder, _, _ = tiny
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(qwen3_moe.ModelLoadError, match="no config.json"):
        qwen3_moe.load(empty)
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tok / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(qwen3_moe.ModelLoadError, match="no tokenizer.json"):
        qwen3_moe.load(no_tok)
    other = tmp_path / "other"
    other.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (other / name).write_bytes((folder / name).read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, model_type="llama", architectures=["LlamaForCausalLM"])))
    with pytest.raises(qwen3_moe.ModelLoadError, match="model_type 'llama'.*not supported"):
        qwen3_moe.load(other)
    (other / "config.json").write_text(json.dumps(dict(cfg, moe_intermediate_size=32)))
    with pytest.raises(qwen3_moe.ModelLoadError, match=r"experts\.0\.gate_proj\.weight has shape \[24, 32\], expected \[32, 32\]"):
        qwen3_moe.load(other)
    (other / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=2)))
    with pytest.raises(qwen3_moe.ModelLoadError, match="do not belong to the configured model"):
        qwen3_moe.load(other)


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers"])
def test_config_missing_a_required_field_names_file_and_field(tiny, tmp_path, field):
    folder, _, _ = tiny
    cfg = json.loads((folder / "config.json").read_text())
    del cfg[field]
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (bad / name).write_bytes((folder / name).read_bytes())
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(qwen3_moe.ModelLoadError, match=rf"config\.json: required field '{field}' is missing"):
        qwen3_moe.load(bad)


def _quantize_all_projections(key, shape, dtype):
    """fp8_quantize.quantize_file's `keep`: every 2-D projection becomes FP8 (the tiny model's are all
    below the default size threshold), the rest stays fp32."""
    return None if key.endswith("proj.weight") and len(shape) == 2 else "kept"


@pytest.mark.parametrize("variant", ["rowwise", "tensorwise", "rowwise_without_comfy_quant"])
def test_quantize_file_output_matches_transformers_on_its_dequantized_weights(tiny, tmp_path, variant):
    """The pack's own quantizer output (comfy_quant markers, weight_scale [N, 1] per row or a scalar)
    loads with FP8 expert banks, and agrees with transformers' Qwen3MoeForCausalLM holding the
    dequantized weights (fp8 value * its row's scale)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeForCausalLM

    from comfy_metal.nodes.fp8 import quantize as fp8_quantize

    folder, _, _ = tiny
    q = tmp_path / "q"
    q.mkdir()
    fp8_quantize.quantize_file(str(folder / "model.safetensors"), str(q / "model.safetensors"),
                               rowwise=variant != "tensorwise", keep=_quantize_all_projections)
    sd = load_file(str(q / "model.safetensors"))
    expert = "model.layers.0.mlp.experts.3.down_proj"
    assert sd[expert + ".weight"].dtype == torch.float8_e4m3fn and f"{expert}.comfy_quant" in sd
    if variant != "tensorwise":
        assert sd[expert + ".weight_scale"].shape == (32, 1)
        assert sd[expert + ".weight_scale"].unique().numel() > 1  # the rows' scales really differ
    if variant == "rowwise_without_comfy_quant":
        sd = {k: v for k, v in sd.items() if not k.endswith(".comfy_quant")}
        save_file(sd, str(q / "model.safetensors"))
    for name in ("config.json", "tokenizer.json"):
        (q / name).write_text((folder / name).read_text())
    deq = {}
    for k, v in sd.items():
        if k.endswith((".weight_scale", ".comfy_quant")):
            continue
        deq[k] = v.float() * sd[k + "_scale"] if v.dtype == torch.float8_e4m3fn else v
    ref = tmp_path / "ref"
    ref.mkdir()
    save_file(deq, str(ref / "model.safetensors"), metadata={"format": "pt"})
    (ref / "config.json").write_text((folder / "config.json").read_text())
    hf = Qwen3MoeForCausalLM.from_pretrained(str(ref), torch_dtype=torch.float32).eval()

    m8 = qwen3_moe.load(q, dtype=torch.float32)
    mlp = m8.model.layers[0].mlp
    assert mlp.fmt == "e4m3fn" and mlp.gate_up.dtype == torch.uint8
    ids = torch.tensor([[5, 9, 17, 3, 40, 41, 7, 8, 22, 63, 1, 2, 30]])
    with torch.no_grad():
        want = hf(ids).logits
        for n in (ids[:, :2], ids):  # decode path and prefill path
            got = m8.model(n, logits="all")["logits"]
            err = (got - want[:, : n.shape[1]]).abs().max().item()
            assert err < 1e-3, f"max abs logit error {err} against the dequantized model"


def test_qwen2_moe_with_shared_expert_matches_transformers(tmp_path):
    """The optional shared expert (Qwen2-MoE layout: sigmoid-gated dense MLP beside the routed experts),
    q/k/v biases without q/k norm, norm_topk_prob off."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(4)
    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                         shared_expert_intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=5, num_experts_per_tok=2, norm_topk_prob=False,
                         max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         use_sliding_window=False, tie_word_embeddings=True)
    hf = Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(moe_testutil.tiny_tokenizer_json(64))
    ours = qwen3_moe.load(tmp_path, dtype=torch.float32)
    assert ours.model.layers[0].mlp.shared_expert is not None
    assert ours.model.lm_head is None   # tied embeddings
    ids = torch.tensor([[3, 9, 27, 5, 11, 60, 2]])
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True)
        got = ours.model(ids, logits="all")
    assert (got["last_hidden_state"] - want.hidden_states[-1]).abs().max().item() < 1e-4
    assert (got["logits"] - want.logits).abs().max().item() < 1e-4


def test_single_file_without_config_infers_shapes(tiny, tmp_path):
    """No config anywhere: shapes come from the tensors (Qwen3 defaults for top-k / rope theta)."""
    folder, _, loaded = tiny
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    sd["tokenizer_json"] = torch.tensor(list((folder / "tokenizer.json").read_bytes()), dtype=torch.uint8)
    sub = tmp_path / "bare"
    sub.mkdir()
    save_file(sd, str(sub / "bare.safetensors"))
    m = qwen3_moe.load(sub / "bare.safetensors")
    c, want = m.config, loaded.config
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "num_experts", "moe_intermediate_size"):
        assert getattr(c, field) == getattr(want, field), field
    assert c.num_experts_per_tok == min(8, want.num_experts)


def test_block_scaled_fp8_checkpoint_matches_dequantized(tiny, tmp_path):
    """Qwen's official FP8 layout: every linear weight float8_e4m3fn with `weight_scale_inv` block scales
    (quantization_config.weight_block_size in config.json); decoded at load, equal to the fp32 model
    holding the same dequantized values."""
    folder, _, _ = tiny
    from safetensors.torch import load_file, save_file

    block = 16
    sd = load_file(str(folder / "model.safetensors"))
    deq = {}
    for k, v in list(sd.items()):
        if k.endswith("proj.weight") and v.dim() == 2:
            n, m = v.shape
            bn, bm = -(-n // block), -(-m // block)
            pad = torch.zeros(bn * block, bm * block)
            pad[:n, :m] = v
            blocks = pad.view(bn, block, bm, block)
            s = blocks.abs().amax(dim=(1, 3)) / 448.0 + 1e-12
            q = (blocks / s[:, None, :, None]).view(bn * block, bm * block)[:n, :m].to(torch.float8_e4m3fn)
            sd[k] = q
            sd[k + "_scale_inv"] = s
            deq[k] = (q.float() * s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :m])
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    for name, tensors, config in (("fp8", sd, cfg), ("ref", {k: deq.get(k, v) for k, v in sd.items()
                                                           if not k.endswith("_scale_inv")}, None)):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(config or json.loads((folder / "config.json").read_text())))
        (d / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    m8 = qwen3_moe.load(tmp_path / "fp8", dtype=torch.float32)
    mr = qwen3_moe.load(tmp_path / "ref", dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 3, 40, 41, 7, 8, 22, 63, 1, 2, 30]])
    with torch.no_grad():
        a = m8.model(ids)["last_hidden_state"]
        b = mr.model(ids)["last_hidden_state"]
    assert (a - b).abs().max().item() < 1e-5
    # and it is really a different model from the unquantized one
    with torch.no_grad():
        c = qwen3_moe.load(folder, dtype=torch.float32).model(ids)["last_hidden_state"]
    assert (a - c).abs().max().item() > 1e-4


def test_bf16_checkpoint_loads_in_bf16_close_to_transformers(tmp_path):
    hf = moe_testutil.make_qwen3_moe(tmp_path, seed=5, dtype=torch.bfloat16)
    ours = qwen3_moe.load(tmp_path, dtype=torch.bfloat16)
    assert ours.model.dtype == torch.bfloat16 and ours.model.layers[0].mlp.gate_up.dtype == torch.bfloat16
    ids = torch.tensor([[5, 9, 17, 3, 40, 41, 7, 8, 22, 63, 1, 2, 30]])
    with torch.no_grad():
        want = hf.model(ids).last_hidden_state.float()
        got = ours.model(ids)["last_hidden_state"].float()
    rel = (got - want).abs().mean() / want.abs().mean()
    assert rel.item() < 0.02, rel.item()
    # and the fp32 load of the same bf16 file is the oracle's fp32 upcast
    ours32 = qwen3_moe.load(tmp_path, dtype=torch.float32)
    from transformers import Qwen3MoeForCausalLM

    hf32 = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()  # fresh fp32 RoPE buffers
    with torch.no_grad():
        want32 = hf32.model(ids).last_hidden_state
        got32 = ours32.model(ids)["last_hidden_state"]
    assert (got32 - want32).abs().max().item() < 1e-4


def test_chat_template_from_tokenizer_config_and_plain_fallback():
    tok_json = moe_testutil.tiny_tokenizer_json(64)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                "{% endif %}")
    t = qwen3_moe.Tokenizer(tok_json, {"chat_template": template, "eos_token": "<|im_end|>"})
    text = t.apply_chat_template("a cat", "be brief")
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na cat<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert t.eos_ids()[0] == t.token_id("<|im_end|>")
    plain = qwen3_moe.Tokenizer(tok_json)
    assert plain.apply_chat_template("a cat") == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    broken = qwen3_moe.Tokenizer(tok_json, {"chat_template": "{% if %}"})
    assert broken.apply_chat_template("a cat") == plain.apply_chat_template("a cat")
    with pytest.raises(qwen3_moe.ModelLoadError, match="not a valid tokenizer.json"):
        qwen3_moe.Tokenizer("{not json")
