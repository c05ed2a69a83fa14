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
import sys
import time
import weakref
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

log = logging.getLogger("comfy_metal")

# On CPU, convolutions allocate im2col/oneDNN workspaces inside the op (invisible to tensor tracking);
# measured against the process's peak RSS they add up to ~40% of the tracked tile peak.
CPU_WORKSPACE_FACTOR = 1.5
MIN_TILE = 8            # latent pixels: below this, OOM falls back to the CPU
RAMP_FRACTION = 0.5     # the feather ramp spans the middle half of each overlap (the outer quarter of a
                        # tile's overlap, where zero padding contaminates it, gets weight 0)

# ---------------------------------------------------------------- tile planning and feather masks


def plan_axis(size: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """[(start, end)] tiles covering [0, size) with at least `overlap` overlap, evenly spread: as few
    tiles of at most `tile` as cover the axis, each then shrunk to the shortest length that still covers
    it (128 px at tile 64 / overlap 16 takes three tiles of 54, not of 64: 16% more decoded pixels
    instead of 50%). Overlap is clamped to tile // 2 and tiles are at least 2 * overlap long, so at
    most two tiles cover any position."""
    size, tile = int(size), int(tile)
    if size <= tile:
        return [(0, size)]
    overlap = max(0, min(int(overlap), tile // 2))
    n = max(2, math.ceil((size - overlap) / (tile - overlap)))
    length = min(tile, max(math.ceil((size + (n - 1) * overlap) / n), 2 * overlap))
    starts = [round(k * (size - length) / (n - 1)) for k in range(n)]
    return [(s, s + length) for s in starts]


def _ramp(length: int) -> torch.Tensor:
    """Rising weights over an overlap of `length` output pixels; ramp(i) + ramp(length-1-i) == 1."""
    if length <= 0:
        return torch.zeros(0)
    i = torch.arange(length, dtype=torch.float64) + 0.5
    flat = (1.0 - RAMP_FRACTION) / 2 * length
    u = ((i - flat) / max(length - 2 * flat, 1e-9)).clamp(0, 1)
    return (0.5 - 0.5 * torch.cos(math.pi * u)).float()


def axis_weights(plan: list[tuple[int, int]], k: int, scale: int) -> torch.Tensor:
    """Feather weights of tile k along one axis, in output pixels (latent * scale). Complementary ramps
    over each overlap with the neighbours, 1 elsewhere, divided by the sum over all tiles: the weights
    sum to exactly 1 also where three tiles meet (tiles spaced closer than half a tile)."""
    total = torch.zeros(plan[-1][1] * scale)
    for j, (sj, ej) in enumerate(plan):
        total[sj * scale:ej * scale] += _raw_axis_weights(plan, j, scale)
    s, e = plan[k]
    return _raw_axis_weights(plan, k, scale) / total[s * scale:e * scale].clamp_min(1e-6)


def _raw_axis_weights(plan: list[tuple[int, int]], k: int, scale: int) -> torch.Tensor:
    s, e = plan[k]
    w = torch.ones((e - s) * scale)
    if k > 0:
        ov = (plan[k - 1][1] - s) * scale
        if ov > 0:
            w[:ov] = _ramp(ov)
    if k + 1 < len(plan):
        ov = (e - plan[k + 1][0]) * scale
        if ov > 0:
            w[len(w) - ov:] = 1.0 - _ramp(ov)
    return w


def axis_core(plan: list[tuple[int, int]], k: int) -> tuple[int, int]:
    """Tile k's core along one axis, relative to its start: the cores partition [0, size) (split at
    the middle of each overlap)."""
    s, e = plan[k]
    lo = s if k == 0 else (s + plan[k - 1][1]) // 2
    hi = e if k + 1 == len(plan) else (plan[k + 1][0] + e) // 2
    return lo - s, hi - s


@dataclasses.dataclass
class Tile:
    y: tuple[int, int]          # latent-grid rows [start, end)
    x: tuple[int, int]
    core_y: tuple[int, int]     # core, relative to the tile start, latent grid
    core_x: tuple[int, int]
    wy_index: int
    wx_index: int


def plan_tiles(h: int, w: int, tile_h: int, tile_w: int, overlap: int):
    """Tiles over an h x w latent grid and the per-axis plans."""
    py, px = plan_axis(h, tile_h, overlap), plan_axis(w, tile_w, overlap)
    tiles = [Tile(py[i], px[j], axis_core(py, i), axis_core(px, j), i, j)
             for i in range(len(py)) for j in range(len(px))]
    return tiles, py, px


# ---------------------------------------------------------------- memory measurement


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages allocated by ops under this mode (per device type): a
    tracemalloc-style measurement that works on CPU and MPS alike."""

    def __init__(self, device: torch.device | None = None):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        # MPS: also sample the driver's allocation after every op (the allocator's pools and
        # MPSGraph temporaries are not tensors); the peak is the larger of the two
        self._driver = None
        if device is not None and device.type == "mps":
            try:
                self._driver = torch.mps.driver_allocated_memory
                self._driver_base = self._driver()
            except Exception:
                self._driver = None

    def _free(self, key):
        n = self.live.pop(key, 0)
        self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    s = t.untyped_storage()
                except Exception:
                    continue
                key = id(s)
                if key in self.live:
                    continue
                n = s.nbytes()
                self.live[key] = n
                self.current += n
                weakref.finalize(s, self._free, key)
        if self.current > self.peak:
            self.peak = self.current
        if self._driver is not None:
            self.peak = max(self.peak, self._driver() - self._driver_base)
        return out


@contextlib.contextmanager
def measure_peak(device: torch.device):
    """Yields a dict; after the block, dict["peak"] = peak bytes allocated inside it on `device`."""
    result = {"peak": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device) - base
        return
    tracker = LiveTensorBytes(device)
    with tracker:
        yield result
    result["peak"] = tracker.peak


def auto_budget(device: torch.device) -> int:
    """Bytes a decode may use when the node's budget is 0 (auto)."""
    try:
        if device.type == "mps":
            rec = torch.mps.recommended_max_memory()
            used = torch.mps.driver_allocated_memory()
            return max(int((rec - used) * 0.6), 512 << 20)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return max(int(free * 0.7), 256 << 20)
    except Exception:
        pass
    try:
        import psutil

        return max(int(psutil.virtual_memory().available * 0.4), 256 << 20)
    except Exception:
        return 2 << 30


def is_oom(e: BaseException) -> bool:
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    msg = str(e).lower()
    return isinstance(e, (RuntimeError, MemoryError)) and (
        "out of memory" in msg or "can't allocate memory" in msg or "cannot allocate memory" in msg
        or isinstance(e, MemoryError))


# ---------------------------------------------------------------- scoped Metal padding


def _torch_before(major: int, minor: int) -> bool:
    try:
        v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return v < (major, minor)


class MetalPadMode(TorchFunctionMode):
    """Route F.pad(4-D/5-D, constant|replicate, non-negative pads) on the given device types through
    the `vae_pad` kernel. Active only inside `with`; other calls pass through untouched."""

    def __init__(self, device_types=("mps",)):
        super().__init__()
        self.device_types = set(device_types)
        self.routed = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.pad or func is torch._C._nn.pad:
            x = args[0] if args else kwargs.get("input")
            pad = args[1] if len(args) > 1 else kwargs.get("pad")
            mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
            value = args[3] if len(args) > 3 else kwargs.get("value", None)
            if (isinstance(x, torch.Tensor) and x.device.type in self.device_types and x.dim() in (4, 5)
                    and mode in ("constant", "replicate") and pad is not None and all(int(p) >= 0 for p in pad)
                    and (mode == "constant" or len(pad) == 2 * (x.dim() - 2))
                    and (x.dim() == 5 or len(pad) <= 4)
                    and x.dtype in (torch.float32, torch.float16, torch.bfloat16)):
                from ..metal_kernels.vae import vae_pad

                self.routed += 1
                return vae_pad(x, tuple(int(p) for p in pad), mode=mode, value=float(value or 0.0))
        return func(*args, **kwargs)


def pad_mode_for(device: torch.device, force: bool | None = None):
    """The scoped pad router when it is needed (MPS with torch < 2.15), or `force` says so."""
    if force or (force is None and device.type == "mps" and _torch_before(2, 15)):
        return MetalPadMode(device_types=(device.type,))
    return contextlib.nullcontext()


# ---------------------------------------------------------------- shared GroupNorm statistics


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
                 cache_limit_bytes: int | None = None, sequential: bool = False):
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
        return self

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
                out, n_gn, hw, dev = hit
                self._gn_idx += n_gn
                if hw is not None:
                    self._last_hw = hw
                return out.to(dev, copy=True)     # a copy: the caller may work in place
            start = self._gn_idx
            out = original(*args, **kwargs)        # may raise _StopAtGroupNorm: nothing cached then
            self.blocks_computed += 1
            if self.target is not None and isinstance(out, torch.Tensor):
                n_gn = self._gn_idx - start
                self.block_meta[(self.tile_key, no)] = (out.shape, out.dtype, out.device, n_gn, self._last_hw)
                self._store(key, no, out, n_gn)
            return out
        return forward

    def _store(self, key, no, out, n_gn):
        nbytes = out.numel() * out.element_size()
        previous = self.latest.get(self.tile_key) if self.sequential else None
        freed = 0
        if previous is not None:
            freed = self.cache[previous[1]][0].numel() * self.cache[previous[1]][0].element_size()
        if self.cache_limit is not None and self.cache_bytes - freed + nbytes > self.cache_limit:
            return                                   # over the limit: later passes recompute this block
        if previous is not None:
            del self.cache[previous[1]]
            self.cache_bytes -= freed
        self.cache[key] = (out.to(self.cache_device, copy=True), n_gn, self._last_hw, out.device)
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
        g = m.num_groups
        r = self._region(x)
        n_b = r.numel() // max(1, r.shape[0] * g)
        if n_b == 0:
            return
        v = r.reshape(r.shape[0], g, -1).float()
        mean_f = v.mean(-1)
        m2_b = ((v - mean_f[..., None]) ** 2).sum(-1).cpu().double()     # (MPS has no float64)
        mean_b = mean_f.cpu().double()
        if self.pending is None:
            self.pending = [n_b, mean_b, m2_b]
            return
        n_a, mean_a, m2_a = self.pending
        n = n_a + n_b
        delta = mean_b - mean_a
        self.pending = [n, mean_a + delta * (n_b / n), m2_a + m2_b + delta * delta * (n_a * n_b / n)]

    def _apply(self, m, x, stats):
        """GroupNorm with the given statistics, as one per-channel scale and shift (fp32)."""
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


# ---------------------------------------------------------------- codecs


@dataclasses.dataclass
class Codec:
    """How to run one VAE on tiles.

    decode(z) -> pixels for an image latent tile [N, C, h, w] (or a video tile, whole);
    decode_stream(z) -> iterator of pixel chunks [N, C, tc, H, W] in time order (causal video VAEs,
        each spatial tile with its own temporal cache); None for image VAEs;
    encode(x) -> latent for a pixel tile (already in the VAE's input range).
    scale: spatial pixels per latent pixel. module: the nn.Module holding the weights (GroupNorm
    discovery, CPU fallback). device/dtype: where and in what the VAE runs.
    """
    name: str
    scale: int
    decode: Callable | None
    encode: Callable | None = None
    decode_stream: Callable | None = None
    module: torch.nn.Module | None = None
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    video: bool = False
    out_channels: int = 3
    latent_channels: int = 4
    sequential_blocks: bool = False   # the decoder is a plain chain of its blocks (shared statistics' cache)
    calibrate_all_frames: bool = False   # video: the decoder holds every latent frame at once (a mid block over
                                         # the whole clip), so its peak grows with the frame count: calibrate
                                         # the cost model on the real frame count, not on two frames

    def frames_out(self, t_latent: int) -> int:
        return t_latent if not self.video else 1 + 4 * (t_latent - 1)


def _module_device_dtype(module):
    for p in module.parameters():
        return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def codec_from_diffusers(vae) -> Codec:
    """diffusers AutoencoderKL (image) or AutoencoderKLWan (causal video)."""
    device, dtype = _module_device_dtype(vae)
    cls = type(vae).__name__
    if cls == "AutoencoderKLWan":
        import importlib

        wan = importlib.import_module(type(vae).__module__)
        patch = vae.config.patch_size

        def stream(z):
            x = vae.post_quant_conv(z)
            counts = getattr(vae, "_cached_conv_counts", None)
            n = counts["decoder"] if counts else sum(isinstance(m, wan.WanCausalConv3d) for m in vae.decoder.modules())
            cache = [None] * n
            for i in range(x.shape[2]):
                out = vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
                if patch is not None:
                    out = wan.unpatchify(out, patch_size=patch)
                yield out.clamp(-1.0, 1.0)

        def encode(x):
            return vae.encode(x).latent_dist.mode()

        scale = int(vae.spatial_compression_ratio) if hasattr(vae, "spatial_compression_ratio") else 8
        return Codec("diffusers-wan", scale, decode=lambda z: vae.decode(z).sample, encode=encode,
                     decode_stream=stream, module=vae, device=device, dtype=dtype, video=True,
                     out_channels=3, latent_channels=vae.config.z_dim)
    if cls in ("AutoencoderKL",):
        scale = 2 ** (len(vae.config.block_out_channels) - 1)
        return Codec("diffusers-kl", scale, decode=lambda z: vae.decode(z).sample,
                     encode=lambda x: vae.encode(x).latent_dist.mode(), module=vae, device=device, dtype=dtype,
                     out_channels=vae.config.out_channels, latent_channels=vae.config.latent_channels,
                     sequential_blocks=True)
    raise TypeError(f"no tiling codec for diffusers model {cls}")


def codec_from_comfy(vae) -> Codec | None:
    """A codec over a ComfyUI VAE object (comfy.sd.VAE) for the architectures we know; None otherwise
    (the node then uses ComfyUI's own tiled decode)."""
    fsm = getattr(vae, "first_stage_model", None)
    if fsm is None:
        return None
    device = torch.device(getattr(vae, "device", "cpu"))
    dtype = getattr(vae, "vae_dtype", torch.float32)
    mod = type(fsm).__module__
    cls = type(fsm).__name__
    latent_dim = getattr(vae, "latent_dim", 2)
    scale = vae.spacial_compression_decode() if hasattr(vae, "spacial_compression_decode") else 8
    if getattr(vae, "handles_tiling", False) or getattr(fsm, "comfy_has_chunked_io", False):
        return None
    if mod.startswith("diffusers.") and cls in ("AutoencoderKL", "AutoencoderKLWan"):
        return codec_from_diffusers(fsm)     # a VAE-like wrapper around a diffusers model
    if latent_dim == 2 and cls in ("AutoencoderKL", "AutoencodingEngine", "AutoencodingEngineLegacy") \
            and type(getattr(fsm, "decoder", None)).__name__ == "Decoder" \
            and type(fsm.decoder).__module__.endswith("diffusionmodules.model") \
            and getattr(fsm, "bn", None) is None and getattr(vae, "extra_1d_channel", None) is None:
        return Codec("comfy-kl", int(scale), decode=lambda z: fsm.decode(z), encode=lambda x: fsm.encode(x),
                     module=fsm, device=device, dtype=dtype, out_channels=getattr(vae, "output_channels", 3),
                     latent_channels=vae.latent_channels, sequential_blocks=True)
    if latent_dim == 3 and cls == "WanVAE" and mod.endswith("wan.vae"):
        def stream(z):
            import comfy.ldm.wan.vae as wan

            cache = [None] * wan.count_cache_layers(fsm.decoder)
            x = fsm.conv2(z)
            chunks = [(0, 1)] + [(1 + 2 * (i - 1), min(1 + 2 * i, x.shape[2])) for i in range(1, 1 + x.shape[2] // 2)]
            for a, b in chunks:
                if a >= b:
                    continue
                out = fsm.decoder(x[:, :, a:b], feat_cache=cache, feat_idx=[0])
                yield torch.cat(out, 2) if isinstance(out, (list, tuple)) else out
        return Codec("comfy-wan21", int(scale), decode=lambda z: fsm.decode(z), encode=lambda x: fsm.encode(x),
                     decode_stream=stream, module=fsm, device=device, dtype=dtype, video=True,
                     out_channels=getattr(vae, "conv_out_channels", 3), latent_channels=vae.latent_channels)
    if latent_dim == 3 and cls == "WanVAE" and mod.endswith("wan.vae2_2"):
        def stream(z):
            import comfy.ldm.wan.vae2_2 as wan

            counter = getattr(wan, "count_conv3d", None)
            cache = [None] * (counter(fsm.decoder) if counter else 256)
            x = fsm.conv2(z)
            for i in range(x.shape[2]):
                out = fsm.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
                if isinstance(out, (list, tuple)):
                    out = torch.cat(out, 2)
                yield wan.unpatchify(out, patch_size=2)
        return Codec("comfy-wan22", int(scale), decode=lambda z: fsm.decode(z), encode=lambda x: fsm.encode(x),
                     decode_stream=stream, module=fsm, device=device, dtype=dtype, video=True,
                     out_channels=3, latent_channels=vae.latent_channels)
    hunyuan = _comfy_hunyuan_video_codec(vae, fsm, latent_dim, scale, device, dtype)
    if hunyuan is not None:
        return hunyuan
    return None


def _comfy_hunyuan_video_codec(vae, fsm, latent_dim, scale, device, dtype) -> Codec | None:
    """HunyuanVideo 1.0: ComfyUI's SD Encoder/Decoder (diffusionmodules.model) built with causal 3-D
    convolutions (`ddconfig["conv3d"]`, `time_compress=4`), 8x spatial, 4x temporal.

    Its decoder runs conv_in and the mid block (attention included) over every latent frame at once,
    then the up path on chunks of two latent frames, each causal convolution carrying its last two
    input frames to the next chunk (`conv_carry_causal_3d`). `decode_stream` drives the same modules in
    the same order and yields each chunk's frames as soon as they are decoded, so per spatial tile only
    the latent-resolution mid activations hold all frames; the full-resolution work is flat in the
    frame count. Decoders without the carried path (VideoConv3d: attention at some resolution) decode
    each spatial tile whole. The encoder chunks its input itself (`fsm.encode` per spatial tile)."""
    dec, enc = getattr(fsm, "decoder", None), getattr(fsm, "encoder", None)
    if latent_dim != 3 or type(fsm).__name__ not in ("AutoencoderKL", "AutoencodingEngineLegacy") \
            or not type(fsm).__module__.endswith("models.autoencoder") or getattr(fsm, "bn", None) is not None:
        return None
    if type(dec).__name__ != "Decoder" or not type(dec).__module__.endswith("diffusionmodules.model"):
        return None
    conv3d = ("CarriedConv3d", "VideoConv3d")
    if type(getattr(dec, "conv_in", None)).__name__ not in conv3d:
        return None
    try:
        tc = vae.temporal_compression_decode() if hasattr(vae, "temporal_compression_decode") else None
    except Exception:
        tc = None
    if tc != 4:
        return None          # Codec.frames_out assumes 1 + 4 * (t - 1)
    encode = None
    if type(enc).__name__ == "Encoder" and type(enc).__module__.endswith("diffusionmodules.model") \
            and type(getattr(enc, "conv_in", None)).__name__ in conv3d:
        encode = lambda x: fsm.encode(x)
    stream = None
    dm = sys.modules.get(type(dec).__module__)
    step = getattr(dm, "conv_carry_causal_3d", None)
    if step is not None and getattr(dec, "carried", False) and hasattr(dm, "nonlinearity") \
            and all(len(getattr(u, "attn", ())) == 0 for u in dec.up) and not getattr(fsm, "max_batch_size", None):
        def stream(z):
            h = step([fsm.post_quant_conv(z)], dec.conv_in)
            h = dec.mid.block_1(h, None)
            h = dec.mid.attn_1(h)
            h = dec.mid.block_2(h, None)
            n = h.shape[2]
            carry_in = None
            for a in range(0, n, 2):
                carry_out = [] if a + 2 < n else None     # the last chunk carries nothing on
                x = h[:, :, a:a + 2]
                for level in reversed(range(dec.num_resolutions)):
                    for block in dec.up[level].block:
                        x = block(x, None, carry_in, carry_out)
                    if level != 0:
                        x = dec.up[level].upsample(x, carry_in, carry_out)
                x = step([dm.nonlinearity(dec.norm_out(x))], dec.conv_out, carry_in, carry_out)
                if getattr(dec, "tanh_out", False):
                    x = torch.tanh(x)
                yield x
                carry_in = carry_out
    return Codec("comfy-hunyuan-video", int(scale), decode=lambda z: fsm.decode(z), encode=encode,
                 decode_stream=stream, module=fsm, device=device, dtype=dtype, video=True,
                 out_channels=getattr(vae, "output_channels", 3), latent_channels=vae.latent_channels,
                 calibrate_all_frames=True)


def codec_from_fn(decode_fn, scale: int, encode_fn=None, module=None, device="cpu", dtype=torch.float32) -> Codec:
    """A codec over bare functions (tests, custom VAEs)."""
    return Codec("function", int(scale), decode=decode_fn, encode=encode_fn, module=module,
                 device=torch.device(device), dtype=dtype)


# ---------------------------------------------------------------- the engine


# Shared statistics: the per-tile block cache's default share of the memory budget (1 / this).
STATS_CACHE_SHARE = 4


@dataclasses.dataclass
class TilingOptions:
    budget_bytes: int = 0          # 0 = auto
    tile: int | None = None        # latent pixels per side; None = from the budget
    overlap: int | None = None     # latent pixels; None = auto (tile // 4, at least 4 latent px... capped)
    shared_stats: bool = False
    stats_cache: bool = True       # shared statistics: keep finished block outputs per tile (fewer recomputes)
    stats_cache_bytes: int | None = None   # cap on that cache (CPU memory); None = a quarter of the budget
    route_pads: bool | None = None  # None = auto (MPS, torch < 2.15)
    progress: Callable[[int, int], None] | None = None   # (done, total)
    output_device: torch.device | str | None = None       # None = compute device if it fits the budget, else CPU
    calibrate: bool = True
    cpu_fallback: bool = True


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


def default_overlap(tile: int) -> int:
    """Latent pixels of overlap when the user leaves it on auto: 3/8 of the tile, up to 24. Feather-only
    tiles normalise themselves, so the overlap is what hides their differences (on a 1024^2 SDXL-width
    decode with 64 px tiles: 34.1 dB at ComfyUI's 8, 36.8 dB at 16); shared statistics need a halo of
    ~16 px (the SD decoder's receptive field) to be exact. Balanced tiles keep the cost moderate."""
    return max(2, min(tile * 3 // 8, 24))


class TiledVAE:
    """Tiled decode/encode of one codec. `decode(latent)` / `encode(pixels)` return fp32 tensors on
    the output device; `info` describes the last run."""

    def __init__(self, codec: Codec, options: TilingOptions | None = None):
        self.codec = codec
        self.opt = options or TilingOptions()
        self._stats_cache_limit = 0
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

    def calibrate(self, fn, sample: torch.Tensor, encode: bool = False) -> tuple[float, float]:
        """(a, b) of peak = a + b * tile_area (latent pixels), from two small tiles on the device."""
        f = self.codec.scale if encode else 1
        h, w = sample.shape[-2] // f, sample.shape[-1] // f
        sides = [s for s in (8, 16) if s <= max(h, w) or s == 8]
        pts = []
        for s in sides:
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
        a, b = self.calibrate(fn, sample, encode=encode)
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
        # Shared statistics cache finished blocks per tile: by default that cache gets a quarter of the
        # budget and the tiles are planned within the rest, so tiles + cache stay within the budget.
        if self.opt.stats_cache_bytes is not None:          # the caller chose the cache size
            self._stats_cache_limit, tile_budget = self.opt.stats_cache_bytes, budget
        elif self.opt.shared_stats and self.opt.stats_cache:
            self._stats_cache_limit = budget // STATS_CACHE_SHARE
            tile_budget = budget - self._stats_cache_limit
        else:
            self._stats_cache_limit, tile_budget = 0, budget
        tile = self.opt.tile
        if tile is None:
            tile = self._tile_for_budget(fn, x, tile_budget, h, w, encode=encode) if self.opt.calibrate else 64
        tile = max(1, min(int(tile), max(h, w)))
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
        self.info.seconds = time.perf_counter() - t_start
        return out

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
            overlap = self.opt.overlap if self.opt.overlap is not None else default_overlap(tile)
            th, tw = min(tile, h), min(tile, w)
            if self.opt.tile is None and h < tile:      # spend the unused area on the long axis
                tw = min(w, max(tw, tile * tile // max(h, 1)))
            elif self.opt.tile is None and w < tile:
                th = min(h, max(th, tile * tile // max(w, 1)))
            tiles, py, px = plan_tiles(h, w, th, tw, overlap)
            self.info.tile, self.info.overlap, self.info.tiles = tile, overlap, len(tiles)
            self.info.tile_shape = (py[0][1] - py[0][0], px[0][1] - px[0][0])
            shared = None
            if self.opt.shared_stats and c.module is not None and not c.video:
                shared = SharedGroupNormStats(c.module, cache=self.opt.stats_cache,
                                              cache_limit_bytes=self._stats_cache_limit,
                                              sequential=c.sequential_blocks)
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

    def _out_device(self, device, nbytes):
        if self.opt.output_device is not None:
            return torch.device(self.opt.output_device)
        budget = self.opt.budget_bytes or auto_budget(device)
        return device if nbytes <= budget * 0.25 else torch.device("cpu")

    def _one_tile(self, x, fn, t: Tile, py, px, encode, device, dtype, acc, write: bool):
        f = self.codec.scale
        (y0, y1), (x0, x1) = t.y, t.x
        if encode:
            src = x[..., y0 * f:y1 * f, x0 * f:x1 * f]
            oscale = 1
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
            if chunk.shape[-2:] != (len(wy), len(wx)):
                raise RuntimeError(f"the VAE returned a tile of {tuple(chunk.shape[-2:])} pixels for a "
                                   f"{(y1 - y0, x1 - x0)} latent tile; expected {(len(wy), len(wx))}")
            if chunk.dim() == 5 and t_off + chunk.shape[2] > acc.shape[2]:
                raise RuntimeError(f"the VAE produced more frames ({t_off + chunk.shape[2]}) than expected ({acc.shape[2]})")
            from ..metal_kernels.vae import vae_blend_accumulate

            chunk = chunk.to(acc.device)
            off = (t_off, y0 * oscale, x0 * oscale) if chunk.dim() == 5 else (y0 * oscale, x0 * oscale)
            vae_blend_accumulate(acc, chunk, wy.to(acc.device), wx.to(acc.device), off)
            t_off += chunk.shape[2] if chunk.dim() == 5 else 1
            del chunk
        return acc


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
