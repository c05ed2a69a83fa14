"""The VAE planner: how one decode or encode runs inside its memory budget.

`plan(codec, x, options, budget, encode)` returns a `Plan`; the engine (engine.py) executes it and, when
the device runs out of memory anyway, asks for the next plan. The budget is resolved once by the engine
(the node's GiB, or `memory.auto_budget`), and every plan keeps `HEADROOM` of it for what the cost model
does not see (allocator rounding, temporaries of the platform's kernels).

Schemes, in the order auto tries them:

* "untiled": the VAE's own decode/encode in one call, when its predicted peak fits (video VAEs; image VAEs
  reach the same result as one tile).
* "stages": exact, one pass. Image KL VAEs: conv_in and the mid block once over the whole latent, then the
  up path stage by stage over the whole image in bands of rows with whole-image GroupNorm moments
  (stagewise.py); their encoders run the down path that way (stagewise_encode.py). Causal 3-D video VAEs
  (Wan 2.1 / Qwen-Image, Wan 2.2, HunyuanVideo 1.0): every stage over the whole frame in bands of rows, chunk
  by chunk in time with the VAE's own chunking and a whole-frame causal cache per convolution (causal.py;
  hunyuan.py, whose GroupNorms take each chunk's moments).
* "tiles": overlapping tiles, feather-blended (`exact=False`: each tile normalises itself) or in lock-step
  from one GroupNorm to the next with whole-image statistics (`exact=True`, shared_stats.py). Decode may
  run the head (conv_in + mid block) once over the whole latent first (`head`); encode may tile only the
  encoder's first `split` stages and run the rest once over their blended output.

Seam mode auto takes the exact scheme whenever it fits the budget, unless it is predicted slower than
both ComfyUI's own tiled decode at its defaults and feather (`comfy_tiled_work`, in passes over the input);
the plan's `reason` says which ran and why.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Iterator

import torch

from ...metal_kernels.probe import MPS_MAX_SCORE_ELEMENTS
from .codecs import Codec
from .memory import measure_peak
from .pad import pad_mode_for
from .shared_stats import SharedGroupNormStats
from .stagewise import StagewiseDecode
from .stagewise_encode import StagewiseEncode
from .tiles import plan_tiles

log = logging.getLogger("comfy_metal")

# The share of the budget a plan may fill by the cost model; the rest is kept for what it does not see.
HEADROOM = 0.85
# On CPU, convolutions allocate im2col/oneDNN workspaces inside the op (invisible to tensor tracking);
# measured against the process's peak RSS they add up to ~40% of the tracked tile peak.
CPU_WORKSPACE_FACTOR = 1.5
MIN_TILE = 8            # latent pixels: below this, OOM falls back to the CPU
# Shared statistics: the per-tile block cache's share of the budget (1 / this) when it is not planned
# together with the tiles.
STATS_CACHE_SHARE = 4
# Lock-step shared statistics cut tiles from the image: a tile is exact only where its zero padding is farther
# away than the receptive field of the decoder after the head (~12 latent px on the SD decoder). The feather
# ramp gives weight only from a quarter of the overlap inwards, so exact mode needs an overlap of at least
# this (76 dB on ComfyUI's SD VAE in the tests), not feather's 3/8 of the tile.
EXACT_OVERLAP = 16
# ComfyUI's VAEDecodeTiled / VAEEncodeTiled defaults, in output pixels (nodes.py): the yardstick of auto.
COMFY_TILE_PX, COMFY_OVERLAP_PX, COMFY_TEMPORAL, COMFY_TEMPORAL_OVERLAP = 512, 64, 64, 8

# Seam modes (TilingOptions.seam and the nodes' `seam_mode`).
AUTO, FEATHER, EXACT = "auto", "feather", "exact"
SEAM_MODES = (AUTO, FEATHER, EXACT)

UNTILED, STAGES, TILES = "untiled", "stages", "tiles"


@dataclasses.dataclass
class Plan:
    """How one run goes. `scheme` is UNTILED, STAGES or TILES (module docstring); `expected_peak` is the
    cost model's peak in the budget's terms (the output comes on top); `reason` says why this plan (auto's
    choice, what did not fit)."""
    scheme: str
    tile: int = 0                    # TILES: latent px per side before balancing
    overlap: int = 0                 # TILES: latent px
    split: int = 0                   # encode TILES: the codec's first `split` encode_stages run in the tiles, the
                                     # rest once over their blended output (0: the whole encoder in each tile)
    cache_limit: int = 0             # TILES with exact: bytes of lock-step shared statistics' block cache
    expected_peak: int = 0
    reason: str = ""
    exact: bool = False              # TILES: lock-step shared GroupNorm statistics
    head: bool = False               # decode: conv_in + mid block once over the whole latent first
    stages: object = None            # STAGES: the band plan (StagePlan, or causal.CausalPlan for video)
    over_budget: bool = False        # nothing fit: the smallest plan, warned with its expected peak
    tile_shape: tuple = (0, 0)       # TILES: the first tile's (rows, cols) after balancing, latent grid
    tiles: int = 0                   # TILES: how many
    calibration: dict = dataclasses.field(default_factory=dict)
    head_peak: int = 0               # decode: the head's predicted peak (when `head`)
    rest_peak: int = 0               # encode: the untiled rest's predicted peak, its input included
    body_bytes: int = 0              # encode TILES with split: the blended output of the tiled stages (fp32)
    work: float = 0.0                # predicted time, in plain passes over the input


def default_overlap(tile: int) -> int:
    """Latent pixels of overlap when the user leaves it on auto: 3/8 of the tile, up to 24. Feather-only
    tiles normalise themselves, so the overlap is what hides their differences (on a 1024^2 SDXL-width
    decode with 64 px tiles: 34.1 dB at ComfyUI's 8, 36.8 dB at 16); shared statistics need a halo of
    ~16 px (the SD decoder's receptive field) to be exact. Balanced tiles keep the cost moderate."""
    return max(2, min(tile * 3 // 8, 24))


def chain(stages):
    """One function running `stages` in order."""
    def run(x):
        for stage in stages:
            x = stage(x)
        return x
    return run


def workspace_factor(device: torch.device) -> float:
    """The cost model's factor on band and tile working memory for what convolutions allocate inside the op."""
    return CPU_WORKSPACE_FACTOR if device.type == "cpu" else 1.0


def score_limited(device: torch.device) -> bool:
    """Whether attention score matrices on `device` must stay under MPS_MAX_SCORE_ELEMENTS."""
    return device.type == "mps"


def _axis_positions(size: int, tile: int, overlap: int) -> list[int]:
    """Lengths of ComfyUI's tiles along one axis (comfy.utils.tiled_scale_multidim)."""
    if size <= tile:
        return [size]
    out = []
    for it in range(0, size - overlap, tile - overlap):
        pos = max(0, min(size - overlap, it))
        out.append(min(tile, size - pos))
    return out


def comfy_tiled_work(codec: Codec, shape, encode: bool) -> float:
    """ComfyUI's own tiled decode (VAEDecodeTiled) or encode (VAEEncodeTiled) at its defaults, predicted in
    passes over the input: the tiles' total volume over the input's. Image VAEs decode and encode in three
    passes of differently shaped tiles (comfy.sd.VAE.decode_tiled_ / encode_tiled_); video VAEs in one pass
    of 3-D tiles (decode_tiled_3d / encode_tiled_3d)."""
    f = codec.scale
    h, w = (shape[-2] // f, shape[-1] // f) if encode else (shape[-2], shape[-1])
    tile, overlap = max(1, COMFY_TILE_PX // f), max(0, COMFY_OVERLAP_PX // f)
    if not codec.video:
        passes = [(tile // 2, tile * 2), (tile * 2, tile // 2), (tile, tile)]
        return sum(sum(_axis_positions(h, ty, overlap)) * sum(_axis_positions(w, tx, overlap))
                   for ty, tx in passes) / max(1, h * w)
    frames = shape[2] if len(shape) == 5 else 1
    if encode:
        t_tile, t_over = COMFY_TEMPORAL, COMFY_TEMPORAL_OVERLAP
    else:
        t_tile = max(2, COMFY_TEMPORAL // 4)
        t_over = max(1, min(t_tile // 2, COMFY_TEMPORAL_OVERLAP // 4))
    vol = sum(_axis_positions(frames, t_tile, t_over)) * sum(_axis_positions(h, tile, overlap)) * \
        sum(_axis_positions(w, tile, overlap))
    return vol / max(1, frames * h * w)


def plan(codec: Codec, x: torch.Tensor, options, budget: int, encode: bool = False) -> Plan:
    """The plan of one run of `codec` over `x` (a latent, or pixels when `encode`) within `budget` bytes;
    `options` is the engine's TilingOptions."""
    return Planner(codec, options, budget).plan(x, encode)


# Seam mode auto on the video VAEs: the exact stages count as slower than ComfyUI's tiled run only when predicted
# more than this much slower. Their halo rows add a few percent, within the time model's error, while comparing with
# feather needs its calibration runs (measured on CPU: auto at 1.20x and 1.42x ComfyUI tiled's time on the Wan 2.1
# and 2.2 clips of `bench --only vae:video`, exact alone 0.93x and 1.02x).
VIDEO_AUTO_SLACK = 1.1


class Planner:
    """The cost model and the choice of scheme (module docstring). Measuring methods run small forwards of
    the codec on the device (crops of at most 16x16 latent px)."""

    def __init__(self, codec: Codec, options, budget: int):
        self.codec = codec
        self.opt = options
        self.budget = int(budget)

    # ---- measurements

    def measure(self, fn, z: torch.Tensor) -> int:
        """Peak bytes allocated by one forward of `fn` over `z` (an iterator of chunks is drained)."""
        with measure_peak(self.codec.device) as m, torch.no_grad():
            out = fn(z)
            if isinstance(out, Iterator) or hasattr(out, "__next__"):
                for _ in out:
                    pass
            del out
        return int(m["peak"])

    def workspace(self) -> float:
        return workspace_factor(self.codec.device)

    def calibrate(self, fn, sample: torch.Tensor, encode: bool = False, budget: float | None = None) -> dict:
        """{"points", "a", "b"} of peak = a + b * tile_area (latent pixels), from two small tiles on the
        device. The second tile is 16x16, or smaller when its peak (extrapolated from the first, 8x8) would
        exceed the budget: calibrating must not be what breaks it."""
        c = self.codec
        f = c.scale if encode else 1
        h, w = sample.shape[-2] // f, sample.shape[-1] // f
        sides = [s for s in (8, 16) if s <= max(h, w) or s == 8]
        pts = []
        for s in sides:
            if pts and budget is not None:
                m1 = pts[0][1] * self.workspace()
                if m1 * (s * s) / max(1, pts[0][0]) > budget * HEADROOM:
                    s = int(math.sqrt(budget * HEADROOM / max(m1, 1) * pts[0][0]))
                    if s * s <= pts[0][0] * 1.5:
                        break
            th, tw = min(s, h), min(s, w)
            shape = list(sample.shape)
            shape[-2], shape[-1] = th * f, tw * f
            if c.video and not encode and not c.calibrate_all_frames:
                shape[2] = min(shape[2], 2)   # first chunk + one steady-state chunk
            z = torch.randn(shape, device=c.device, dtype=c.dtype)
            pts.append((th * tw, self.measure(fn, z)))
        if len(pts) == 1 or pts[1][0] == pts[0][0]:
            a, b = 0.0, pts[0][1] / max(1, pts[0][0])
        else:
            (p1, m1), (p2, m2) = pts
            b = max((m2 - m1) / (p2 - p1), m2 / p2 * 0.5)
            a = max(0.0, m2 - b * p2)
        ws = self.workspace()
        return {"points": pts, "a": a * ws, "b": b * ws}

    def peak_of_area(self, x: torch.Tensor, fn: Callable, area: int | None = None, unit: int = 1) -> int:
        """Predicted peak of `fn` (a part that runs untiled: the decoder's head, the encoder's rest) over x:
        peak = b * A + c * A^2 (A = area in x's pixels, `area` or x's; the A^2 term is the mid attention's
        score matrix when the attention materialises it), fitted to the measured peaks of two crops of x of
        at most 8x8 and 16x16 latent pixels (`unit` pixels of x per latent pixel)."""
        c = self.codec
        h, w = x.shape[-2:]
        pts = []
        for s in (8 * unit, 16 * unit):
            th, tw = min(s, h), min(s, w)
            if pts and pts[-1][0] == th * tw:
                break
            z = x[..., :th, :tw].to(device=c.device, dtype=c.dtype)
            pts.append((th * tw, self.measure(fn, z)))
        if len(pts) == 1:
            b, q = pts[0][1] / pts[0][0], 0.0
        else:
            (a1, m1), (a2, m2) = pts
            q = max(0.0, (m2 / a2 - m1 / a1) / (a2 - a1))
            b = max(m1 / a1 - q * a1, 0.0)
        area = area or h * w
        return int((b * area + q * area * area) * self.workspace())

    # ---- attention under MPS's score limit

    def attention_shape(self, x: torch.Tensor) -> tuple[int, int]:
        """(sequences, latent frames per sequence) of the VAE's attention: one head per batch item, frame by
        frame (image VAEs, Wan) or over all frames at once (HunyuanVideo 1.0)."""
        frames = x.shape[2] if self.codec.video and x.dim() == 5 else 1
        if self.codec.attention_over_frames:
            return x.shape[0], frames
        return x.shape[0] * frames, 1

    def attention_fits(self, x: torch.Tensor, area: int) -> bool:
        """Whether the VAE's attention over `area` latent pixels a frame stays under MPS's score-matrix limit
        (ComfyUI's VAE attention builds the whole matrix when memory allows)."""
        sequences, frames = self.attention_shape(x)
        return not score_limited(self.codec.device) or \
            sequences * (frames * area) ** 2 < MPS_MAX_SCORE_ELEMENTS

    def attention_side(self, x: torch.Tensor) -> int:
        """The largest square tile side whose attention stays under MPS's score-matrix limit."""
        sequences, frames = self.attention_shape(x)
        side = int((MPS_MAX_SCORE_ELEMENTS / sequences) ** 0.25 / frames ** 0.5) + 1
        while side > 1 and not self.attention_fits(x, side * side):
            side -= 1
        return max(1, side)

    # ---- tile geometry

    def tile_hw(self, tile, h, w):
        th, tw = min(tile, h), min(tile, w)
        if self.opt.tile is None and h < tile:      # spend the unused area on the long axis
            tw = min(w, max(tw, tile * tile // max(h, 1)))
        elif self.opt.tile is None and w < tile:
            th = min(h, max(th, tile * tile // max(w, 1)))
        return th, tw

    def overlap(self, tile, exact: bool, split_overlap: int = 0) -> int:
        """The overlap of a plan at this tile size: the user's, else feather's default, and at least
        EXACT_OVERLAP for lock-step shared statistics (see there); for an encoder whose first stages alone
        run tiled, `split_overlap` (what those stages reach)."""
        if self.opt.overlap is not None:
            return self.opt.overlap
        if exact and split_overlap:
            return split_overlap
        return max(default_overlap(tile), EXACT_OVERLAP) if exact else default_overlap(tile)

    def feather_work(self, tile, h, w, exact=False) -> float:
        """The tiles' predicted time in passes: their total area over the image's."""
        th, tw = self.tile_hw(tile, h, w)
        tiles, _, _ = plan_tiles(h, w, th, tw, self.overlap(tile, exact))
        return sum((t.y[1] - t.y[0]) * (t.x[1] - t.x[0]) for t in tiles) / max(1, h * w)

    def over_budget(self, p: Plan, smallest_peak: float, budget: float):
        """No plan fits: the smallest runs, with a warning naming its expected peak and the budget that would
        hold it (never over the budget silently)."""
        if smallest_peak <= budget:
            return
        need = smallest_peak + self.budget - budget       # plus what the budget already held
        p.over_budget, p.expected_peak = True, int(need)
        log.warning(f"comfy_metal: VAE: no tile plan fits the {self.budget / 2**30:.3f} GiB budget; running the "
                    f"smallest ({MIN_TILE}px latent tiles), expected peak {need / 2**30:.3f} GiB; a budget of "
                    f"{need / HEADROOM / 2**30:.3f} GiB would hold it")

    def tile_for_budget(self, p: Plan, fn, sample, budget: int, h: int, w: int, encode=False) -> int:
        cal = self.calibrate(fn, sample, encode=encode, budget=budget)
        p.calibration = cal
        a, b = cal["a"], cal["b"]
        self.over_budget(p, a + b * min(MIN_TILE, h) * min(MIN_TILE, w), budget)
        area = max((budget * HEADROOM - a) / max(b, 1e-9), MIN_TILE * MIN_TILE)
        side = int(math.sqrt(area))
        if side >= max(h, w):
            return max(h, w)
        # one short axis: give its unused area to the other
        if h < side:
            side = max(side, int(area // h))
        elif w < side:
            side = max(side, int(area // w))
        return max(MIN_TILE, side)

    def cache_bytes_per_px(self, fn, x, encode) -> float:
        """Shared statistics' block cache: bytes per latent pixel of a tile of the largest output of the
        blocks it caches (stored in fp16/bf16), from one forward over a crop of at most 8x8 latent px."""
        c = self.codec
        f = c.scale
        side = 8 * f if encode else 8
        crop = x[..., :side, :side].to(device=c.device, dtype=c.dtype)
        area = (crop.shape[-2] // (f if encode else 1)) * (crop.shape[-1] // (f if encode else 1))
        most = [0]

        def hook(m, args, out):
            if isinstance(out, torch.Tensor):
                most[0] = max(most[0], out.numel() * 2)

        hooks = [b.register_forward_hook(hook) for b in SharedGroupNormStats._cacheable(c.module)]
        try:
            with torch.no_grad():
                fn(crop)
        finally:
            for hk in hooks:
                hk.remove()
        return 2 * most[0] / max(1, area)      # a tile's latest block + the convolutions inside the next

    def plan_shared(self, p: Plan, fn, x, budget, h, w, encode, split_overlap=0) -> int:
        """Shared statistics: the tile size and the block cache planned together. With every tile's
        latest block cached, a pass recomputes only the block holding its GroupNorm, so a decode costs
        about 1.5 plain passes (a ResNet block's first conv runs twice: once to reach norm2, once more
        after its statistics are final) whatever the number of GroupNorms; without the cache every pass
        restarts from the input. So the largest tile whose peak (cost model) plus the cache of the whole
        plan (largest cached activation x the tiles' total area, fp16) fits the budget; the cache gets
        the rest of the budget. Tiles shorter than two halos cannot be exact (plan_axis caps the overlap
        at half a tile): the search stops there."""
        cal = self.calibrate(fn, x, encode=encode, budget=budget)
        p.calibration = cal
        a, b = cal["a"], cal["b"]
        bpp = self.cache_bytes_per_px(fn, x, encode)
        usable = budget * HEADROOM
        shortest = min(max(h, w), 2 * (split_overlap or EXACT_OVERLAP)) if self.opt.overlap is None else MIN_TILE
        for side in range(max(h, w), max(MIN_TILE, shortest) - 1, -1):
            th, tw = self.tile_hw(side, h, w)
            tiles, py, px = plan_tiles(h, w, th, tw, self.overlap(side, True, split_overlap))
            tile_area = (py[0][1] - py[0][0]) * (px[0][1] - px[0][0])
            cache = bpp * sum((t.y[1] - t.y[0]) * (t.x[1] - t.x[0]) for t in tiles) if len(tiles) > 1 else 0
            if a + b * tile_area + cache * 1.1 <= usable:
                p.cache_limit = int(max(cache * 1.1, usable - a - b * tile_area))
                return side
        # not even the smallest tile with a full cache: cache what fits
        best = self.tile_for_budget(p, fn, x, int(budget * 0.75), h, w, encode=encode)
        p.cache_limit = budget // STATS_CACHE_SHARE
        log.warning(f"comfy_metal: shared statistics: the block cache of the whole image does not fit the "
                    f"{budget / 2**30:.2f} GiB budget; later passes recompute blocks (slower)")
        if self.opt.overlap is None and best < shortest:
            log.warning(f"comfy_metal: shared statistics: {best} px latent tiles hold an overlap of "
                        f"{best // 2} px, less than the {shortest // 2} px the VAE reaches: not exact")
        return best

    # ---- the decoder's head and the encoder's split

    def head_output(self, x: torch.Tensor) -> torch.Tensor:
        """A stand-in for the head's whole-latent output, for its shape and dtype (the planner runs the tail
        only on crops of it): one random pixel per channel, expanded (no whole-latent storage). The head over
        one latent pixel gives the channels."""
        c = self.codec
        with torch.no_grad(), pad_mode_for(c.device, self.opt.route_pads):
            px = c.decode_head(x[..., :1, :1].to(device=c.device, dtype=c.dtype))
        return torch.randn_like(px).expand(*px.shape[:-2], *x.shape[-2:])

    def plan_split(self, p: Plan, x: torch.Tensor, budget: int, h: int, w: int) -> int:
        """Encode: how many of the codec's encode_stages run tiled (0: all, the whole encoder per tile). The
        fewest whose untiled rest fits: the blended output of the tiled stages (fp32, on the device, held
        across the tiles; at most a quarter of the budget, so the tiles keep most of it) plus the rest's
        predicted peak within the budget. The fewer stages run tiled, the fewer GroupNorms see a tile
        instead of the image (and the fewer passes shared statistics make). The rest's cost is fitted on
        random inputs of 8x8 and 16x16 latent px, the stage's channels from one latent pixel's forward.
        Sets p.body_bytes and p.rest_peak (the rest's peak with its input)."""
        c = self.codec
        f = c.scale
        crop = x[..., :f, :f].to(device=c.device, dtype=c.dtype)
        with torch.no_grad(), pad_mode_for(c.device, self.opt.route_pads):
            outs = []
            for stage in c.encode_stages[:-1]:
                crop = stage(crop)
                outs.append(crop[..., :1, :1])
        del crop
        for split in range(1, len(c.encode_stages)):
            unit = f // c.encode_scales[split - 1]            # the stage's output pixels per latent pixel
            px = outs[split - 1]
            body_bytes = px.numel() * 4 * h * w * unit * unit
            if body_bytes > budget // STATS_CACHE_SHARE:
                continue
            cast = body_bytes * px.element_size() // 4 if c.dtype != torch.float32 else 0
            rest = chain(c.encode_stages[split:])
            if self.opt.calibrate:
                feats = torch.randn((*px.shape[:-2], min(16, h) * unit, min(16, w) * unit), device=c.device,
                                    dtype=c.dtype)
                peak = self.peak_of_area(feats, rest, area=h * w * unit * unit, unit=unit)
                del feats
            else:
                peak = 0
            need = body_bytes + cast + peak
            if need <= budget * HEADROOM:
                p.split, p.body_bytes, p.rest_peak = split, body_bytes, need
                return split
        log.info(f"comfy_metal: the VAE encoder's mid block over the whole {(h, w)} latent does not fit the "
                 f"budget; each tile runs the whole encoder")
        return 0

    def split_overlap(self, split: int) -> int:
        """Lock-step shared statistics on an encoder's first stages alone (the rest untiled): those stages are
        exact once each tile's core has a halo of their receptive radius (2-3 latent px for SD's first two
        levels, against ~10 for the whole encoder), so the overlap is twice that and the tiles cover little
        more than the image (on a 704x448 SD-width encode: 78 dB at overlap 6). 0 otherwise."""
        c = self.codec
        if not 0 < split <= len(c.encode_reach):
            return 0
        return 2 * math.ceil(c.encode_reach[split - 1] / c.scale)

    # ---- the plan

    def plan(self, x: torch.Tensor, encode: bool) -> Plan:
        c, opt = self.codec, self.opt
        f = c.scale
        h, w = (x.shape[-2] // f, x.shape[-1] // f) if encode else x.shape[-2:]
        seam = opt.seam
        whole = self.attention_fits(x, h * w)     # the whole latent in one attention (head, encoder rest)
        if not whole:
            log.warning(f"comfy_metal: VAE {'encode' if encode else 'decode'}: attention over the whole {h}x{w} "
                        f"latent would build a score matrix past MPS's 2^31-element limit (wrong results "
                        f"there); tiles of at most {self.attention_side(x)} latent px run the whole VAE")
        if c.video:
            chosen = self._video_stages(x, h, w, seam, encode)
            if chosen.scheme == STAGES:
                return chosen
            p = self._plan_encode(x, h, w, seam, whole) if encode else self._plan_decode(x, h, w, seam, whole)
            p.reason = chosen.reason or p.reason
            return p
        if encode:
            return self._plan_encode(x, h, w, seam, whole)
        return self._plan_decode(x, h, w, seam, whole)

    def _video_stages(self, x, h, w, seam, encode) -> Plan:
        """Causal 3-D video VAEs: every stage over the whole frame in bands of rows, chunk by chunk in time
        with whole-frame causal caches (causal.py), when its plan fits the budget and (seam mode auto) it is
        not predicted slower than both ComfyUI's tiled run and feather tiles. A TILES plan with only a reason
        otherwise."""
        c, opt = self.codec, self.opt
        prog = c.encode_program if encode else c.decode_program
        what = "encode" if encode else "decode"
        if prog is None or seam == FEATHER or not opt.stages or opt.tile is not None:
            why = (f"no stages for this VAE's {'encoder' if encode else 'decoder'}"
                   + (f" ({c.programs_note})" if c.programs_note else "") if prog is None else "a fixed tile size")
            return Plan(TILES, reason=f"auto: feather ({why})" if seam == AUTO else "")
        runner = prog.runner(c.device, c.dtype, self.workspace())
        sp = runner.plan(tuple(x.shape), self.budget * HEADROOM)
        if sp is None:
            why = "exact stage by stage does not fit the budget (the causal caches and two whole-frame buffers)"
            log.info(f"comfy_metal: VAE {what}: {why}; tiles instead")
            return Plan(TILES, reason=f"auto: feather ({why})" if seam == AUTO else "")
        comfy = comfy_tiled_work(c, tuple(x.shape), encode)
        reason = ""
        if seam == AUTO:
            detail = f"predicted {sp.work:.2f} passes, ComfyUI tiled {comfy:.2f}"
            if sp.work > comfy * VIDEO_AUTO_SLACK:
                feather = Plan(TILES)
                fn = c.encode if encode else (c.decode_stream or c.decode)
                tile = self.tile_for_budget(feather, fn, x, self.budget, h, w, encode=encode)
                feather_work = self.feather_work(tile, h, w)
                one_tile = self.tile_hw(tile, h, w) == (h, w)    # the same run as the stages, with more memory
                if sp.work > feather_work and not one_tile:
                    return Plan(TILES, reason=f"auto: feather ({detail}, feather {feather_work:.2f})")
                detail += f", feather {feather_work:.2f}"
            reason = f"auto: exact (stage by stage, {detail})"
        return Plan(STAGES, tile=max(h, w), tile_shape=(h, w), tiles=1, stages=sp, expected_peak=sp.peak,
                    work=sp.work, reason=reason)

    def _head(self, x, budget) -> tuple[int, bool]:
        """(predicted peak, fits) of the decoder's head over the whole latent."""
        peak = self.peak_of_area(x, self.codec.decode_head) if self.opt.calibrate else 0
        if peak > budget * HEADROOM:
            log.info(f"comfy_metal: the VAE's mid block over the whole {tuple(x.shape[-2:])} latent needs "
                     f"~{peak / 2**30:.2f} GiB, over the budget; each tile runs the whole decoder")
            return peak, False
        return peak, True

    def _plan_decode(self, x, h, w, seam, whole) -> Plan:
        c, opt = self.codec, self.opt
        budget = self.budget
        fn = c.decode_stream or c.decode
        sample, head, head_peak = x, False, 0
        if c.decode_head is not None and c.decode_tail is not None and opt.untiled_head and not c.video and whole:
            head_peak, head = self._head(x, budget)
            if head:
                sample, fn = self.head_output(x), c.decode_tail
                budget = max(budget - sample.numel() * sample.element_size(), 1)
        reason, feather = "", None
        if head and c.decode_stages and seam != FEATHER and opt.stages and opt.tile is None and opt.calibrate:
            chosen, reason, feather = self._decode_stages(sample, fn, budget, h, w, seam)
            if chosen is not None:
                chosen.head, chosen.head_peak = True, head_peak
                return chosen
        elif seam == AUTO:
            why = ("attention over the whole latent would pass MPS's 2^31-element score limit" if not whole
                   else "no whole-image stages for this decoder" if not c.decode_stages or not opt.stages
                   else "the mid block over the whole latent does not fit the budget" if not head
                   else "a fixed tile size")
            reason = f"auto: feather ({why})"
        exact = seam == EXACT
        p = self._plan_tiles(sample, fn, budget, h, w, False, exact, reason, feather=feather)
        p.head, p.head_peak = head, head_peak
        if not p.over_budget:
            p.expected_peak = self.tiles_peak(p, sample, False)
        return p

    def _decode_stages(self, sample, fn, budget, h, w, seam):
        """Exact decode of the tail stage by stage over the whole image (stagewise.py), when its plan fits the
        budget and (seam mode auto) it is not predicted slower than both ComfyUI's tiled decode and feather.
        (plan or None, auto's reason, feather's tile plan when auto measured it)."""
        c = self.codec
        sw = StagewiseDecode(c.decode_stages, c.device, c.dtype, self.workspace())
        stage_plan = sw.plan(tuple(sample.shape), budget * HEADROOM)
        if seam == AUTO:
            feather = Plan(TILES)
            tile = self.tile_for_budget(feather, fn, sample, budget, h, w)
            feather_work = self.feather_work(tile, h, w)
            comfy = comfy_tiled_work(c, tuple(sample.shape), False)
            one_tile = self.tile_hw(tile, h, w) == (h, w)
            if stage_plan is None or one_tile or (stage_plan.work > comfy and stage_plan.work > feather_work):
                why = ("one tile holds the image, exact already" if one_tile else
                       "exact does not fit the budget" if stage_plan is None else
                       f"exact's predicted time {stage_plan.work:.2f} passes > ComfyUI tiled's {comfy:.2f} and "
                       f"feather's {feather_work:.2f}")
                feather.tile = tile
                return None, f"auto: feather ({why})", feather
            reason = (f"auto: exact (predicted {stage_plan.work:.2f} passes, ComfyUI tiled {comfy:.2f}, feather "
                      f"{feather_work:.2f})")
        elif stage_plan is None:
            log.info("comfy_metal: exact decode stage by stage does not fit the budget; lock-step tiles instead")
            return None, "", None
        else:
            reason = ""
        return Plan(STAGES, tile=max(h, w), tile_shape=(h, w), tiles=1, stages=stage_plan,
                    expected_peak=int(stage_plan.peak + sample.numel() * sample.element_size()),
                    work=stage_plan.work, reason=reason), reason, None

    def _plan_encode(self, x, h, w, seam, whole) -> Plan:
        c, opt = self.codec, self.opt
        budget = self.budget
        if c.encode_body_stages and seam != FEATHER and opt.stages and opt.untiled_rest and opt.tile is None \
                and opt.calibrate \
                and not c.video and whole:
            chosen = self._encode_stages(x, budget, h, w, seam)
            if chosen.scheme == STAGES:
                return chosen
            reason = chosen.reason
        else:
            reason = ""
            if seam == AUTO:
                why = ("attention over the whole latent would pass MPS's 2^31-element score limit" if not whole
                       else "no whole-image stages for this encoder" if not c.encode_body_stages or not opt.stages
                       else "a fixed tile size")
                reason = f"auto: feather ({why})"
        fn, sample = c.encode, x
        split, body_bytes, rest_peak = 0, 0, 0
        p0 = Plan(TILES)
        if len(c.encode_stages) > 1 and opt.untiled_rest and not c.video and whole:
            split = self.plan_split(p0, x, budget, h, w)
            if split:
                fn = chain(c.encode_stages[:split])
                budget = max(budget - p0.body_bytes, 1)
                body_bytes, rest_peak = p0.body_bytes, p0.rest_peak
        exact = seam == EXACT
        p = self._plan_tiles(sample, fn, budget, h, w, True, exact, reason, split_overlap=self.split_overlap(split))
        p.split, p.body_bytes, p.rest_peak = split, body_bytes, rest_peak
        if not p.over_budget:
            p.expected_peak = self.tiles_peak(p, sample, True)
        return p

    def _encode_stages(self, x, budget, h, w, seam) -> Plan:
        """Exact encode: the down path stage by stage over the whole image (stagewise_encode.py, one pass), then
        the rest of the encoder once over its latent-resolution output, when both fit the budget. Under seam
        mode auto it is chosen whenever it fits: one pass plus band edges, where ComfyUI's and feather's
        tiles overlap. A TILES plan with only a reason when it does not fit."""
        c = self.codec
        sw = StagewiseEncode(c.encode_body_stages, c.device, c.dtype, self.workspace(), prepare=c.encode_input)
        stage_plan = sw.plan(tuple(x.shape), budget * HEADROOM)
        need = 0
        if stage_plan is not None:
            last = sw._shapes(tuple(x.shape))[-1][2]                     # the body's output (C, h, w)
            store = torch.empty(0, dtype=stage_plan.store_dtype).element_size()
            feats = torch.randn((x.shape[0], last[0], min(16, h), min(16, w)), device=c.device, dtype=c.dtype)
            need = x.shape[0] * last[0] * h * w * store + self.peak_of_area(feats, c.encode_stages[-1], area=h * w)
            del feats
        if stage_plan is None or need > budget * HEADROOM:
            why = "exact stage by stage does not fit the budget"
            log.info(f"comfy_metal: VAE encode: {why}; tiles instead")
            return Plan(TILES, reason=f"auto: feather ({why})" if seam == AUTO else "")
        reason = (f"auto: exact (stage by stage, predicted {stage_plan.work:.2f} passes, ComfyUI tiled "
                  f"{comfy_tiled_work(c, tuple(x.shape), True):.2f}; fits the budget)") if seam == AUTO else ""
        return Plan(STAGES, tile=max(h, w), tile_shape=(h, w), tiles=1, stages=stage_plan, reason=reason,
                    expected_peak=int(max(stage_plan.peak, need)), rest_peak=int(need), work=stage_plan.work)

    def _plan_tiles(self, sample, fn, budget, h, w, encode, exact, reason, split_overlap=0, feather=None) -> Plan:
        """Tiles: the size from the cost model (feather; `feather`: its tile already measured), or planned
        with lock-step shared statistics' block cache (exact)."""
        c, opt = self.codec, self.opt
        p = Plan(TILES, exact=exact, reason=reason)
        joint = exact and opt.stats_cache and opt.stats_cache_bytes is None and opt.tile is None and opt.calibrate \
            and c.module is not None and not c.video
        if opt.stats_cache_bytes is not None:          # the caller chose the cache size
            p.cache_limit, tile_budget = opt.stats_cache_bytes, budget
        elif exact and opt.stats_cache and not joint:
            p.cache_limit = budget // STATS_CACHE_SHARE
            tile_budget = budget - p.cache_limit
        else:
            tile_budget = budget
        tile = opt.tile
        if joint:
            tile = self.plan_shared(p, fn, sample, budget, h, w, encode, split_overlap)
        elif tile is None and feather is not None:
            tile, p.calibration, p.over_budget, p.expected_peak = feather.tile, feather.calibration, \
                feather.over_budget, feather.expected_peak
        elif tile is None:
            tile = self.tile_for_budget(p, fn, sample, tile_budget, h, w, encode=encode) if opt.calibrate else 64
        tile = max(1, min(int(tile), max(h, w)))
        if fn in (c.encode, c.decode, c.decode_stream) and not self.attention_fits(sample, tile * tile):
            tile = self.attention_side(sample)              # each tile runs the VAE's attention over itself
        self.set_tile(p, tile, h, w, split_overlap)
        return p

    def set_tile(self, p: Plan, tile: int, h: int, w: int, split_overlap: int | None = None):
        """p's tile size, overlap and balanced tile shape at `tile` latent px (also after an OOM halving)."""
        if split_overlap is None:
            split_overlap = self.split_overlap(p.split)
        p.tile, p.overlap = tile, self.overlap(tile, p.exact, split_overlap)
        th, tw = self.tile_hw(tile, h, w)
        tiles, py, px = plan_tiles(h, w, th, tw, p.overlap)
        p.tiles, p.tile_shape = len(tiles), (py[0][1] - py[0][0], px[0][1] - px[0][0])
        p.work = sum((t.y[1] - t.y[0]) * (t.x[1] - t.x[0]) for t in tiles) / max(1, h * w)

    def tiles_peak(self, p: Plan, x, encode) -> int:
        """The cost model's peak of a TILES plan, in the budget's terms (the output accumulator comes on
        top): the largest tile's forward (a + b * area) plus what stays resident across tiles (the
        whole-image mid output when the head ran untiled, the blended body output of an encoder's split)."""
        cal = p.calibration
        if not cal:
            return 0
        th, tw = p.tile_shape
        peak = cal["a"] + cal["b"] * th * tw
        if not encode and p.head:                # x is the head's output
            peak += x.numel() * x.element_size()
        if encode and p.split:                # the blended body output stays during the tiles
            peak += p.body_bytes
        return int(max(peak, p.head_peak, p.rest_peak))
