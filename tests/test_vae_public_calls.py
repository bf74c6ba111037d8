"""The public calls users make on a parallelized diffusers VAE, against one device.

- `vae.encode(x).latent_dist.mode()` in training: diffusers' `DiagonalGaussianDistribution`
  chunks the moments, and torch's backward of the chunk fills the unused half's gradient
  with plain zeros, which DTensor refused to cat with the DTensor half (issue 25).
- `mochi_decode(vae, z)`: `vae.decode(z).sample` of Mochi with the video left `Shard(2)`
  (DTensor runs the decode's final slice along T by gathering the whole video).

Tolerances: float64 at atol = rtol = 1e-10, as tests/test_diffusers.py states: the sharded
run adds the same products in another order (GroupNorm statistics across ranks, parameter
gradients summed over ranks), a few ulps of O(1) values, while a misplaced frame is O(1).
Pure data moves (zero fills, the slice) are compared exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import HaloError
from haloshard._dtensor_ops import install
from haloshard.integrations.diffusers import mochi_decode, plan_for
from haloshard.testing import (
    check_plan,
    seeded_randn,
    shard,
    sharded,
    simulated_mesh,
    single_device,
    worker_mesh,
)

pytest.importorskip("diffusers")

TOL = {"atol": 1e-10, "rtol": 1e-10}


def hunyuan() -> torch.nn.Module:
    from diffusers import AutoencoderKLHunyuanVideo

    with single_device():
        torch.manual_seed(0)
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=2,
            spatial_compression_ratio=4, temporal_compression_ratio=4)
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
        return vae.double().eval()


def mochi() -> torch.nn.Module:
    from diffusers import AutoencoderKLMochi

    with single_device():  # GroupNorm and attention heads need 32 channels
        torch.manual_seed(0)
        vae = AutoencoderKLMochi(
            encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
            latent_channels=4, layers_per_block=(1,) * 5)
        return vae.double().eval()


def mode(vae: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The public training call: the posterior mode."""
    return vae.encode(x).latent_dist.mode()


def case_encode_mode(mesh: Any, name: str, frames: int) -> None:
    vae, size = (hunyuan(), 8) if name == "hunyuan" else (mochi(), 16)
    x = seeded_randn((1, 3, frames, size, size), 1)
    check_plan(mesh, vae, plan_for(vae), x, 2, run=mode, reference=mode, **TOL)


def case_mochi_decode(mesh: Any, latent_frames: int) -> None:
    vae = mochi()
    z = seeded_randn((1, 4, latent_frames, 2, 2), 3)
    check_plan(mesh, vae, plan_for(vae), z, 4, run=mochi_decode,
               reference=lambda m, t: m.decode(t).sample, **TOL)


@pytest.mark.simulated
@pytest.mark.parametrize(("name", "frames", "world"), [
    # 9 frames as 3, 3, 3 -> 3 latent frames, one per rank. The latent shards are even:
    # torch's own to_local backward (check_plan's cotangent) gives per-rank strides for
    # uneven ones, which simulated ranks cannot hash in DTensor's cat
    ("hunyuan", 9, 3),
    ("mochi", 7, 2),  # 4, 3 -> 2 latent frames: 1, 1
])
def test_encode_mode_simulated(name: str, frames: int, world: int) -> None:
    with simulated_mesh(world) as mesh:
        case_encode_mode(mesh, name, frames)


@pytest.mark.simulated
@pytest.mark.parametrize(("latent_frames", "world"), [
    (3, 2),  # 18 frames as 9, 9 -> drop 5: 13 as 7, 6, rank 0's from both ranks
    (3, 4),  # 18 as 5, 5, 5, 3 -> 13 as 4, 4, 4, 1: shifted across every boundary
    (1, 3),  # 6 as 2, 2, 2 -> 1 frame left, on rank 0, taken from rank 2
])
def test_mochi_decode_simulated(latent_frames: int, world: int) -> None:
    with simulated_mesh(world) as mesh:
        case_mochi_decode(mesh, latent_frames)


