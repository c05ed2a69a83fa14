"""Encode through the rest of the encoder untiled: the engine's part for image KL encoders whose codec gives
`encode_stages` (codecs.py). The tiles run only the encoder's first stages -- its full-resolution down
levels, whose activations are what needs tiling -- blended at their output resolution into one buffer,
and the rest (the lower levels, the mid block with its global attention, norm_out, conv_out, quant_conv,
the posterior's mode) runs once over that buffer, so the attention and every later GroupNorm see the
whole image. `TiledVAE` (engine.py) mixes this in."""
from __future__ import annotations

import logging
import math

import torch

from .memory import is_oom
from .pad import pad_mode_for
from .stagewise_encode import StagewiseEncode

log = logging.getLogger("comfy_metal")


class EncodeRestUntiled:
    """Methods of TiledVAE for the encode split (they use its codec, options, info and cost model)."""

    def _encode_exact_overlap(self) -> int:
        """Lock-step shared statistics on an encoder's first stages alone (the rest untiled): those stages are
        exact once each tile's core has a halo of their receptive radius (2-3 latent px for SD's first two
        levels, against ~10 for the whole encoder), so the overlap is twice that and the tiles cover little
        more than the image (on a 704x448 SD-width encode: 78 dB at overlap 6). 0 otherwise."""
        c, split = self.codec, self.info.tiled_stages
        if self._enc_rest is None or not 0 < split <= len(c.encode_reach):
            return 0
        return 2 * math.ceil(c.encode_reach[split - 1] / c.scale)

    def _plan_untiled_tail(self, x: torch.Tensor, budget: int, h: int, w: int) -> int | None:
        """Encode: how many of the codec's encode_stages run tiled (None: all, the whole encoder per tile).
        The fewest whose untiled rest fits: the blended output of the tiled stages (fp32, on the device,
        held across the tiles; at most a quarter of the budget, so the tiles keep most of it) plus the rest's
        predicted peak within the budget. The fewer stages run tiled, the fewer GroupNorms see a tile
        instead of the image (and the fewer passes shared statistics make). The rest's cost is fitted on
        random inputs of 8x8 and 16x16 latent px, the stage's channels from one latent pixel's forward.
        Sets info.untiled_tail, tiled_stages, body_bytes and tail_peak (the rest's peak with its input)."""
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
            if body_bytes > budget // 4:
                continue
            cast = body_bytes * px.element_size() // 4 if c.dtype != torch.float32 else 0
            rest = _chain(c.encode_stages[split:])
            if self.opt.calibrate:
                feats = torch.randn((*px.shape[:-2], min(16, h) * unit, min(16, w) * unit), device=c.device, dtype=c.dtype)
                peak = self._head_peak(feats, rest, area=h * w * unit * unit, unit=unit)
                del feats
            else:
                peak = 0
            need = body_bytes + cast + peak
            if need <= budget * 0.85:
                self.info.untiled_tail, self.info.tiled_stages = True, split
                self.info.body_bytes, self.info.tail_peak = body_bytes, need
                return split
        log.info(f"comfy_metal: the VAE encoder's mid block over the whole {(h, w)} latent does not fit the "
                 f"budget; each tile runs the whole encoder")
        return None

    def _stagewise_encode(self, x: torch.Tensor, budget: int, h: int, w: int, workspace: float):
        """Exact encode: the down path stage by stage over the whole image (stagewise_encode.py, one pass),
        then the rest of the encoder once over its latent-resolution output, when both fit the budget.
        Under seam mode auto it is chosen whenever it fits: one pass plus band edges, where feather's tiles
        overlap. Returns the latent, or None (the tiled paths run)."""
        c = self.codec
        sw = StagewiseEncode(c.encode_body_stages, c.device, c.dtype, workspace, prepare=c.encode_input)
        plan = sw.plan(tuple(x.shape), budget * 0.85)
        need = 0
        if plan is not None:
            last = sw._shapes(tuple(x.shape))[-1][2]                     # the body's output (C, h, w)
            store = torch.empty(0, dtype=plan.store_dtype).element_size()
            feats = torch.randn((x.shape[0], last[0], min(16, h), min(16, w)), device=c.device, dtype=c.dtype)
            need = x.shape[0] * last[0] * h * w * store + self._head_peak(feats, c.encode_stages[-1], area=h * w)
            del feats
        if plan is None or need > budget * 0.85:
            why = "exact stage by stage does not fit the budget"
            if self.opt.shared_stats is None:
                self.info.auto = f"auto: feather ({why})"
            log.info(f"comfy_metal: VAE encode: {why}; tiles instead")
            return None
        if self.opt.shared_stats is None:
            self.info.auto = (f"auto: exact (stage by stage, predicted {plan.work:.2f} passes; fits the budget, "
                              f"where feather's tiles overlap)")
        try:
            with torch.no_grad(), pad_mode_for(c.device, self.opt.route_pads):
                feats = sw.run(x, plan)
                z = c.encode_stages[-1](feats.to(c.dtype))
        except Exception as e:
            if not is_oom(e):
                raise
            e = feats = None
            log.warning("comfy_metal: the stage-by-stage exact encode ran out of memory; encoding in tiles")
            self.info.auto = "auto: feather (the stage-by-stage exact encode ran out of memory)" \
                if self.opt.shared_stats is None else ""
            return None
        del feats
        info = self.info
        info.shared_stats, info.scheme, info.passes, info.tiles = True, "stages", 1, 1
        info.tile, info.tile_shape, info.bands = max(h, w), (h, w), sw.bands_run
        info.untiled_tail = True
        info.expected_peak = int(max(plan.peak, need))
        bad = int((~torch.isfinite(z)).sum())
        if bad:
            info.nonfinite = bad
            log.warning(f"comfy_metal: VAE encode (stage by stage): {bad} NaN/inf values in the latent; they are "
                        f"in the output")
        if self.opt.progress is not None:
            self.opt.progress(1, 1)
        return z.to(device=self._out_device(c.device, z.numel() * 4, final=True), dtype=torch.float32)

    def _run_tail(self, feats: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Encode: the untiled rest of the encoder (down to the mid block, conv_out and the posterior's mode)
        over the blended whole-image output of the tiled stages -> the latent (fp32, on the output device).
        On the device the tiles ran on (the CPU after a fallback, the module moved there)."""
        c = self.codec
        moved = device != c.device and c.module is not None
        if moved:
            c.module.to(device=device, dtype=torch.float32)
        try:
            with torch.no_grad(), pad_mode_for(device, self.opt.route_pads):
                z = self._enc_rest(feats.to(device=device, dtype=c.dtype if device == c.device else torch.float32))
        finally:
            if moved:
                c.module.to(device=c.device, dtype=c.dtype)
        del feats
        return z.to(device=self._out_device(device, z.numel() * 4, final=True), dtype=torch.float32)



def _chain(stages):
    """One function running `stages` in order."""
    def run(x):
        for stage in stages:
            x = stage(x)
        return x
    return run
