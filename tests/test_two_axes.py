"""Halos on two mesh axes: T and H sharded at once on a `(t, h)` mesh (and a `dp` axis).

A conv whose input DTensor is `[Shard(2), Shard(3)]` exchanges its T halo on the `t` axis,
then its H halo on the `h` axis over the T-extended window, so the corners a 3x3x3 kernel
reads from its diagonal neighbour arrive with the second exchange. `GroupNormParallel`
combines its statistics over both axes. Checked against one device: output, input gradient
and every parameter gradient (summed over both axes), uneven and empty shards on either
axis, halos longer than a chunk (kernel 5), strided convs, every padding mode, and a third
`dp` axis sharding the batch. Float64; the sums are the single device's, taken in another
order (windows, per-rank partial gradients): 1e-12 bounds that, while a misplaced slice or
corner is O(1).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import (
    CausalConvParallel,
    FirstFrameParallel,
    GroupNormParallel,
    HaloError,
    HaloParallel,
    HaloShard,
    LocalParallel,
    reduce_grads,
)
from haloshard.testing import (
    seeded_module,
    seeded_randn,
    simulated_mesh,
    single_device,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-10}


def _model(pad_mode: str, seed: int) -> nn.Module:
    return seeded_module(nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1, padding_mode=pad_mode),   # corners from diagonals
        nn.GroupNorm(2, 4), nn.SiLU(),
        nn.Conv3d(4, 4, (5, 5, 3), padding=(2, 2, 1)),           # halos of 2: multi-hop
        nn.Conv3d(4, 3, 3, stride=2, padding=1),                 # strided on both dims
    ), seed).double()


def _plan() -> dict[str, Any]:
    return {"0": HaloParallel(), "1": GroupNormParallel(), "3": HaloParallel(),
            "4": HaloParallel()}


def case_two_axes(mesh: DeviceMesh, length: int, height: int, pad_mode: str, seed: int
                  ) -> None:
    batch = 2 if "dp" in (mesh.mesh_dim_names or ()) else 1
    check_two_axes(mesh, _model(pad_mode, seed), _plan(), (batch, 2, length, height, 4), seed)


def _kinds(seed: int) -> nn.Module:
    """The other layer kinds whose halo is derived: transposed conv (strided), pooling,
    resampling (nearest and trilinear), a dilated conv."""
    return seeded_module(nn.Sequential(
        nn.ConvTranspose3d(2, 3, 3, stride=2, padding=1, output_padding=1),
        nn.MaxPool3d(3, stride=1, padding=1),
        nn.AvgPool3d(2),
        nn.Upsample(scale_factor=2, mode="trilinear"),
        nn.Conv3d(3, 2, 3, padding=2, dilation=2, padding_mode="replicate"),
        nn.Upsample(scale_factor=2, mode="nearest"),
    ), seed).double()


def case_kinds(mesh: DeviceMesh, length: int, height: int, seed: int) -> None:
    plan = {str(i): HaloParallel() for i in range(6)}
    check_two_axes(mesh, _kinds(seed), plan, (1, 2, length, height, 3), seed)


class Causal(nn.Module):
    """A causal wrapper: pads T itself (`mode`), then a conv (3x3 spatially, zero padding
    of its own, or `F.pad` of H too with `pad_h`), any stride on T."""

    def __init__(self, mode: str = "constant", stride: int = 1, pad_h: bool = False) -> None:
        super().__init__()
        self.mode, self.pad_h = mode, pad_h
        self.conv = nn.Conv3d(2, 2, 3, stride=(stride, 1, 1),
                              padding=(0, 0 if pad_h else 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = 1 if self.pad_h else 0
        return self.conv(torch.nn.functional.pad(x, (0, 0, h, h, 2, 0), mode=self.mode))


class TimeDown(nn.Module):
    """Keep the first frame, average each following pair (per pixel: local along H)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rest = x[:, :, 1:]
        n = rest.shape[2] // 2 * 2
        return torch.cat([x[:, :, :1], (rest[:, :, 0:n:2] + rest[:, :, 1:n:2]) / 2], dim=2)


def _wrappers(seed: int) -> nn.Module:
    return seeded_module(nn.Sequential(
        Causal(),                                   # explicit spec: T zeros, H from its conv
        Causal("replicate", stride=2),              # CausalConvParallel, stride 2 on T
        nn.Conv3d(2, 2, 1),                         # LocalParallel: per-slice along T and H
        TimeDown(),                                 # FirstFrameParallel, local along H
    ), seed).double()


def _wrapper_plan() -> dict[str, Any]:
    return {"0": HaloParallel(HaloShard(2, left=2)), "1": CausalConvParallel(),
            "2": LocalParallel(), "3": FirstFrameParallel(2, "down", even="first", local_dims=(3,))}


def case_wrappers(mesh: DeviceMesh, length: int, height: int, seed: int) -> None:
    """Causal wrappers (explicit spec, CausalConvParallel), a 1x1 conv and a first-frame
    resampler on T+H: the wrappers' T halo from their spec, their H halo from the one conv
    inside; the others run on the H chunk."""
    check_two_axes(mesh, _wrappers(seed), _wrapper_plan(), (1, 2, length, height, 3), seed)


