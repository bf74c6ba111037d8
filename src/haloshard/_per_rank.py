"""Per-rank views that one SPMD body needs in real and simulated ranks alike.

`verify_plan` (a library API) and the `testing` helpers both build per-rank inputs and read
every rank's values back: the names live here, below both, and `haloshard.testing`
re-exports them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from haloshard._compat import (
    LocalTensor,
    local_tensors,
    maybe_disable_local_tensor_mode,
    maybe_run_for_local_tensor,
)
from haloshard._layout import shard_size_and_offset


def shard(full: torch.Tensor, dim: int, world_size: int, rank: int) -> torch.Tensor:
    """Rank's `Shard(dim)` chunk of `full` (uneven and empty chunks included)."""
    size, offset = shard_size_and_offset(full.shape[dim], world_size, rank)
    return full.narrow(dim, offset, size)


def single_device() -> contextlib.AbstractContextManager[None]:
    """Run plain single-device code (the reference) inside a simulated mesh.

    Under `LocalTensorMode` every op, even on plain tensors, is run per simulated rank;
    the reference must run outside it. A no-op in real processes.
    """
    return maybe_disable_local_tensor_mode()


def rank_map(mesh: DeviceMesh, fn: Callable[[int], Any], *, mesh_axis: int | str = 0) -> Any:
    """`fn(rank)` with this rank's coordinate on `mesh_axis`.

    Under `LocalTensorMode` it runs once per simulated rank and returns a LocalTensor (or a
    per-rank int); in a real process it simply calls `fn`.
    """
    return maybe_run_for_local_tensor(fn)(mesh.get_local_rank(mesh_axis))


def per_rank(tensor: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every rank's local value of `tensor` as plain detached tensors, keyed by global rank.

    A `LocalTensor` (simulated ranks; also after its `simulated_mesh` has closed) gives one
    entry per simulated rank; a plain tensor in a real process gives this rank's entry only.

    Example::
        >>> with simulated_mesh(2) as mesh:
        ...     x = rank_map(mesh, lambda r: torch.full((1,), float(r)))
        >>> per_rank(x)
        {0: tensor([0.]), 1: tensor([1.])}
    """
    with maybe_disable_local_tensor_mode():
        if isinstance(tensor, LocalTensor):
            locals_ = local_tensors(tensor)
            return {r: locals_[r].detach().clone() for r in sorted(locals_)}
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {rank: tensor.detach().clone()}


def seeded_randn(shape: Sequence[int], seed: int, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """A standard-normal tensor from its own generator, made once on one device (also
    inside a simulated mesh), drawn in float64 on the CPU and then cast and moved to
    `device`, so every dtype and device sees the same values."""
    with single_device():
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(device, dtype)
