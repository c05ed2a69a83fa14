"""The VAE's pad and blend kernels in the strict emulator against their references on the shapes that hit
every tail path of their 3-D grids: planes not a multiple of the planes a pad thread takes, columns and rows
past the last full threadgroup, narrow planes, temporal pads on both sides, and several launches when the
planes exceed the kernels' 32-bit offsets."""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import dispatch, vae

# (shape, pad, mode): N * C of 1, 11 (vae.PAD_PLANES + 3) and 20; widths of 3, 40 (a partial second group
# column) and 70; heights of 1, 9 (a partial group row) and 17
PAD_CASES = [((1, 1, 1, 3), (2, 1, 0, 0), "constant"),
             ((1, 11, 9, 40), (1, 1, 1, 1), "constant"),
             ((2, 10, 17, 3), (0, 2, 3, 0), "replicate"),
             ((1, 11, 2, 9, 40), (1, 0, 2, 1, 2, 0), "replicate"),       # a causal pad: 2 frames before
             ((1, 3, 3, 4, 70), (0, 1, 1, 0, 1, 2), "constant"),          # frames on both sides
             ((1, 2, 1, 5, 3), (1, 1, 1, 1, 3, 1), "replicate")]          # one input frame, 5 output ones


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,pad,mode", PAD_CASES)
def test_pad_tail_paths(emulator_backend, shape, pad, mode, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) + sum(pad))).to(dtype)
    got = vae.vae_pad(x, pad, mode=mode, value=0.1)               # 0.1: rounded once to the dtype, as F.pad does
    assert dispatch.last_backend["vae_pad"] == "emulator"
    want = vae.vae_pad_reference(x, pad, mode=mode, value=0.1)
    assert got.shape == want.shape and torch.equal(got, want)


BLEND_CASES = [((1, 11, 20, 45), (1, 11, 9, 40), (11, 5)),             # the tile at the bottom-right corner
               ((2, 3, 7, 3), (2, 3, 1, 3), (6, 0)),
               ((1, 3, 6, 17, 40), (1, 3, 4, 9, 33), (2, 8, 7))]       # frames 2..5 of 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("acc_shape,tile_shape,offset", BLEND_CASES)
def test_blend_tail_paths(emulator_backend, acc_shape, tile_shape, offset, dtype):
    gen = torch.Generator().manual_seed(sum(acc_shape))
    acc = torch.randn(acc_shape, generator=gen)
    tile = torch.randn(tile_shape, generator=gen).to(dtype)
    wy, wx = torch.rand(tile_shape[-2], generator=gen), torch.rand(tile_shape[-1], generator=gen)
    want = vae.vae_blend_accumulate_reference(acc.clone(), tile, wy, wx, offset)
    got = vae.vae_blend_accumulate(acc.clone(), tile, wy, wx, offset)
    assert dispatch.last_backend["vae_blend_accumulate"] == "emulator"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_planes_beyond_the_32_bit_offsets_run_in_several_launches(emulator_backend, monkeypatch):
    """With the offset limit lowered to a few planes, each kernel launches once per run of planes on views
    starting at the run's first plane, and the results are unchanged."""
    from comfy_metal.metal_kernels import emulator

    launches = []
    real = emulator.compile_library

    def counting(src, *a, **k):
        lib = real(src, *a, **k)

        class Counted:
            def __getattr__(self, name):
                kernel = getattr(lib, name)
                if not name.startswith("vae_"):
                    return kernel

                def call(*args, **kw):
                    launches.append((name, kw["threads"]))
                    return kernel(*args, **kw)
                return call
        return Counted()
    monkeypatch.setattr(emulator, "compile_library", counting)
    dispatch.reset()
    monkeypatch.setattr(vae, "MAX_OFFSET", 3 * 7 * 12 * 16 + 1)       # three planes of the padded output
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 10, 5, 10, 14, generator=gen).half()
    for spec in (vae.vae_pad.spec, vae.vae_blend_accumulate.spec):      # the self-checks' launches first
        dispatch.choose(spec, torch.device("cpu"))
    launches.clear()
    got = vae.vae_pad(x, (1, 1, 1, 1, 2, 0), mode="replicate")
    assert torch.equal(got, vae.vae_pad_reference(x, (1, 1, 1, 1, 2, 0), mode="replicate"))
    pads = [t for n, t in launches if n.startswith("vae_pad")]
    assert len(pads) == 4 and pads[0] == (16, 12, 1)                   # planes 0-2, 3-5, 6-8, 9: one thread each
    acc = torch.randn(1, 10, 7, 12, 16, generator=gen)
    tile = torch.randn(1, 10, 3, 5, 6, generator=gen)
    wy, wx = torch.rand(5, generator=gen), torch.rand(6, generator=gen)
    want = vae.vae_blend_accumulate_reference(acc.clone(), tile, wy, wx, (4, 7, 10))
    got = vae.vae_blend_accumulate(acc, tile, wy, wx, (4, 7, 10))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    blends = [t for n, t in launches if n.startswith("vae_blend")]
    assert len(blends) == 4 and blends[0] == (6, 5, 3)