@pytest.mark.simulated
def test_mochi_decode_output_is_sharded() -> None:
    """Each rank holds only its chunk of the video (`vae.decode` gathers all of it)."""
    vae = mochi()
    z = seeded_randn((1, 4, 3, 2, 2), 3)
    with single_device():
        want = vae.decode(z).sample
    with simulated_mesh(4) as mesh:
        parallelize_module(vae, mesh, plan_for(vae))
        y = mochi_decode(vae, sharded(mesh, z)[0])
        assert isinstance(y, DTensor) and y.placements == (Shard(2),)
        assert y.shape == want.shape == (1, 3, 13, 16, 16)
        for r, size in enumerate((4, 4, 4, 1)):
            assert y.to_local()._local_tensors[r].shape[2] == size  # type: ignore[attr-defined]
        assert isinstance(vae.decode(sharded(mesh, z)[0]).sample, DTensor)


def test_mochi_decode_errors() -> None:
    vae = mochi()
    vae.use_framewise_decoding = True
    with pytest.raises(HaloError, match="use_framewise_decoding is on"):
        mochi_decode(vae, torch.zeros(1, 4, 3, 2, 2, dtype=torch.float64))
    with pytest.raises(HaloError, match="expected diffusers' AutoencoderKLMochi, got Linear"):
        mochi_decode(torch.nn.Linear(2, 2), torch.zeros(1, 2))


def test_mochi_decode_one_device() -> None:
    """On plain tensors it is the public call itself."""
    vae = mochi()
    z = seeded_randn((1, 4, 2, 2, 2), 3)
    torch.testing.assert_close(mochi_decode(vae, z), vae.decode(z).sample, atol=0, rtol=0)


def views(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A multi-output view of which only the first output is used."""
    return {
        "chunk": lambda t: torch.chunk(t, 2, dim=1)[0],
        "split": lambda t: torch.split(t, [1, 3], dim=1)[0],
        "unbind": lambda t: torch.unbind(t, dim=1)[1],
        "chunk_sharded_dim": lambda t: torch.chunk(t, 2, dim=2)[1],
    }[kind]


@pytest.mark.simulated
@pytest.mark.parametrize("kind", ["chunk", "split", "unbind", "chunk_sharded_dim"])
def test_unused_view_outputs(kind: str) -> None:
    """The gradient through one output of a multi-output view of a `Shard(2)` DTensor, the
    others unused (their zero fills were plain tensors): exact, it only moves data."""
    install()
    full = seeded_randn((1, 4, 6, 2, 2), 1)
    gy_full = seeded_randn(tuple(views(kind)(full).shape), 2)
    with single_device():
        ref = full.clone().requires_grad_()
        (views(kind)(ref * 2) * gy_full).sum().backward()
    with simulated_mesh(2) as mesh:
        x, local = sharded(mesh, full)
        y = views(kind)(x * 2)
        gy = DTensor.from_local(gy_full, mesh, [Replicate()]).redistribute(mesh, y.placements)
        (y * gy).sum().backward()
        for r in range(2):
            torch.testing.assert_close(local.grad._local_tensors[r],  # type: ignore[union-attr]
                                       shard(ref.grad, 2, 2, r), atol=0, rtol=0)


@pytest.mark.simulated
def test_mixed_cat_elsewhere_still_refused() -> None:
    """Outside those backward nodes a plain tensor beside a DTensor is refused as before,
    and so is a nonzero one inside (a tensor hook on a view's output runs in its node)."""
    install()
    mixed = r"got mixed torch\.Tensor and DTensor"
    with simulated_mesh(2) as mesh:
        x, _ = sharded(mesh, seeded_randn((1, 2, 4, 1, 1), 1))
        with single_device():
            zeros = torch.zeros(1, 2, 4, 1, 1, dtype=torch.float64)
            ones = torch.ones(1, 1, 4, 1, 1, dtype=torch.float64)
        with pytest.raises(RuntimeError, match=mixed):
            torch.cat([x, zeros], dim=1)
        first = torch.chunk(x * 2, 2, dim=1)[0]
        first.register_hook(lambda g: torch.cat([g, ones], dim=1)[:, :1])
        with pytest.raises(RuntimeError, match=mixed):
            first.sum().backward()


def on_gloo() -> None:
    mesh = worker_mesh(dist.get_world_size())
    case_encode_mode(mesh, "hunyuan", 9)  # 3 latent frames as 2, 1: uneven, real ranks
    case_encode_mode(mesh, "mochi", 7)
    case_mochi_decode(mesh, 3)


@pytest.mark.gloo
def test_gloo(gloo: Callable[[int], Any]) -> None:
    gloo(2).run(on_gloo, timeout=300)
