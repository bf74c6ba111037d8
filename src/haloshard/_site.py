"""Where a sharded module's input lives, and its output rewrapped as the input came.

Every strategy of `_forward` starts from a `Site`: the local chunk of a `Shard(dim)` DTensor
(`dtensor_site`), or a plain chunk on a style's 1-D mesh, whose global length (and the rest
of its signature) the ranks agree on in one small gather (`site_of`); and ends with
`rewrap`, which gives this rank's output chunk back as the input came (plain, or a DTensor
on the input's mesh and placements). A chunk of an enclosing block may carry spare zero
slices (`Site.spare`, `with_spare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from haloshard import _comm
from haloshard._agree import Fields, check_rows, dtype_code, gather
from haloshard._compat import DTensorSpec, TensorMeta, maybe_run_for_local_tensor
from haloshard._conv import with_spare_slice
from haloshard._errors import HaloError
from haloshard._forward import enclosing
from haloshard._redistribute import unwrap


@dataclass(frozen=True)
class Site:
    """Where the input lives: its local chunk, mesh axis, placements and global shape."""

    local: torch.Tensor
    mesh: DeviceMesh
    axis: int
    placements: tuple[Placement, ...] | None  # None: plain tensor in, plain tensor out
    shape: tuple[int, ...]
    dim: int
    # other spatial dims sharded on other mesh axes, (mesh axis, dim): T and H at once
    others: tuple[tuple[int, int], ...] = ()
    # zero slices appended along dim to a chunk an enclosing block runs on (an empty chunk
    # runs as one: its own forward may refuse 0 elements); `local` excludes them
    spare: Any = 0

    @property
    def length(self) -> int:
        return self.shape[self.dim]


def site_of(x: torch.Tensor, dim: int, mesh: DeviceMesh | None, *, several: bool = False
            ) -> Site:
    """The site of a module's first input: a DTensor's (`dtensor_site`), or a plain chunk's
    on the 1-D `mesh`, its global length agreed by every rank (a bad input on one rank
    raises on every rank)."""
    fits = isinstance(x, torch.Tensor) and -x.ndim <= dim < x.ndim
    got = f"a {x.ndim}-D tensor" if isinstance(x, torch.Tensor) else type(x).__name__
    problem = f"a halo module's first input must be a tensor with dim {dim}, got {got}"
    if isinstance(x, DTensor) or mesh is None or mesh.ndim != 1:
        if not fits:
            raise HaloError(problem)
        if isinstance(x, DTensor):
            return dtensor_site(x, dim, several=several)
        if mesh is None:
            raise HaloError("a plain-tensor input needs a mesh: apply the halo with "
                            "HaloParallel (parallelize_module) or pass a DTensor")
        raise HaloError(f"a plain-tensor input needs a 1-D mesh, got a {mesh.ndim}-D mesh; "
                        "pass a DTensor or the cp sub-mesh")
    outer = enclosing(x) if fits else None
    spare = 0 if outer is None else outer.spare
    if has_spare(spare):  # a chunk of an enclosing block: its spare slices are not ours
        x = x.narrow(dim, 0, x.shape[dim] - spare)
    # Plain chunks agree on their lengths, and on the rest of their signature in the same
    # row (a dtype or batch changed on one rank raises on every rank now, not in a later
    # collective); a bad input on one rank rides in it too, so every rank raises instead
    # of the others waiting.
    row = (_input_row(x, dim) if fits
           else torch.tensor([0, 1] + [-1] * (len(_INPUT_FIELDS) - 2)))
    rows = gather(row, _comm.resolve_group((mesh, 0)), "halo input exchange")
    bad = [r for r, got in enumerate(rows) if got[1]]
    if bad:
        raise HaloError(problem if not fits else f"rank(s) {bad} of the group passed this "
                        f"halo module an input without dim {dim}; expected a tensor with it")
    check_rows(rows, _INPUTS, None)
    shape = tuple(sum(r[0] for r in rows) if i == dim else int(s)
                  for i, s in enumerate(x.shape))
    return Site(x, mesh, 0, None, shape, dim, spare=spare)


def has_spare(spare: Any) -> bool:
    """Whether spare slices may be appended (per-rank counts, simulated, may be)."""
    return not (isinstance(spare, int) and spare == 0)


def with_spare(y: Any, site: Site) -> Any:
    """A module's output on `site.local` as the enclosing block's chunk carrying spare
    slices expects it: an empty output chunk gets one zero slice back."""
    if not has_spare(site.spare):
        return y
    if isinstance(y, tuple) and y and isinstance(y[0], torch.Tensor):
        return (with_spare_slice(y[0], site.dim), *y[1:])
    return with_spare_slice(y, site.dim)


_INPUT_FIELDS = ("length", "error", "ndim", "dtype", "requires_grad", "grad_enabled",
                 *(f"size of dim {i}" for i in range(8)))


@maybe_run_for_local_tensor
def _input_row(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A plain chunk's row: its length along `dim`, then what every rank must share."""
    d = dim % t.ndim
    sizes = [-1 if i == d else int(n) for i, n in enumerate(t.shape[:8])]
    return torch.tensor([t.shape[d], 0, t.ndim, dtype_code(t.dtype), int(t.requires_grad),
                         int(torch.is_grad_enabled()), *sizes, *[-1] * (8 - len(sizes))])