def check_two_axes(mesh: DeviceMesh, model: nn.Module, plan: dict[str, Any],
                   shape: tuple[int, ...], seed: int) -> None:
    """`model` with `plan` on T and H sharded (the batch too on a `dp` axis) against one
    device: output, input gradient, every parameter gradient summed over the axes."""
    names = mesh.mesh_dim_names or ()
    placements = [Shard(0) if n == "dp" else Shard(2) if n == "t" else Shard(3)
                  for n in names]
    with single_device():
        full = seeded_randn(shape, seed)
        twin = copy.deepcopy(model)
        x_ref = full.clone().requires_grad_()
        y_ref = twin(x_ref)
        gy = seeded_randn(tuple(y_ref.shape), seed + 1)
        (y_ref * gy).sum().backward()
    parallelize_module(model, mesh["t"], plan)
    x = distribute_tensor(full, mesh, placements).requires_grad_()
    y = model(x)
    assert isinstance(y, DTensor) and tuple(y.placements) == tuple(placements)
    assert y.shape == y_ref.shape, (y.shape, y_ref.shape)
    torch.testing.assert_close(y.full_tensor(), y_ref.detach(), **TOL)
    (y * distribute_tensor(gy, mesh, placements)).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, **TOL)
    for axis in names:
        reduce_grads(model, mesh, mesh_axis=axis)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        got = DTensor.from_local(p.grad, mesh, [Replicate()] * mesh.ndim, run_check=False)
        torch.testing.assert_close(got.full_tensor(), q.grad, **TOL)
    with torch.no_grad():  # inference: real ranks build each two-axis window in one buffer
        torch.testing.assert_close(model(x.detach()).full_tensor(), y_ref.detach(), **TOL)


def case_refusal(mesh: DeviceMesh) -> None:
    """What cannot take H's halo raises, naming the dim, instead of running on a window
    without it: a wrapper that pads H itself, a module not known to be per-slice along H."""
    with single_device():
        full = seeded_randn((1, 2, 4, 4, 4), 1)
    x = distribute_tensor(full, mesh, [Shard(2), Shard(3)])
    padded = Causal(pad_h=True).double()
    parallelize_module(padded, mesh["t"], HaloParallel(HaloShard(2, left=2)))
    with pytest.raises(HaloError, match=r"pads dim 3 itself"):
        padded(x)
    down = TimeDown()
    parallelize_module(down, mesh["t"], FirstFrameParallel(2, "down", even="first"))
    with pytest.raises(HaloError, match=r"also sharded on dim 3.*local_dims=\(3,\)"):
        down(x)
    norm = TimeDown()
    parallelize_module(norm, mesh["t"], LocalParallel())
    with pytest.raises(HaloError, match=r"also sharded on dim 3.*local_dims=\(3,\)"):
        norm(x)


# (T, H): uneven on both; a chunk shorter than kernel 5's halo of 2; an empty shard on t;
# an empty shard on h
GEOMETRIES = [(7, 6), (3, 5), (1, 4), (4, 1)]


@pytest.mark.simulated
@pytest.mark.parametrize(("length", "height"), GEOMETRIES)
@pytest.mark.parametrize("pad_mode", ["zeros", "replicate", "reflect", "circular"])
def test_two_axes_simulated(length: int, height: int, pad_mode: str) -> None:
    if pad_mode in ("reflect", "circular") and min(length, height) < 2:
        pytest.skip("the single-device conv cannot reflect or wrap a length-1 dim")
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        case_two_axes(mesh, length, height, pad_mode, 3)


@pytest.mark.simulated
def test_with_dp_axis_simulated() -> None:
    with simulated_mesh((2, 2, 2), mesh_dim_names=("dp", "t", "h")) as mesh:
        case_two_axes(mesh, 5, 5, "zeros", 4)


@pytest.mark.simulated
@pytest.mark.parametrize(("length", "height"), [(7, 4), (9, 6)])
def test_wrappers_simulated(length: int, height: int) -> None:
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        case_wrappers(mesh, length, height, 7)


@pytest.mark.simulated
@pytest.mark.parametrize(("length", "height"), [(4, 6), (5, 3)])
def test_kinds_simulated(length: int, height: int) -> None:
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        case_kinds(mesh, length, height, 9)


@pytest.mark.simulated
def test_refusal_simulated() -> None:
    with simulated_mesh((2, 2), mesh_dim_names=("t", "h")) as mesh:
        case_refusal(mesh)


def on_gloo() -> None:
    mesh = worker_mesh((2, 2), mesh_dim_names=("t", "h"))
    for length, height in GEOMETRIES:
        case_two_axes(mesh, length, height, "zeros", 5)
    case_two_axes(mesh, 6, 5, "circular", 6)
    for length, height in [(7, 5), (3, 3), (9, 1)]:  # uneven, one frame or row on a rank
        case_wrappers(mesh, length, height, 8)
    case_kinds(mesh, 5, 3, 9)
    case_refusal(mesh)


@pytest.mark.gloo
def test_two_axes_gloo(gloo: Callable[[int], Any]) -> None:
    assert dist.is_available()
    gloo(4).run(on_gloo, timeout=300)


@pytest.mark.parametrize("local_dims", [(2,), [3], (1,), (3.0,)])
def test_local_dims_checked(local_dims: Any) -> None:
    """`local_dims` must be a tuple of spatial dims other than the sharded one."""
    for style in (lambda: LocalParallel(local_dims=local_dims),
                  lambda: FirstFrameParallel(2, "down", local_dims=local_dims)):
        with pytest.raises(HaloError, match=r"local_dims as a tuple of spatial dims"):
            style()
