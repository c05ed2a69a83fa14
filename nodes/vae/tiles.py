"""Tile planning on the latent grid and the feather masks whose weights sum to exactly 1."""
from __future__ import annotations

import dataclasses
import math

import torch

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
