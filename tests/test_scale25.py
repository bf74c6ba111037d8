"""Issue 25 ("Real scale"), the misses left at P = 2: against one device.

- Mochi's decode on T and H at once: `mochi_decode` drops the first frames along T with a
  hooked slice; with the video also sharded on H that slice refused ("_DropFirst got an
  input also sharded on dim 3"). Dropping frames along T reads each row alone, so the drop
  keeps each rank's rows (and, with H sharded alone, slices T locally).

Tolerances: float64 at atol = rtol = 1e-10, as tests/test_diffusers_dims.py states: the
sharded run adds the same products in another order (GroupNorm statistics combined across
ranks, K/V gathered, parameter gradients summed over ranks), a few ulps of O(1) values
apart, while a misplaced frame or row is O(1).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import reduce_grads
from haloshard.integrations.diffusers import mochi_decode, plan_for
from haloshard.testing import seeded_randn, simulated_mesh, single_device

pytest.importorskip("diffusers")

TOL = {"atol": 1e-10, "rtol": 1e-10}


def mochi() -> nn.Module:
    from diffusers import AutoencoderKLMochi

    with single_device():  # GroupNorm and attention heads need 32 channels
        torch.manual_seed(0)
        vae = AutoencoderKLMochi(
            encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
            latent_channels=4, layers_per_block=(1,) * 5)
        return vae.double().eval()


def check_decode(mesh: DeviceMesh, vae: nn.Module, plan: dict[str, Any], full: torch.Tensor,
                 placements: list[Any]) -> None:
    """`mochi_decode` of the parallelized `vae` (plan on the mesh's first axis) against
    one device's `vae.decode(z).sample`: the output (still on `placements`), the input
    gradient, every parameter gradient summed over the mesh's axes."""
    with single_device():
        twin = copy.deepcopy(vae)
        z_ref = full.clone().requires_grad_()
        y_ref = twin.decode(z_ref).sample
        gy = seeded_randn(tuple(y_ref.shape), 7, full.dtype)
        (y_ref * gy).sum().backward()
    parallelize_module(vae, mesh[mesh.mesh_dim_names[0]] if mesh.ndim > 1 else mesh, plan)
    z = distribute_tensor(full, mesh, placements).requires_grad_()
    y = mochi_decode(vae, z)
    assert isinstance(y, DTensor) and tuple(y.placements) == tuple(placements), y
    assert y.shape == y_ref.shape, (y.shape, y_ref.shape)
    torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **TOL)
    (y * distribute_tensor(gy, mesh, placements)).sum().backward()
    torch.testing.assert_close(z.grad.full_tensor(), z_ref.grad, **TOL)
    for axis in range(mesh.ndim):
        reduce_grads(vae, mesh, mesh_axis=axis)
    for (name, p), q in zip(vae.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            got = DTensor.from_local(p.grad, mesh, [Replicate()] * mesh.ndim, run_check=False)
            torch.testing.assert_close(got.full_tensor(), q.grad, **TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- Mochi decode on T+H
@pytest.mark.simulated
@pytest.mark.parametrize("shape", [
    # latent T 2, 1 x H 2, 1 -> 12, 6 frames -> drop 5: 13 as 7, 6, rank 0's last frame
    # from rank 1; rows 2, 1 -> x8: 16, 8 (uneven)
    (1, 4, 3, 3, 2),
    # latent T 1, 0 -> 6, 0 frames -> 1, 0 (an empty shard on t); rows 1, 0 (empty on h)
    (1, 4, 1, 1, 2),
    # latent T 2, 2 -> 12, 12 -> 19 as 10, 9: every rank takes 5 frames from the next
    (1, 4, 4, 2, 2),
])
def test_mochi_decode_time_rows_simulated(shape: tuple[int, ...]) -> None:
    """`mochi_decode` on `[Shard(2), Shard(3)]` on a 2x2 `(t, h)` mesh (`plan_for(vae,
    dims=(2, 3))`): output, input gradient and every parameter gradient; the video stays
    `[Shard(2), Shard(3)]`."""
    vae = mochi()
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        check_decode(mesh, vae, plan_for(vae, dims=(2, 3)),
                     seeded_randn(shape, 1, torch.float64), [Shard(2), Shard(3)])


@pytest.mark.simulated
def test_mochi_decode_rows_simulated() -> None:
    """`mochi_decode` with H sharded alone (T whole on every rank): as `vae.decode`."""
    vae = mochi()
    with simulated_mesh(2) as mesh:
        check_decode(mesh, vae, plan_for(vae, dims=(3,)),
                     seeded_randn((1, 4, 2, 3, 2), 1, torch.float64), [Shard(3)])

