"""`python -m comfy_metal doctor`: capability report, every kernel's backend, the end-to-end pipeline."""
import json
import os
import pathlib
import subprocess


ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run_doctor(out, *extra, env=None, cwd=None):
    import comfyui_env

    out_args = ["--out", str(out)] if out is not None else []
    return subprocess.run(comfyui_env.pack_command("doctor", *out_args, *extra, root=ROOT), capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})}, cwd=cwd)


def assert_capabilities_of_this_torch(caps):
    """The probe reports the torch it runs under: what each API of it is, and from 2.15 (CI's second leg)
    the APIs that release has on every platform."""
    import torch

    from comfy_metal.metal_kernels import probe

    assert caps["torch"] == torch.__version__
    assert caps["F.scaled_mm"] == hasattr(torch.nn.functional, "scaled_mm")
    assert caps["torch._grouped_mm"] == hasattr(torch, "_grouped_mm")
    assert caps["float8_dtypes"] == (hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e5m2"))
    names = caps["float8_dtype_names"].split()
    assert all(isinstance(getattr(torch, f"float8_{n}"), torch.dtype) for n in names) and "e4m3fn" in names
    assert caps["native_fp8_e4m3fn_on_mps"] == (caps["mps_available"] and probe.TORCH_VERSION >= (2, 15))
    if probe.TORCH_VERSION >= (2, 15):
        assert caps["F.scaled_mm"] and caps["torch._grouped_mm"] and caps["float8_dtypes"] and caps["mps_pad_is_safe"]
        assert {"e4m3fn", "e5m2", "e8m0fnu"} <= set(names)


def test_doctor_json_reports_every_kernel_and_runs_the_pipeline(tmp_path):
    from comfy_metal.metal_kernels import REGISTRY

    proc = _run_doctor(tmp_path, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    kernels = report["status"]["kernels"]
    assert set(kernels) == set(REGISTRY)
    for name, k in kernels.items():
        assert k["backend"] in ("metal", "emulator", "reference") and k["reason"], name
    assert report["summary"]["verdict"].startswith("No Apple GPU here")     # the Metal tab's words
    caps = report["status"]["capabilities"]
    assert "native_fp8_e4m3fn_on_mps" in caps and "torch.mps.compile_shader" in caps
    assert_capabilities_of_this_torch(caps)
    stages = {s["stage"]: s for s in report["stages"]}
    assert list(stages) == ["FP8 load", "MoE text encode", "Metal sampler", "low-memory VAE decode", "PNG",
                            "Metal attention"]
    assert all(s["ok"] for s in stages.values()), stages
    assert "1.000 bytes/weight" in stages["FP8 load"]["detail"]
    assert "matches float64" in stages["Metal attention"]["detail"]
    png = tmp_path / "comfy-metal-doctor.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_doctor_text_report_is_readable_and_writes_nothing_into_the_current_folder(tmp_path):
    """Without --out the PNG goes into a new temporary folder (the report prints its path), never into
    the folder the doctor runs in (the README's quick start runs it in a clone)."""
    import re

    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    proc = _run_doctor(None, env={"TMPDIR": str(tmp)}, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for heading in ("Capabilities", "Kernels (COMFY_METAL_BACKEND=auto)", "End-to-end pipeline on synthetic weights"):
        assert heading in proc.stdout
    # it leads with the Metal tab's verdict in words
    assert proc.stdout.lstrip().startswith("No Apple GPU here: Comfy Metal runs its plain PyTorch code"), proc.stdout[:500]
    assert os.listdir(cwd) == []
    png = pathlib.Path(re.search(r"PNG written to (\S+\.png)", proc.stdout).group(1))
    assert png.is_absolute() and png.parent.parent == tmp.resolve(), png
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
