"""Load 2 / 3 / 4 Text Encoders (FP8, Metal) inside a real ComfyUI ($COMFYUI_PATH; skipped otherwise).

Each set on tiny random encoders of the real architectures (ComfyUI's own encoder classes with small
configs, as the workflow tests build them; see tests/helpers/workflow_models.py), as a mixed set: some files
Comfy-Org "fp8_scaled", the others bf16.
- flux (Dual): CLIP-L bf16 + T5-XXL FP8;
- sd3 (Triple): CLIP-L bf16 + CLIP-G FP8 (all 32 layers: ComfyUI finds CLIP-G by layer 30) + T5-XXL FP8
  at d_model 4096 (SD3 pads the CLIP-L/G output to 4096 and concatenates it with the T5 output; the
  embedding keeps its first 8192 rows);
- hidream (Quadruple): CLIP-L bf16 + CLIP-G bf16 + T5-XXL FP8 (24 blocks: HiDream finds its T5 by block
  23) + Llama-3.1-8B FP8 (ComfyUI's Llama2 at width 32, its real 128256-token vocabulary).
Our loader and core's (DualCLIPLoader / TripleCLIPLoader / QuadrupleCLIPLoader) run in one prompt through
ComfyUI's executor, each followed by CLIPTextEncode. The oracle is core's loader on the same weights with
the FP8 files dequantized (fp32 Linear weights, the other tensors as stored, so that ComfyUI picks the same
encoder dtypes for both). Compared: the conditioning, the pooled output, and for hidream the Llama's
conditioning_llama3; checked: the loader's badge record, one CLIPTextEncode badge record per FP8 encoder,
every FP8 weight of the files kept FP8 at 1 byte. The nodes' inputs are ComfyUI's
Dual/Triple/QuadrupleCLIPLoader's.

HiDream's Llama-3 tokenizer: ComfyUI reads it from its own comfy/text_encoders/llama_tokenizer/tokenizer.json,
which the ComfyUI archive the tests use lacks (empty: too large for the archive). There the test uses a
stand-in tokenizer.json (byte-level BPE with Llama-3's real special tokens and ids, read by ComfyUI's own
tokenizer code; workflow_models.use_llama3_tokenizer_stand_in); with a full ComfyUI checkout the real one.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import fp8_models as fm
import workflow_models as wm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TEXT = "a photo of a cat on a red sofa"
# Both encoders compute in the same dtypes (ComfyUI's choice for text encoders). The flux pair has the
# arbitrary per-tensor scales of real files: core's copy stores the dequantized weights rounded to the
# encoder's half-precision dtype while ours widens the exact FP8 values inside each layer, so the two differ
# by that rounding (2^-11 relative per weight in fp16; measured about 1e-3 at the output).
ROUNDED_TOL = 1e-2
# The sd3 and hidream sets use power-of-two scales: every dequantized weight is exact in bf16/fp16, both
# encoders hold identical weights, and only the order of float32 sums could differ between the two paths
# (about 1e-7 relative each). Non-power-of-two scales would leave core's bf16 rounding of the weights (2^-9),
# which 24 random T5 blocks amplify to about 1e-1 at the output: too loose to check anything.
EXACT_TOL = 1e-4


def _write_set(comfyui, loader_mod, prefix: str, files, pow2_scales=False) -> tuple[list[str], list[str], int]:
    """Write a set of text encoder files. `files`: (role, state dict builder, FP8?) in loader order.
    Returns (our file names, the oracle's file names, FP8 weights written). An FP8 file's oracle copy has
    its FP8 weights dequantized (fp32) and the other tensors as stored; a bf16 file is its own oracle."""
    folder = comfyui.models_dir("text_encoders")
    fmt_mod = fm.pack_module(loader_mod, "nodes.fp8.formats")
    ours, oracle, n_fp8 = [], [], 0
    for role, build, fp8 in files:
        sd = build()
        if not fp8:
            name = f"{prefix}_{role}_bf16.safetensors"
            bf16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
            save_file(bf16, str(folder / name))
            ours.append(name)
            oracle.append(name)
            continue
        name, deq_name = f"{prefix}_{role}_fp8.safetensors", f"{prefix}_{role}_deq.safetensors"
        wm.write_scaled_fp8(folder / name, sd, pow2_scales=pow2_scales)
        del sd
        deq = fm.dequantized_file(fmt_mod, folder / name, rest_dtype=None)
        save_file({k: v.contiguous() for k, v in deq.items()}, str(folder / deq_name))
        del deq
        with fmt_mod.open_checkpoint(folder / name) as ck:
            n_fp8 += len(ck.layers)
        ours.append(name)
        oracle.append(deq_name)
    comfyui.refresh_models()
    return ours, oracle, n_fp8


def _remove(comfyui, names) -> None:
    folder = comfyui.models_dir("text_encoders")
    for n in set(names):
        (folder / n).unlink(missing_ok=True)


@pytest.fixture
def flux_pair(comfyui, loader_mod, monkeypatch):
    """((clip_l bf16, t5 fp8_scaled), their oracle copies, FP8 weights) in models/text_encoders; tiny configs."""
    import comfy.sd

    wm.shrink_text_encoders(monkeypatch, comfy.sd)
    ours, oracle, n_fp8 = _write_set(comfyui, loader_mod, "fp8multi", [
        ("clip_l", wm.clip_l_state_dict, False),
        ("t5xxl", lambda: wm.t5_state_dict("t5_config_xxl.json", wm.T5XXL), True)])
    yield ours, oracle, n_fp8
    _remove(comfyui, ours + oracle)


@pytest.fixture
def sd3_triple(comfyui, loader_mod, monkeypatch):
    """((clip_l bf16, clip_g fp8_scaled, t5 fp8_scaled at d_model 4096), oracle copies, FP8 weights)."""
    import comfy.sd

    wm.shrink_text_encoders(monkeypatch, comfy.sd, clip_g=True, t5xxl=wm.T5XXL_SD3)
    ours, oracle, n_fp8 = _write_set(comfyui, loader_mod, "fp8triple", [
        ("clip_l", lambda: wm.clip_l_state_dict(over=wm.CLIP_LG), False),
        ("clip_g", wm.clip_g_state_dict, True),
        # built in bf16: the 4096-wide embedding is the big part (64 MiB; its oracle copy stays bf16 too)
        ("t5xxl", lambda: wm.t5_state_dict("t5_config_xxl.json", wm.T5XXL_SD3, dtype=torch.bfloat16), True)],
        pow2_scales=True)
    yield ours, oracle, n_fp8
    _remove(comfyui, ours + oracle)


@pytest.fixture
def hidream_quad(comfyui, loader_mod, monkeypatch, tmp_path):
    """((clip_l bf16, clip_g bf16, t5 fp8_scaled 24 blocks, llama fp8_scaled), oracle copies, FP8 weights)."""
    import comfy.sd

    wm.shrink_text_encoders(monkeypatch, comfy.sd, clip_g=True, t5xxl=wm.T5XXL_24)
    wm.use_llama3_tokenizer_stand_in(monkeypatch, tmp_path / "llama_tokenizer")
    ours, oracle, n_fp8 = _write_set(comfyui, loader_mod, "fp8quad", [
        ("clip_l", lambda: wm.clip_l_state_dict(over=wm.CLIP_LG), False),
        ("clip_g", wm.clip_g_state_dict, False),
        ("t5xxl", lambda: wm.t5_state_dict("t5_config_xxl.json", wm.T5XXL_24), True),
        ("llama", wm.llama3_state_dict, True)], pow2_scales=True)
    yield ours, oracle, n_fp8
    _remove(comfyui, ours + oracle)


def _conditioning(out) -> tuple[torch.Tensor, dict]:
    """(cond, extras) of CLIPTextEncode's output as the executor cached it."""
    out = out[0] if isinstance(out, list) else out
    if not isinstance(out[0][0], torch.Tensor):
        out = out[0]
    return out[0][0], out[0][1]


def _encode_against_core(comfyui, loader_mod, ours_class: str, core_class: str, names, oracle_names,
                         **inputs):
    """Our loader (node 1) and core's (node 3) on the oracle copies, each encoding TEXT with CLIPTextEncode
    (nodes 2 and 4), in one prompt through ComfyUI's executor. Returns (our CLIP, our conditioning, core's,
    the status records of the run)."""
    files = {f"clip_name{i}": n for i, n in enumerate(names, 1)}
    core_files = {f"clip_name{i}": n for i, n in enumerate(oracle_names, 1)}
    core_inputs = {**core_files, **{k: v for k, v in inputs.items() if k == "type"}}
    prompt = {"1": {"class_type": ours_class, "inputs": {**files, **inputs, "device": "cpu"}},
              "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": TEXT}},
              "3": {"class_type": core_class, "inputs": core_inputs},
              "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["3", 0], "text": TEXT}}}
    status = fm.pack_module(loader_mod, "nodes.status")
    _, start = status.records_since(0)
    res = comfyui.run_prompt(prompt, execute=["1", "2", "3", "4"])
    recs, _ = status.records_since(start)
    clip = res.node_outputs["1"][0]
    clip = clip[0] if isinstance(clip, list) else clip
    return clip, _conditioning(res.node_outputs["2"][0]), _conditioning(res.node_outputs["4"][0]), recs


