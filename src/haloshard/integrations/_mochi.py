"""Mochi's VAE decode (diffusers' `AutoencoderKLMochi`) with T sharded, output kept sharded.

`vae._decode(z)` runs the decoder once over the clip (`plan_for(vae)` covers it), then drops
the first `temporal_compression_ratio - 1` frames (`drop_last_temporal_frames`) with a slice
along T. On a `Shard(2)` DTensor, DTensor runs that slice by gathering the whole video on
every rank. `mochi_decode` runs it as a stencil instead: each rank keeps its `Shard(2)` chunk
of the shorter clip, taking the frames that move across a rank boundary from the ranks after
it (the dropped frames are at the global start, so every chunk shifts by the same count).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from haloshard._annotation import Annotation
from haloshard._errors import HaloError
from haloshard._forward import install
from haloshard._halo_forward import HaloForward
from haloshard._layout import PadMode


@dataclass(frozen=True)
class DropFirstStencil:
    """`x[:, :, count:]` along T: output frame `j` is input frame `j + count`.

    Example::
        >>> DropFirstStencil(2).out_length(18), DropFirstStencil(2).window(4, 8)
        (16, (4, 10, 0))
    """

    count: int
    pad: PadMode = "zeros"  # never used: windows stay inside [0, T)
    fill: float | None = None
    min_input: int = 1

    def out_length(self, length: int) -> int:
        return max(length - self.count, 0)

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        # the module drops `count` frames from the front of its window itself
        return start, stop + self.count, 0


class _DropFirst(nn.Module):
    """The end of `AutoencoderKLMochi._decode`: the first `count` frames dropped."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, self.count:]


# One hooked drop per VAE, so its per-signature agreements are made once, not per call.
_DROPS: weakref.WeakKeyDictionary[nn.Module, _DropFirst] = weakref.WeakKeyDictionary()


def _check_vae(vae: nn.Module) -> None:
    if type(vae).__name__ != "AutoencoderKLMochi":
        raise HaloError(f"expected diffusers' AutoencoderKLMochi, got {type(vae).__name__}")
    for name in ("use_tiling", "use_slicing", "use_framewise_decoding"):
        if getattr(vae, name, False):
            raise HaloError(f"AutoencoderKLMochi.{name} is on; turn it off (decode would no "
                            "longer run the decoder once over the sharded clip)")


def _drop(vae: nn.Module, count: int) -> _DropFirst:
    drop = _DROPS.get(vae)
    if drop is None or drop.count != count:
        drop = _DropFirst(count)
        forward = HaloForward.of(drop, Annotation(None, 2, DropFirstStencil(count)), None)
        # dropping frames along T reads each row and column alone: a video also sharded
        # on H or W (a `(t, h)` mesh) keeps its chunk there, with no halo
        forward.per_slice = (3, 4)
        install(drop, forward)
        _DROPS[vae] = drop
    return drop


def mochi_decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """`vae.decode(z).sample` of a Mochi VAE parallelized with `plan_for(vae)`, on a
    `Shard(2)` latent, with the video a `Shard(2)` DTensor (DTensor's own slice in
    `vae.decode` would gather the whole video on every rank). A latent also sharded on H
    (`plan_for(vae, dims=(2, 3))`, `[Shard(2), Shard(3)]` on a `(t, h)` mesh) keeps its
    rows; one sharded on H alone is sliced along T locally, as `vae.decode` does.

    Raises:
        HaloError: for another model, or tiling, slicing or framewise decoding on.

    Example::
        parallelize_module(vae, mesh, plan_for(vae))
        mochi_decode(vae, distribute_tensor(z, mesh, [Shard(2)])).shape[2]  # z: T = 3 -> 13
    """
    _check_vae(vae)
    dec = vae.decoder(z)[0]
    count = vae.temporal_compression_ratio - 1
    if not vae.drop_last_temporal_frames or dec.size(2) < count + 1 or count == 0:
        return dec
    if not isinstance(dec, DTensor) or Shard(2) not in dec.placements:
        return dec[:, :, count:]  # T whole on every rank: DTensor slices it locally
    return _drop(vae, count)(dec)
