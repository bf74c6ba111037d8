"""diffusers' Wan 2.1 VAE with T sharded gives exactly `vae._encode(x)` and
`vae._decode(z)` (the chunk loops with their feature caches), forward, input gradient and
parameter gradients.

A tiny random-init `AutoencoderKLWan` (unmodified diffusers 0.42.1; two temporal
downsamplings, the mid-block's attention on), float64, T = 1 + 4n frames over 2 to 4 ranks:
uneven chunks and an empty last shard (T=9 on 4 ranks: 3, 3, 3, 0; 5 frames after the first
downsampling: 2, 2, 1, 0); the decoder on T = 2 to 5 latent frames, whose upsamplings give
1 + 2 (T - 1) and then 1 + 4 (T - 1) frames. Tolerance: the sharded run computes the same
products, summed in another order (windows, partial parameter gradients added over ranks), in
float64 with O(1) values through a few dozen layers: 1e-10 bounds that, while a wrong frame is
O(1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import HaloError
from haloshard.testing import (
    check_plan,
    seeded_randn,
    sharded,
    simulated_mesh,
    single_device,
    worker_mesh,
)

diffusers = pytest.importorskip("diffusers")

TOL = {"atol": 1e-10, "rtol": 1e-8}


def tiny_wan(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2],
                                     num_res_blocks=1, temperal_downsample=[True, True])
    return vae.double()


def case_encode(mesh: DeviceMesh, length: int, seed: int) -> None:
    from haloshard.integrations.diffusers import wan_encode, wan_encoder_plan

    vae = tiny_wan(seed)
    check_plan(mesh, vae, wan_encoder_plan(vae), seeded_randn((1, 3, length, 16, 16), seed),
               seed + 1, run=wan_encode, reference=lambda m, x: m._encode(x), **TOL)


def case_decode(mesh: DeviceMesh, length: int, seed: int) -> None:
    from haloshard.integrations.diffusers import wan_decode, wan_decoder_plan

    vae = tiny_wan(seed)
    # small latents keep the clamp to [-1, 1] inactive: its gradient is then exact too
    z = 0.3 * seeded_randn((1, 4, length, 4, 4), seed)
    check_plan(mesh, vae, wan_decoder_plan(vae), z, seed + 1, run=wan_decode,
               reference=lambda m, t: m._decode(t).sample, **TOL)


def case_refusals(mesh: DeviceMesh, seed: int) -> None:
    from haloshard.integrations.diffusers import wan_encode, wan_encoder_plan

    with single_device():
        vae = tiny_wan(seed)
    parallelize_module(vae, mesh, wan_encoder_plan(vae))
    with pytest.raises(HaloError, match="T=8; expected T % 4 == 1"):
        wan_encode(vae, sharded(mesh, torch.zeros(1, 3, 8, 16, 16, dtype=torch.float64))[0])
    with pytest.raises(HaloError, match="AutoencoderKLWan, got Conv3d"):
        wan_encoder_plan(nn.Conv3d(1, 1, 1))


@pytest.mark.simulated
@pytest.mark.parametrize(("world", "length"), [(2, 13), (3, 9), (4, 9)])
def test_encode_simulated(world: int, length: int) -> None:
    with simulated_mesh(world) as mesh:
        case_encode(mesh, length, 3)
        if world == 2:
            case_refusals(mesh, 4)


@pytest.mark.simulated
@pytest.mark.parametrize(("world", "length"), [(2, 3), (3, 5), (4, 2)])
def test_decode_simulated(world: int, length: int) -> None:
    with simulated_mesh(world) as mesh:
        case_decode(mesh, length, 7)


def on_gloo(lengths: tuple[int, ...], decoded: tuple[int, ...]) -> None:
    mesh = worker_mesh(dist.get_world_size())
    for length in lengths:
        case_encode(mesh, length, 5)
    for length in decoded:
        case_decode(mesh, length, 8)


@pytest.mark.gloo
@pytest.mark.parametrize(("world", "lengths", "decoded"), [(3, (13,), (4,)), (4, (9,), (3,))])
def test_wan_gloo(gloo: Callable[[int], Any], world: int, lengths: tuple[int, ...],
                  decoded: tuple[int, ...]) -> None:
    gloo(world).run(on_gloo, lengths, decoded, timeout=300)
