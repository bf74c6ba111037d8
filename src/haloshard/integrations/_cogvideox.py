"""CogVideoX's VAE (diffusers' `AutoencoderKLCogVideoX`) with T sharded, exactly as
`vae._encode` and `vae._decode` compute it on one device.

Neither calls its encoder or decoder once: `_encode` loops over batches of 8 frames (the
first batch takes the remainder), `_decode` over batches of 2 latent frames, each call
carrying a conv cache to the next. For the causal convs that is one call over the clip; the
resamplers keep the parity one call sees; but every GroupNorm (and the decoder's spatial
norm) takes its statistics over one batch. With T sharded, one call over each rank's frames
under `haloshard.frame_batches` does the same: each norm normalises each batch alone, from
statistics all-gathered per batch.
"""

from __future__ import annotations

import torch
from torch import nn

from haloshard._errors import HaloError
from haloshard._segments import frame_batches


def _batches(length: int, size: int) -> tuple[int, ...]:
    """The frame batches of diffusers' loop: `length // size` batches (at least one), the
    first with the remainder.

    Example::
        >>> _batches(25, 8), _batches(5, 8)
        ((9, 8, 8), (5,))
    """
    count = max(length // size, 1)
    return (length - size * (count - 1), *([size] * (count - 1)))


def _check_vae(vae: nn.Module) -> None:
    if type(vae).__name__ != "AutoencoderKLCogVideoX":
        raise HaloError(f"expected diffusers' AutoencoderKLCogVideoX, got {type(vae).__name__}")
    if getattr(vae, "use_tiling", False):
        raise HaloError("AutoencoderKLCogVideoX.use_tiling is on; disable it (tiles would be "
                        "sharded twice)")


def cogvideox_encode(vae: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`vae._encode(x)` (the moments before sampling) of a CogVideoX VAE parallelized with
    `plan_for(vae)`, on a `Shard(2)` input: its loop over frame batches in one call.

    Raises:
        HaloError: for another model, or tiling on.

    Example::
        parallelize_module(vae, mesh, plan_for(vae))
        cogvideox_encode(vae, distribute_tensor(video, mesh, [Shard(2)])).shape[2]  # 7
    """
    _check_vae(vae)
    with frame_batches(_batches(x.shape[2], vae.num_sample_frames_batch_size)):
        h = vae.encoder(x)[0]
        return h if vae.quant_conv is None else vae.quant_conv(h)


def cogvideox_decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """`vae._decode(z).sample` of a CogVideoX VAE parallelized with `plan_for(vae)`, on a
    `Shard(2)` latent: its loop over latent frame batches in one call.

    Raises:
        HaloError: for another model, or tiling on.
    """
    _check_vae(vae)
    with frame_batches(_batches(z.shape[2], vae.num_latent_frames_batch_size)):
        if vae.post_quant_conv is not None:
            z = vae.post_quant_conv(z)
        return vae.decoder(z)[0]
