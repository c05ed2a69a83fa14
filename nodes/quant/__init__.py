"""ComfyUI's comfy_quant block formats (NVFP4, MXFP8, INT8, W4A8, W4A4): the file layout of each
quantized layer (formats.py) and the layers that keep it at its stored size and compute with the
Metal kernels of metal_kernels/quant.py (ops.py). No nodes of its own: the FP8 loaders (nodes/fp8) load
these files, and files mixing FP8 and block-quantized layers.
"""