def _check_loader_and_badges(loader_mod, ours_class: str, clip, recs, n_fp8: int, fp8_encoders: int) -> None:
    """The loader's own record (no kernel runs at load), one CLIPTextEncode badge record per FP8 encoder
    listing FP8 kernels only, none for core's encode, every FP8 weight of the files kept FP8 at 1 byte."""
    assert [(r["node_id"], r["backend"]) for r in recs if r["node_class"] == ours_class] == [("1", "none")], recs
    enc = [r for r in recs if r["node_id"] == "2"]
    assert len(enc) == fp8_encoders and all(r["kernels"] and set(r["kernels"]) <= {"fp8_decode", "gemv"}
                                            for r in enc), enc
    assert not [r for r in recs if r["node_id"] in ("3", "4")], recs
    ops_mod = fm.pack_module(loader_mod, "nodes.fp8.ops")
    assert sum(1 for _ in ops_mod.fp8_modules(clip.cond_stage_model)) == n_fp8
    assert ops_mod.weight_bytes(clip.cond_stage_model)["bytes_per_fp8_weight"] < 1.01


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all(), (a.shape, b.shape)
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_dual_matches_core_dualcliploader_through_the_executor(comfyui, loader_mod, flux_pair):
    names, oracle, n_fp8 = flux_pair
    clip, (a, ea), (b, eb), recs = _encode_against_core(
        comfyui, loader_mod, "MetalFP8DualTextEncoderLoader", "DualCLIPLoader", names, oracle, type="flux")
    _check_loader_and_badges(loader_mod, "MetalFP8DualTextEncoderLoader", clip, recs, n_fp8, fp8_encoders=1)
    rel, relp = _rel(a, b), _rel(ea["pooled_output"], eb["pooled_output"])
    print(f"flux pair fp8 ours vs DualCLIPLoader(dequantized): cond rel {rel:.2e}, pooled rel {relp:.2e}")
    assert rel < ROUNDED_TOL and relp < ROUNDED_TOL


