"""GroupNorm with T sharded: exact statistics from per-rank (count, mean, M2) sums.

float64 results match `F.group_norm` on the full tensor to 1e-10: the statistics are the same
sums taken in another order (Chan's combination), a few ulps apart. bfloat16 inputs are
compared with a float64 reference at 2 bf16 ulps of the output's scale (|y| < ~4): the op
computes in float32 and rounds once to bfloat16 at the end.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from haloshard import HaloError, group_norm
from haloshard.testing import (
    assert_close_per_rank,
    rank_map,
    shard,
    simulated_mesh,
    single_device,
    sum_over_ranks,
    worker_mesh,
)

# (channels, groups, T): groups of one channel, several channels, one group; T uneven/empty.
GEOMETRY = [(6, 3, 7), (8, 2, 5), (4, 1, 9), (4, 4, 3)]
# float32: the statistics are sums rounded in float32 (about 1e-7 relative each) and the
# output is under ~4 (unit variance, a weight of randn): 1e-5 is some 80 ulps of it, far
# below a statistic taken over the wrong slices (O(0.1)).
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2 * 2**-8 * 4}


def case_group_norm(mesh: DeviceMesh, channels: int, groups: int, length: int,
                    dtype: torch.dtype, layout: torch.memory_format = torch.contiguous_format,
                    batch: int = 2) -> None:
    world = mesh.size()
    with single_device():
        gen = torch.Generator().manual_seed(channels * 10 + length)
        # an offset, so naive sum-of-squares would cancel
        full = torch.randn(batch, channels, length, 3, 2, generator=gen,
                           dtype=torch.float64) * 3 + 5
        weight = torch.randn(channels, generator=gen, dtype=torch.float64)
        bias = torch.randn(channels, generator=gen, dtype=torch.float64)
        upstream = torch.randn(full.shape, generator=gen, dtype=torch.float64)
        ref_in = full.clone().requires_grad_()
        ref_w, ref_b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        ref = F.group_norm(ref_in, groups, ref_w, ref_b, 1e-5)
        (ref * upstream).sum().backward()
    x = rank_map(mesh, lambda r: shard(full, 2, world, r).to(dtype).contiguous(
        memory_format=layout)).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    b = bias.to(dtype).requires_grad_()
    y = group_norm(x, groups, w, b, 1e-5, mesh)
    (y * rank_map(mesh, lambda r: shard(upstream, 2, world, r).to(dtype))).sum().backward()
    tol = TOL[dtype]
    assert_close_per_rank(y, lambda r: shard(ref, 2, world, r).detach().to(dtype), mesh,
                          atol=tol, rtol=0)
    if type(y) is torch.Tensor:  # as one device's GroupNorm: the output in x's layout
        assert y.is_contiguous(memory_format=layout), y.stride()
    if dtype != torch.float64:
        return  # gradients in bfloat16 are checked by the float64 case's exactness
    assert_close_per_rank(x.grad, lambda r: shard(ref_in.grad, 2, world, r), mesh, atol=tol)
    for got, want in ((w.grad, ref_w.grad), (b.grad, ref_b.grad)):
        torch.testing.assert_close(sum_over_ranks(got, mesh), want, atol=tol, rtol=0)


# (channels, groups, segment lengths, sharded dim): segments inside a shard, across shard
# edges, of one slice, on the last dim
SEGMENTED = [(6, 3, (3, 2, 2), 2), (4, 2, (1, 4), 2), (4, 1, (5, 1, 3), 3), (8, 4, (2, 3), 4)]


def case_segmented(mesh: DeviceMesh, channels: int, groups: int,
                   segments: tuple[int, ...], dim: int) -> None:
    """Each segment normalised alone, as a loop of `F.group_norm` over frame batches."""
    world, length = mesh.size(), sum(segments)
    with single_device():
        gen = torch.Generator().manual_seed(channels + length)
        shape = [2, channels, 3, 2, 2]
        shape[dim] = length
        full = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 5
        weight, bias = (torch.randn(channels, generator=gen, dtype=torch.float64)
                        for _ in range(2))
        upstream = torch.randn(full.shape, generator=gen, dtype=torch.float64)
        ref_in = full.clone().requires_grad_()
        ref_w, ref_b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        ref = torch.cat([F.group_norm(part, groups, ref_w, ref_b, 1e-5)
                         for part in ref_in.split(segments, dim)], dim)
        (ref * upstream).sum().backward()
    x = rank_map(mesh, lambda r: shard(full, dim, world, r).clone()).requires_grad_()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    y = group_norm(x, groups, w, b, 1e-5, mesh, segments=segments, dim=dim)
    (y * rank_map(mesh, lambda r: shard(upstream, dim, world, r))).sum().backward()
    assert_close_per_rank(y, lambda r: shard(ref, dim, world, r).detach(), mesh, atol=1e-10,
                          rtol=0)
    assert_close_per_rank(x.grad, lambda r: shard(ref_in.grad, dim, world, r), mesh,
                          atol=1e-10, rtol=0)
    for got, want in ((w.grad, ref_w.grad), (b.grad, ref_b.grad)):
        torch.testing.assert_close(sum_over_ranks(got, mesh), want, atol=1e-10, rtol=0)


@pytest.mark.simulated
@pytest.mark.parametrize(("channels", "groups", "segments", "dim"), SEGMENTED)
def test_segmented_simulated(channels: int, groups: int, segments: tuple[int, ...],
                             dim: int) -> None:
    with simulated_mesh(3) as mesh:
        case_segmented(mesh, channels, groups, segments, dim)


def on_gloo(dtype: torch.dtype) -> None:
    mesh = worker_mesh(dist.get_world_size())
    for channels, groups, length in GEOMETRY:
        case_group_norm(mesh, channels, groups, length, dtype)
        if dtype != torch.bfloat16:  # channels-last chunks, as Mochi's and LTX's convs leave them
            for batch in (1, 2):  # batch 1: normalised as one row of B * C channels
                case_group_norm(mesh, channels, groups, length, dtype, torch.channels_last_3d,
                                batch)
            case_group_norm(mesh, channels, groups, length, dtype, batch=1)
    if dtype == torch.float64:
        for geometry in SEGMENTED:
            case_segmented(mesh, *geometry)


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo(gloo, world: int) -> None:
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        gloo(world).run(on_gloo, dtype)


@pytest.mark.simulated
@pytest.mark.parametrize(("channels", "groups", "length", "dtype"),
                         [(*g, torch.float64) for g in GEOMETRY] + [(6, 3, 7, torch.bfloat16)])
def test_simulated(channels: int, groups: int, length: int, dtype: torch.dtype) -> None:
    with simulated_mesh(4) as mesh:
        case_group_norm(mesh, channels, groups, length, dtype)


def test_channels_not_divisible() -> None:
    with simulated_mesh(2) as mesh, pytest.raises(HaloError, match="num_groups=4"):
        group_norm(rank_map(mesh, lambda r: torch.ones(1, 6, 2)), 4, None, None, 1e-5, mesh)


def test_double_backward_refused() -> None:
    """`_GroupNormFn`'s backward treats the statistics as constants: a graph built through it
    (create_graph) would give silently wrong second-order gradients, so it raises instead
    (on every rank alike: each rank runs the same backward)."""
    with simulated_mesh(2) as mesh:
        x = rank_map(mesh, lambda r: torch.randn(
            1, 4, 3, 2, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        ).requires_grad_()
        y = group_norm(x, 2, None, None, 1e-5, mesh)
        with pytest.raises(HaloError, match="differentiable once"):
            torch.autograd.grad((y * y).sum(), x, create_graph=True)
        (gx,) = torch.autograd.grad((y * y).sum(), x)  # first order is unchanged
        assert gx.shape == x.shape
