"""The tiling engine behind "VAE Decode (Low Memory, Metal)" and its encode counterpart.

It works on any *codec*: a small adapter with `decode(z_tile)` / `encode(x_tile)` around a VAE's own
modules (ComfyUI's VAE objects, diffusers' AutoencoderKL / AutoencoderKLWan, or a bare function), so
the core is testable without ComfyUI.

* One pass: the latent is cut into overlapping tiles (planned on the latent grid); each decoded tile
  is weighted by a separable feather mask whose weights sum to exactly 1 over every output pixel
  (complementary cosine ramps inside each overlap) and added into an fp32 accumulator by the
  `vae_blend_accumulate` kernel (Metal on MPS). No normalisation buffer, no second or third pass.
* Shared statistics (GroupNorm VAEs): all tiles advance in lock-step from one GroupNorm to the next.
  Pass k runs every tile up to GroupNorm call k (earlier calls normalised with final whole-image
  statistics), adds that call's per-group count/mean/M2 over the tile's *core* region (the cores
  partition the image, so each pixel counts once; combined in float64 with Chan's formula) and stops
  the tile; once all tiles are there, call k's statistics are final. The last pass runs to the end and
  writes the output. Finished blocks are cached per tile on the CPU so a pass recomputes only the block
  holding its GroupNorm. The GroupNorms/blocks are wrapped for the duration of the call only
  (instance-level forward override, restored in `finally`).
* Video (causal 3D VAEs: Wan 2.1 / Qwen-Image, Wan 2.2): each spatial tile is decoded chunk by
  chunk through the VAE's own decoder with its own temporal feature cache (`feat_cache`), and each
  chunk goes straight into the accumulator, so working memory is flat in the number of frames.
  HunyuanVideo 1.0 (ComfyUI's SD decoder with causal 3-D convolutions): the mid block runs over all
  latent frames of the tile, then the up path two latent frames at a time with its conv carries.
* Budget: the tile size comes from a linear cost model (peak = a + b * tile latent area) calibrated
  by measuring the peak of two small tiles on the actual device (CUDA peak allocated; elsewhere the
  live bytes of every tensor the decode allocates, tracked by a TorchDispatchMode).
* Padding: on MPS with torch < 2.15 the VAE's constant/replicate F.pad calls on 4-D/5-D tensors go
  through the `vae_pad` kernel (TorchFunctionMode, active only inside this call).
* OOM: halve the tile and redo the pass (warning); below the minimum tile, decode on the CPU with a
  clear message. The input latent is never modified.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Callable, Iterator

import torch

from ...metal_kernels.probe import MPS_MAX_SCORE_ELEMENTS
from .codecs import Codec
from .memory import auto_budget, is_oom, measure_peak
from .pad import MetalPadMode, pad_mode_for
from .plan import Tile, axis_weights, plan_tiles
from .encode_rest import EncodeRestUntiled, _chain
from .shared_stats import SharedGroupNormStats, _StopAtGroupNorm
from .stagewise import StagewiseDecode

log = logging.getLogger("comfy_metal")

# On CPU, convolutions allocate im2col/oneDNN workspaces inside the op (invisible to tensor tracking);
# measured against the process's peak RSS they add up to ~40% of the tracked tile peak.
CPU_WORKSPACE_FACTOR = 1.5
MIN_TILE = 8            # latent pixels: below this, OOM falls back to the CPU


# ---------------------------------------------------------------- the engine


# Shared statistics: the per-tile block cache's default share of the memory budget (1 / this).
STATS_CACHE_SHARE = 4
# Lock-step shared statistics cut tiles from the image: a tile is exact only where its zero padding is farther
# away than the receptive field of the decoder after the head (~12 latent px on the SD decoder). The feather
# ramp gives weight only from a quarter of the overlap inwards, so exact mode needs an overlap of at least
# this (76 dB on ComfyUI's SD VAE in the tests), not feather's 3/8 of the tile.
EXACT_OVERLAP = 16
# seam mode auto: exact when its predicted time is at most this many times feather's.
AUTO_EXACT_TIME_RATIO = 1.3


@dataclasses.dataclass
class TilingOptions:
    budget_bytes: int = 0          # 0 = auto
    tile: int | None = None        # latent pixels per side; None = from the budget
    overlap: int | None = None     # latent pixels; None = auto (tile // 4, at least 4 latent px... capped)
    shared_stats: bool | None = False   # True: exact (shared GroupNorm statistics); False: feather;
                                        # None: auto, exact when it fits and costs <= 1.3x feather's time
    stats_cache: bool = True       # shared statistics: keep finished block outputs per tile (fewer recomputes)
    stats_cache_half: bool = True  # shared statistics: the block cache in fp16/bf16 (statistics stay fp32/fp64)
    stats_cache_bytes: int | None = None   # cap on that cache (CPU memory); None = a quarter of the budget
    route_pads: bool | None = None  # None = auto (MPS, torch < 2.15)
    progress: Callable[[int, int], None] | None = None   # (done, total)
    output_device: torch.device | str | None = None       # None = compute device if it fits the budget, else CPU
    calibrate: bool = True
    cpu_fallback: bool = True
    untiled_head: bool = True      # decode: run the codec's latent-resolution head (conv_in + mid block) once
                                   # over the whole latent when it fits the budget
    untiled_tail: bool = True      # encode: tile only the encoder's first (full-resolution) stages and run the
                                   # rest (down to the mid block and conv_out) once when it fits the budget


@dataclasses.dataclass
class RunInfo:
    tile: int = 0
    overlap: int = 0
    tiles: int = 0
    tile_shape: tuple[int, int] = (0, 0)   # the first tile's (rows, cols) after balancing, latent grid
    passes: int = 0
    retries: int = 0
    cpu_fallback: bool = False
    seconds: float = 0.0
    calibration: dict = dataclasses.field(default_factory=dict)
    pads_routed: int = 0
    shared_stats: bool = False
    groupnorm_calls: int = 0
    blocks_computed: int = 0        # shared statistics: block forwards run (cache hits and skips excluded)
    stats_cache_peak: int = 0       # shared statistics: peak bytes of the block cache
    untiled_head: bool = False      # decode: conv_in + mid block ran once over the whole latent
    head_peak: int = 0              # its predicted peak bytes (0 when it did not run untiled)
    untiled_tail: bool = False      # encode: the tiles ran the encoder's first `tiled_stages` stages only; the
                                    # rest (mid block, norm_out, conv_out included) ran once over their blended
                                    # whole-image output
    tiled_stages: int = 0           # encode: how many of the codec's encode_stages ran tiled
    tail_peak: int = 0              # encode: the untiled rest's predicted peak bytes, its input included
    body_bytes: int = 0             # encode: the blended output of the tiled stages (fp32, on the device)
    expected_peak: int = 0          # the cost model's peak of the plan that ran (tiles + cache + head output)
    over_budget: bool = False       # no plan fit the budget: the smallest ran (warned, with expected_peak)
    nonfinite: int = 0              # NaN/inf values in the decoded tiles (warned once)
    scheme: str = ""                # "stages" when the exact decode ran stage by stage (stagewise.py), else ""
    bands: int = 0                  # stage-wise decode: band forwards run
    auto: str = ""                  # seam mode auto: what it chose and why (predicted times)

    @property
    def mode(self) -> str:
        """What ran, as its expected quality against the untiled decode: "exact" (one tile, or shared
        statistics on tiles cut from the whole-image mid output) or "feather, overlap N"."""
        if self.shared_stats:
            return "exact (shared statistics)" if self.untiled_head or self.untiled_tail \
                else "shared statistics (per-tile attention)"
        if self.tiles <= 1:
            return "exact (one tile)"
        return f"feather, overlap {self.overlap}"


def default_overlap(tile: int) -> int:
    """Latent pixels of overlap when the user leaves it on auto: 3/8 of the tile, up to 24. Feather-only
    tiles normalise themselves, so the overlap is what hides their differences (on a 1024^2 SDXL-width
    decode with 64 px tiles: 34.1 dB at ComfyUI's 8, 36.8 dB at 16); shared statistics need a halo of
    ~16 px (the SD decoder's receptive field) to be exact. Balanced tiles keep the cost moderate."""
    return max(2, min(tile * 3 // 8, 24))


class TiledVAE(EncodeRestUntiled):
    """Tiled decode/encode of one codec. `decode(latent)` / `encode(pixels)` return fp32 tensors on
    the output device; `info` describes the last run."""

    def __init__(self, codec: Codec, options: TilingOptions | None = None):
        self.codec = codec
        self.opt = options or TilingOptions()
        self._stats_cache_limit = 0
        self._enc_oscale, self._enc_rest = 1, None    # encode: the tiled stages' output px per latent px, the rest
        self.info = RunInfo()

    # ---- cost model

    def _measure_tile(self, fn, z: torch.Tensor) -> int:
        with measure_peak(self.codec.device) as m, torch.no_grad():
            out = fn(z)
            if isinstance(out, Iterator) or hasattr(out, "__next__"):
                for _ in out:
                    pass
            del out
        return int(m["peak"])

    def calibrate(self, fn, sample: torch.Tensor, encode: bool = False, budget: float | None = None) \
            -> tuple[float, float]:
        """(a, b) of peak = a + b * tile_area (latent pixels), from two small tiles on the device. The
        second tile is 16x16, or smaller when its peak (extrapolated from the first, 8x8) would exceed
        the budget: calibrating must not be what breaks it."""
        f = self.codec.scale if encode else 1
        h, w = sample.shape[-2] // f, sample.shape[-1] // f
        sides = [s for s in (8, 16) if s <= max(h, w) or s == 8]
        pts = []
        for s in sides:
            if pts and budget is not None:
                m1 = pts[0][1] * (CPU_WORKSPACE_FACTOR if self.codec.device.type == "cpu" else 1)
                if m1 * (s * s) / max(1, pts[0][0]) > budget * 0.85:
                    s = int(math.sqrt(budget * 0.85 / max(m1, 1) * pts[0][0]))
                    if s * s <= pts[0][0] * 1.5:
                        break
            th, tw = min(s, h), min(s, w)
            shape = list(sample.shape)
            shape[-2], shape[-1] = th * f, tw * f
            if self.codec.video and not encode and not self.codec.calibrate_all_frames:
                shape[2] = min(shape[2], 2)   # first chunk + one steady-state chunk
            z = torch.randn(shape, device=self.codec.device, dtype=self.codec.dtype)
            pts.append((th * tw, self._measure_tile(fn, z)))
        if len(pts) == 1 or pts[1][0] == pts[0][0]:
            a, b = 0.0, pts[0][1] / max(1, pts[0][0])
        else:
            (p1, m1), (p2, m2) = pts
            b = max((m2 - m1) / (p2 - p1), m2 / p2 * 0.5)
            a = max(0.0, m2 - b * p2)
        if self.codec.device.type == "cpu":
            a, b = a * CPU_WORKSPACE_FACTOR, b * CPU_WORKSPACE_FACTOR
        self.info.calibration = {"points": pts, "a": a, "b": b}
        return a, b

    def _tile_for_budget(self, fn, sample, budget: int, h: int, w: int, encode=False) -> int:
        a, b = self.calibrate(fn, sample, encode=encode, budget=budget)
        self._check_fits(a + b * min(MIN_TILE, h) * min(MIN_TILE, w), budget)
        area = max((budget * 0.85 - a) / max(b, 1e-9), MIN_TILE * MIN_TILE)
        side = int(math.sqrt(area))
        if side >= max(h, w):
            return max(h, w)
        # one short axis: give its unused area to the other
        if h < side:
            side = max(side, int(area // h))
        elif w < side:
            side = max(side, int(area // w))
        return max(MIN_TILE, side)

    def _predicted_peak(self, x, encode) -> int:
        """The cost model's peak of the planned run, in the budget's terms (the output accumulator comes
        on top): the largest tile's forward (a + b * area) plus what stays resident across tiles (the
        whole-image mid output when the head ran untiled, the shared-statistics block cache)."""
        cal = self.info.calibration
        if not cal:
            return 0
        th, tw = self.info.tile_shape
        peak = cal["a"] + cal["b"] * th * tw
        if not encode and self.info.untiled_head:
            peak += x.numel() * x.element_size()            # x is the head's output here
        if encode and self.info.untiled_tail:                # the blended body output stays during the tiles
            peak += self.info.body_bytes
        return int(max(peak, self.info.head_peak, self.info.tail_peak))

    def _check_fits(self, smallest_peak: float, budget: float):
        """No plan fits: run the smallest one, with a warning naming its expected peak and the budget that
        would hold it (never over the budget silently)."""
        if smallest_peak <= budget:
            return
        need = smallest_peak + (self.opt.budget_bytes or budget) - budget    # plus what the budget already held
        self.info.over_budget = True
        self.info.expected_peak = int(need)
        log.warning(f"comfy_metal: VAE: no tile plan fits the {(self.opt.budget_bytes or budget) / 2**30:.3f} GiB "
                    f"budget; running the smallest ({MIN_TILE}px latent tiles), expected peak "
                    f"{need / 2**30:.3f} GiB; a budget of {need / 0.85 / 2**30:.3f} GiB would hold it")

    def _tile_hw(self, tile, h, w):
        th, tw = min(tile, h), min(tile, w)
        if self.opt.tile is None and h < tile:      # spend the unused area on the long axis
            tw = min(w, max(tw, tile * tile // max(h, 1)))
        elif self.opt.tile is None and w < tile:
            th = min(h, max(th, tile * tile // max(w, 1)))
        return th, tw

    def _cache_bytes_per_px(self, fn, x, encode) -> float:
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

    def _plan_shared(self, fn, x, budget, h, w, encode) -> int:
        """Shared statistics: the tile size and the block cache planned together. With every tile's
        latest block cached, a pass recomputes only the block holding its GroupNorm, so a decode costs
        about 1.5 plain passes (a ResNet block's first conv runs twice: once to reach norm2, once more
        after its statistics are final) whatever the number of GroupNorms; without the cache every pass
        restarts from the input. So the largest tile whose peak (cost model) plus the cache of the whole
        plan (largest cached activation x the tiles' total area, fp16) fits the budget; the cache gets
        the rest of the budget."""
        a, b = self.calibrate(fn, x, encode=encode, budget=budget)
        bpp = self._cache_bytes_per_px(fn, x, encode)
        usable = budget * 0.85
        best = None
        # Tiles shorter than two halos cannot be exact (plan_axis caps the overlap at half a tile): the
        # search stops there. (It used to go down to 8 px tiles with feather's overlap, 4 px at 13 px tiles,
        # a ~1 px halo where the decoder reaches ~12: 32.7 dB at ComfyUI's tiled peak, below feather.)
        shortest = min(max(h, w), 2 * (self._encode_exact_overlap() or EXACT_OVERLAP)) \
            if self.opt.overlap is None else MIN_TILE
        for side in range(max(h, w), max(MIN_TILE, shortest) - 1, -1):
            th, tw = self._tile_hw(side, h, w)
            tiles, py, px = plan_tiles(h, w, th, tw, self._overlap(side))
            tile_area = (py[0][1] - py[0][0]) * (px[0][1] - px[0][0])
            cache = bpp * sum((t.y[1] - t.y[0]) * (t.x[1] - t.x[0]) for t in tiles) if len(tiles) > 1 else 0
            if a + b * tile_area + cache * 1.1 <= usable:
                best = side
                self._stats_cache_limit = int(max(cache * 1.1, usable - a - b * tile_area))
                break
        if best is None:                 # not even the smallest tile with a full cache: cache what fits
            best = self._tile_for_budget(fn, x, budget * 0.75, h, w, encode=encode)
            self._stats_cache_limit = budget // STATS_CACHE_SHARE
            log.warning(f"comfy_metal: shared statistics: the block cache of the whole image does not fit the "
                        f"{budget / 2**30:.2f} GiB budget; later passes recompute blocks (slower)")
            if self.opt.overlap is None and best < shortest:
                log.warning(f"comfy_metal: shared statistics: {best} px latent tiles hold an overlap of "
                            f"{best // 2} px, less than the {shortest // 2} px the VAE reaches: not exact")
        return best

    # ---- public

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        return self._run(latent, encode=False)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [N, C, H, W] or [N, C, T, H, W] in the VAE's input range, H and W multiples of scale."""
        return self._run(pixels, encode=True)

    def _run(self, x: torch.Tensor, encode: bool) -> torch.Tensor:
        c = self.codec
        fn = c.encode if encode else (c.decode_stream or c.decode)
        if fn is None:
            raise ValueError(f"the {c.name} VAE has no {'encoder' if encode else 'decoder'}")
        t_start = time.perf_counter()
        self.info = RunInfo()
        f = c.scale
        if encode:
            h, w = x.shape[-2] // f, x.shape[-1] // f
            if h * f != x.shape[-2] or w * f != x.shape[-1]:
                raise ValueError(f"encode: pixel size {tuple(x.shape[-2:])} must be a multiple of {f}")
        else:
            h, w = x.shape[-2:]
        budget = self.opt.budget_bytes or auto_budget(c.device)
        whole = self._attention_fits(x, h * w)     # the whole latent in one attention (head, encoder rest)
        if not whole:
            log.warning(f"comfy_metal: VAE {'encode' if encode else 'decode'}: attention over the whole {h}x{w} "
                        f"latent would build a score matrix past MPS's 2^31-element limit (wrong results "
                        f"there); tiles of at most {self._attention_side(x)} latent px run the whole VAE")
        if not encode and c.decode_head is not None and c.decode_tail is not None and self.opt.untiled_head \
                and not c.video and whole:
            feats = self._untiled_head(x, budget)
            if feats is not None:
                x, fn = feats, c.decode_tail
                budget = max(budget - feats.numel() * feats.element_size(), 1)
        feather_tile = None
        if not encode and self.info.untiled_head and c.decode_stages and self.opt.shared_stats is not False \
                and self.opt.tile is None and self.opt.calibrate:
            out, feather_tile = self._stagewise(x, fn, budget, h, w)
            if out is not None:
                self.info.seconds = time.perf_counter() - t_start
                return out
        elif self.opt.shared_stats is None:
            why = ("attention over the whole latent would pass MPS's 2^31-element score limit" if not whole
                   else "no whole-image stages for this encoder" if encode and not c.encode_body_stages
                   else "a fixed tile size" if encode
                   else "no whole-image stages for this decoder" if not c.decode_stages
                   else "the mid block over the whole latent does not fit the budget" if not self.info.untiled_head
                   else "a fixed tile size")
            self.info.auto = f"auto: feather ({why})"
        self._enc_oscale, self._enc_rest = 1, None
        if encode and c.encode_body_stages and self.opt.shared_stats is not False and self.opt.untiled_tail \
                and self.opt.tile is None and self.opt.calibrate and not c.video and whole:
            out = self._stagewise_encode(x, budget, h, w, CPU_WORKSPACE_FACTOR if c.device.type == "cpu" else 1.0)
            if out is not None:
                self.info.seconds = time.perf_counter() - t_start
                return out
        if encode and len(c.encode_stages) > 1 and self.opt.untiled_tail and not c.video and whole:
            split = self._plan_untiled_tail(x, budget, h, w)
            if split is not None:
                fn = _chain(c.encode_stages[:split])
                self._enc_rest = _chain(c.encode_stages[split:])
                self._enc_oscale = c.scale // c.encode_scales[split - 1]
                budget = max(budget - self.info.body_bytes, 1)
        # Shared statistics cache finished blocks per tile: the tile size and that cache are planned
        # together (`_plan_shared`); with a fixed tile, the cache gets a quarter of the budget.
        joint = self.opt.shared_stats and self.opt.stats_cache and self.opt.stats_cache_bytes is None \
            and self.opt.tile is None and self.opt.calibrate and c.module is not None and not c.video
        if self.opt.stats_cache_bytes is not None:          # the caller chose the cache size
            self._stats_cache_limit, tile_budget = self.opt.stats_cache_bytes, budget
        elif self.opt.shared_stats and self.opt.stats_cache and not joint:
            self._stats_cache_limit = budget // STATS_CACHE_SHARE
            tile_budget = budget - self._stats_cache_limit
        else:
            self._stats_cache_limit, tile_budget = 0, budget
        tile = self.opt.tile
        if joint:
            tile = self._plan_shared(fn, x, budget, h, w, encode)
        elif tile is None and feather_tile is not None:
            tile = feather_tile
        elif tile is None:
            tile = self._tile_for_budget(fn, x, tile_budget, h, w, encode=encode) if self.opt.calibrate else 64
        tile = max(1, min(int(tile), max(h, w)))
        if fn in (c.encode, c.decode, c.decode_stream) and not self._attention_fits(x, tile * tile):
            tile = self._attention_side(x)              # each tile runs the VAE's attention over itself
        device = c.device
        while True:
            try:
                out = self._pass_all(x, fn, tile, encode, device)
                break
            except Exception as e:
                if not is_oom(e):
                    raise
                e = None
                if device.type == "cpu" and tile <= MIN_TILE:
                    raise
                if tile > MIN_TILE:
                    new = max(MIN_TILE, tile // 2)
                    log.warning(f"comfy_metal: VAE {'encode' if encode else 'decode'} ran out of memory with "
                                f"{tile}px latent tiles; retrying with {new}px tiles")
                    tile = new
                    self.info.retries += 1
                    _empty_cache(device)
                    continue
                if not self.opt.cpu_fallback:
                    raise
                log.warning(f"comfy_metal: VAE {'encode' if encode else 'decode'} does not fit on {device} even "
                            f"with {tile}px latent tiles; decoding on the CPU (slow, but the latent is kept)")
                self.info.cpu_fallback = True
                device = torch.device("cpu")
                _empty_cache(c.device)
        if self.info.untiled_tail:
            try:
                out = self._run_tail(out, device)
            except Exception as e:
                if not is_oom(e):
                    raise
                e = out = None
                _empty_cache(device)
                log.warning("comfy_metal: VAE encode: the encoder's untiled rest ran out of memory; encoding again "
                            "with the whole encoder in each tile")
                retry = TiledVAE(c, dataclasses.replace(self.opt, untiled_tail=False))
                out = retry.encode(x)
                self.info = retry.info
                self.info.retries += 1
        self.info.seconds = time.perf_counter() - t_start
        return out

    def _feather_work(self, tile, h, w) -> float:
        """Feather's predicted time in plain passes of the tail: the tiles' total area over the image's."""
        th, tw = self._tile_hw(tile, h, w)
        tiles, _, _ = plan_tiles(h, w, th, tw, self._overlap(tile))
        return sum((t.y[1] - t.y[0]) * (t.x[1] - t.x[0]) for t in tiles) / max(1, h * w)

    def _stagewise(self, x, fn, budget, h, w):
        """Exact decode of the tail stage by stage over the whole image (stagewise.py), when its plan fits
        the budget and (seam mode auto) its predicted time is at most AUTO_EXACT_TIME_RATIO x feather's.
        Returns (output or None, feather's tile when auto measured it)."""
        c = self.codec
        sw = StagewiseDecode(c.decode_stages, c.device, c.dtype,
                             CPU_WORKSPACE_FACTOR if c.device.type == "cpu" else 1.0)
        plan = sw.plan(tuple(x.shape), budget * 0.85)
        feather_tile = None
        if self.opt.shared_stats is None:
            feather_tile = self._tile_for_budget(fn, x, budget, h, w)
            feather = self._feather_work(feather_tile, h, w)
            one_tile = self._tile_hw(feather_tile, h, w) == (h, w)
            if plan is None or one_tile or plan.work > AUTO_EXACT_TIME_RATIO * feather:
                why = ("one tile holds the image, exact already" if one_tile else
                       "exact does not fit the budget" if plan is None else
                       f"exact's predicted time {plan.work:.2f} passes > {AUTO_EXACT_TIME_RATIO} x feather's {feather:.2f}")
                self.info.auto = f"auto: feather ({why})"
                return None, feather_tile
            self.info.auto = (f"auto: exact (predicted {plan.work:.2f} passes, feather {feather:.2f}; "
                              f"exact when <= {AUTO_EXACT_TIME_RATIO} x feather)")
        elif plan is None:
            log.info("comfy_metal: exact decode stage by stage does not fit the budget; lock-step tiles instead")
            return None, None
        self.info.shared_stats, self.info.scheme, self.info.passes, self.info.tiles = True, "stages", 1, 1
        self.info.tile, self.info.tile_shape = max(h, w), (h, w)
        self.info.expected_peak = int(plan.peak + x.numel() * x.element_size())
        out_bytes = x.shape[0] * c.out_channels * h * w * c.scale ** 2 * 4
        try:
            with torch.no_grad(), pad_mode_for(c.device, self.opt.route_pads):
                out = sw.run(x, plan, self._out_device(c.device, out_bytes))
        except Exception as e:
            if not is_oom(e):
                raise
            e = None
            _empty_cache(c.device)
            log.warning("comfy_metal: the stage-by-stage exact decode ran out of memory; decoding in tiles")
            self.info.shared_stats, self.info.scheme = False, ""
            if self.opt.shared_stats is None:
                self.info.auto = "auto: feather (the stage-by-stage exact decode ran out of memory)"
            return None, feather_tile
        self.info.bands = sw.bands_run
        if self.opt.progress is not None:
            self.opt.progress(1, 1)
        bad = int((~torch.isfinite(out)).sum())
        if bad:
            self.info.nonfinite = bad
            log.warning(f"comfy_metal: VAE decode (stage by stage): {bad} NaN/inf values in the output (from the "
                        f"latent or the VAE's activations); they are in the output")
        return out, feather_tile

    def _attention_shape(self, x: torch.Tensor) -> tuple[int, int]:
        """(sequences, latent frames per sequence) of the VAE's attention: one head per batch item, frame by
        frame (image VAEs, Wan) or over all frames at once (HunyuanVideo 1.0)."""
        frames = x.shape[2] if self.codec.video and x.dim() == 5 else 1
        if self.codec.attention_over_frames:
            return x.shape[0], frames
        return x.shape[0] * frames, 1

    def _attention_fits(self, x: torch.Tensor, area: int) -> bool:
        """Whether the VAE's attention over `area` latent pixels a frame stays under MPS's score-matrix limit
        (ComfyUI's VAE attention builds the whole matrix when memory allows)."""
        sequences, frames = self._attention_shape(x)
        return not _score_limited(self.codec.device) or \
            sequences * (frames * area) ** 2 < MPS_MAX_SCORE_ELEMENTS

    def _attention_side(self, x: torch.Tensor) -> int:
        """The largest square tile side whose attention stays under MPS's score-matrix limit."""
        sequences, frames = self._attention_shape(x)
        side = int((MPS_MAX_SCORE_ELEMENTS / sequences) ** 0.25 / frames ** 0.5) + 1
        while side > 1 and not self._attention_fits(x, side * side):
            side -= 1
        return max(1, side)

    def _overlap(self, tile) -> int:
        """The overlap of a plan at this tile size: the user's, else feather's default, and at least
        EXACT_OVERLAP for lock-step shared statistics (see there); for an encoder whose first stages alone
        run tiled, `_encode_exact_overlap`."""
        if self.opt.overlap is not None:
            return self.opt.overlap
        if self.opt.shared_stats and self._encode_exact_overlap():
            return self._encode_exact_overlap()     # what the tiled first stages reach (the planner's floor)
        return max(default_overlap(tile), EXACT_OVERLAP) if self.opt.shared_stats else default_overlap(tile)

    def _head_peak(self, x: torch.Tensor, fn: Callable | None = None, area: int | None = None, unit: int = 1) -> int:
        """Predicted peak of the head (or `fn`, another part that runs untiled) over the whole latent:
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
            pts.append((th * tw, self._measure_tile(fn or c.decode_head, z)))
        if len(pts) == 1:
            b, q = pts[0][1] / pts[0][0], 0.0
        else:
            (a1, m1), (a2, m2) = pts
            q = max(0.0, (m2 / a2 - m1 / a1) / (a2 - a1))
            b = max(m1 / a1 - q * a1, 0.0)
        area = area or h * w
        peak = b * area + q * area * area
        if c.device.type == "cpu":
            peak *= CPU_WORKSPACE_FACTOR
        return int(peak)

    def _untiled_head(self, x: torch.Tensor, budget: int) -> torch.Tensor | None:
        """The codec's head (conv_in + mid block, attention included) over the whole latent, when its
        predicted peak fits the budget; None otherwise (each tile then runs the whole decoder)."""
        c = self.codec
        peak = self._head_peak(x) if self.opt.calibrate else 0
        if peak > budget * 0.85:
            log.info(f"comfy_metal: the VAE's mid block over the whole {tuple(x.shape[-2:])} latent needs "
                     f"~{peak / 2**30:.2f} GiB, over the budget; each tile runs the whole decoder")
            return None
        try:
            with torch.no_grad(), pad_mode_for(c.device, self.opt.route_pads):
                feats = c.decode_head(x.to(device=c.device, dtype=c.dtype))
        except Exception as e:
            if not is_oom(e):
                raise
            e = None
            _empty_cache(c.device)
            log.warning("comfy_metal: the VAE's mid block over the whole latent ran out of memory; "
                        "each tile runs the whole decoder")
            return None
        self.info.untiled_head, self.info.head_peak = True, peak
        return feats

    def _pass_all(self, x, fn, tile, encode, device):
        c = self.codec
        f = c.scale
        module_moved = False
        if device != c.device and c.module is not None:
            c.module.to(device=device, dtype=torch.float32)
            module_moved = True
        dtype = c.dtype if device == c.device else torch.float32
        try:
            h, w = (x.shape[-2] // f, x.shape[-1] // f) if encode else x.shape[-2:]
            overlap = self._overlap(tile)
            th, tw = self._tile_hw(tile, h, w)
            tiles, py, px = plan_tiles(h, w, th, tw, overlap)
            self.info.tile, self.info.overlap, self.info.tiles = tile, overlap, len(tiles)
            self.info.tile_shape = (py[0][1] - py[0][0], px[0][1] - px[0][0])
            if not self.info.over_budget:
                self.info.expected_peak = self._predicted_peak(x, encode)
            shared = None
            if self.opt.shared_stats and len(tiles) == 1:
                log.info("comfy_metal: one tile: its GroupNorm statistics are the whole image's already")
            elif self.opt.shared_stats and c.module is not None and not c.video:
                shared = SharedGroupNormStats(c.module, cache=self.opt.stats_cache,
                                              cache_limit_bytes=self._stats_cache_limit,
                                              sequential=c.sequential_blocks, half=self.opt.stats_cache_half)
                if not shared:
                    log.info("comfy_metal: the VAE has no GroupNorm; shared statistics are not needed")
                    shared = None
            self.info.shared_stats = shared is not None
            step = [0]
            # Shared statistics run one pass per GroupNorm call plus the final one: count the calls on a
            # small crop first, so the progress total is exact from the first report and never changes.
            gn_calls = self._count_groupnorm_calls(shared.modules, x, fn, encode, device, dtype) \
                if shared is not None else 0
            t0 = time.perf_counter()
            out = None
            pads = pad_mode_for(device, self.opt.route_pads)
            with contextlib.ExitStack() as stack:
                if shared is not None:
                    stack.enter_context(shared)
                stack.enter_context(torch.no_grad())
                stack.enter_context(pads)
                if shared is None:
                    acc = None
                    for tile_ in tiles:
                        acc = self._one_tile(x, fn, tile_, py, px, encode, device, dtype, acc, write=True)
                        step[0] += 1
                        self._progress(step[0], len(tiles), t0)
                    self.info.passes = 1
                    out = acc
                else:
                    out = self._lockstep(shared, x, fn, tiles, py, px, encode, device, dtype, t0, gn_calls)
            if isinstance(pads, MetalPadMode):
                self.info.pads_routed = pads.routed
            return out
        finally:
            if module_moved:
                c.module.to(device=c.device, dtype=c.dtype)

    def _count_groupnorm_calls(self, modules, x, fn, encode, device, dtype) -> int:
        """GroupNorm calls of one forward, counted on a crop of at most 8x8 latent pixels (the decoder's
        structure, not the tile size, sets the count)."""
        f = self.codec.scale
        side = 8 * f if encode else 8
        crop = x[..., :side, :side].to(device=device, dtype=dtype)
        calls = [0]

        def count(m, args):
            calls[0] += 1

        hooks = [m.register_forward_pre_hook(count) for m in modules]
        try:
            with torch.no_grad():
                out = fn(crop)
                if isinstance(out, Iterator) or hasattr(out, "__next__"):
                    for _ in out:
                        pass
                del out
        finally:
            for h in hooks:
                h.remove()
        return calls[0]

    def _lockstep(self, shared, x, fn, tiles, py, px, encode, device, dtype, t0, gn_calls):
        """Shared statistics: pass k brings every tile to GroupNorm call k (gathering its statistics over
        the tiles' cores), until a pass in which every tile runs to the end; that pass writes the output.
        Progress: `gn_calls` + 1 passes of len(tiles) steps, a total fixed before the first step."""
        k = 0
        steps = 0
        total = len(tiles) * (gn_calls + 1)
        while True:
            shared.start_pass(k)
            acc = None
            stopped = 0
            for i, tile_ in enumerate(tiles):
                shared.start_tile(tile_, i)
                try:
                    acc = self._one_tile(x, fn, tile_, py, px, encode, device, dtype, acc, write=True)
                except _StopAtGroupNorm:
                    stopped += 1
                steps += 1
                if steps < total:   # the total stays fixed even if the crop's count were short
                    self._progress(steps, total, t0)
            self.info.passes += 1
            if stopped == len(tiles):
                shared.end_pass()
                k += 1
                continue
            if stopped:
                raise RuntimeError(f"shared statistics: {stopped} of {len(tiles)} tiles called more GroupNorms "
                                   f"than the others (the decoder is not the same on every tile)")
            if k != gn_calls:
                log.warning("comfy_metal: shared statistics: %d GroupNorm calls per tile, %d on the counting crop; "
                            "the progress total was off", k, gn_calls)
            self._progress(total, total, t0)
            self.info.groupnorm_calls = k
            self.info.blocks_computed, self.info.stats_cache_peak = shared.blocks_computed, shared.peak_cache_bytes
            if shared.unmapped:
                log.warning("comfy_metal: shared statistics: %d GroupNorm inputs had an unknown layout; their "
                            "statistics include the tiles' overlaps", shared.unmapped)
            return acc

    def _progress(self, done, total, t0):
        if self.opt.progress is not None:
            self.opt.progress(done, total)
        elapsed = time.perf_counter() - t0
        if total > 1 and (done == total or done % max(1, total // 10) == 0):
            eta = elapsed / done * (total - done)
            log.info(f"comfy_metal: VAE tile {done}/{total}, {elapsed:.1f}s elapsed, ETA {eta:.1f}s")

    def _out_device(self, device, nbytes, final=False):
        if self.info.untiled_tail and not final:    # the blended body output, for the encoder's tail on `device`
            return device
        if self.opt.output_device is not None:
            return torch.device(self.opt.output_device)
        budget = self.opt.budget_bytes or auto_budget(device)
        return device if nbytes <= budget * 0.25 else torch.device("cpu")

    def _one_tile(self, x, fn, t: Tile, py, px, encode, device, dtype, acc, write: bool):
        f = self.codec.scale
        (y0, y1), (x0, x1) = t.y, t.x
        if encode:
            src = x[..., y0 * f:y1 * f, x0 * f:x1 * f]
            oscale = self._enc_oscale       # > 1 when the tiles run only the encoder's first stages
        else:
            src = x[..., y0:y1, x0:x1]
            oscale = f
        src = src.to(device=device, dtype=dtype)
        wy = axis_weights(py, t.wy_index, oscale)
        wx = axis_weights(px, t.wx_index, oscale)
        outs = fn(src)
        if not (isinstance(outs, Iterator) or hasattr(outs, "__next__")):
            outs = iter([outs])
        t_off = 0
        for chunk in outs:
            if not write:
                t_off += chunk.shape[2] if chunk.dim() == 5 else 1
                continue
            if acc is None:
                full_h, full_w = py[-1][1] * oscale, px[-1][1] * oscale
                shape = list(chunk.shape[:2])
                if chunk.dim() == 5:
                    streaming = not encode and self.codec.decode_stream is not None
                    shape.append(self.codec.frames_out(x.shape[2]) if streaming else chunk.shape[2])
                shape += [full_h, full_w]
                nbytes = math.prod(shape) * 4
                acc = torch.zeros(shape, dtype=torch.float32, device=self._out_device(device, nbytes))
            bad = int((~torch.isfinite(chunk)).sum())
            if bad:
                if not self.info.nonfinite:
                    log.warning(f"comfy_metal: VAE {'encode' if encode else 'decode'}: the tile at latent rows "
                                f"{y0}:{y1}, cols {x0}:{x1} produced {bad} NaN/inf values (the input has "
                                f"{int((~torch.isfinite(src)).sum())}); they are in the output")
                self.info.nonfinite += bad
            if chunk.shape[-2:] != (len(wy), len(wx)):
                raise RuntimeError(f"the VAE returned a tile of {tuple(chunk.shape[-2:])} pixels for a "
                                   f"{(y1 - y0, x1 - x0)} latent tile; expected {(len(wy), len(wx))}")
            if chunk.dim() == 5 and t_off + chunk.shape[2] > acc.shape[2]:
                raise RuntimeError(f"the VAE produced more frames ({t_off + chunk.shape[2]}) than expected ({acc.shape[2]})")
            from ...metal_kernels.vae import vae_blend_accumulate

            chunk = chunk.to(acc.device)
            off = (t_off, y0 * oscale, x0 * oscale) if chunk.dim() == 5 else (y0 * oscale, x0 * oscale)
            vae_blend_accumulate(acc, chunk, wy.to(acc.device), wx.to(acc.device), off)
            t_off += chunk.shape[2] if chunk.dim() == 5 else 1
            del chunk
        return acc


def _score_limited(device: torch.device) -> bool:
    """Whether attention score matrices on `device` must stay under MPS_MAX_SCORE_ELEMENTS."""
    return device.type == "mps"


def _empty_cache(device):
    import gc

    gc.collect()
    try:
        if device.type == "mps":
            torch.mps.empty_cache()
        elif device.type == "cuda":
            torch.cuda.empty_cache()
    except Exception:
        pass
