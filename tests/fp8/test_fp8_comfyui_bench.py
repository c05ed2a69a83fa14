"""The FP8 bench's load table against a real ComfyUI ($COMFYUI_PATH; skipped with the reason otherwise).

Fairness: MetalFP8ModelLoader and ComfyUI's stock loader are timed doing the same steps -- build the
MODEL from the file, then load it in full onto the compute device (load_models_gpu(force_full_load=True)).
"""
from __future__ import annotations

import re

from comfy_metal.nodes.cli.bench import fp8 as bench_fp8


def test_load_table_times_both_loaders_doing_the_same(comfyui_path, monkeypatch):
    monkeypatch.setenv("COMFYUI_PATH", str(comfyui_path))
    t = bench_fp8.load_table(quick=True)
    rows = {r[0]: r for r in t.rows}
    col = t.columns.index("on device")
    for name in ("MetalFP8ModelLoader", "ComfyUI UNETLoader (stock)"):
        row = rows[name]
        assert row[3] != "error", row
        # after the load step the whole model is on the compute device: loaded_size() == model_size()
        m = re.fullmatch(r"(.+) of (.+)", str(row[col]))
        assert m and m.group(1) == m.group(2) and not m.group(1).startswith("0 "), row
    assert "force_full_load=True" in t.note and "Both ComfyUI rows" in t.note, t.note
