"""halo_conv (interior computed while the halo travels) against the single-device conv.

The split path runs the same conv arithmetic on three windows instead of one tensor; a
blocked CPU kernel may round differently, so float64 results get 1e-12. Weight and bias
gradients are per-rank partial sums, summed over ranks before comparing (reordered sums).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from haloshard import HaloError
from haloshard._conv import halo_conv
from haloshard.testing import (
    assert_close_per_rank,
    rank_map,
    reference_pad,
    shard,
    simulated_mesh,
    single_device,
    sum_over_ranks,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-12}
# (ndim, T, kernel, dilation, left, right, pad, groups, bias, overlap)
CASES = [
    (3, 17, 3, 1, 1, 1, "zeros", 1, True, True),
    (3, 17, 3, 1, 2, 0, "replicate", 1, True, True),   # causal
    (3, 9, 3, 2, 4, 0, "replicate", 2, False, True),   # dilated causal, grouped, no bias
    (5, 13, 3, 1, 1, 1, "zeros", 4, True, True),       # depthwise conv3d
    (5, 13, 3, 1, 2, 0, "replicate", 1, True, False),  # exchange first
    (4, 5, 3, 1, 1, 1, "reflect", 1, True, True),      # chunks shorter than the kernel
    (3, 2, 3, 1, 1, 1, "zeros", 1, True, True),        # an empty chunk on 3+ ranks
    (3, 3, 1, 1, 0, 0, "zeros", 1, True, True),        # kernel 1: no halo (empty on 4 ranks)
]


def case_conv(mesh: DeviceMesh, ndim: int, length: int, kernel: int, dilation: int,
              left: int, right: int, pad: str, groups: int, bias: bool, overlap: bool,
              transport: str | None = None) -> None:
    world = mesh.size()
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[ndim]
    spatial = (length, 5, 4)[: ndim - 2]
    ks = (kernel, 3, 3)[: ndim - 2]
    with single_device():
        gen = torch.Generator().manual_seed(length + kernel)
        full = torch.randn(2, 4, *spatial, generator=gen, dtype=torch.float64)
        w = torch.randn(8, 4 // groups, *ks, generator=gen, dtype=torch.float64)
        b = torch.randn(8, generator=gen, dtype=torch.float64) if bias else None
        refs = [t.clone().requires_grad_() if t is not None else None for t in (full, w, b)]
        other = (0, 1, 1)[: ndim - 2]
        dil = (dilation, 1, 1)[: ndim - 2]
        ref = conv(reference_pad(refs[0], left, right, 2, pad), refs[1], refs[2],
                   padding=other, dilation=dil, groups=groups)
        upstream = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        (ref * upstream).sum().backward()
    x = rank_map(mesh, lambda r: shard(full, 2, world, r).clone()).requires_grad_()
    wl = w.clone().requires_grad_()
    bl = b.clone().requires_grad_() if b is not None else None
    y = halo_conv(x, wl, bl, dim=2, left=left, right=right, group=mesh, padding=other,
                  dilation=dil, groups=groups, pad=pad, overlap=overlap, transport=transport)
    (y * rank_map(mesh, lambda r: shard(upstream, 2, world, r))).sum().backward()
    assert_close_per_rank(y, lambda r: shard(ref.detach(), 2, world, r), mesh, **TOL)
    assert_close_per_rank(x.grad, lambda r: shard(refs[0].grad, 2, world, r), mesh, **TOL)
    torch.testing.assert_close(sum_over_ranks(wl.grad, mesh), refs[1].grad, **TOL)
    if bl is not None:
        torch.testing.assert_close(sum_over_ranks(bl.grad, mesh), refs[2].grad, **TOL)


def on_gloo() -> None:
    mesh = worker_mesh(dist.get_world_size())
    for case in CASES:
        case_conv(mesh, *case)
    for transport in ("p2p", "allgather"):  # the split path over the other transports
        case_conv(mesh, *CASES[1], transport=transport)


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo(gloo, world: int) -> None:
    gloo(world).run(on_gloo)


@pytest.mark.simulated
@pytest.mark.parametrize("case", CASES)
def test_simulated(case: tuple) -> None:
    with simulated_mesh(3) as mesh:
        case_conv(mesh, *case)


def test_bad_halo_for_kernel() -> None:
    with simulated_mesh(2) as mesh:
        x = rank_map(mesh, lambda r: torch.ones(1, 2, 4))
        with pytest.raises(HaloError, match=r"left \+ right = dilation \* \(kernel - 1\) = 2"):
            halo_conv(x, torch.ones(2, 2, 3), dim=2, left=1, right=0, group=mesh)


def case_styles(mesh: DeviceMesh) -> None:
    """HaloParallel runs a stride-1 conv as halo_conv by default, or exchange-first with
    overlap=False; both give the single-device conv (float64, 1e-12 as above)."""
    import copy

    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from haloshard import HaloParallel

    world = mesh.size()
    with single_device():
        gen = torch.Generator().manual_seed(5)
        conv = torch.nn.Conv3d(4, 6, (3, 3, 3), padding=(1, 1, 1), dtype=torch.float64)
        full = torch.randn(2, 4, 11, 5, 4, generator=gen, dtype=torch.float64)
        ref = conv(full)
    for overlap in (True, False):
        model = parallelize_module(copy.deepcopy(conv), mesh, HaloParallel(overlap=overlap))
        y = model(distribute_tensor(full, mesh, [Shard(2)]))
        assert isinstance(y, DTensor) and y.placements == (Shard(2),)
        assert_close_per_rank(y.to_local(), lambda r: shard(ref.detach(), 2, world, r), mesh,
                              **TOL)


def on_gloo_styles() -> None:
    case_styles(worker_mesh(dist.get_world_size()))


@pytest.mark.gloo
def test_styles_gloo(gloo) -> None:
    gloo(3).run(on_gloo_styles)


@pytest.mark.simulated
def test_styles_simulated() -> None:
    with simulated_mesh(4) as mesh:
        case_styles(mesh)
