"""Low-memory tiled VAE decode/encode.

nodes.py holds the node classes; the engine (engine.py, `TiledVAE`) works on a codec (codecs.py) with a
tile plan (plan.py), a memory model (memory.py), shared GroupNorm statistics (shared_stats.py) and scoped
Metal padding (pad.py). The names below are the engine's public API.
"""
from .codecs import Codec, codec_from_comfy, codec_from_diffusers, codec_from_fn
from .engine import RunInfo, TiledVAE, TilingOptions, default_overlap
from .memory import auto_budget, is_oom, measure_peak
from .pad import MetalPadMode, pad_mode_for
from .plan import Tile, axis_core, axis_weights, plan_axis, plan_tiles
from .shared_stats import SharedGroupNormStats
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402  (after the engine it uses)

__all__ = ["Codec", "codec_from_comfy", "codec_from_diffusers", "codec_from_fn", "RunInfo", "TiledVAE",
           "TilingOptions", "default_overlap", "auto_budget", "is_oom", "measure_peak", "MetalPadMode",
           "pad_mode_for", "Tile", "axis_core", "axis_weights", "plan_axis", "plan_tiles", "SharedGroupNormStats",
           "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
