"""Small things every capability uses, written once.

comfyui.py        finding a ComfyUI outside ComfyUI (run, benches, the test harness) and the pack's own folder
memory.py         peak process memory (VmHWM, or an RSS sampler)
models.py         the loaders' model lists and what an empty one says (one wording for every loader)
quality.py        PSNR
report.py         the plain-text tables of doctor and bench
syncs.py          counting host syncs (benches and tests)
text_encoders.py  the FP8 and GGUF text encoder loaders' type lists and Load 2 / 3 / 4 Text Encoders classes
The dtype names (MSL type names, FP8 dtype <-> name) live with the kernels: metal_kernels/dtypes.py.
"""