def test_triple_sd3_matches_core_tripleclip_loader_through_the_executor(comfyui, loader_mod, sd3_triple):
    names, oracle, n_fp8 = sd3_triple
    clip, (a, ea), (b, eb), recs = _encode_against_core(
        comfyui, loader_mod, "MetalFP8TripleTextEncoderLoader", "TripleCLIPLoader", names, oracle)
    _check_loader_and_badges(loader_mod, "MetalFP8TripleTextEncoderLoader", clip, recs, n_fp8, fp8_encoders=2)
    te = clip.cond_stage_model
    assert te.clip_l is not None and te.clip_g is not None and te.t5xxl is not None
    assert te.clip_g.num_layers == 32 and te.clip_l.num_layers == 12
    # SD3's layout: CLIP-L + CLIP-G tokens (77, padded to 4096 wide) then the T5 tokens (77)
    assert a.shape == (1, 154, 4096), a.shape
    assert ea["pooled_output"].shape == (1, 2 * wm.CLIP_LG["hidden_size"])
    rel, relp = _rel(a, b), _rel(ea["pooled_output"], eb["pooled_output"])
    rel_t5 = _rel(a[:, 77:], b[:, 77:])
    print(f"sd3 triple fp8 ours vs TripleCLIPLoader(dequantized): cond rel {rel:.2e} (T5 part {rel_t5:.2e}), "
          f"pooled rel {relp:.2e}")
    assert rel < EXACT_TOL and rel_t5 < EXACT_TOL and relp < EXACT_TOL


