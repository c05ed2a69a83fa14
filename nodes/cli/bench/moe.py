"""`python -m comfy_metal bench --only moe`: MoE layer and model throughput.

Tables:
1. One MoE layer (router + experts), prefill and decode: the pack's sync-free path vs transformers'
   Qwen3MoeSparseMoeBlock (its default experts implementation) vs a ComfyUI-style per-expert loop
   (hit experts found with nonzero, one .item() per expert), with the host syncs each makes.
2. A small whole Qwen3-MoE model: prefill tokens/s and greedy decode tokens/s, the pack vs
   transformers' Qwen3MoeForCausalLM with the same random weights.
3. Prefill experts at Qwen3-30B-A3B widths (MPS only): the pack's grouped GEMM kernel against the platform
   path it is measured against at run time (torch._grouped_mm, FP8 banks decoded first), per projection, in
   bf16 and FP8 banks: ms, TFLOP/s and the ratio.
4. Decode of a Qwen3-30B-A3B shaped model (hidden 2048, 32/4 heads of 128, 128 experts top-8 of 768;
   fewer layers, reported per layer) in bf16 and FP8 experts: tokens/s, ms per layer, the weight
   bytes a token reads, the bandwidth that implies and its fraction of the memory roofline (the
   device's measured copy bandwidth). On CPU the full shape runs only without --quick.
"""
from __future__ import annotations


import torch

from ...common.report import Table, bench_device, median_seconds
from ...common.syncs import count_syncs

F = torch.nn.functional


def comfy_style_loop(x, experts, weights, gate_up, down):
    """The per-expert loop ComfyUI's MoE encoders run: find the hit experts with nonzero, then for each
    (one host sync) gather its tokens, run gate/up, SiLU-GLU, down, and scatter the weighted result."""
    T, H = x.shape
    K = experts.shape[1]
    E = gate_up.shape[0]
    per_pair = torch.zeros((T * K, H), dtype=x.dtype, device=x.device)
    mask = F.one_hot(experts, num_classes=E).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for ei in hit:
        e = int(ei.item())
        pos, tok = torch.where(mask[e])
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[tok, pos, None]
        per_pair[tok * K + pos] = y.to(x.dtype)
    return per_pair.view(T, K, H).sum(dim=1)


def _layer_table(quick: bool, device) -> Table:
    from ....metal_kernels import moe

    if quick:
        E, H, I, K = 32, 512, 256, 4
    elif device.type == "cpu":   # ~0.8 GB of fp32 banks (x2 with transformers' copy)
        E, H, I, K = 64, 1024, 512, 8
    else:                        # Qwen3-30B-A3B's MoE layer
        E, H, I, K = 128, 2048, 768, 8
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * 0.02).to(device, dtype)
    down = (torch.randn(E, H, I, generator=gen) * 0.02).to(device, dtype)
    router = (torch.randn(E, H, generator=gen) * 0.05).to(device, dtype)
    t = Table(f"MoE layer on {device.type} ({dtype}): {E} experts top-{K}, hidden {H}, expert width {I}",
              ["tokens", "implementation", "ms", "tokens/s", "host syncs", "vs loop"])
    hf_block = None
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                             norm_topk_prob=True)
        hf_block = Qwen3MoeSparseMoeBlock(cfg).to(device, dtype).eval()
        with torch.no_grad():
            hf_block.experts.gate_up_proj.copy_(gate_up)
            hf_block.experts.down_proj.copy_(down)
            hf_block.gate.weight.copy_(router)
        hf_impl = getattr(cfg, "_experts_implementation", None) or "eager"
    except Exception as e:  # transformers missing or changed
        hf_impl = f"unavailable ({type(e).__name__})"
    for T in ((1, 64) if quick else (1, 512)):
        x = (torch.randn(T, H, generator=gen) * 0.5).to(device, dtype)

        def ours():
            w, e = moe.moe_route(F.linear(x, router), K)
            return moe.moe_experts_forward(x, e, w.to(dtype), gate_up, down)

        def loop():
            w, e = moe.moe_route_reference(F.linear(x, router), K)
            return comfy_style_loop(x, e, w.to(dtype), gate_up, down)

        runs = [("comfy_metal sync-free", ours), ("ComfyUI-style per-expert loop", loop)]
        if hf_block is not None:
            runs.append((f"transformers Qwen3MoeSparseMoeBlock ({hf_impl})", lambda: hf_block(x[None])))
        with torch.no_grad():
            rep = 3 if quick else 5
            res = [(name, median_seconds(fn, device, repeat=rep), count_syncs(fn)) for name, fn in runs]
        loop_s = res[1][1]
        for name, s, n in res:
            t.add(T, name, s * 1e3, T / s, n, f"{loop_s / s:.2f}x")
    t.note = "host syncs: item/nonzero/... per forward, counted with a torch dispatch mode."
    return t


