"""The engine behind "VAE Decode (Low Memory, Metal)" and its encode counterpart: it executes the planner's
plan (planner.py) for one decode or encode, and retries with the next plan when the device runs out of
memory anyway.

It works on any *codec* (codecs.py): a small adapter with `decode(z)` / `encode(x)` around a VAE's own
modules (ComfyUI's VAE objects, diffusers' AutoencoderKL / AutoencoderKLWan, or a bare function), so the
core is testable without ComfyUI.

* Untiled: the codec's own decode/encode in one call.
* Stages (exact, one pass): the whole input stage by stage in bands of rows (stagewise.py and
  stagewise_encode.py for KL VAEs, causal.py and hunyuan.py for the causal 3-D video VAEs).
* Tiles (one pass, feather): the latent is cut into overlapping tiles (tiles.py); each decoded tile is
  weighted by a separable feather mask whose weights sum to exactly 1 over every output pixel and added
  into an fp32 accumulator by the `vae_blend_accumulate` kernel (Metal on MPS).
* Tiles in lock-step (exact, GroupNorm VAEs): pass k runs every tile up to GroupNorm call k (earlier calls
  normalised with final whole-image statistics), adds that call's per-group moments over the tile's *core*
  (the cores partition the image; combined in float64) and stops the tile; the last pass writes the output.
  Finished blocks are cached per tile so a pass recomputes only the block holding its GroupNorm
  (shared_stats.py). Wrappers are on for the duration of the call only.
* Video tiles: each spatial tile is decoded chunk by chunk through the VAE's own decoder with its own
  temporal cache, each chunk straight into the accumulator, so memory is flat in the number of frames.
* Padding: on MPS with torch < 2.15 the VAE's constant/replicate F.pad calls on 4-D/5-D tensors go through
  the `vae_pad` kernel (pad.py, active only inside this call).
* Out of memory: stages fall back to tiles; tiles are halved and the pass redone (warning); below the
  minimum tile the run moves to the CPU with a clear message. The input is never modified.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Callable, Iterator

import torch

from . import planner
from .codecs import Codec
from .memory import auto_budget, is_oom
from .pad import MetalPadMode, pad_mode_for
from .planner import AUTO, FEATHER, MIN_TILE, STAGES, STATS_CACHE_SHARE, UNTILED, Plan, chain
from .shared_stats import SharedGroupNormStats, _StopAtGroupNorm
from .stagewise import StagewiseDecode
from .stagewise_encode import StagewiseEncode
from .tiles import Tile, axis_weights, plan_tiles

log = logging.getLogger("comfy_metal")


@dataclasses.dataclass
class TilingOptions:
    budget_bytes: int = 0          # 0 = auto (memory.auto_budget), resolved once per run
    tile: int | None = None        # latent pixels per side; None = from the budget
    overlap: int | None = None     # latent pixels; None = auto (planner.default_overlap)
    seam: str = FEATHER            # FEATHER: tiles, each normalising itself; EXACT: the untiled result up to
                                   # rounding (stages, else lock-step tiles); AUTO: exact when it fits and is
                                   # not predicted slower than ComfyUI's tiled decode (planner.py)
    stats_cache: bool = True       # lock-step: keep finished block outputs per tile (fewer recomputes)
    stats_cache_half: bool = True  # lock-step: the block cache in fp16/bf16 (statistics stay fp32/fp64)
    stats_cache_bytes: int | None = None   # cap on that cache (CPU memory); None = planned with the tiles
    route_pads: bool | None = None  # None = auto (MPS, torch < 2.15)
    progress: Callable[[int, int], None] | None = None   # (done, total)
    output_device: torch.device | str | None = None       # None = compute device if it fits the budget, else CPU
    calibrate: bool = True
    cpu_fallback: bool = True
    stages: bool = True            # exact: the stage-by-stage scheme when it fits (else tiles in lock-step)
    untiled_head: bool = True      # decode: run the codec's latent-resolution head (conv_in + mid block) once
                                   # over the whole latent when it fits the budget
    untiled_rest: bool = True      # encode: tile only the encoder's first (full-resolution) stages and run the
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
    shared_stats: bool = False      # GroupNorms used the whole image's statistics (stages or lock-step tiles)
    groupnorm_calls: int = 0
    blocks_computed: int = 0        # lock-step: block forwards run (cache hits and skips excluded)
    stats_cache_peak: int = 0       # lock-step: peak bytes of the block cache
    untiled_head: bool = False      # decode: conv_in + mid block ran once over the whole latent
    head_peak: int = 0              # its predicted peak bytes (0 when it did not run untiled)
    untiled_rest: bool = False      # encode: the rest of the encoder (mid block, norm_out, conv_out included)
                                    # ran once over the whole image's body output
    tiled_stages: int = 0           # encode: how many of the codec's encode_stages ran tiled
    rest_peak: int = 0              # encode: the untiled rest's predicted peak bytes, its input included
    body_bytes: int = 0             # encode: the blended output of the tiled stages (fp32, on the device)
    expected_peak: int = 0          # the cost model's peak of the plan that ran
    over_budget: bool = False       # no plan fit the budget: the smallest ran (warned, with expected_peak)
    nonfinite: int = 0              # NaN/inf values in the output (warned once)
    scheme: str = ""                # planner.UNTILED, STAGES or TILES
    bands: int = 0                  # stages: band forwards run
    auto: str = ""                  # seam mode auto: what it chose and why (predicted times)

    @property
    def mode(self) -> str:
        """What ran, as its expected quality against the untiled decode: "exact" (untiled, one tile, stages,
        or shared statistics on tiles cut from the whole-image mid output) or "feather, overlap N"."""
        if self.scheme == UNTILED:
            return "exact (untiled)"
        if self.scheme == STAGES and not self.shared_stats:
            return "exact (stage by stage)"
        if self.shared_stats:
            return "exact (shared statistics)" if self.untiled_head or self.untiled_rest \
                else "shared statistics (per-tile attention)"
        if self.tiles <= 1:
            return "exact (one tile)"
        return f"feather, overlap {self.overlap}"


class TiledVAE:
    """Decode/encode of one codec within a memory budget. `decode(latent)` / `encode(pixels)` return fp32
    tensors on the output device; `info` describes the last run."""

    def __init__(self, codec: Codec, options: TilingOptions | None = None):
        self.codec = codec
        self.opt = options or TilingOptions()
        self.budget = 0
        self._cache_limit = 0
        self._oscale = 1               # encode tiles: the tiled stages' output px per latent px
        self.info = RunInfo()

    # ---- public

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        return self._run(latent, encode=False)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [N, C, H, W] or [N, C, T, H, W] in the VAE's input range, H and W multiples of scale."""
        return self._run(pixels, encode=True)

    def _run(self, x: torch.Tensor, encode: bool) -> torch.Tensor:
        c = self.codec
        if (c.encode if encode else (c.decode_stream or c.decode)) is None:
            raise ValueError(f"the {c.name} VAE has no {'encoder' if encode else 'decoder'}")
        t_start = time.perf_counter()
        self.info = RunInfo()
        if encode and (x.shape[-2] % c.scale or x.shape[-1] % c.scale):
            raise ValueError(f"encode: pixel size {tuple(x.shape[-2:])} must be a multiple of {c.scale}")
        self.budget = int(self.opt.budget_bytes or auto_budget(c.device))
        out = self._execute(self._plan(x, encode), x, encode)
        self.info.seconds = time.perf_counter() - t_start
        return out

    def _plan(self, x, encode, options=None) -> Plan:
        return planner.plan(self.codec, x, options or self.opt, self.budget, encode)

    # ---- executing a plan

    def _record(self, p: Plan):
        i = self.info
        i.scheme, i.tile, i.overlap, i.tiles, i.tile_shape = p.scheme, p.tile, p.overlap, p.tiles, p.tile_shape
        i.calibration, i.expected_peak, i.over_budget = p.calibration, p.expected_peak, p.over_budget
        i.head_peak, i.rest_peak, i.body_bytes, i.tiled_stages = p.head_peak, p.rest_peak, p.body_bytes, p.split
        i.auto = p.reason if self.opt.seam == AUTO else i.auto

    def _execute(self, p: Plan, x: torch.Tensor, encode: bool) -> torch.Tensor:
        self._record(p)
        if p.scheme == STAGES:
            out = self._causal_stages(p, x, encode) if self.codec.video else \
                self._encode_stages(p, x) if encode else self._decode_stages(p, x)
            if out is not None:
                return out
            what = "encode" if encode else "decode"
            _empty_cache(self.codec.device)
            log.warning(f"comfy_metal: the stage-by-stage exact {what} ran out of memory; {what[:-1]}ing in tiles")
            tiles = self._plan(x, encode, dataclasses.replace(self.opt, stages=False))
            tiles.reason = f"auto: feather (the stage-by-stage exact {what} ran out of memory)" \
                if self.opt.seam == AUTO else tiles.reason
            return self._execute(tiles, x, encode)
        return self._tiles(p, x, encode)

    def _head(self, x):
        """The codec's head (conv_in + mid block, attention included) over the whole latent; None when it runs
        out of memory."""
        c = self.codec
        try:
            with torch.no_grad(), pad_mode_for(c.device, self.opt.route_pads):
                return c.decode_head(x.to(device=c.device, dtype=c.dtype))
        except Exception as e:
            if not is_oom(e):
                raise
            e = None
            _empty_cache(c.device)
            log.warning("comfy_metal: the VAE's mid block over the whole latent ran out of memory; "
                        "each tile runs the whole decoder")
            return None

    def _decode_stages(self, p: Plan, x):
        """The KL decoder's tail stage by stage over the whole image after its head (stagewise.py); None when it
        runs out of memory (the caller plans tiles)."""
        c = self.codec
        h, w = x.shape[-2:]
        feats = self._head(x)
        if feats is None:
            return None
        self.info.untiled_head = True
        sw = StagewiseDecode(c.decode_stages, c.device, c.dtype, planner.workspace_factor(c.device))
        out_bytes = x.shape[0] * c.out_channels * h * w * c.scale ** 2 * 4
        try:
            with torch.no_grad(), pad_mode_for(c.device, self.opt.route_pads):
                out = sw.run(feats, p.stages, self._out_device(c.device, out_bytes))
        except Exception as e:
            if not is_oom(e):
                raise
            e = feats = None
            self.info.untiled_head = False
            return None
        self.info.shared_stats, self.info.passes, self.info.bands = True, 1, sw.bands_run
        return self._finish(out, "decode (stage by stage)")

    def _encode_stages(self, p: Plan, x):
        """The KL encoder's down path stage by stage over the whole image (stagewise_encode.py), then the rest of
        the encoder once over its latent-resolution output; None when it runs out of memory."""
        c = self.codec
        sw = StagewiseEncode(c.encode_body_stages, c.device, c.dtype, planner.workspace_factor(c.device),
                             prepare=c.encode_input)
        try:
            with torch.no_grad(), pad_mode_for(c.device, self.opt.route_pads):
                feats = sw.run(x, p.stages)
                z = c.encode_stages[-1](feats.to(c.dtype))
        except Exception as e:
            if not is_oom(e):
                raise
            e = feats = None
            return None
        del feats
        i = self.info
        i.shared_stats, i.passes, i.bands, i.untiled_rest = True, 1, sw.bands_run, True
        z = z.to(device=self._out_device(c.device, z.numel() * 4, final=True), dtype=torch.float32)
        return self._finish(z, "encode (stage by stage)")

    def _causal_stages(self, p: Plan, x, encode):
        """A causal 3-D video VAE stage by stage over the whole frame (causal.py); None when it runs out of
        memory (the caller plans tiles)."""
        c = self.codec
        prog = c.encode_program if encode else c.decode_program
        runner = prog.runner(c.device, c.dtype, planner.workspace_factor(c.device), prepare=c.encode_input)
        try:
            with torch.no_grad():
                if encode:
                    out = runner.run(x, p.stages)
                    out = out.to(self._out_device(c.device, out.numel() * 4, final=True))
                else:
                    n, _, t, h, w = x.shape
                    shape = (n, c.out_channels, prog.out_frames(t), h * c.scale, w * c.scale)
                    out = torch.empty(shape, dtype=torch.float32, device=self._out_device(c.device,
                                                                                          math.prod(shape) * 4))
                    runner.run(x, p.stages, out=out)
        except Exception as e:
            if not is_oom(e):
                raise
            e = out = None
            return None
        self.info.passes, self.info.bands = 1, runner.bands_run
        return self._finish(out, f"{'encode' if encode else 'decode'} (stage by stage)",
                            bad=None if encode else runner.nonfinite)

    def _finish(self, out, what, bad=None):
        """The stage schemes' end: progress done, NaN/inf in the output (`bad` when counted already) warned."""
        if self.opt.progress is not None:
            self.opt.progress(1, 1)
        bad = _nonfinite(out) if bad is None else bad
        if bad:
            self.info.nonfinite = bad
            log.warning(f"comfy_metal: VAE {what}: {bad} NaN/inf values in the output (from the input or the "
                        f"VAE's activations); they are in the output")
        return out

    def _tiles(self, p: Plan, x: torch.Tensor, encode: bool) -> torch.Tensor:
        c = self.codec
        fn = c.encode if encode else (c.decode_stream or c.decode)
        h, w = (x.shape[-2] // c.scale, x.shape[-1] // c.scale) if encode else x.shape[-2:]
        src = x
        if p.head:
            feats = self._head(x)
            if feats is None:
                return self._execute(self._plan(x, encode, dataclasses.replace(self.opt, untiled_head=False)),
                                     x, encode)
            src, fn = feats, c.decode_tail
            self.info.untiled_head = True
        rest = None
        self._oscale = 1
        if encode and p.split:
            fn, rest = chain(c.encode_stages[:p.split]), chain(c.encode_stages[p.split:])
            self._oscale = c.scale // c.encode_scales[p.split - 1]
            self.info.untiled_rest = True
        self._cache_limit = p.cache_limit
        tile = p.tile
        device = c.device
        plans = planner.Planner(c, self.opt, self.budget)
        while True:
            try:
                out = self._pass_all(src, fn, p, encode, device)
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
                    plans.set_tile(p, tile, h, w)
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
        if rest is None:
            return out
        try:
            return self._run_rest(rest, out, device)
        except Exception as e:
            if not is_oom(e):
                raise
            e = out = None
            _empty_cache(device)
            log.warning("comfy_metal: VAE encode: the encoder's untiled rest ran out of memory; encoding again "
                        "with the whole encoder in each tile")
            retries = self.info.retries + 1
            self.info = RunInfo()
            out = self._execute(self._plan(x, True, dataclasses.replace(self.opt, untiled_rest=False)), x, True)
            self.info.retries += retries
            return out

    def _run_rest(self, rest, feats: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Encode: the untiled rest of the encoder (down to the mid block, conv_out and the posterior's mode)
        over the blended whole-image output of the tiled stages -> the latent (fp32, on the output device).
        On the device the tiles ran on (the CPU after a fallback, the module moved there)."""
        c = self.codec
        moved = device != c.device and c.module is not None
        if moved:
            c.module.to(device=device, dtype=torch.float32)
        try:
            with torch.no_grad(), pad_mode_for(device, self.opt.route_pads):
                z = rest(feats.to(device=device, dtype=c.dtype if device == c.device else torch.float32))
        finally:
            if moved:
                c.module.to(device=c.device, dtype=c.dtype)
        del feats
        return z.to(device=self._out_device(device, z.numel() * 4, final=True), dtype=torch.float32)

    def _pass_all(self, x, fn, p: Plan, encode, device):
        c = self.codec
        f = c.scale
        module_moved = False
        if device != c.device and c.module is not None:
            c.module.to(device=device, dtype=torch.float32)
            module_moved = True
        dtype = c.dtype if device == c.device else torch.float32
        try:
            h, w = (x.shape[-2] // f, x.shape[-1] // f) if encode else x.shape[-2:]
            th, tw = planner.Planner(c, self.opt, self.budget).tile_hw(p.tile, h, w)
            tiles, py, px = plan_tiles(h, w, th, tw, p.overlap)
            self.info.tile, self.info.overlap, self.info.tiles = p.tile, p.overlap, len(tiles)
            self.info.tile_shape = (py[0][1] - py[0][0], px[0][1] - px[0][0])
            shared = None
            if p.exact and len(tiles) == 1:
                log.info("comfy_metal: one tile: its GroupNorm statistics are the whole image's already")
            elif p.exact and c.module is not None and not c.video:
                shared = SharedGroupNormStats(c.module, cache=self.opt.stats_cache,
                                              cache_limit_bytes=self._cache_limit,
                                              sequential=c.sequential_blocks, half=self.opt.stats_cache_half)
                if not shared:
                    log.info("comfy_metal: the VAE has no GroupNorm; shared statistics are not needed")
                    shared = None
            self.info.shared_stats = shared is not None
            # Shared statistics run one pass per GroupNorm call plus the final one: count the calls on a
            # small crop first, so the progress total is exact from the first report and never changes.
            gn_calls = self._count_groupnorm_calls(shared.modules, x, fn, encode, device, dtype) \
                if shared is not None else 0
            t0 = time.perf_counter()
            pads = pad_mode_for(device, self.opt.route_pads)
            with contextlib.ExitStack() as stack:
                if shared is not None:
                    stack.enter_context(shared)
                stack.enter_context(torch.no_grad())
                stack.enter_context(pads)
                if shared is None:
                    acc = None
                    for k, tile_ in enumerate(tiles):
                        acc = self._one_tile(x, fn, tile_, py, px, encode, device, dtype, acc, write=True)
                        self._progress(k + 1, len(tiles), t0)
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
        if self.info.untiled_rest and not final:    # the blended body output, for the encoder's rest on `device`
            return device
        if self.opt.output_device is not None:
            return torch.device(self.opt.output_device)
        return device if nbytes <= self.budget / STATS_CACHE_SHARE else torch.device("cpu")

    def _one_tile(self, x, fn, t: Tile, py, px, encode, device, dtype, acc, write: bool):
        f = self.codec.scale
        (y0, y1), (x0, x1) = t.y, t.x
        if encode:
            src = x[..., y0 * f:y1 * f, x0 * f:x1 * f]
            oscale = self._oscale           # > 1 when the tiles run only the encoder's first stages
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


def _nonfinite(t: torch.Tensor, chunk: int = 1 << 22) -> int:
    """NaN/inf values in t, counted a chunk at a time (no output-sized temporaries)."""
    flat = t.reshape(-1) if t.is_contiguous() else t.flatten()
    return sum(int(piece.isfinite().logical_not_().sum()) for piece in flat.split(chunk))


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
