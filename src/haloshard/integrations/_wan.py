"""Wan 2.1's video VAE encoder (diffusers' `AutoencoderKLWan`) with T sharded, exactly as
`vae._encode` computes it on one device.

`_encode` is not one call: it runs the encoder on frame 0, then on chunks of 4 frames, with a
feature cache per causal conv (the last frames of its input) carried from chunk to chunk. For
the causal convs that is the same as one call over the whole clip (each pads 2 zero frames at
frame 0 only), but the temporal downsampling (`WanResample`, mode `downsample3d`) happens only
on the cached path: a call without a cache skips it. On the cached path it keeps frame 0 and
maps frames `2m-2, 2m-1, 2m` to output m (a stride-2 conv that reads the previous chunk's last
frame from the cache): the "keep the first frame, resample the rest" rule, with one frame of
context before each pair.

So with T sharded each rank runs one call over its frames, every causal conv with its halo
(`HaloShard(2, left=2)`), and every `downsample3d` through `FirstFrameParallel(2, "down")`
whose window already holds that context frame; on its window the module runs its own forward
twice, with its own cache protocol: on the window's first frame alone (which fills the cache),
then on the rest. Outputs equal `vae._encode(x)`'s shard, forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard._errors import HaloError
from haloshard._layer_styles import FirstFrameParallel, LocalParallel
from haloshard._layout import HaloShard
from haloshard._styles import HaloParallel


def cached_downsample(forward: Any, window: torch.Tensor) -> torch.Tensor:
    """Run a `WanResample("downsample3d")` on a window as `_encode`'s chunk loop would: its
    first frame alone with an empty cache (kept as is), then the rest with that frame cached
    (a stride-2 conv over the cached frame and the rest)."""
    cache: list[Any] = [None]
    first = forward(window.narrow(2, 0, 1), feat_cache=cache, feat_idx=[0])
    rest = window.shape[2] - 1
    if rest == 0:
        return first
    return torch.cat([first, forward(window.narrow(2, 1, rest), feat_cache=cache,
                                     feat_idx=[0])], dim=2)


def _check_vae(vae: nn.Module) -> None:
    from diffusers import AutoencoderKLWan

    if not isinstance(vae, AutoencoderKLWan):
        raise HaloError(f"expected diffusers' AutoencoderKLWan, got {type(vae).__name__}")
    config = vae.config
    if config.patch_size is not None or config.is_residual:
        raise HaloError(f"the Wan 2.1 encoder is supported (patch_size=None, is_residual="
                        f"False), got patch_size={config.patch_size}, is_residual="
                        f"{config.is_residual} (Wan 2.2's residual down blocks)")


def wan_encoder_plan(vae: nn.Module) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan that makes `wan_encode(vae, x)` equal `vae._encode(x)`
    with T sharded: causal convs get their 2-frame halo, temporal downsamplers run their
    cached path on first-frame windows, per-frame layers (RMS norms, the mid-block's
    per-frame attention, spatial downsamplers, kernel-1 convs) run on the local frames.

    Raises:
        HaloError: for a model that is not Wan 2.1's `AutoencoderKLWan`.

    Example::
        >>> parallelize_module(vae, mesh, wan_encoder_plan(vae))
        >>> wan_encode(vae, distribute_tensor(video, mesh, [Shard(2)])).placements
        (Shard(dim=2),)
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanAttentionBlock,
        WanCausalConv3d,
        WanResample,
        WanRMS_norm,
    )

    _check_vae(vae)
    plan: dict[str, ParallelStyle] = {"quant_conv": LocalParallel()}
    inside: list[str] = []  # per-frame blocks run whole: their own layers take no entry
    for fqn, module in vae.encoder.named_modules(prefix="encoder"):
        if any(fqn.startswith(f"{outer}.") for outer in inside):
            continue
        if isinstance(module, WanCausalConv3d) and module.kernel_size[0] > 1:
            plan[fqn] = HaloParallel(HaloShard(2, left=module.kernel_size[0] - 1))
        elif isinstance(module, WanCausalConv3d | WanRMS_norm):
            plan[fqn] = LocalParallel()
        elif isinstance(module, WanAttentionBlock):
            plan[fqn], inside = LocalParallel(), [*inside, fqn]
        elif isinstance(module, WanResample):
            plan[fqn] = (FirstFrameParallel(2, "down", even="first", local=cached_downsample)
                         if module.mode == "downsample3d" else LocalParallel())
            inside.append(fqn)
    return plan


def wan_encode(vae: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`vae._encode(x)` (the moments before sampling) of a parallelized Wan VAE on a
    `Shard(2)` input: one call over each rank's frames, exactly what the chunk loop gives.

    Raises:
        HaloError: when T is not 1 + 4n (what `_encode`'s chunks of 1 + 4 + 4 ... frames
            need), or for a model `wan_encoder_plan` does not cover.
    """
    _check_vae(vae)
    length = x.shape[2]
    if length % 4 != 1:
        raise HaloError(f"Wan encodes 1 + 4n frames (a first frame, then chunks of 4), got "
                        f"T={length}; expected T % 4 == 1")
    return vae.quant_conv(vae.encoder(x))