def _model_tables(quick: bool, device) -> list[Table]:
    from ...moe import qwen3 as qwen3_moe

    try:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError as e:
        return [Table("Qwen3-MoE model vs transformers", ["note"], [[f"transformers is not importable: {e}"]])]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    kw = dict(vocab_size=2048, hidden_size=256 if quick else 512, intermediate_size=512,
              moe_intermediate_size=128 if quick else 256, num_hidden_layers=2 if quick else 4,
              num_attention_heads=8, num_key_value_heads=2, head_dim=32 if quick else 64,
              num_experts=16 if quick else 64, num_experts_per_tok=4 if quick else 8,
              norm_topk_prob=True, bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)).to(dtype).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.05)
    ours = qwen3_moe.from_state_dict(hf.state_dict(), dict(kw, model_type="qwen3_moe"), device, dtype)
    hf = hf.to(device)
    S, new = (64, 16) if quick else (256, 32)
    ids = torch.randint(0, kw["vocab_size"], (1, S), device=device)
    t = Table(f"Qwen3-MoE model on {device.type} ({dtype}): {kw['num_hidden_layers']} layers, hidden "
              f"{kw['hidden_size']}, {kw['num_experts']} experts top-{kw['num_experts_per_tok']}",
              ["phase", "implementation", "tokens/s", "vs transformers"])
    with torch.no_grad():
        pre_ours = median_seconds(lambda: ours(ids), device, repeat=3)
        pre_hf = median_seconds(lambda: hf.model(ids), device, repeat=3)
        dec_ours = median_seconds(lambda: ours.generate(ids[:, :8], max_new_tokens=new), device, repeat=2)
        dec_hf = median_seconds(lambda: hf.generate(ids[:, :8], max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                           pad_token_id=0), device, repeat=2)
    t.add(f"prefill {S} tokens", "comfy_metal", S / pre_ours, f"{pre_hf / pre_ours:.2f}x")
    t.add(f"prefill {S} tokens", "transformers", S / pre_hf, "1.00x")
    t.add(f"greedy decode {new} tokens", "comfy_metal", new / dec_ours, f"{dec_hf / dec_ours:.2f}x")
    t.add(f"greedy decode {new} tokens", "transformers", new / dec_hf, "1.00x")
    t.note = "decode tokens/s includes the 8-token prefill; same random weights in both."
    return [t]


