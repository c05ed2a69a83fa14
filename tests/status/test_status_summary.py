"""nodes/status/summary.py: the verdict, what the pack saved and what to do, in plain words, for each kind of
machine a user has (no Apple GPU, a Mac before and after the first run, a Mac with measured speedups, switched
off, an old torch, a failed check, nearly full memory)."""
from __future__ import annotations

from comfy_metal.nodes.status import summary

SOURCES = {"flash_attention": "attention.metal", "fp8_decode": "fp8.metal", "gemv": "linear.metal",
           "gguf_dequantize": "gguf.metal", "sampler_euler_step": "sampling.metal", "vae_pad": "vae.metal",
           "moe_route": "moe.metal", "softmax": "softmax.metal"}


def payload(backend="metal", device="mps", torch="2.15.0", mps=True, **extra):
    caps = {"torch": torch, "python": "3.12.1", "platform": "Darwin arm64", "mps_available": mps,
            "cuda_available": False, "native_fp8_e4m3fn_on_mps": mps and torch >= "2.15", "float8_dtypes": True,
            "F.scaled_mm": True, "torch._grouped_mm": True, "torch.mps.compile_shader": True,
            "mps_pad_is_safe": torch >= "2.15", "mps_recommended_max_memory": 48 * 2**30 if mps else None}
    reason = {"metal": "passed its self-check", "pending": "not self-checked yet",
              "reference": f"Metal runs only on MPS tensors (this call is on {device})"}[backend]
    kernels = {n: {"backend": backend, "device": device, "source": src, "reason": reason} for n, src in SOURCES.items()}
    out = {"capabilities": caps, "backend_setting": "auto", "force_reference": False, "kernels": kernels,
           "forced_kernels": [], "measured": [], "loaded_models": [],
           "memory": {"device": device, "in_use": 2 * 2**30, "recommended_max": 48 * 2**30}}
    out.update(extra)
    return out


def test_no_apple_gpu():
    s = summary.plain_summary(payload("reference", device="cpu", torch="2.13.0+cpu", mps=False))
    assert s["verdict"] == ("No Apple GPU here: Comfy Metal runs its plain PyTorch code, so workflows work but are "
                            "not sped up")
    assert s["saved"] == []
    assert s["todo"] == ["Here, pick ComfyUI's own samplers (the names without _metal): the _metal samplers only "
                         "pay off on an Apple GPU"]       # no torch upgrade advice where there is no Apple GPU
    assert {g["words"] for g in s["features"]} == {"plain PyTorch code (no Apple GPU here)"}
    cuda = payload("reference", device="cuda", mps=False)
    cuda["capabilities"]["cuda_available"] = True
    assert summary.plain_summary(cuda)["verdict"].startswith("An NVIDIA GPU, no Apple GPU here:")
    emulated = summary.plain_summary(payload("metal", device="cpu", mps=False, backend_setting="emulator"))
    assert "emulator" in emulated["verdict"] and emulated["todo"][0].startswith("Unset COMFY_METAL_BACKEND=emulator")


def test_mac_before_anything_ran():
    s = summary.plain_summary(payload("pending"))
    assert s["verdict"].startswith("Apple GPU found: Comfy Metal checks its GPU code against plain PyTorch the first "
                                   "time each node runs")
    assert s["todo"] == []


def test_mac_in_use_with_measured_speedups_and_memory_saved():
    measured = [{"kernel": "flash_attention", "choice": "metal_flash", "times_ms": {"sub_quad": 21.0, "metal_flash": 10.0},
                 "shape_class": [1], "device": "mps"},
                {"kernel": "flash_attention", "choice": "metal_flash", "times_ms": {"sub_quad": 14.0, "metal_flash": 10.0},
                 "shape_class": [2], "device": "mps"},
                {"kernel": "sampler_euler_step", "choice": "reference", "times_ms": {"reference": 1.0, "metal": 2.0},
                 "shape_class": [3], "device": "mps"}]
    models = [{"name": "flux1-dev-Q4_K_S.gguf", "held_bytes": 6 * 2**30, "bf16_bytes": 22 * 2**30},
              {"name": "t5xxl_fp8_e4m3fn_scaled.safetensors", "held_bytes": 5 * 2**30, "bf16_bytes": 9 * 2**30}]
    p = payload("metal", measured=measured, loaded_models=models)
    p["kernels"]["gguf_dequantize"]["backend"] = "pending"
    s = summary.plain_summary(p)
    # sampling was measured slower than PyTorch at its only size: not "in use"; GGUF not checked yet
    assert s["verdict"] == ("Apple GPU: in use for attention, FP8 models, the low-memory VAE and MoE text encoders; "
                            "2.1× faster attention measured")
    assert s["saved"] == [
        "2 quantized models: 11.0 GiB in memory instead of 31.0 GiB (20.0 GiB saved)",
        "flux1-dev-Q4_K_S.gguf: 6.0 GiB in memory, where bf16 would take 22.0 GiB",
        "t5xxl_fp8_e4m3fn_scaled.safetensors: 5.0 GiB in memory, where bf16 would take 9.0 GiB",
        "Attention: 1.4–2.1× faster than PyTorch's own code, measured on this machine (2 sizes)"]
    assert s["todo"] == []
    gguf = next(g for g in s["features"] if g["feature"] == "GGUF models")
    assert gguf["state"] == "pending" and gguf["words"] == "checked on the Apple GPU the first time a node uses it"
    report = summary.short_report(s, p["memory"])
    assert report.splitlines()[0] == s["verdict"] + "."
    assert "- Memory: 2.0 GiB in use of 48.0 GiB" in report


