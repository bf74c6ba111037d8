"""A diffusers video VAE encoding and decoding a clip with T sharded over gloo ranks.

A tiny random-init video VAE of diffusers 0.42.1 (`--model hunyuan`, `cogvideox`, `mochi`,
`ltx`, `wan`: the real configuration, causal convs, norms, attention, temporal down- and
upsampling; fewer channels) is parallelized with
`haloshard.integrations.diffusers.plan_for` (Wan: `wan_encoder_plan` and `wan_decoder_plan`,
whose `wan_encode` / `wan_decode` equal its chunk loops `_encode` / `_decode`) and run on P
processes. Each
rank also runs the single-device model and prints the largest difference of its shard, and
the activation bytes autograd keeps for a backward through encode + decode (the training
peak) against one device:

    python examples/diffusers_vae.py --model hunyuan --ranks 4

(LTX's difference is about 1e-7: diffusers' RMSNorm computes in float32.)
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from haloshard.integrations.diffusers import (
    plan_for,
    wan_decode,
    wan_decoder_plan,
    wan_encode,
    wan_encoder_plan,
)
from haloshard.testing import GlooWorld, shard, worker_mesh


def hunyuan(channels: int) -> nn.Module:
    from diffusers import AutoencoderKLHunyuanVideo

    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4, block_out_channels=(channels,) * 3, layers_per_block=1,
        down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, norm_num_groups=4,
        spatial_compression_ratio=4, temporal_compression_ratio=4)
    # on by default: long clips would be encoded and decoded in blended temporal tiles
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    return vae


def cogvideox(channels: int) -> nn.Module:
    from diffusers import AutoencoderKLCogVideoX

    return AutoencoderKLCogVideoX(
        latent_channels=4, block_out_channels=(channels,) * 3, layers_per_block=1,
        down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3, norm_num_groups=4)


def mochi(channels: int) -> nn.Module:
    from diffusers import AutoencoderKLMochi

    width = max(32, channels // 32 * 32)  # its GroupNorm and attention heads need 32
    return AutoencoderKLMochi(encoder_block_out_channels=(width,) * 4,
                              decoder_block_out_channels=(width,) * 4, latent_channels=4,
                              layers_per_block=(1,) * 5)


def ltx(channels: int) -> nn.Module:
    from diffusers import AutoencoderKLLTXVideo

    return AutoencoderKLLTXVideo(
        latent_channels=4, block_out_channels=(channels,) * 4,
        decoder_block_out_channels=(channels,) * 4, layers_per_block=(1,) * 5,
        decoder_layers_per_block=(1,) * 5)


def wan(channels: int) -> nn.Module:
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=channels, z_dim=LATENT, dim_mult=[1, 2, 2],
                            num_res_blocks=1, temperal_downsample=[True, True])


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "hunyuan": hunyuan, "cogvideox": cogvideox, "mochi": mochi, "ltx": ltx, "wan": wan}
LATENT = 4


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def encode_decode(vae: nn.Module, x: torch.Tensor) -> tuple[Any, Any]:
    """The posterior mean of `vae.encode(x)` and its decoding, as the VAE computes them
    (without its frame batching, tiling and slicing; Wan: its chunk loops)."""
    if type(vae).__name__ == "AutoencoderKLWan":
        if isinstance(x, DTensor):
            z = wan_encode(vae, x)[:, :LATENT]
            return z, wan_decode(vae, z)
        z = vae._encode(x)[:, :LATENT]
        return z, vae._decode(z).sample
    h = _first(vae.encoder(x))
    if getattr(vae, "quant_conv", None) is not None:
        h = vae.quant_conv(h)
    z = h[:, :LATENT]
    post = getattr(vae, "post_quant_conv", None)
    return z, _first(vae.decoder(post(z) if post is not None else z))


@contextmanager
def saved_bytes() -> Iterator[dict[str, int]]:
    """Bytes of the distinct storages autograd saves for the backward (DTensors: local)."""
    seen: dict[int, int] = {}
    out = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
        out["bytes"] = sum(seen.values())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out


def on_rank(model: str, frames: int, size: int, channels: int) -> dict[str, float]:
    mesh = worker_mesh(dist.get_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    vae = MODELS[model](channels).double().eval()
    x = torch.randn(1, 3, frames, size, size, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)
    with saved_bytes() as single:
        z_ref, y_ref = encode_decode(vae, x.requires_grad_())
    sharded_vae = copy.deepcopy(vae)
    plan = ({**wan_encoder_plan(sharded_vae), **wan_decoder_plan(sharded_vae)} if model == "wan"
            else plan_for(sharded_vae))
    parallelize_module(sharded_vae, mesh, plan)
    local = shard(x.detach(), 2, world, rank).requires_grad_()
    xs = DTensor.from_local(local, mesh, [Shard(2)], shape=x.shape, stride=x.stride())
    with saved_bytes() as mine:
        z, y = encode_decode(sharded_vae, xs)
    diff = {name: (got.to_local() - shard(ref, 2, world, rank)).abs().amax().item()
            if got.to_local().numel() else 0.0
            for name, got, ref in (("latent", z, z_ref), ("video", y, y_ref))}
    return {**diff, "frames": float(local.shape[2]), "MiB": mine["bytes"] / 2**20,
            "single MiB": single["bytes"] / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="hunyuan")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=16)
    args = parser.parse_args()
    with GlooWorld(args.ranks, timeout=600) as world:
        rows = world.run(on_rank, args.model, args.frames, args.size, args.channels)
    print(f"{args.model}: T={args.frames}, {args.size}x{args.size}, float64, "
          f"{args.ranks} gloo ranks")
    for key in ("latent", "video"):
        print(f"  max |sharded - single| {key}: {max(r[key] for r in rows):.3e}")
    single = rows[0]["single MiB"]
    print(f"  activations kept for backward, single device: {single:.2f} MiB")
    for rank, row in enumerate(rows):
        print(f"  rank {rank} ({int(row['frames'])} frames): {row['MiB']:.2f} MiB "
              f"({row['MiB'] / single:.2f} of single; 1/P = {1 / args.ranks:.2f})")


if __name__ == "__main__":
    main()
