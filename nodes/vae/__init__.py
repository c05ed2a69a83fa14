"""Low-memory VAE decode/encode.

nodes.py holds the node classes. The planner (planner.py) chooses how a run fits the budget, from a memory
model (memory.py) and tile geometry (tiles.py); the engine (engine.py, `TiledVAE`) executes the plan on a
codec (codecs.py): untiled, stage by stage (stagewise.py, stagewise_encode.py, causal.py), or tiles with
shared GroupNorm statistics (shared_stats.py), with scoped Metal padding (pad.py). The names below are the
engine's public API.
"""
from .codecs import Codec, codec_from_comfy, codec_from_diffusers, codec_from_fn
from .engine import RunInfo, TiledVAE, TilingOptions
from .memory import auto_budget, is_oom, measure_peak
from .pad import MetalPadMode, pad_mode_for
from .planner import AUTO, EXACT, FEATHER, SEAM_MODES, Plan, default_overlap, plan
from .tiles import Tile, axis_core, axis_weights, plan_axis, plan_tiles
from .shared_stats import SharedGroupNormStats
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402  (after the engine it uses)

__all__ = ["Codec", "codec_from_comfy", "codec_from_diffusers", "codec_from_fn", "RunInfo", "TiledVAE",
           "TilingOptions", "AUTO", "EXACT", "FEATHER", "SEAM_MODES", "Plan", "default_overlap", "plan",
           "auto_budget", "is_oom", "measure_peak", "MetalPadMode", "pad_mode_for", "Tile", "axis_core",
           "axis_weights", "plan_axis", "plan_tiles", "SharedGroupNormStats", "NODE_CLASS_MAPPINGS",
           "NODE_DISPLAY_NAME_MAPPINGS"]
