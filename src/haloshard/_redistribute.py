"""`redistribute`: `DTensor.redistribute` that also moves data into and out of `HaloShard`.

torch's redistribute is a fixed chain that knows nothing of custom placements: asked for a
`HaloShard` it relabels the tensor and moves no data. This module routes every step that
touches a `HaloShard` through haloshard's own exchange and hands the rest to torch:

- `Shard(d) -> HaloShard(d, l, r)`: `halo_exchange` of the neighbours' edge slices;
- `Replicate -> HaloShard`: local slicing and padding, no communication;
- `HaloShard -> Shard(d)`: the halos are dropped, no communication;
- `HaloShard -> Replicate`: drop halos, then torch's all-gather;
- `HaloShard -> HaloShard` (other widths): narrowing needs nothing, widening is an
  exchange (same plan and transports) of only the slices the rank does not hold yet;
- `[HaloShard(2, ..), HaloShard(3, ..)]` (T and H on two mesh axes): the halos of each axis
  in turn, the later exchange over the earlier one's halos, so the corners are held too.

Gradient convention: the gradient of a `HaloShard` DTensor carries the same placement and
its local tensor is d(loss)/d(local tensor), halo slices included; the halo gradients are
not yet added into the slices they copy. The function that made the `HaloShard` adds them
into their owners in its backward (the adjoint of its copy), so every gradient crosses the
wire once. Hence `HaloShard -> Shard(d)` backward only pads the gradient with zero halos.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from haloshard import _comm
from haloshard._compat import local_tensor, maybe_run_for_local_tensor
from haloshard._errors import HaloError
from haloshard._exchange import halo_exchange, memory_format, widen
from haloshard._layout import HaloShard, check_pad_fits, shard_sizes
from haloshard._tracing import planner_cache, surfaces_errors

# torch's own method, captured before `_dtensor_ops` routes HaloShard requests through us.
torch_redistribute = DTensor.redistribute


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of `shape` (what a fresh global tensor of that shape would have)."""
    return tuple(reversed(list(accumulate([1, *reversed(shape[1:])], lambda a, b: a * b))))


def halo_axes(placements: Sequence[Placement]) -> list[int]:
    """The mesh axes carrying a `HaloShard` (T and H at once: two)."""
    return [i for i, p in enumerate(placements) if isinstance(p, HaloShard)]


def halo_axis(placements: Sequence[Placement]) -> int | None:
    """The mesh axis carrying a `HaloShard`, or None; raises for more than one (DTensor
    ops on `HaloShard` inputs take one; `redistribute` takes several)."""
    axes = halo_axes(placements)
    if len(axes) > 1:
        raise HaloError(f"DTensor ops take at most one HaloShard per placement list, got "
                        f"{tuple(placements)}; redistribute to one (or none) first")
    return axes[0] if axes else None


def without_halo(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """`placements` with `HaloShard(d, ...)` replaced by `Shard(d)` (same split, no halos)."""
    return tuple(Shard(p.dim) if isinstance(p, HaloShard) else p for p in placements)


def wrap(local: torch.Tensor, like: DTensor | tuple[DeviceMesh, Sequence[int]],
         placements: Sequence[Placement]) -> DTensor:
    """`DTensor.from_local` with the global shape of `like`, differentiably (see `_Wrap`)."""
    mesh, shape = (like.device_mesh, like.shape) if isinstance(like, DTensor) else like
    return _Wrap.apply(local, mesh, tuple(placements), tuple(shape))


class _Wrap(torch.autograd.Function):
    """Forward: local `(.., L_r, ..)` -> DTensor of global shape `(.., T, ..)`, `placements`.
    Backward: DTensor gradient -> its local tensor in this layout `(.., L_r, ..)`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
        shape: tuple[int, ...],
    ) -> DTensor:
        ctx.mesh, ctx.placements = mesh, placements
        # from_local's own autograd rejects custom placements; here grad mode is off.
        out = DTensor.from_local(local, mesh, placements, shape=torch.Size(shape),
                                 stride=contiguous_stride(shape))
        check_local(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return local_grad(grad, ctx.mesh, ctx.placements), None, None, None


def unwrap(dt: DTensor, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
    """`dt.to_local()`, differentiably, with the gradient rebuilt on `dt`'s global shape.

    torch's `to_local` backward recomputes the global stride from the local gradient, which
    yields per-rank symbolic ints for uneven shards under `LocalTensorMode` and then fails.
    The package's one unwrap: the styles' input sites and `verify_plan` use it too.
    """
    return _Unwrap.apply(dt, tuple(grad_placements or dt.placements))


class _Unwrap(torch.autograd.Function):
    """Forward: DTensor of global shape `(.., T, ..)` -> its local tensor `(.., L_r, ..)`.
    Backward: local gradient -> DTensor of the global shape in `grad_placements`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, dt: DTensor, grad_placements: tuple[Placement, ...]
    ) -> torch.Tensor:
        ctx.meta = (dt.device_mesh, grad_placements, dt.shape, dt.stride())
        return layout_view(dt.to_local())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor | None, None]:  # type: ignore[override]
        mesh, placements, shape, stride = ctx.meta
        return DTensor.from_local(grad, mesh, placements, shape=shape, stride=stride), None


