"""Wan 2.1's video VAE (diffusers' `AutoencoderKLWan`) with T sharded, exactly as
`vae._encode` and `vae._decode` compute it on one device.

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

`_decode` is a loop over single latent frames with the same caches. Its temporal upsampler
(`WanResample`, mode `upsample3d`) marks its cache "Rep" at frame 0, which it upsamples
spatially only; every later frame goes through a causal conv (`time_conv`, kernel 3) whose
zero history starts at frame 1, so frame 0 is never that conv's context, and each conv
output becomes 2 frames: `1 + 2 (T - 1)` outputs. The window rule `CachedUpStencil` starts
each window at frame 0, or early enough that the window's own first frame (run alone, as
the loop runs frame 0) and the conv's 2 frames of history are real frames of the window, so
no kept output reads the window's zero history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard._errors import HaloError
from haloshard._layer_styles import FirstFrameParallel, LocalParallel
from haloshard._layout import HaloShard, PadMode
from haloshard._styles import HaloParallel


def cached_resample(forward: Any, window: torch.Tensor) -> torch.Tensor:
    """Run a `WanResample` on a window as the chunk loops would: its first frame alone with
    an empty cache, then the rest with that cache. Down (`_encode`): the first frame is
    kept as is and cached, the rest go through a stride-2 conv over the cached frame and
    them. Up (`_decode`): the first frame is upsampled spatially only (the cache marked
    "Rep"), the rest through a causal `time_conv` with zero history."""
    cache: list[Any] = [None]
    first = forward(window.narrow(2, 0, 1), feat_cache=cache, feat_idx=[0])
    rest = window.shape[2] - 1
    if rest == 0:
        return first
    return torch.cat([first, forward(window.narrow(2, 1, rest), feat_cache=cache,
                                     feat_idx=[0])], dim=2)


@dataclass(frozen=True)
class CachedUpStencil:
    """Frame 0 gives one output and is no other's context; frames 1.. go through a causal
    conv of `span` frames (zero history before frame 1), each conv output becoming `factor`
    frames: output length `1 + (T - 1) * factor` (Wan's temporal upsampler on `_decode`).

    A window from input i0 >= 1 runs like one from frame 0: its first frame yields one
    (dropped) output and its next `span - 1` frames are history; so the window starts
    `span` frames before its first wanted input, or at frame 0.

    Example::
        >>> CachedUpStencil(2, 3).window(9, 13)  # outputs 9..12 come from inputs 5..6
        (2, 7, 5)
    """

    factor: int
    span: int
    pad: PadMode = "zeros"  # never read: windows stay inside [0, T)
    fill: float | None = None
    min_input: int = 1

    def __post_init__(self) -> None:
        if self.factor < 1 or self.span < 1:
            raise HaloError(f"CachedUpStencil needs factor >= 1 and span >= 1, got "
                            f"factor={self.factor}, span={self.span}")

    def out_length(self, length: int) -> int:
        return 0 if length <= 0 else 1 + (length - 1) * self.factor

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f = self.factor
        first = 0 if start == 0 else (start - 1) // f + 1  # the input of output `start`
        i0 = max(0, first - self.span)
        i1 = 1 if stop == 1 else (stop - 2) // f + 2
        return i0, i1, start - i0 * f


def _check_vae(vae: nn.Module) -> None:
    from diffusers import AutoencoderKLWan

    if not isinstance(vae, AutoencoderKLWan):
        raise HaloError(f"expected diffusers' AutoencoderKLWan, got {type(vae).__name__}")
    config = vae.config
    if config.patch_size is not None or config.is_residual:
        raise HaloError(f"the Wan 2.1 VAE is supported (patch_size=None, is_residual="
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
        parallelize_module(vae, mesh, wan_encoder_plan(vae))
        wan_encode(vae, distribute_tensor(video, mesh, [Shard(2)])).placements  # Shard(2)
    """
    _check_vae(vae)
    return {"quant_conv": LocalParallel(), **_plan(vae.encoder, "encoder")}


def wan_decoder_plan(vae: nn.Module) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan that makes `wan_decode(vae, z)` equal
    `vae._decode(z).sample` with T sharded: causal convs get their 2-frame halo, temporal
    upsamplers run their cached path on `CachedUpStencil` windows, per-frame layers run on
    the local frames.

    Raises:
        HaloError: for a model that is not Wan 2.1's `AutoencoderKLWan`.

    Example::
        parallelize_module(vae, mesh, wan_decoder_plan(vae))
        wan_decode(vae, distribute_tensor(z, mesh, [Shard(2)])).shape[2]  # z: T = 5; 17
    """
    _check_vae(vae)
    return {"post_quant_conv": LocalParallel(), **_plan(vae.decoder, "decoder")}


def _plan(part: nn.Module, prefix: str) -> dict[str, ParallelStyle]:
    from diffusers.models.autoencoders.autoencoder_kl_wan import (
        WanAttentionBlock,
        WanCausalConv3d,
        WanResample,
        WanRMS_norm,
    )

    plan: dict[str, ParallelStyle] = {}
    inside: list[str] = []  # per-frame blocks run whole: their own layers take no entry
    for fqn, module in part.named_modules(prefix=prefix):
        if any(fqn.startswith(f"{outer}.") for outer in inside):
            continue
        if isinstance(module, WanCausalConv3d) and module.kernel_size[0] > 1:
            plan[fqn] = HaloParallel(HaloShard(2, left=module.kernel_size[0] - 1))
        elif isinstance(module, WanCausalConv3d | WanRMS_norm):
            plan[fqn] = LocalParallel()
        elif isinstance(module, WanAttentionBlock):
            plan[fqn], inside = LocalParallel(), [*inside, fqn]
        elif isinstance(module, WanResample):
            plan[fqn] = _resample_style(module)
            inside.append(fqn)
    return plan


def _resample_style(module: nn.Module) -> ParallelStyle:
    if module.mode == "downsample3d":
        return FirstFrameParallel(2, "down", even="first", local=cached_resample)
    if module.mode == "upsample3d":
        span = module.time_conv.kernel_size[0]
        return HaloParallel(CachedUpStencil(2, span), local=cached_resample)
    return LocalParallel()


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


def wan_decode(vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """`vae._decode(z).sample` (the clamped video) of a parallelized Wan VAE on a `Shard(2)`
    latent: one call over each rank's frames, exactly what the frame-by-frame loop gives.

    Raises:
        HaloError: for a model `wan_decoder_plan` does not cover.
    """
    _check_vae(vae)
    y = vae.decoder(vae.post_quant_conv(z))
    if not isinstance(y, DTensor):
        return torch.clamp(y, min=-1.0, max=1.0)
    # elementwise, so on the local chunk: DTensor's own dispatch would hash per-rank strides
    # under simulated ranks
    return DTensor.from_local(torch.clamp(y.to_local(), min=-1.0, max=1.0), y.device_mesh,
                              y.placements, run_check=False, shape=y.shape, stride=y.stride())
