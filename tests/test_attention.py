"""Attention over tokens sharded along L: all-gathered K/V against SDPA on the full tensors.

Query rows are independent, so the forward is the same arithmetic as on one device up to the
kernel's blocking (float64: 1e-12). dK and dV are sums over ranks of per-rank partial
gradients, reordered sums (1e-12 in float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from haloshard import HaloError, attention, gather_along
from haloshard.testing import (
    assert_close_per_rank,
    rank_map,
    shard,
    simulated_mesh,
    single_device,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-12}
# torch's limit, not haloshard's: LocalTensorMode before 2.13 cannot matmul LocalTensors
# whose ranks hold different lengths (uneven chunks; "Unable to cast ... torch.SymInt").
UNEVEN_MATMUL = ("LocalTensorMode cannot matmul simulated ranks of uneven lengths before "
                 "torch 2.13 (RuntimeError: Unable to cast torch.SymInt)")


def case_attention(mesh: DeviceMesh, length: int) -> None:
    world = mesh.size()
    with single_device():
        gen = torch.Generator().manual_seed(length)
        full = [torch.randn(2, 2, length, 4, generator=gen, dtype=torch.float64)
                for _ in range(4)]
        refs = [t.clone().requires_grad_() for t in full[:3]]
        ref = F.scaled_dot_product_attention(*refs)
        (ref * full[3]).sum().backward()
    local = [rank_map(mesh, lambda r, t=t: shard(t, 2, world, r).clone()).requires_grad_()
             for t in full[:3]]
    out = attention(*local, mesh, global_length=length)
    (out * rank_map(mesh, lambda r: shard(full[3], 2, world, r))).sum().backward()
    assert_close_per_rank(out, lambda r: shard(ref.detach(), 2, world, r), mesh, **TOL)
    for got, want in zip(local, refs, strict=True):
        assert_close_per_rank(got.grad, lambda r, w=want: shard(w.grad, 2, world, r), mesh,
                              **TOL)
    gathered = gather_along(local[0], 2, mesh, global_length=length)
    assert_close_per_rank(gathered, lambda r: full[0], mesh)  # a data move: exact


def on_gloo() -> None:
    mesh = worker_mesh(dist.get_world_size())
    for length in (5, 7, 16):
        case_attention(mesh, length)


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo(gloo, world: int) -> None:
    gloo(world).run(on_gloo)


@pytest.mark.simulated
@pytest.mark.requires_torch("2.13", reason=UNEVEN_MATMUL)
@pytest.mark.parametrize("length", [5, 7])  # 4 ranks: (2, 2, 1, 0) and (2, 2, 2, 1)
def test_simulated(length: int) -> None:
    with simulated_mesh(4) as mesh:
        case_attention(mesh, length)


@pytest.mark.simulated
def test_gather_frames_of_tokens() -> None:
    """Tokens of T*S split by frames (T=5 on 4 ranks: 2, 2, 1, 0 frames of S=3 tokens)."""
    full = torch.arange(2 * 15 * 2, dtype=torch.float64).reshape(2, 15, 2)
    with simulated_mesh(4) as mesh:
        local = rank_map(mesh, lambda r: shard(full.unflatten(1, (5, 3)), 1, 4, r).flatten(1, 2))
        gathered = gather_along(local, 1, mesh, global_length=5, frame=3)
        assert_close_per_rank(gathered, lambda r: full, mesh, atol=0, rtol=0)


def test_token_dim_checked() -> None:
    with simulated_mesh(2) as mesh:
        q = rank_map(mesh, lambda r: torch.ones(1, 1, 2, 4))
        with pytest.raises(HaloError, match=r"token dim to be dim 2 of \(1, 1, 2, 4\)"):
            attention(q, q, q, mesh, global_length=4, dim=3)