def layout_view(t: torch.Tensor) -> torch.Tensor:
    """A fresh view of `t` (as `view_as`) with the strides a new tensor of its memory format
    has. `view_as` (which DTensor's `from_local` and `to_local` call) gives a size-1 dim of
    a channels-last tensor, a batch of 1, another stride; it addresses no memory, but
    torch's layout checks (`suggest_memory_format`: the convs', GroupNorm's) then read the
    chunk as not channels-last: a conv copies it to the standard layout, and every layer
    after runs in that layout where one device keeps channels-last."""
    strides = _layout_strides(t)
    return t.view_as(t) if strides is None else t.as_strided(t.shape, strides,
                                                            t.storage_offset())


def layout_strides(t: torch.Tensor) -> torch.Tensor:
    """`t`, or (a channels-last `t` whose size-1 dims carry other strides, see
    `layout_view`) a view of it with its memory format's strides."""
    strides = _layout_strides(t)
    return t if strides is None or tuple(strides) == t.stride() else t.as_strided(
        t.shape, strides, t.storage_offset())


def _layout_strides(t: torch.Tensor) -> list[int] | None:
    """The strides of a new tensor of `t`'s shape and channels-last memory format; None
    for the standard layout, or a traced or simulated tensor."""
    if memory_format(t) == torch.contiguous_format or not _comm.is_eager(t):
        return None
    # channels-last: C innermost, then the spatial dims from the last, then the batch
    strides, step = [0] * t.ndim, 1
    for d in [1, *range(t.ndim - 1, 1, -1), 0]:
        strides[d] = step
        step *= max(t.shape[d], 1)
    return strides


