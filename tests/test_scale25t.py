"""Issue 25 ("Real scale"), the training step at P = 2: what a rank runs beyond its share.

- GroupNorm's backward with T sharded (`_GroupNormFn`) was written step by step: `x - mean`,
  `xh`, `dy * w`, `dxh * xh`, `dxh - m1`, `xh * m2`, ... nine chunk-sized temporaries and
  as many passes, where torch's own GroupNorm backward writes only `dx`. It now computes
  per-(batch, channel) sums of `dy` and `dy * x` (block by block), their group sums
  (all-reduced as before; on dense float rows torch's own GroupNorm backward kernel computes
  both sums from our statistics, with no temporary), and `dx = a * dy + b * x + c` in one
  buffer: counted, and exact against one device (input, weight and bias gradients; uneven
  and empty shards, batches of 1 and 2, with and without segments; simulated and gloo).

Tolerances: float64 at atol = 1e-10, as tests/test_norms.py states: the statistics and the
group sums are the same sums taken in another order, a few ulps of O(1) values apart, while
a misplaced group or frame is O(1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from haloshard import group_norm
from haloshard.testing import (
    assert_close_per_rank,
    rank_map,
    seeded_randn,
    shard,
    simulated_mesh,
    single_device,
    sum_over_ranks,
    worker_mesh,
)

TOL = {"atol": 1e-10, "rtol": 0}


class NewBuffers(TorchDispatchMode):
    """The shape of every tensor an aten op writes into a new buffer under it (in-place
    ops, which write into an existing one, and views, which write nothing, are left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.ops: set[str] = set()  # every aten op's name

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        if (isinstance(out, torch.Tensor) and not func.is_view
                and not func.overloadpacket.__name__.endswith("_")):
            self.shapes.append(tuple(out.shape))
        return out


def _reference(full: torch.Tensor, groups: int, weight: torch.Tensor, bias: torch.Tensor,
               upstream: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One device's `F.group_norm`: output, input, weight and bias gradients."""
    with single_device():
        x, w, b = (t.clone().requires_grad_() for t in (full, weight, bias))
        y = F.group_norm(x, groups, w, b, 1e-5)
        grads = torch.autograd.grad(y, (x, w, b), upstream)
        return (y.detach(), *grads)


@pytest.mark.simulated
def test_group_norm_backward_one_chunk_sized_buffer() -> None:
    """`group_norm`'s backward on a `Shard(2)` chunk (T = 16 as 8, 8) writes one new
    chunk-sized tensor, `dx` (it wrote nine), and its gradients match one device's."""
    full = seeded_randn((1, 8, 16, 4, 4), 1, torch.float64) * 3 + 5  # an offset
    weight, bias = seeded_randn((8,), 2, torch.float64), seeded_randn((8,), 3, torch.float64)
    upstream = seeded_randn(full.shape, 4, torch.float64)
    y_ref, gx_ref, gw_ref, gb_ref = _reference(full, 2, weight, bias, upstream)
    with simulated_mesh(2) as mesh:
        x = rank_map(mesh, lambda r: shard(full, 2, 2, r).clone()).requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        y = group_norm(x, 2, w, b, 1e-5, mesh)
        gy = rank_map(mesh, lambda r: shard(upstream, 2, 2, r))
        with NewBuffers() as buffers:
            gx, gw, gb = torch.autograd.grad(y, (x, w, b), gy)
        assert buffers.shapes.count((1, 8, 8, 4, 4)) == 1, buffers.shapes
        assert_close_per_rank(y, lambda r: shard(y_ref, 2, 2, r), mesh, **TOL)
        assert_close_per_rank(gx, lambda r: shard(gx_ref, 2, 2, r), mesh, **TOL)
        torch.testing.assert_close(sum_over_ranks(gw, mesh), gw_ref, **TOL)
        torch.testing.assert_close(sum_over_ranks(gb, mesh), gb_ref, **TOL)


@pytest.mark.simulated
@pytest.mark.parametrize(("length", "world", "affine"),
                         [(7, 2, True), (3, 4, True), (5, 3, False), (1, 2, True)])
def test_group_norm_backward_uneven_and_empty(length: int, world: int, affine: bool
                                              ) -> None:
    """Uneven chunks (7 on 2, 5 on 3) and empty ones (3 on 4, 1 on 2), with and without
    the affine parameters, a batch of 2: every gradient as one device's."""
    full = seeded_randn((2, 6, length, 3, 2), 5, torch.float64) * 3 + 5
    weight, bias = seeded_randn((6,), 6, torch.float64), seeded_randn((6,), 7, torch.float64)
    upstream = seeded_randn(full.shape, 8, torch.float64)
    y_ref, gx_ref, gw_ref, gb_ref = _reference(full, 3, weight, bias, upstream)
    if not affine:
        with single_device():
            x_ref = full.clone().requires_grad_()
            y_ref = F.group_norm(x_ref, 3, None, None, 1e-5)
            (gx_ref,) = torch.autograd.grad(y_ref, x_ref, upstream)
    with simulated_mesh(world) as mesh:
        x = rank_map(mesh, lambda r: shard(full, 2, world, r).clone()).requires_grad_()
        params = [weight.clone().requires_grad_(), bias.clone().requires_grad_()]
        y = group_norm(x, 3, *(params if affine else (None, None)), 1e-5, mesh)
        gy = rank_map(mesh, lambda r: shard(upstream, 2, world, r))
        grads = torch.autograd.grad(y, (x, *params) if affine else (x,), gy)
        assert_close_per_rank(grads[0], lambda r: shard(gx_ref, 2, world, r), mesh, **TOL)
        if affine:
            torch.testing.assert_close(sum_over_ranks(grads[1], mesh), gw_ref, **TOL)
            torch.testing.assert_close(sum_over_ranks(grads[2], mesh), gb_ref, **TOL)


@pytest.mark.simulated
@pytest.mark.parametrize(("segments", "dim"), [((5, 6, 5), 2), ((3, 1, 4), 3)])
def test_group_norm_segments_backward_one_chunk_sized_buffer(segments: tuple[int, ...],
                                                             dim: int) -> None:
    """With segments (frame batches, as CogVideoX's loops normalise them) the backward also
    writes one new chunk-sized tensor, `dx` (it wrote nine), and every gradient matches a
    loop of `F.group_norm` over the segments on one device."""
    shape = [1, 8, 4, 4, 4]
    shape[dim] = sum(segments)
    full = seeded_randn(tuple(shape), 11, torch.float64) * 3 + 5
    weight, bias = seeded_randn((8,), 12, torch.float64), seeded_randn((8,), 13, torch.float64)
    upstream = seeded_randn(full.shape, 14, torch.float64)
    with single_device():
        x_ref, w_ref, b_ref = (t.clone().requires_grad_() for t in (full, weight, bias))
        y_ref = torch.cat([F.group_norm(part, 2, w_ref, b_ref, 1e-5)
                           for part in x_ref.split(segments, dim)], dim)
        gx_ref, gw_ref, gb_ref = torch.autograd.grad(y_ref, (x_ref, w_ref, b_ref), upstream)
    with simulated_mesh(2) as mesh:
        x = rank_map(mesh, lambda r: shard(full, dim, 2, r).clone()).requires_grad_()
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        y = group_norm(x, 2, w, b, 1e-5, mesh, segments=segments, dim=dim)
        gy = rank_map(mesh, lambda r: shard(upstream, dim, 2, r))
        with NewBuffers() as buffers:
            gx, gw, gb = torch.autograd.grad(y, (x, w, b), gy)
        chunk = list(full.shape)
        chunk[dim] = sum(segments) // 2
        assert buffers.shapes.count(tuple(chunk)) == 1, buffers.shapes
        assert_close_per_rank(gx, lambda r: shard(gx_ref, dim, 2, r), mesh, **TOL)
        torch.testing.assert_close(sum_over_ranks(gw, mesh), gw_ref, **TOL)
        torch.testing.assert_close(sum_over_ranks(gb, mesh), gb_ref, **TOL)


def gloo_group_norm_backward(cases: list[tuple[int, int, bool]]) -> list[tuple[int, bool]]:
    """Each `(batch, length, affine)` case on this rank: every gradient against one device's
    (asserted); the chunk-sized new buffers its backward wrote, and whether torch's own
    GroupNorm backward kernel ran."""
    mesh, rank, world = worker_mesh(dist.get_world_size()), dist.get_rank(), dist.get_world_size()
    counts = []
    for batch, length, affine in cases:
        full = seeded_randn((batch, 8, length, 4, 3), 20 + length, torch.float64) * 3 + 5
        weight, bias = (seeded_randn((8,), 21 + i, torch.float64) for i in range(2))
        upstream = seeded_randn(full.shape, 23, torch.float64)
        x_ref, w_ref, b_ref = (t.clone().requires_grad_() for t in (full, weight, bias))
        y_ref = F.group_norm(x_ref, 4, *((w_ref, b_ref) if affine else (None, None)), 1e-5)
        want = torch.autograd.grad(y_ref, (x_ref, w_ref, b_ref) if affine else (x_ref,),
                                   upstream)
        x = shard(full, 2, world, rank).clone().requires_grad_()
        params = [weight.clone().requires_grad_(), bias.clone().requires_grad_()]
        y = group_norm(x, 4, *(params if affine else (None, None)), 1e-5, mesh)
        gy = shard(upstream, 2, world, rank).contiguous()  # as a layer's gradient comes
        with NewBuffers() as buffers:
            got = torch.autograd.grad(y, (x, *params) if affine else (x,), gy)
        counts.append((buffers.shapes.count(tuple(x.shape)),
                       "native_group_norm_backward" in buffers.ops))
        torch.testing.assert_close(got[0], shard(want[0], 2, world, rank), **TOL)
        for g, w in zip(got[1:], want[1:], strict=True):
            torch.testing.assert_close(sum_over_ranks(g, mesh), w, **TOL)
    return counts


@pytest.mark.gloo
def test_group_norm_backward_gloo(gloo) -> None:
    """On 2 gloo ranks (plain tensors: torch's kernel computes the sums), batches of 1 and 2,
    T even, uneven (7) and with an empty chunk (1): every gradient as one device's, and one
    new chunk-sized buffer (`dx`) per backward on every rank with frames, where torch's
    kernel computed the sums (the empty chunk's rank sums nothing, its own way)."""
    cases = [(1, 16, True), (2, 7, True), (2, 6, False), (1, 1, True)]
    for rank, counts in enumerate(gloo(2).run(gloo_group_norm_backward, cases)):
        assert counts[:3] == [(1, True)] * 3, (rank, counts)
