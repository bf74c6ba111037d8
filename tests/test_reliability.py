"""halo_exchange in the conditions training stacks create: dtypes, memory formats, no-grad
and inference modes, empty batches, determinism and activation checkpointing.

Each body runs on 3 gloo ranks (T=7 splits 3, 3, 1: uneven) and under simulated ranks.
Forward is a pure data move: exact. Gradient tolerances are stated where they are used.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from haloshard import TRANSPORTS, halo_exchange
from haloshard.testing import (
    assert_close_per_rank,
    rank_map,
    reference_halo,
    shard,
    simulated_mesh,
    single_device,
    worker_mesh,
)

T = 7


def _full(dtype: torch.dtype = torch.float64, batch: int = 2) -> torch.Tensor:
    """The global tensor, made on one device (not per simulated rank)."""
    with single_device():
        gen = torch.Generator().manual_seed(11)
        return torch.randn(batch, 3, T, 4, 5, generator=gen, dtype=torch.float64).to(dtype)


def _local(mesh: DeviceMesh, full: torch.Tensor) -> torch.Tensor:
    world = mesh.size()
    return rank_map(mesh, lambda r: shard(full, 2, world, r).clone())


def case_dtypes(mesh: DeviceMesh) -> None:
    """Forward exact in every float dtype (a data move rounds nothing)."""
    world = mesh.size()
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        full = _full(dtype)
        y = halo_exchange(_local(mesh, full), left=2, right=1, dim=2, group=mesh, pad="replicate")
        assert_close_per_rank(y, lambda r, f=full: reference_halo(f, 2, 1, 2, world, r,
                                                                  "replicate"), mesh)


def case_layouts(mesh: DeviceMesh) -> None:
    """channels_last_3d and strided inputs give the same values; channels_last stays so."""
    world, full = mesh.size(), _full()
    expected = lambda r: reference_halo(full, 1, 1, 2, world, r)  # noqa: E731
    x = _local(mesh, full)
    last = x.contiguous(memory_format=torch.channels_last_3d)
    y = halo_exchange(last, left=1, right=1, dim=2, group=mesh)
    assert_close_per_rank(y, expected, mesh)
    assert y.is_contiguous(memory_format=torch.channels_last_3d)
    with single_device():
        transposed = full.transpose(3, 4).contiguous()
    strided = _local(mesh, transposed).transpose(3, 4)
    assert_close_per_rank(halo_exchange(strided, left=1, right=1, dim=2, group=mesh), expected,
                                        mesh)


def case_modes(mesh: DeviceMesh) -> None:
    """requires_grad=False, no_grad, inference_mode and an empty batch."""
    world, full = mesh.size(), _full()
    expected = lambda r: reference_halo(full, 2, 2, 2, world, r, "circular")  # noqa: E731
    x = _local(mesh, full)
    y = halo_exchange(x, left=2, right=2, dim=2, group=mesh, pad="circular")
    assert not y.requires_grad
    assert_close_per_rank(y, expected, mesh)
    with torch.no_grad():
        assert_close_per_rank(halo_exchange(x.requires_grad_(), left=2, right=2, dim=2, group=mesh,
                                            pad="circular"),
                              expected, mesh)
    empty = _full(batch=0)
    y0 = halo_exchange(_local(mesh, empty).requires_grad_(), left=1, right=1, dim=2, group=mesh)
    assert_close_per_rank(y0, lambda r: reference_halo(empty, 1, 1, 2, world, r), mesh)
    y0.sum().backward()


def case_inference_mode(mesh: DeviceMesh) -> None:
    world, full = mesh.size(), _full()
    with torch.inference_mode():
        y = halo_exchange(_local(mesh, full), left=1, right=2, dim=2, group=mesh, pad="reflect")
    assert_close_per_rank(y, lambda r: reference_halo(full, 1, 2, 2, world, r, "reflect"),
                          mesh)


def case_deterministic(mesh: DeviceMesh) -> None:
    """Two runs with the same inputs: bitwise-identical outputs and gradients."""
    full = _full()
    for transport in TRANSPORTS:
        if transport == "p2p" and _simulated():
            continue
        runs = []
        for _ in range(2):
            x = _local(mesh, full).requires_grad_()
            y = halo_exchange(x, left=3, right=1, dim=2, group=mesh, pad="replicate",
                              transport=transport)
            (y * y).sum().backward()
            runs.append((y.detach(), x.grad))
        assert_close_per_rank(runs[0][0], _picker(runs[1][0], mesh), mesh)
        assert_close_per_rank(runs[0][1], _picker(runs[1][1], mesh), mesh)


def _simulated() -> bool:
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    return enabled_local_tensor_mode() is not None


def _picker(t: torch.Tensor, mesh: DeviceMesh):
    """expected(rank) for a per-rank tensor: its own value on that rank."""
    if _simulated():
        return lambda r: t._local_tensors[r]  # type: ignore[attr-defined]
    return lambda r: t


def case_checkpoint(mesh: DeviceMesh) -> None:
    """Non-reentrant checkpointing re-exchanges in the recomputed forward; grads match.

    The conv is the same op on the same data in both runs, so results are bitwise equal.
    """
    world, full = mesh.size(), _full()
    with single_device():
        weight = torch.randn(4, 3, 3, 1, 1, generator=torch.Generator().manual_seed(2),
                             dtype=torch.float64)

    def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv3d(halo_exchange(x, left=2, right=0, dim=2, group=mesh, pad="replicate"), w)

    grads = []
    for use_checkpoint in (False, True):
        x = _local(mesh, full).requires_grad_()
        w = weight.clone().requires_grad_()
        y = checkpoint(layer, x, w, use_reentrant=False) if use_checkpoint else layer(x, w)
        (y * y).sum().backward()
        grads.append((y.detach(), x.grad, w.grad))
    for a, b in zip(grads[0], grads[1], strict=True):
        assert_close_per_rank(a, _picker(b, mesh), mesh)
    with single_device():
        ref = F.conv3d(F.pad(full, (0, 0, 0, 0, 2, 0), mode="replicate"), weight)
    assert_close_per_rank(grads[0][0], lambda r: shard(ref, 2, world, r), mesh,
                          atol=1e-12, rtol=1e-12)  # the same sums; conv kernels may reorder


CASES = ["case_dtypes", "case_layouts", "case_modes", "case_inference_mode",
         "case_deterministic", "case_checkpoint"]


def on_gloo(cases: list[str]) -> None:
    mesh = worker_mesh(dist.get_world_size())
    for case in cases:
        globals()[case](mesh)


@pytest.mark.gloo
def test_gloo(gloo) -> None:
    gloo(3).run(on_gloo, CASES, timeout=300)


@pytest.mark.simulated
@pytest.mark.parametrize("case", [c for c in CASES if c != "case_inference_mode"])
def test_simulated(case: str) -> None:
    with simulated_mesh(3) as mesh:
        globals()[case](mesh)
