"""Shared GroupNorm statistics: every tile normalised with the whole image's per-group statistics, the
tiles advancing in lock-step from one GroupNorm to the next (see engine.py)."""
from __future__ import annotations

import torch

from .tiles import Tile

# ---------------------------------------------------------------- shared GroupNorm statistics


def _piece_moments(x: torch.Tensor, groups: int):
    """(mean, population variance) per (sample, group) of one piece, fp32 [N, groups]. On the CPU and CUDA through
    torch's fused GroupNorm kernel (its statistics pass; with eps 0, var = 1 / rstd^2): one read of the piece,
    ~10x faster on the CPU than the two-pass formula with its temporaries, which serves the other devices."""
    if x.device.type in ("cpu", "cuda"):
        v = x.float().contiguous()
        n, c = v.shape[0], v.shape[1]
        _, mean, rstd = torch.ops.aten.native_group_norm(v, None, None, n, c, v.numel() // max(1, n * c), groups, 0.0)
        return mean.reshape(n, groups), rstd.reshape(n, groups).pow(-2)
    v = x.reshape(x.shape[0], groups, -1).float()
    mean = v.mean(-1)
    return mean, ((v - mean[..., None]) ** 2).mean(-1)


class GroupMoments:
    """Per-(sample, group) count / mean / M2 of an activation seen in pieces: each piece reduced in fp32,
    the pieces combined in float64 with Chan's formula (exact up to fp32 rounding inside a piece).
    `final()` is [n, mean, m2] (float64 [N, groups]) for `group_norm_with`, or None if nothing was added."""

    def __init__(self):
        self.stats: list | None = None

    def add(self, x: torch.Tensor, groups: int | None):
        if groups is None:
            return
        n_b = x.numel() // max(1, x.shape[0] * groups)
        if n_b == 0:
            return
        mean_f, var_f = _piece_moments(x, groups)
        m2_b = (var_f.cpu().double() * n_b)                              # (MPS has no float64)
        mean_b = mean_f.cpu().double()
        if self.stats is None:
            self.stats = [n_b, mean_b, m2_b]
            return
        n_a, mean_a, m2_a = self.stats
        n = n_a + n_b
        delta = mean_b - mean_a
        self.stats = [n, mean_a + delta * (n_b / n), m2_a + m2_b + delta * delta * (n_a * n_b / n)]

    def final(self):
        return self.stats


def group_norm_with(m: torch.nn.GroupNorm, x: torch.Tensor, stats) -> torch.Tensor:
    """GroupNorm `m` of x with the given [n, mean, m2] statistics, as one per-channel scale and shift (fp32)."""
    n, mean, m2 = stats
    g = m.num_groups
    c = x.shape[1]
    rstd = torch.rsqrt((m2 / n).float() + m.eps).to(x.device)            # [N, g]
    scale = rstd.repeat_interleave(c // g, dim=1)                        # [N, C]
    shift = -mean.float().to(x.device).repeat_interleave(c // g, dim=1) * scale
    if m.affine and m.weight is not None:
        w = m.weight.to(device=x.device, dtype=torch.float32)
        scale = scale * w
        shift = shift * w + m.bias.to(device=x.device, dtype=torch.float32)
    view = (x.shape[0], c) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.view(view), x.float(), scale.view(view)).to(x.dtype)


class _StopAtGroupNorm(Exception):
    """Raised inside a tile's forward when it reaches the GroupNorm whose statistics are being gathered."""


class SharedGroupNormStats:
    """Exact shared GroupNorm statistics: all tiles advance in lock-step from one GroupNorm to the next.

    The GroupNorm calls of a decode are numbered in call order (0 .. L-1, the same for every tile).
    Pass k runs every tile from its input: calls < k normalise with the final whole-image statistics,
    call k adds the per-group count / mean / M2 of the tile's *core* region (the cores partition the
    output, mapped to the call's resolution; fp32 per tile, combined across tiles in float64 with
    Chan's formula) and stops the tile (`_StopAtGroupNorm`). When every tile has reached call k its
    statistics are final. Pass L runs to the end (all calls use final statistics) and writes the output.
    So the statistics every GroupNorm uses are those of the untiled activations up to the halo: a
    tile's core is exact when the overlap covers the decoder's receptive field (attention in the mid
    block sees only its tile, the remaining difference).

    Restarting from the input costs up to L passes; `cache` keeps, per tile, the outputs of the
    blocks that own a GroupNorm (and of the GroupNorm-free layers between them) once they are final,
    on `cache_device`, so pass k recomputes only the block holding call k. `sequential` (decoders
    that are a plain chain of those blocks, as the SD/SDXL/Flux KL decoders are) keeps only each
    tile's latest finished block: earlier blocks, whose outputs only fed it, are skipped (they return
    zeros of their recorded shape, which the cached block ignores), so the cache holds one activation
    per tile instead of all of them. Within `with` every torch.nn.GroupNorm (and every cached block)
    under `root` gets an instance-level `forward`, removed on exit."""

    def __init__(self, root: torch.nn.Module, cache: bool = True, cache_device="cpu",
                 cache_limit_bytes: int | None = None, sequential: bool = False, half: bool = True):
        self.half = half
        self.modules = [m for m in root.modules() if isinstance(m, torch.nn.GroupNorm)]
        self.blocks = self._cacheable(root) if cache else []
        self.cache_device = torch.device(cache_device)
        self.cache_limit = cache_limit_bytes
        self.cache_bytes = 0
        self.peak_cache_bytes = 0
        self.sequential = sequential
        self.latest: dict = {}               # sequential: tile -> (block call number, cache key) of its cached output
        self.block_meta: dict = {}           # (tile, block call number) -> (shape, dtype, device, gn calls, hw)
        self.blocks_computed = 0             # block calls that ran (not served by the cache or skipped)
        self._block_no = 0
        self.final: list[list] = []          # per call index: [n, mean (float64), m2 (float64)], finished
        self.pending: list | None = None     # statistics being gathered for call `target`
        self.target = 0                      # the call index pass k gathers; None = final pass
        self.core = None                     # ((y0, y1), (x0, x1), (tile_h, tile_w)) latent grid
        self.tile_key = None
        self.cache: dict = {}                # (tile, id(block), occurrence) -> (output, gn calls inside)
        self._gn_idx = 0
        self._occ: dict[int, int] = {}
        self._last_hw = None
        self._saved = []
        self.unmapped = 0                    # 3-D GroupNorm inputs whose layout was not recognised
        self.inner: dict = {}                # (tile, block call number, id(leaf)) -> (output, dtype): see _inner_forward
        self.inner_bytes = 0
        self._cur_block = -1

    def __bool__(self):
        return bool(self.modules)

    @staticmethod
    def _cacheable(root):
        """An antichain of modules whose outputs can be cached: modules owning a GroupNorm child, and
        parameterised GroupNorm-free modules next to them (convs, upsamplers)."""
        gn = torch.nn.GroupNorm
        has_gn = {}

        def contains(m):
            k = id(m)
            if k not in has_gn:
                has_gn[k] = isinstance(m, gn) or any(contains(c) for c in m.children())
            return has_gn[k]

        out = []

        def walk(m):
            for c in m.children():
                if isinstance(c, gn):
                    continue
                if isinstance(c, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                    walk(c)
                elif any(isinstance(g, gn) for g in c.children()) and \
                        not any(contains(g) for g in c.children() if not isinstance(g, gn)):
                    out.append(c)
                elif not contains(c):
                    if any(True for _ in c.parameters()):
                        out.append(c)
                else:
                    walk(c)

        walk(root)
        return out

    def __enter__(self):
        for m in self.modules:
            self._wrap(m, self._gn_forward)
        for b in self.blocks:
            self._wrap(b, self._block_forward)
        if self.sequential:
            for b in self.blocks:
                for leaf in self._inner_leaves(b):
                    self._wrap(leaf, self._inner_forward)
        return self

    @staticmethod
    def _inner_leaves(block):
        """The parameterised GroupNorm-free leaves inside a block owning GroupNorms (a ResNet block's
        convolutions): their outputs are cached within the block (`_inner_forward`)."""
        if not any(isinstance(c, torch.nn.GroupNorm) for c in block.children()):
            return []
        return [m for m in block.modules() if m is not block and not any(True for _ in m.children())
                and not isinstance(m, torch.nn.GroupNorm) and any(True for _ in m.parameters(recurse=False))]

    def _inner_forward(self, m, original):
        """Inside the block whose GroupNorm is being gathered, the layers before that GroupNorm are final
        (earlier GroupNorms use final statistics) and are recomputed on the next pass only to reach it
        again. So the output of each convolution inside the block is kept for the tile (one block's worth,
        dropped once the block itself is cached): a ResNet block's conv1 then runs once, not twice, and a
        shared-statistics decode does each convolution once, as one plain pass does; only the GroupNorms
        and activations between them run again (elementwise, cheap)."""
        def forward(*args, **kwargs):
            key = (self.tile_key, self._cur_block, id(m))
            hit = self.inner.get(key)
            if hit is not None:
                out, dtype = hit
                return out.to(args[0].device if args and isinstance(args[0], torch.Tensor) else out.device,
                              dtype=dtype, copy=True)
            out = original(*args, **kwargs)
            if self.target is not None and isinstance(out, torch.Tensor):
                cdt = self._cache_dtype(out)
                nbytes = out.numel() * torch.empty(0, dtype=cdt).element_size()
                if self.cache_limit is not None and self.cache_bytes + self.inner_bytes + nbytes > self.cache_limit:
                    return out                               # over the limit: the next pass recomputes it
                self.inner[key] = (out.to(self.cache_device, dtype=cdt, copy=True), out.dtype)
                self.inner_bytes += nbytes
                self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache_bytes + self.inner_bytes)
            return out
        return forward

    def _drop_inner(self, tile_key):
        for k in [k for k in self.inner if k[0] == tile_key]:
            out, _ = self.inner.pop(k)
            self.inner_bytes -= out.numel() * out.element_size()

    def _wrap(self, m, maker):
        had = "forward" in m.__dict__
        self._saved.append((m, had, m.__dict__.get("forward")))
        m.forward = maker(m, m.forward)

    def __exit__(self, *exc):
        for m, had, fwd in reversed(self._saved):
            if had:
                m.forward = fwd
            else:
                m.__dict__.pop("forward", None)
        self._saved.clear()
        self.cache.clear()
        self.inner.clear()
        self.inner_bytes = 0
        self.latest.clear()
        self.block_meta.clear()
        self.cache_bytes = 0
        return False

    # ---- driven by the engine

    def start_pass(self, target: int | None):
        """Pass gathering call `target` (None: the final pass, everything normalised with final stats)."""
        self.target = target
        self.pending = None

    def end_pass(self):
        """All tiles reached call `target`: its statistics are final."""
        if self.pending is None:
            raise RuntimeError("shared statistics: no tile reached GroupNorm call %s" % self.target)
        self.final.append(self.pending)
        self.pending = None

    def start_tile(self, tile: Tile, key):
        self.core = (tile.core_y, tile.core_x, (tile.y[1] - tile.y[0], tile.x[1] - tile.x[0]))
        self.tile_key = key
        self._block_no = 0
        self._cur_block = -1
        self._gn_idx = 0
        self._occ.clear()
        self._last_hw = None

    # ---- wrappers

    def _block_forward(self, m, original):
        def forward(*args, **kwargs):
            occ = self._occ.get(id(m), 0)
            self._occ[id(m)] = occ + 1
            no = self._block_no
            self._block_no += 1
            key = (self.tile_key, id(m), occ)
            if self.sequential and self.latest.get(self.tile_key, (-1, None))[0] > no:
                # a later block of this tile is cached: this block's output only fed it
                shape, dtype, device, n_gn, hw = self.block_meta[(self.tile_key, no)]
                self._gn_idx += n_gn
                if hw is not None:
                    self._last_hw = hw
                return torch.zeros(shape, dtype=dtype, device=device)
            hit = self.cache.get(key)
            if hit is not None:
                out, n_gn, hw, dev, dtype = hit
                self._gn_idx += n_gn
                if hw is not None:
                    self._last_hw = hw
                return out.to(dev, dtype=dtype, copy=True)     # a copy: the caller may work in place
            start = self._gn_idx
            self._cur_block = no
            out = original(*args, **kwargs)        # may raise _StopAtGroupNorm: nothing cached then
            self._cur_block = -1
            self.blocks_computed += 1
            if self.target is not None and isinstance(out, torch.Tensor):
                n_gn = self._gn_idx - start
                self.block_meta[(self.tile_key, no)] = (out.shape, out.dtype, out.device, n_gn, self._last_hw)
                self._store(key, no, out, n_gn)
                if self.inner:
                    self._drop_inner(self.tile_key)
            return out
        return forward

    def _cache_dtype(self, out: torch.Tensor) -> torch.dtype:
        """The block cache holds fp32 activations in fp16 (half the bytes; ~2^-11 relative rounding, well
        under the 45 dB floor) or in bf16 when a value is out of fp16's range (the SDXL VAE's
        activations are); the statistics themselves stay fp32/fp64."""
        if out.dtype != torch.float32 or not self.half:
            return out.dtype
        amax = out.abs().max().item() if out.numel() else 0.0
        return torch.float16 if amax < 60000.0 else torch.bfloat16

    def _store(self, key, no, out, n_gn):
        cdt = self._cache_dtype(out)
        nbytes = out.numel() * torch.empty(0, dtype=cdt).element_size()
        previous = self.latest.get(self.tile_key) if self.sequential else None
        freed = 0
        if previous is not None:
            freed = self.cache[previous[1]][0].numel() * self.cache[previous[1]][0].element_size()
        if self.cache_limit is not None and self.cache_bytes + self.inner_bytes - freed + nbytes > self.cache_limit:
            return                                   # over the limit: later passes recompute this block
        if previous is not None:
            del self.cache[previous[1]]
            self.cache_bytes -= freed
        self.cache[key] = (out.to(self.cache_device, dtype=cdt, copy=True), n_gn, self._last_hw, out.device,
                           out.dtype)
        self.cache_bytes += nbytes
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache_bytes)
        if self.sequential:
            self.latest[self.tile_key] = (no, key)

    def _gn_forward(self, m, original):
        def forward(x, *args, **kwargs):
            idx = self._gn_idx
            self._gn_idx += 1
            if x.dim() >= 4:
                self._last_hw = tuple(x.shape[-2:])
            if self.target is not None and idx == self.target:
                self._gather(m, x)
                raise _StopAtGroupNorm()
            if idx < len(self.final):
                return self._apply(m, x, self.final[idx])
            raise RuntimeError(f"shared statistics: GroupNorm call {idx} has no statistics yet "
                               f"(the decoder called its GroupNorms in a different order for this tile)")
        return forward

    def _region(self, x: torch.Tensor) -> torch.Tensor:
        (cy0, cy1), (cx0, cx1), (th, tw) = self.core
        if x.dim() == 3:
            # [N, C, h*w] (e.g. diffusers' attention group_norm): the layout of the last 4-D call
            if self._last_hw is not None and self._last_hw[0] * self._last_hw[1] == x.shape[-1]:
                x = x.reshape(*x.shape[:2], *self._last_hw)
            else:
                self.unmapped += 1
                return x
        h, w = x.shape[-2:]
        return x[..., round(cy0 * h / th):round(cy1 * h / th), round(cx0 * w / tw):round(cx1 * w / tw)]

    def _gather(self, m, x):
        r = self._region(x)
        moments = GroupMoments()
        moments.stats = self.pending
        moments.add(r, m.num_groups)
        self.pending = moments.final()

    def _apply(self, m, x, stats):
        return group_norm_with(m, x, stats)