def test_quadruple_hidream_matches_core_quadrupleclip_loader_through_the_executor(comfyui, loader_mod,
                                                                                   hidream_quad):
    names, oracle, n_fp8 = hidream_quad
    clip, (a, ea), (b, eb), recs = _encode_against_core(
        comfyui, loader_mod, "MetalFP8QuadrupleTextEncoderLoader", "QuadrupleCLIPLoader", names, oracle)
    _check_loader_and_badges(loader_mod, "MetalFP8QuadrupleTextEncoderLoader", clip, recs, n_fp8,
                             fp8_encoders=2)
    te = clip.cond_stage_model
    assert None not in (te.clip_l, te.clip_g, te.t5xxl, te.llama)
    # HiDream's layout: the T5 tokens (128) as the conditioning, the Llama's hidden states of every layer
    # (without the start token) as conditioning_llama3, CLIP-L + CLIP-G pooled
    assert a.shape == (1, 128, wm.T5XXL_24["d_model"]), a.shape
    ll_a, ll_b = ea["conditioning_llama3"], eb["conditioning_llama3"]
    assert ll_a.shape[:2] == (1, wm.LLAMA3_8B["num_hidden_layers"])
    assert ll_a.shape[-1] == wm.LLAMA3_8B["hidden_size"]
    assert ea["pooled_output"].shape == (1, 2 * wm.CLIP_LG["hidden_size"])
    rel, rell, relp = _rel(a, b), _rel(ll_a, ll_b), _rel(ea["pooled_output"], eb["pooled_output"])
    print(f"hidream quad fp8 ours vs QuadrupleCLIPLoader(dequantized): T5 cond rel {rel:.2e}, "
          f"llama rel {rell:.2e}, pooled rel {relp:.2e}")
    assert rel < EXACT_TOL and rell < EXACT_TOL and relp < EXACT_TOL


@pytest.mark.parametrize("fmt", ["FP8", "GGUF"])
def test_inputs_are_cores_and_type_list_is_read_from_comfyui(comfyui, fmt):
    for ours, core, n in ((f"Metal{fmt}DualTextEncoderLoader", "DualCLIPLoader", 2),
                          (f"Metal{fmt}TripleTextEncoderLoader", "TripleCLIPLoader", 3),
                          (f"Metal{fmt}QuadrupleTextEncoderLoader", "QuadrupleCLIPLoader", 4)):
        mine = comfyui.object_info(ours)[ours]["input"]["required"]
        theirs = comfyui.object_info(core)[core]["input"]["required"]
        names = [f"clip_name{i}" for i in range(1, n + 1)]
        assert set(names) <= set(mine) and set(names) <= set(theirs)
        assert mine["device"][0] == ["gpu", "cpu"]
        if "type" in theirs:
            assert mine["type"][0] == theirs["type"][0]
        else:
            assert "type" not in mine
    single = f"Metal{fmt}TextEncoderLoader"
    assert comfyui.object_info(single)[single]["input"]["required"]["type"][0] == \
        comfyui.object_info("CLIPLoader")["CLIPLoader"]["input"]["required"]["type"][0]


def test_the_type_lists_without_comfyui_are_comfyuis_types(comfyui, loader_mod, monkeypatch):
    """Outside ComfyUI the loaders list ComfyUI v0.33's types: every one a type of this ComfyUI's loaders."""
    import sys

    te = fm.pack_module(loader_mod, "nodes.common.text_encoders")
    core = {name: comfyui.object_info(name)[name]["input"]["required"]["type"][0]
            for name in ("CLIPLoader", "DualCLIPLoader")}
    monkeypatch.delitem(sys.modules, "nodes")
    assert te.clip_types() == te.CLIP_TYPES_FALLBACK and set(te.CLIP_TYPES_FALLBACK) <= set(core["CLIPLoader"])
    assert te.dual_clip_types() == te.DUAL_CLIP_TYPES_FALLBACK
    assert set(te.DUAL_CLIP_TYPES_FALLBACK) <= set(core["DualCLIPLoader"])


@pytest.mark.parametrize("node_class, n", [("MetalFP8DualTextEncoderLoader", 2),
                                           ("MetalFP8TripleTextEncoderLoader", 3),
                                           ("MetalFP8QuadrupleTextEncoderLoader", 4)])
def test_a_bad_file_names_the_file(comfyui, loader_mod, flux_pair, node_class, n):
    (clip_l, _), _, _ = flux_pair
    folder = comfyui.models_dir("text_encoders")
    bad = folder / "fp8multi_broken.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    comfyui.refresh_models()
    node = getattr(fm.pack_module(loader_mod, "nodes.fp8.nodes"), node_class)()
    files = {f"clip_name{i}": clip_l for i in range(1, n)} | {f"clip_name{n}": bad.name}
    extra = {"type": "flux"} if n == 2 else {}
    try:
        with pytest.raises(Exception, match="fp8multi_broken"):
            node.load(**files, **extra, device="cpu")
    finally:
        bad.unlink()