def test_switched_off_old_torch_failed_check_and_full_memory():
    off = summary.plain_summary(payload("reference", force_reference=True, backend_setting="reference"))
    assert off["verdict"] == ("Apple GPU found, but Comfy Metal's GPU code is switched off: its nodes run plain "
                              "PyTorch code")
    assert off["todo"][0].startswith("Turn off Force reference kernels")
    assert {g["words"] for g in off["features"]} == {"plain PyTorch code (switched off by Force reference kernels)"}
    p = payload("metal", torch="2.13.0", memory={"device": "mps", "in_use": 46 * 2**30, "recommended_max": 48 * 2**30},
                forced_kernels=["gemv"])
    p["kernels"]["fp8_decode"].update(backend="reference", reason="self-check case 1 failed: max abs error 3 exceeds")
    s = summary.plain_summary(p)
    assert s["todo"] == [
        "PyTorch 2.13.0: upgrade to 2.15 or newer (pip install --upgrade torch) for FP8 numbers on the Apple GPU "
        "itself and its fixes for large tensors",
        "COMFY_METAL_REFERENCE=gemv keeps those parts on plain PyTorch code: unset it and restart ComfyUI to use the "
        "Apple GPU for them",
        "1 part of the Metal code failed its check on this Mac and runs plain PyTorch code instead: please report it "
        "with the output of python -m comfy_metal doctor",
        "Memory is nearly full (46.0 GiB of 48.0 GiB): use a smaller (GGUF) model, or lower the memory budget of VAE "
        "Decode (Low Memory, Metal)"]
    fp8 = next(g for g in s["features"] if g["feature"] == "FP8 models")
    assert fp8["state"] == "mixed" and fp8["failed"] == [{"kernel": "fp8_decode", "reason": p["kernels"]["fp8_decode"]["reason"]}]
    assert "uses the Apple GPU" in fp8["words"] and "its check failed on this Mac" in fp8["words"]
    assert s["verdict"].startswith("Apple GPU: in use for attention, FP8 models, GGUF models")
    broken = payload("reference")
    assert summary.plain_summary(broken)["verdict"] == ("Apple GPU found, but Comfy Metal's GPU code failed its "
                                                        "checks: its nodes run plain PyTorch code")


def test_machine_and_setting_in_words():
    s = summary.plain_summary(payload("pending"))
    rows = {r["key"]: (r["label"], r["value"]) for r in s["machine"]}
    assert rows["mps_available"] == ("Apple GPU", "yes")
    assert rows["mps_recommended_max_memory"] == ("memory the Apple GPU may use", "48.0 GiB")
    assert rows["torch._grouped_mm"][0].startswith("grouped matrix multiply for MoE experts")
    assert s["backend"] == ("Kernel choice: automatic: the Apple GPU where its code passed its check and is faster "
                            "(COMFY_METAL_BACKEND=auto)")


def test_node_runs_in_words_newest_first():
    runs = {"7": {"node_id": "7", "node_class": None, "backend": "reference", "time": 2,
                  "kernels": {"sampler_euler_step": {"backend": "reference", "device": "cpu",
                                                     "reason": "Metal runs only on MPS tensors (this call is on cpu)"}}},
            "MetalStatus": {"node_id": None, "node_class": "MetalStatus", "backend": "metal", "time": 1, "note": "n",
                            "kernels": {"softmax": {"backend": "metal", "device": "mps", "reason": "passed"}}}}
    s = summary.plain_summary(payload("metal", node_backends=runs))
    assert s["runs"] == [
        {"node": "#7 (a ComfyUI node)", "backend": "reference", "words": "plain PyTorch code (no Apple GPU here)",
         "note": None},
        {"node": "MetalStatus", "backend": "metal", "words": "uses the Apple GPU", "note": "n"}]
