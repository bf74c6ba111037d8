"""`halo_exchange`: the differentiable neighbour exchange on a local shard.

Three steps, each its own function: agree (every rank checks its arguments, then all ranks
exchange a row of ints so a mistake on one rank raises `HaloError` on all of them and every
rank learns every chunk length), move (the transport carries exactly the distinct remote halo
slices), assemble (halos are indexed out of `recv ++ own slices ++ zero slice` and the output is
one `cat`). Every step is a differentiable torch op, so autograd's backward is the exact
adjoint: each halo slice's gradient is added into the slice it was copied from, on its owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from einops import rearrange
from torch.distributed._local_tensor import maybe_run_for_local_tensor

from haloshard import _comm
from haloshard._comm import Group, GroupLike
from haloshard._errors import HaloError
from haloshard._layout import LENIENT_PADS, PAD_MODES, check_pad_fits, shard_sizes
from haloshard._plan import exchange_plan

TRANSPORTS: tuple[str, ...] = ("all_to_all", "p2p", "allgather")
_DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
_MAX_DIMS = 8
# One row of ints per rank; "length" is the only field allowed to differ between ranks.
_FIELDS = ("error", "ndim", "dim", "left", "right", "pad", "transport", "dtype",
           "requires_grad", "length", *(f"size of dim {i}" for i in range(_MAX_DIMS)))
_ERR, _LEN = _FIELDS.index("error"), _FIELDS.index("length")


def _local_problem(
    x: torch.Tensor, left: object, right: object, dim: object, pad: object, transport: object
) -> str | None:
    """What is wrong with this rank's own arguments, or None."""
    for name, value in (("left", left), ("right", right)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"{name} halo must be a non-negative int, got {value!r}"
    if not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        return f"dim {dim!r} is out of range for a {x.ndim}-D tensor"
    if x.ndim > _MAX_DIMS:
        return f"tensors of at most {_MAX_DIMS} dims are supported, got {x.ndim}"
    if pad not in PAD_MODES + LENIENT_PADS:
        return f"pad must be one of {PAD_MODES}, got {pad!r}"
    if transport not in TRANSPORTS:
        return f"transport must be one of {TRANSPORTS} or None, got {transport!r}"
    return None


def _code(value: object, choices: tuple[object, ...]) -> int:
    return choices.index(value) if value in choices else -1


def _as_int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


@maybe_run_for_local_tensor
def _meta_row(
    x: torch.Tensor, left: int, right: int, dim: int, pad: str, transport: str, error: bool
) -> torch.Tensor:
    d = _as_int(dim) % max(x.ndim, 1) if not error else _as_int(dim)
    sizes = [-1 if i == d else s for i, s in enumerate(x.shape[:_MAX_DIMS])]
    pads = PAD_MODES + LENIENT_PADS
    row = [int(error), x.ndim, d, _as_int(left), _as_int(right), _code(pad, pads),
           _code(transport, TRANSPORTS), _code(x.dtype, _DTYPES), int(x.requires_grad),
           x.shape[d] if not error else -1, *sizes, *[-1] * (_MAX_DIMS - len(sizes))]
    return torch.tensor(row, dtype=torch.int64, device=x.device)


@maybe_run_for_local_tensor
def _check_rows(rows: list[list[int]], own_problem: str | None) -> None:
    """Raise the same `HaloError` on every rank when any rank's row is bad or differs.

    Per simulated rank under LocalTensorMode: groups of a 2-D mesh may hold different rows
    (an uneven batch over dp), which arrive as per-rank ints.
    """
    if own_problem is not None:
        raise HaloError(own_problem)
    bad = [k for k, row in enumerate(rows) if row[_ERR]]
    if bad:
        raise HaloError(f"rank(s) {bad} of the group rejected their halo_exchange arguments "
                        "(see the error on those ranks); every rank must pass valid arguments")
    for i, field in enumerate(_FIELDS):
        values = [row[i] for row in rows]
        if i != _LEN and len(set(values)) > 1:
            raise HaloError(
                f"ranks disagree on {field}: {values} (rank by rank); every rank must pass "
                "the same halo_exchange arguments and tensors that differ only in the length "
                "of the sharded dim"
            )


def _agree(
    x: torch.Tensor, left: int, right: int, dim: int, pad: str, transport: str,
    group: Group, global_length: int | None,
) -> tuple[int, tuple[int, ...]]:
    """Validate on every rank at once; return the normalised dim and every chunk length."""
    problem = _local_problem(x, left, right, dim, pad, transport)
    if torch.compiler.is_compiling():
        # No data-dependent metadata exchange in a graph: the caller states the length.
        if problem is not None or global_length is None:
            raise HaloError(problem or "under torch.compile pass global_length=")
        lengths = shard_sizes(global_length, group.size)
    else:
        row = _meta_row(x, left, right, dim, pad, transport, problem is not None)
        rows = _comm.gather_ints(row, group)
        _check_rows(rows, problem)
        lengths = tuple(row[_LEN] for row in rows)
        _check_lengths(lengths, global_length, dim)
    check_pad_fits(sum(lengths), left, right, pad)
    return dim % x.ndim, lengths


def _check_lengths(lengths: tuple[int, ...], global_length: int | None, dim: int) -> None:
    total = sum(lengths)
    if global_length is not None and global_length != total:
        raise HaloError(f"global_length={global_length} but the chunks along dim {dim} add "
                        f"up to {total} (lengths {list(lengths)})")
    expected = shard_sizes(total, len(lengths))
    if lengths != expected:
        raise HaloError(f"chunk lengths along dim {dim} are {list(lengths)} (rank by rank); "
                        f"Shard({dim}) splits the global length {total} as {list(expected)}")


@lru_cache(maxsize=1024)
def _plan_tensors(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str, device: torch.device
) -> tuple[torch.Tensor, ...]:
    plan = exchange_plan(rank, lengths, left, right, pad)
    idx = (plan.send_idx, plan.self_idx, plan.left_idx, plan.right_idx, plan.gather_idx,
           plan.gather_pick)
    return tuple(torch.tensor(i, dtype=torch.int64, device=device) for i in idx)


# Decorated once here: building the wrapper inside a compiled region breaks dynamo's guards.
_rank_plan_tensors = maybe_run_for_local_tensor(_plan_tensors)


@maybe_run_for_local_tensor
def _plan_ints(
    rank: int, lengths: tuple[int, ...], left: int, right: int, pad: str
) -> list[int]:
    # A flat list: LocalTensorMode combines per-rank ints position by position.
    plan = exchange_plan(rank, lengths, left, right, pad)
    return [*plan.recv_splits, *plan.send_splits, plan.gather_len - len(plan.gather_idx)]


def _front(ndim: int, dim: int) -> tuple[str, str]:
    """einops patterns moving `dim` to the front and back."""
    names = [f"d{i}" for i in range(ndim)]
    moved = [names[dim], *names[:dim], *names[dim + 1 :]]
    return f"{' '.join(names)} -> {' '.join(moved)}", f"{' '.join(moved)} -> {' '.join(names)}"


@dataclass(frozen=True)
class _Route:
    """Everything one rank's exchange needs besides the index tensors (no tensors here)."""

    dim: int
    left: int
    right: int
    transport: str
    group: Group
    recv_splits: list[Any]
    send_splits: list[Any]
    gather_pad: Any
    to_front: str
    from_front: str


def _forward_move(x: torch.Tensor, send_idx: torch.Tensor, gather_idx: torch.Tensor,
                  route: _Route) -> torch.Tensor:
    """Start carrying the remote halo slices (async where the transport allows).

    Returns the received buffer at the front; for `allgather`, every rank's contribution
    (pick `gather_pick` out of it once it is needed).
    """
    if route.transport == "allgather":
        mine = rearrange(x.index_select(route.dim, gather_idx), route.to_front)
        filler = mine.new_zeros((route.gather_pad, *mine.shape[1:]))
        return _comm.all_gather(torch.cat([mine, filler]), route.group)
    send = rearrange(x.index_select(route.dim, send_idx), route.to_front).contiguous()
    move = _comm.p2p if route.transport == "p2p" else _comm.all_to_all
    return move(send, route.recv_splits, route.send_splits, route.group)


def _backward_move(g_recv: torch.Tensor, gather_idx: torch.Tensor, gather_pick: torch.Tensor,
                   route: _Route) -> torch.Tensor:
    """Start the adjoint of `_forward_move`: received slices' gradients back to owners."""
    g_recv = g_recv.contiguous()
    if route.transport == "allgather":
        g_every = g_recv.new_zeros(
            (route.group.size * (gather_idx.shape[0] + route.gather_pad), *g_recv.shape[1:]))
        g_every.index_add_(0, gather_pick, g_recv)
        return _comm.reduce_scatter(g_every, route.group)
    move = _comm.p2p if route.transport == "p2p" else _comm.all_to_all
    return move(g_recv, route.send_splits, route.recv_splits, route.group)


def _empty_like_layout(x: torch.Tensor, shape: list[Any]) -> torch.Tensor:
    """An output buffer in `x`'s memory format, so channels_last convs stay channels_last.

    Allocated channels-last-ordered and viewed back (a `new_empty`, which LocalTensorMode
    runs per rank, rather than a factory call with a memory_format).
    """
    formats = {5: (torch.channels_last_3d, "n t h w c -> n c t h w"),
               4: (torch.channels_last, "n h w c -> n c h w")}
    if x.ndim in formats and not x.is_contiguous():
        fmt, pattern = formats[x.ndim]
        if x.is_contiguous(memory_format=fmt):
            return rearrange(x.new_empty([shape[0], *shape[2:], shape[1]]), pattern)
    return x.new_empty(shape)


@dataclass(frozen=True)
class HaloMove:
    """One rank's prepared exchange: the plan's index tensors and its route.

    Split into steps so a consumer can do its own work while the halo is in flight:
    `start` -> (other work) -> `halos`; backward: `start_backward` -> (other work) -> `fold`.
    """

    send_idx: torch.Tensor
    self_idx: torch.Tensor
    left_idx: torch.Tensor
    right_idx: torch.Tensor
    gather_idx: torch.Tensor
    gather_pick: torch.Tensor
    route: _Route

    def start(self, x: torch.Tensor) -> torch.Tensor:
        """Start moving `x`'s edge slices to the ranks that need them."""
        return _forward_move(x, self.send_idx, self.gather_idx, self.route)

    def halos(self, x: torch.Tensor, moved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the move; the left and right halos in `x`'s layout order."""
        route = self.route
        recv = moved.index_select(0, self.gather_pick) if route.transport == "allgather" \
            else moved
        own = rearrange(x.index_select(route.dim, self.self_idx), route.to_front)
        source = torch.cat([recv, own, own.new_zeros((1, *own.shape[1:]))])
        left, right = (rearrange(source.index_select(0, i), route.from_front)
                       for i in (self.left_idx, self.right_idx))
        return left, right

    def start_backward(self, g_left: torch.Tensor, g_right: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum the halos' gradients per source slice and start sending them to the owners.

        Summed first (replicate repeats slices), so each slice's gradient crosses once.
        Returns (the move in flight, the gradient of this rank's own copied slices).
        """
        route = self.route
        g_halo = [rearrange(g, route.to_front) for g in (g_left, g_right)]
        n_recv, n_own = sum(route.recv_splits), self.self_idx.shape[0]
        g_source = g_halo[0].new_zeros((n_recv + n_own + 1, *g_halo[0].shape[1:]))
        g_source.index_add_(0, self.left_idx, g_halo[0]).index_add_(0, self.right_idx,
                                                                     g_halo[1])
        moved = _backward_move(g_source[:n_recv], self.gather_idx, self.gather_pick, route)
        return moved, g_source[n_recv : n_recv + n_own]

    def fold(self, g_x: torch.Tensor, moved: torch.Tensor, g_own: torch.Tensor) -> None:
        """Wait for the halo gradients and add them, in place, into their slices of `g_x`."""
        route = self.route
        g_x.index_add_(route.dim, self.self_idx, rearrange(g_own, route.from_front))
        if route.transport == "allgather":
            received = moved[: self.gather_idx.shape[0]]
            g_x.index_add_(route.dim, self.gather_idx, rearrange(received, route.from_front))
        else:
            g_x.index_add_(route.dim, self.send_idx, rearrange(moved, route.from_front))


class _HaloExchange(torch.autograd.Function):
    """Forward copies neighbours' edge slices into the halo: `(T_r) -> (left + T_r + right)`.
    Backward adds halo gradients into the owners' edges: `(left + T_r + right) -> (T_r)`.

    Both directions start the transport first and copy the interior (the bulk of the bytes)
    while the halo is in flight; the output is written in place, with no full-size `cat`.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, move: HaloMove) -> torch.Tensor:  # type: ignore[override]
        route = move.route
        dim, left, length = route.dim, route.left, x.shape[route.dim]
        ctx.move, ctx.length = move, length
        moved = move.start(x)
        shape = list(x.shape)
        shape[dim] = left + length + route.right
        out = _empty_like_layout(x, shape)
        out.narrow(dim, left, length).copy_(x)
        halo_left, halo_right = move.halos(x, moved)
        out.narrow(dim, 0, left).copy_(halo_left)
        out.narrow(dim, left + length, route.right).copy_(halo_right)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        move: HaloMove = ctx.move
        dim, left, length, right = move.route.dim, move.route.left, ctx.length, move.route.right
        moved, g_own = move.start_backward(grad.narrow(dim, 0, left),
                                           grad.narrow(dim, left + length, right))
        g_x = grad.narrow(dim, left, length).clone()  # keeps a channels_last layout
        move.fold(g_x, moved, g_own)
        return g_x, None


def prepare_halo(
    x: torch.Tensor, left: int, right: int, dim: int, group: GroupLike, *, pad: str = "zeros",
    transport: str | None = None, global_length: int | None = None,
) -> tuple[HaloMove | None, tuple[int, ...]]:
    """Validate on every rank and plan one exchange; None when there is nothing to move.

    Returns the prepared move and every rank's chunk length along `dim`.
    """
    grp = _comm.resolve_group(group)
    transport = "all_to_all" if transport is None else transport
    dim, lengths = _agree(x, left, right, dim, pad, transport, grp, global_length)
    if left == right == 0:
        return None, lengths
    to_front, from_front = _front(x.ndim, dim)
    tensors = _rank_plan_tensors(grp.rank, lengths, left, right, pad, x.device)
    ints = _plan_ints(grp.rank, lengths, left, right, pad)
    world = grp.size
    route = _Route(dim, left, right, transport, grp, ints[:world], ints[world : 2 * world],
                   ints[-1], to_front, from_front)
    return HaloMove(*tensors, route), lengths


def halo_exchange(
    x: torch.Tensor,
    left: int,
    right: int,
    dim: int,
    group: GroupLike,
    *,
    pad: str = "zeros",
    transport: str | None = None,
    global_length: int | None = None,
) -> torch.Tensor:
    """Extend a local `Shard(dim)` chunk by its neighbours' halo slices, differentiably.

    Forward copies neighbours' edge slices into the halo:
    `(..., T_r, ...) -> (..., left + T_r + right, ...)`, equal to
    `F.pad(global, (left, right), mode=pad)[start_r : start_r + T_r + left + right]` along
    `dim`. Backward adds halo gradients into the owners' edges:
    `(..., left + T_r + right, ...) -> (..., T_r, ...)`.

    Args:
        x: this rank's chunk; the ranks' chunks are `Shard(dim)`'s split of the global tensor
            (uneven and empty chunks included).
        left: slices to prepend; may exceed a neighbour's chunk (taken from several ranks).
        right: slices to append.
        dim: the sharded dimension.
        group: a ProcessGroup, a 1-D DeviceMesh or a `(mesh, mesh_axis)` pair; ranks are
            group-local, so the `cp` axis of a `(dp, cp)` mesh works.
        pad: `zeros`, `replicate`, `reflect` or `circular`: fills beyond the global ends.
        transport: `all_to_all` (default: moves only halo bytes, compiles), `p2p`
            (`batch_isend_irecv`, eager only) or `allgather` (every rank in the same
            all-gather of its edge slices).
        global_length: the global length of `dim`; required under `torch.compile`, where no
            metadata can be exchanged, and checked against the chunks in eager mode.

    Returns:
        The chunk with its halos, in `x`'s dtype and layout order.

    Raises:
        HaloError: on every rank, when any rank passes a bad argument or a tensor that
            differs from the others in anything but the length of `dim`.

    Example::
        >>> # on 4 ranks, global T = 5 split (2, 2, 1, 0)
        >>> y = halo_exchange(x, 2, 1, 2, mesh)  # x: (1, 8, T_r, 16, 16)
        >>> y.shape  # on rank 2
        torch.Size([1, 8, 4, 16, 16])
    """
    move, _ = prepare_halo(x, left, right, dim, group, pad=pad, transport=transport,
                           global_length=global_length)
    return x if move is None else _HaloExchange.apply(x, move)
