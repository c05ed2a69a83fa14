"""`bench --only attention` builds its tables (tiny sizes here; the real ones are for the CLI)."""
from __future__ import annotations

import importlib


def test_bench_tables(comfyui, monkeypatch):
    bench = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.cli.bench.attention")
    monkeypatch.setattr(bench, "QUICK_TOKENS", 48)
    tables = bench.bench(quick=True)
    assert [t.title.split(",")[0] for t in tables] == [
        "Attention: Flux 1024² (4096+512 tok)", "Attention: SDXL 1024² (4096 tok)",
        "Attention: Wan 2.2 480p 81 frames (32760 tok)"]
    for t in tables:
        assert t.columns[:6] == ["path", "ms", "peak", "max err vs fp64", "time / sub_quad", "time / SDPA"]
        labels = [r[0] for r in t.rows]
        assert labels[0].startswith("metal_flash reference (CPU")      # no MPS here: labelled as such
        assert labels[-2:] == ["ComfyUI sub_quad (MPS default)", "ComfyUI attention_pytorch (SDPA)"]
        assert t.rows[-2][4] == "1.00x" and t.rows[-1][5] == "1.00x"
        assert float(t.rows[0][3]) < 5e-3, t.rows[0]                    # ours close to float64
        assert all(float(row[3]) < 0.05 for row in t.rows), t.rows
        assert "reduced on CPU" in t.note and "48 tokens" in t.note
        t.render()


def test_bench_only_attention_from_the_command_line(comfyui, monkeypatch, capsys):
    """`python -m comfy_metal bench --only attention --quick` selects this section (and only it)."""
    name = comfyui.pack_module.__name__
    bench = importlib.import_module(name + ".nodes.cli.bench.attention")
    cli = importlib.import_module(name + ".nodes.cli.main")
    monkeypatch.setattr(bench, "QUICK_TOKENS", 32)
    assert cli.main(["bench", "--only", "attention", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.count("Attention: ") == 3 and "Kernels: Metal vs reference" not in out