def copy_bandwidth(device, nbytes=256 << 20) -> float:
    """Measured device copy bandwidth in bytes/s (read + write)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    s = median_seconds(lambda: y.copy_(x), device, repeat=5)
    return 2 * nbytes / s


def _qwen30b_table(quick: bool, device) -> Table | None:
    from ...moe import qwen3 as qwen3_moe

    layers = 1 if device.type == "cpu" else (2 if quick else 4)
    if device.type == "cpu" and quick:
        t = Table("Qwen3-30B-A3B shaped decode", ["note"])
        t.add("skipped with --quick on CPU (the full shape needs ~1.3 GB per bf16 layer); run without --quick")
        return t
    H, nh, nkv, d, E, K, I = 2048, 32, 4, 128, 128, 8, 768
    cfg = qwen3_moe.MoEConfig(vocab_size=1024, hidden_size=H, intermediate_size=6144, moe_intermediate_size=I,
                              num_hidden_layers=layers, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=d,
                              num_experts=E, num_experts_per_tok=K)
    bw = copy_bandwidth(device)
    t = Table(f"Qwen3-30B-A3B shaped decode on {device.type} ({layers} layers, per-layer numbers)",
              ["experts", "tokens/s (all layers)", "ms / layer", "MB read / layer / token", "GB/s",
               "roofline fraction"])
    dtype = torch.bfloat16
    ctx = 128
    for label, fmt in (("bf16", None), ("fp8 e4m3fn", "e4m3fn")):
        model = qwen3_moe.random_model(cfg, device, dtype, expert_fmt=fmt)
        cache = qwen3_moe.KVCache(cfg, 1, ctx + 64, device, dtype)
        with torch.no_grad():
            model(torch.randint(0, 1024, (1, ctx), device=device), cache=cache, start=0)
            tok = torch.randint(0, 1024, (1, 1), device=device)
            pos = [ctx]

            def step():
                model(tok, cache=cache, start=ctx)  # same position each time: steady-state cost

            s = median_seconds(step, device, repeat=5 if device.type != "cpu" else 3)
        elt = 1 if fmt else 2
        attn = (H * nh * d * 2 + H * nkv * d * 2) * 2
        router = E * H * 2
        experts = K * 3 * H * I * elt
        kv = 2 * nkv * d * ctx * 2
        per_layer = attn + router + experts + kv
        gbs = per_layer * layers / s / 1e9
        t.add(label, 1.0 / s, s * 1e3 / layers, per_layer / 1e6, gbs, f"{gbs * 1e9 / bw:.2f}")
        del model, cache
    t.note = (f"roofline: measured copy bandwidth {bw / 1e9:.1f} GB/s on {device.type}; bytes = attention + router + "
              f"{K} experts' weights + KV cache at {ctx} tokens (vocab/lm_head excluded).")
    return t


def _grouped_table(quick: bool, device) -> Table:
    from ....metal_kernels import dispatch, moe

    E, H, I, K = 128, 2048, 768, 8
    T = 128 if quick else 512
    t = Table(f"Prefill experts at Qwen3-30B-A3B widths on {device.type}: {T} tokens x top-{K} of {E} experts, "
              f"hidden {H}, expert width {I}",
              ["bank", "projection", "rows", "grouped kernel ms", "platform ms", "kernel TFLOP/s", "platform / kernel"])
    if device.type != "mps":
        t.add("the Metal kernel runs on MPS only; its prediction: python -m comfy_metal bench --predict --only moe_grouped",
              *[""] * 6)
        return t
    lib = dispatch.compile_library("metal")
    gen = torch.Generator(device="cpu").manual_seed(1)
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(device)
    order, sorted_e, offsets = moe.moe_group(experts, E)
    P = T * K
    for label, fmt in (("bf16", None), ("fp8 e4m3fn", "e4m3fn")):
        for proj, n, k in (("gate+up", 2 * I, H), ("down", H, I)):
            src = torch.randn(E, n, k, generator=gen) * 0.05
            bank = src.to(torch.float8_e4m3fn).view(torch.uint8).to(device) if fmt else src.to(device, torch.bfloat16)
            scale = (torch.rand(E, n, generator=gen) + 0.5).to(device) if fmt else None
            xs = torch.randn(P, k, generator=gen).to(device, torch.bfloat16)
            with torch.no_grad():
                ms_k = median_seconds(lambda: moe.moe_grouped_gemm_metal(lib, xs, offsets, bank, scale, fmt=fmt),
                                      device, repeat=5) * 1e3
                ms_p = median_seconds(lambda: moe._platform_grouped_linear(xs, sorted_e, offsets, bank, scale, None,
                                                                           fmt, torch.bfloat16), device, repeat=5) * 1e3
            t.add(label, proj, P, ms_k, ms_p, 2 * P * n * k / ms_k / 1e9, f"{ms_p / ms_k:.2f}x")
            del bank, xs
    t.note = ("platform: torch._grouped_mm on the bank (FP8 banks decoded to bf16 first), else each row's weights "
              "gathered; moe_grouped_linear times the two per shape class and runs the faster.")
    return t


def bench(quick: bool = False) -> list[Table]:
    device = bench_device()
    tables = [_layer_table(quick, device)]
    tables += _model_tables(quick, device)
    tables.append(_grouped_table(quick, device))
    t = _qwen30b_table(quick, device)
    if t is not None:
        tables.append(t)
    return tables