def local_grad(grad: Any, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """The local gradient in `placements`' layout, whatever placement `grad` arrived in.

    A gradient in another placement is a true gradient of the global tensor: its share of
    the halo copies is zero, so it is laid out as the chunk with zero halos.
    """
    if not isinstance(grad, DTensor):
        raise HaloError(f"expected a DTensor gradient for placements {placements}, "
                        f"got {type(grad).__name__}")
    if tuple(grad.placements) == placements:
        return grad.to_local()
    if halo_axes(grad.placements):
        raise HaloError(f"gradient placed {tuple(grad.placements)} cannot be laid out as "
                        f"{placements}")
    core = torch_redistribute(grad, mesh, without_halo(placements)).to_local()
    for axis in halo_axes(placements):
        p = placements[axis]
        assert isinstance(p, HaloShard)
        pads = [0, 0] * (core.ndim - p.dim - 1) + [p.left, p.right]
        core = torch.nn.functional.pad(core, pads)
    return core


@maybe_run_for_local_tensor
def _check_local_length(length: int, expected: int, rank: int, p: HaloShard,
                        global_length: int) -> None:
    if length != expected:
        raise HaloError(
            f"a DTensor placed {p!r} with global length {global_length} along dim {p.dim} "
            f"must hold {expected} slices there on rank {rank} (its chunk and both halos), "
            f"but its local tensor has {length}: build it with haloshard.redistribute (or "
            "from a local tensor that includes its halos)")


def check_local(dt: DTensor) -> None:
    """Raise `HaloError` when `dt`'s local tensor does not fit its `HaloShard` placement.

    `DTensor.from_local` checks nothing: a chunk without its halos would be read as one with
    them, and real slices dropped. Rank-local (no communication).
    """
    local, mesh = local_tensor(dt), dt.device_mesh
    for axis in halo_axes(dt.placements):
        p = dt.placements[axis]
        assert isinstance(p, HaloShard)
        if p.dim >= local.ndim:
            raise HaloError(f"{p!r} shards dim {p.dim} of a {local.ndim}-D local tensor")
        size, length = mesh.size(axis), dt.shape[p.dim]
        expected = maybe_run_for_local_tensor(
            lambda r, p=p, size=size, length=length: p.local_length(length, size, r))(
                mesh.get_local_rank(axis))
        _check_local_length(local.shape[p.dim], expected, mesh.get_local_rank(axis), p,
                            length)


def _normalize(placements: Sequence[Placement], mesh: DeviceMesh) -> tuple[Placement, ...]:
    placements = tuple(placements)
    if len(placements) != mesh.ndim or not all(isinstance(p, Placement) for p in placements):
        raise HaloError(f"expected {mesh.ndim} placements for a {mesh.ndim}-D mesh, got "
                        f"{placements}")
    return placements


def check_placements(shape: Sequence[int], placements: Sequence[Placement]) -> None:
    """Raise `HaloError` when a `HaloShard` in `placements` cannot describe `shape`."""
    for axis in halo_axes(placements):
        p = placements[axis]
        assert isinstance(p, HaloShard)
        if p.dim >= len(shape):
            raise HaloError(f"{p!r} shards dim {p.dim} of a {len(shape)}-D tensor")
        for i, other in enumerate(placements):
            if i != axis and isinstance(other, Shard) and other.dim % len(shape) == p.dim:
                raise HaloError(f"{p!r} on mesh axis {axis} and {other!r} on mesh axis {i} "
                                f"split the same dim {p.dim}; a halo dim may be split by one "
                                "axis only")
        check_pad_fits(shape[p.dim], p.left, p.right, p.pad)


@surfaces_errors
def redistribute(dt: DTensor, placements: Sequence[Placement], *,
                 transport: str | None = None) -> DTensor:
    """`DTensor.redistribute` that also accepts `HaloShard` placements, differentiably.

    Steps touching a `HaloShard` move only the halo slices the layout needs (see the module
    docstring); every other step is torch's. The result's `shape` is the global shape and
    its `to_local()` is the rank's chunk with its halos.

    Unlike torch's `dt.redistribute(device_mesh, placements)` it takes no mesh, on purpose:
    a halo step never changes the mesh, so the result is always on `dt`'s, and a mesh
    argument could only be wrong. `dt.redistribute(dt.device_mesh, placements)` (or with
    no mesh) comes here too once a `HaloShard` exists; another mesh raises `HaloError`.

    Args:
        dt: the DTensor to move.
        placements: one placement per mesh axis; a `HaloShard` on a tensor dim no other
            mesh axis splits (T and H at once: one on each axis, the corners included,
            as the hooks' windows hold them).
        transport: `halo_exchange`'s transport for `Shard -> HaloShard` and for widening a
            `HaloShard` (default all_to_all).

    Returns:
        A DTensor on `dt`'s mesh with `placements`.

    Raises:
        HaloError: for a bad placement list or a halo the pad mode cannot fill.

    Example::
        >>> x = distribute_tensor(torch.randn(4, 8, 7), mesh, [Shard(2)])  # T_r: 2, 2, 2, 1
        >>> y = redistribute(x, [HaloShard(2, left=2)])
        >>> y.shape, {rank: t.shape[2] for rank, t in per_rank(y.to_local()).items()}
        (torch.Size([4, 8, 7]), {0: 4, 1: 4, 2: 4, 3: 3})
    """
    mesh = dt.device_mesh
    src, dst = tuple(dt.placements), _normalize(placements, mesh)
    check_placements(dt.shape, src)
    check_placements(dt.shape, dst)
    check_local(dt)
    a, b = halo_axes(src), halo_axes(dst)
    if src == dst or not (a or b):
        return dt if src == dst else torch_redistribute(dt, mesh, dst)
    if (len(a) == len(b) == 1 and a == b and without_halo(src) == without_halo(dst)
            and src[a[0]].pad == dst[b[0]].pad):  # type: ignore[attr-defined]
        return _rehalo(dt, a[0], dst[b[0]], transport)  # type: ignore[arg-type]
    if a:
        dt = _drop_halos(dt, a)
    if not b:
        return torch_redistribute(dt, mesh, dst)
    return _to_halo(dt, b, dst, transport)


def _to_halo(dt: DTensor, axes: list[int], dst: tuple[Placement, ...],
             transport: str | None) -> DTensor:
    """From a DTensor without halos to `dst`: torch moves the other axes first; replicated
    axes slice their halos (no traffic), then sharded ones exchange theirs in axis order,
    each over the halos added before it (the corners come with the later exchange)."""
    mid = list(without_halo(dst))
    sliced = [a for a in axes if isinstance(dt.placements[a], Replicate)]
    for axis in sliced:
        mid[axis] = Replicate()  # every rank already holds its halos: slice, no traffic
    if tuple(dt.placements) != tuple(mid):
        dt = torch_redistribute(dt, dt.device_mesh, mid)
    if sliced:
        dt = _slice_halos(dt, sliced, dst)
    for axis in axes:
        if axis not in sliced:
            dt = _add_halos(dt, axis, dst, transport)
    return dt


def _add_halos(dt: DTensor, axis: int, dst: tuple[Placement, ...],
               transport: str | None) -> DTensor:
    """`Shard(d) -> HaloShard(d, l, r)` on one axis: the neighbour exchange.

    Forward: `(.., T_r, ..) -> (.., l + T_r + r, ..)`; backward (halo_exchange's): halo
    gradients are added into their owners' edges.
    """
    p = dst[axis]
    assert isinstance(p, HaloShard)
    y = halo_exchange(unwrap(dt), left=p.left, right=p.right, dim=p.dim,
                      group=(dt.device_mesh, axis), pad=p.pad, transport=transport,
                      global_length=dt.shape[p.dim])
    return wrap(y, dt, [p if i == axis else q for i, q in enumerate(dt.placements)])


@planner_cache(1024)
def _sources(rank: int, p: HaloShard, length: int, world: int) -> tuple[list[int], list[bool]]:
    sources = p.local_sources(length, world, rank)
    return [0 if g is None else g for g in sources], [g is not None for g in sources]


def _slice_halos(dt: DTensor, axes: list[int], dst: tuple[Placement, ...]) -> DTensor:
    """`Replicate -> HaloShard(d, l, r)` on each of `axes`: every rank slices its own part.

    Forward: `(.., T, ..) -> (.., l + T_r + r, ..)` along each, no communication. Backward:
    each rank's gradient is its share of the global one, so the input gradient is
    `Partial()` there.
    """
    mesh = dt.device_mesh
    grad_placements = [Partial() if i in axes else q for i, q in enumerate(dt.placements)]
    local = unwrap(dt, grad_placements)
    for axis in axes:
        p = dst[axis]
        assert isinstance(p, HaloShard)
        local = _slice_one(local, p, dt.shape[p.dim], mesh, axis)
    placements = [dst[i] if i in axes else q for i, q in enumerate(dt.placements)]
    return wrap(local, dt, placements)


def _slice_one(local: torch.Tensor, p: HaloShard, length: int, mesh: DeviceMesh, axis: int
               ) -> torch.Tensor:
    """This rank's chunk and halos along `p.dim` of a tensor it holds whole along it."""
    def index(rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        idx, keep = _sources(rank, p, length, mesh.size(axis))
        shape = [len(keep) if i == p.dim else 1 for i in range(local.ndim)]
        return (torch.tensor(idx, dtype=torch.int64, device=device),
                torch.tensor(keep, dtype=torch.bool, device=device).reshape(shape))

    if length == 0:  # all halo, all zeros; cat keeps the (empty) autograd edge
        shape = [p.left + p.right if i == p.dim else n for i, n in enumerate(local.shape)]
        return torch.cat([local, local.new_zeros(shape)], p.dim)
    idx, keep = maybe_run_for_local_tensor(index)(mesh.get_local_rank(axis), local.device)
    taken = local.index_select(p.dim, idx)
    # where(), not a multiply: a zero halo must stay zero next to an inf or nan.
    return torch.where(keep, taken, taken.new_zeros(()))


def _drop_halos(dt: DTensor, axes: list[int]) -> DTensor:
    """`HaloShard(d, l, r) -> Shard(d)` on each of `axes`: keep the chunk, no communication.

    Forward: `(.., l + T_r + r, ..) -> (.., T_r, ..)` along each; backward: `(.., T_r, ..)
    -> (.., l + T_r + r, ..)` with zero halos (the halos' producer adds halo gradients into
    owners).
    """
    local = unwrap(dt)
    for axis in axes:
        p = dt.placements[axis]
        assert isinstance(p, HaloShard)
        local = local.narrow(p.dim, p.left, local.shape[p.dim] - p.left - p.right)
    return wrap(local, dt, without_halo(dt.placements))


def _rehalo(dt: DTensor, axis: int, new: HaloShard, transport: str | None) -> DTensor:
    """`HaloShard(d, l, r) -> HaloShard(d, l', r')` on one axis (same pad mode).

    Widening is `widen`: the exchange plan of the extra slices, given the ones every rank
    holds, so only slices no rank holds yet cross the wire, by `transport`. Narrowing a side
    drops slices, no communication. Forward: `(.., l + T_r + r, ..) -> (.., l' + T_r + r',
    ..)`; backward: the new halos' gradients are added into the slices they copy (owners'
    chunks or this rank's held slices), dropped slices get zero.
    """
    old, mesh = dt.placements[axis], dt.device_mesh
    assert isinstance(old, HaloShard)
    dst = tuple(new if i == axis else q for i, q in enumerate(dt.placements))
    d, extra = old.dim, (max(new.left - old.left, 0), max(new.right - old.right, 0))
    lengths = shard_sizes(dt.shape[d], mesh.size(axis))
    wide = widen(unwrap(dt), *extra, d, (mesh, axis), held=(old.left, old.right),
                 lengths=lengths, pad=old.pad, transport=transport)
    start = extra[0] + old.left - new.left
    size = wide.shape[d] - start - (extra[1] + old.right - new.right)
    return wrap(wide.narrow(d, start, size), dt, dst)