# A flagged input (field "error") raises with the group's ranks named before the check.
_INPUTS = Fields(_INPUT_FIELDS, "halo module", "every rank must pass this halo module a plain "
                 "chunk that differs only in the length of the sharded dim",
                 may_differ=frozenset({"length", "error"}), error=None)


def dtensor_site(x: DTensor, dim: int, *, several: bool = False) -> Site:
    """The site of a DTensor sharded along `dim` on one mesh axis; with `several`, other
    spatial dims may be sharded on other axes too (`Site.others`)."""
    axes = [a for a, p in enumerate(x.placements) if p == Shard(dim)]
    if len(axes) != 1:
        raise HaloError(f"the input must be sharded along dim {dim} on exactly one mesh axis, "
                        f"got placements {tuple(x.placements)}")
    others: list[tuple[int, int]] = []
    for a, p in enumerate(x.placements):
        if isinstance(p, Replicate) or p in (Shard(0), Shard(dim)):
            continue
        d = p.dim % x.ndim if isinstance(p, Shard) else None
        if not several or d is None or d < 2 or d in [o for _, o in others]:
            raise HaloError(f"placement {p} is not supported beside Shard({dim}): expected "
                            "Replicate or Shard(0) (batch) on the other mesh axes"
                            + ("" if several else "; this layer takes one sharded "
                               "spatial dim (HaloParallel, CausalConvParallel, "
                               "FirstFrameParallel, LocalParallel, GroupNormParallel and "
                               "AttentionParallel take a second)"))
        others.append((a, d))
    return Site(unwrap(x), x.device_mesh, axes[0], tuple(x.placements),
                tuple(x.shape), dim, tuple(others))


@maybe_run_for_local_tensor
def pick(rank: int, *columns: tuple[int, ...]) -> list[int]:
    # A flat list: LocalTensorMode combines per-rank ints position by position.
    return [column[rank] for column in columns]


@maybe_run_for_local_tensor
def check_same_length(got: int, expected: int, what: str, dim: int) -> None:
    """`HaloError` unless a per-slice module kept the length of dim."""
    if got != expected:
        raise HaloError(f"{what} is for modules that keep the length of dim {dim}: the "
                        f"module returned {got} slices from a chunk of {expected}")


def rewrap(y: torch.Tensor, site: Site, dim: int, length: int) -> Any:
    """This rank's output chunk `y` as the input came: plain for a plain chunk, else a
    `Shard(dim)` DTensor on the input's mesh and placements, `length` long along dim."""
    if site.placements is None:
        return y
    shape, stride = _global_layout(y, site, dim, length)
    return DTensor.from_local(y, site.mesh, site.placements, run_check=False, shape=shape,
                              stride=stride)


def output_spec(y: torch.Tensor, site: Site, dim: int, length: int) -> DTensorSpec:
    """The spec `rewrap` gives this rank's output chunk `y` of a DTensor input."""
    assert site.placements is not None
    return DTensorSpec(site.mesh, site.placements,
                       tensor_meta=TensorMeta(*_global_layout(y, site, dim, length), y.dtype))


def _global_layout(y: torch.Tensor, site: Site, dim: int, length: int
                   ) -> tuple[torch.Size, tuple[int, ...]]:
    """The global shape of the output `y` is this rank's chunk of, and its contiguous
    stride."""
    shape = _global_shape(y, site, dim, length)
    return shape, tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _global_shape(y: torch.Tensor, site: Site, dim: int, out_length: int) -> torch.Size:
    """`out_length` along dim, the input's global batch where a mesh axis shards the batch
    (a layer keeps the batch), and the local sizes elsewhere (nothing else is sharded)."""
    batch_sharded = site.placements is not None and Shard(0) in site.placements
    kept = {0} if batch_sharded else set()
    kept |= {d for _, d in site.others}  # other sharded dims, kept by a per-slice layer
    return torch.Size(
        out_length if i == dim else site.shape[i] if i in kept else int(size)
        for i, size in enumerate(y.shape)
    )
