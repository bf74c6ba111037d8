"""The five diffusers video VAEs of `benchmarks.vae`: how to build each one, and its public
calls on one device beside the same calls with T sharded.

`build(name, config)` makes a VAE with random weights (no hub): `config="default"` is the
class's own default constructor (the released architecture; LTX-Video 0.9.5's decoder is
its release configuration on 0.9.0's encoder, whose down blocks the plans cover), `"tiny"`
a few channels of the same structure, for tests. `decode` and `encode` are the one-device
public calls (`vae.decode(z).sample`, `vae.encode(x).latent_dist.mode()`), `sharded_*` the
calls a user makes after `parallelize_module(vae, mesh, plan(vae, dims))` on a DTensor
sharded on `dims`: the same public calls (on H: every model's own frame loop), or with T
sharded, what docs/diffusers.md says to call where the public call is a frame loop
(CogVideoX, Wan) or gathers the video (Mochi's decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard.integrations.diffusers import (
    cogvideox_decode,
    cogvideox_encode,
    mochi_decode,
    plan_for,
    wan_decode,
    wan_decoder_plan,
    wan_encode,
    wan_encoder_plan,
)

# LTX-Video 0.9.5's decoder (diffusers' scripts/convert_ltx_to_diffusers.py): residual
# depth-to-space upsamplers halving the channels, conditioned on the decode timestep, no
# noise injection
_LTX095_DECODER = {
    "decoder_block_out_channels": (256, 512, 1024), "decoder_layers_per_block": (5, 5, 5, 5),
    "decoder_spatio_temporal_scaling": (True, True, True),
    "decoder_inject_noise": (False,) * 4, "upsample_residual": (True,) * 3,
    "upsample_factor": (2,) * 3, "timestep_conditioning": True}
_LTX_TINY = {"latent_channels": 4, "block_out_channels": (8,) * 4, "layers_per_block": (1,) * 5}


@dataclass(frozen=True)
class Model:
    """A diffusers VAE class, its constructor arguments per config, and its compression:
    `temporal` pixel frames per latent frame (after the first), `spatial` pixels per latent
    pixel."""

    cls: str
    temporal: int
    spatial: dict[str, int]
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the decode timestep of a timestep-conditioned decoder (a plain tensor on every rank)
    timestep: float | None = None


MODELS: dict[str, Model] = {
    "hunyuan": Model("AutoencoderKLHunyuanVideo", 4, {"default": 8, "tiny": 4}, {"tiny": {
        "latent_channels": 4, "block_out_channels": (8,) * 3, "layers_per_block": 1,
        "down_block_types": ("HunyuanVideoDownBlock3D",) * 3,
        "up_block_types": ("HunyuanVideoUpBlock3D",) * 3, "norm_num_groups": 2,
        "spatial_compression_ratio": 4, "temporal_compression_ratio": 4}}),
    "cogvideox": Model("AutoencoderKLCogVideoX", 4, {"default": 8, "tiny": 4}, {"tiny": {
        "latent_channels": 4, "block_out_channels": (8,) * 3, "layers_per_block": 1,
        "down_block_types": ("CogVideoXDownBlock3D",) * 3,
        "up_block_types": ("CogVideoXUpBlock3D",) * 3, "norm_num_groups": 2}}),
    "ltx": Model("AutoencoderKLLTXVideo", 8, {"default": 32, "tiny": 32}, {"tiny": {
        **_LTX_TINY, "decoder_block_out_channels": (8,) * 4,
        "decoder_layers_per_block": (1,) * 5}}),
    "ltx095": Model("AutoencoderKLLTXVideo", 8, {"default": 32, "tiny": 32}, {
        "default": _LTX095_DECODER,
        "tiny": {**_LTX_TINY, **_LTX095_DECODER, "decoder_block_out_channels": (8, 16, 32),
                 "decoder_layers_per_block": (1,) * 4}}, timestep=0.05),
    "mochi": Model("AutoencoderKLMochi", 6, {"default": 8, "tiny": 8}, {"tiny": {
        "encoder_block_out_channels": (32,) * 4, "decoder_block_out_channels": (32,) * 4,
        "latent_channels": 4, "layers_per_block": (1,) * 5}}),
    "wan": Model("AutoencoderKLWan", 4, {"default": 8, "tiny": 4}, {"tiny": {
        "base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2], "num_res_blocks": 1,
        "temperal_downsample": [True, True]}}),
}


def build(name: str, config: str, seed: int = 0) -> nn.Module:
    """`MODELS[name]` in `config` with weights drawn from `seed` (the same on every rank),
    float32, eval mode, with no frame loop of its own beyond the one its public call is.

    HunyuanVideo decodes and encodes in temporal tiles by default (`use_framewise_*`): the
    exact reference turns that off; `benchmarks.vae --approx` measures it.
    """
    import diffusers

    torch.manual_seed(seed)
    model = MODELS[name]
    vae = getattr(diffusers, model.cls)(**model.kwargs.get(config, {})).float().eval()
    for flag in ("use_framewise_encoding", "use_framewise_decoding"):
        if hasattr(vae, flag):
            setattr(vae, flag, False)
    return vae


def latent_channels(vae: nn.Module) -> int:
    config = vae.config
    return int(config.z_dim if hasattr(config, "z_dim") else config.latent_channels)


def shapes(name: str, config: str, frames: int, size: int
           ) -> tuple[tuple[int, int, int, int, int], tuple[int, int, int]]:
    """The video shape `(1, 3, T, H, W)` for at most `frames` frames of at most `size`
    pixels (T = 1 + k * temporal: every model's valid lengths; H = W a multiple of the
    spatial compression), and its latent's `(T, H, W)`."""
    model = MODELS[name]
    latent_t = max((frames - 1) // model.temporal, 0) + 1
    pixels = max(size // model.spatial[config], 1)
    side = pixels * model.spatial[config]
    return (1, 3, 1 + (latent_t - 1) * model.temporal, side, side), (latent_t, pixels, pixels)


def plan(vae: nn.Module, dims: tuple[int, ...] = (2,)) -> dict[str, ParallelStyle]:
    """The whole VAE's plan (encoder and decoder) on `dims` (`plan_for`'s; Wan on T: its
    own chunk-loop plans). Raises `HaloError` where the model cannot be sharded on `dims`."""
    if type(vae).__name__ == "AutoencoderKLWan" and dims == (2,):
        return {**wan_encoder_plan(vae), **wan_decoder_plan(vae)}
    return plan_for(vae, dims=dims)


def _timestep(name: str, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    step = MODELS[name].timestep
    return () if step is None else (torch.tensor([step], device=like.device),)


def decode(name: str, vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """One device's public call: `vae.decode(z).sample`."""
    return vae.decode(z, *_timestep(name, z)).sample


def encode(name: str, vae: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One device's public call: `vae.encode(x).latent_dist.mode()`."""
    return vae.encode(x).latent_dist.mode()


def sharded_decode(name: str, vae: nn.Module, z: torch.Tensor, dims: tuple[int, ...]
                   ) -> torch.Tensor:
    """`decode` of a VAE parallelized on `dims`, on a latent sharded on them: the public
    call itself, but with T sharded the calls docs/diffusers.md gives for the models whose
    public call is a frame loop (CogVideoX, Wan) or ends in a slice along T (Mochi:
    `mochi_decode` keeps the video sharded where the public call gathers it). With H
    sharded alone every model's own frame loop runs on every rank."""
    if 2 in dims and name == "cogvideox":
        return cogvideox_decode(vae, z)
    if 2 in dims and name == "wan":
        return wan_decode(vae, z)
    if 2 in dims and name == "mochi":
        return mochi_decode(vae, z)
    return decode(name, vae, z)


def sharded_encode(name: str, vae: nn.Module, x: torch.Tensor, dims: tuple[int, ...]
                   ) -> torch.Tensor:
    """`encode` of a VAE parallelized on `dims`, on a video sharded on them: the public
    call (its backward on a DTensor included), or with T sharded, for the frame loops of
    CogVideoX and Wan, the posterior of the moments `cogvideox_encode` / `wan_encode`
    compute (what `vae.encode` wraps `vae._encode`'s moments in)."""
    if 2 in dims and name in ("cogvideox", "wan"):
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        moments = (cogvideox_encode if name == "cogvideox" else wan_encode)(vae, x)
        return DiagonalGaussianDistribution(moments).mode()
    return encode(name, vae, x)
