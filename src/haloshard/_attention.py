"""Attention along a sharded dim: each rank's queries attend to the all-gathered keys/values.

A VAE mid-block attends over every frame, so halos are not enough: each rank needs all keys
and values. All-gathering K and V over the `cp` axis is exact and simple; it costs
`2 * (P - 1) / P` of the global K/V bytes on the wire and the full K and V in memory on every
rank (the queries, the scores and the output stay sharded). Its backward is a reduce-scatter
of dK and dV, so gradients are exact too. For inference, `blocks_many` brings the same
chunks one source rank at a time (a broadcast each, agreed the same way), so attention can
fold them in without the full K and V (`haloshard._masked_attention`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange

from haloshard import _comm
from haloshard._agree import (
    Agreed,
    Agreements,
    Fields,
    check_rows,
    dtype_code,
    gather,
    gather_while_tracing,
    reuse_agreement,
)
from haloshard._comm import GroupLike
from haloshard._compat import enabled_local_tensor_mode, maybe_run_for_local_tensor
from haloshard._errors import HaloError
from haloshard._exchange import (
    as_int,
    check_own_length,
    length_problem,
    own_length_problem,
    tensor_problem,
)
from haloshard._layout import shard_sizes
from haloshard._tracing import surfaces_errors


@maybe_run_for_local_tensor
def _valid_rows(lengths: tuple[int, ...], chunk: int, device: torch.device) -> torch.Tensor:
    """Rows of the padded all-gather that hold real slices, in global order."""
    return torch.tensor([r * chunk + i for r, n in enumerate(lengths) for i in range(n)],
                        dtype=torch.int64, device=device)


_MAX_DIMS = 8
_TENSOR_FIELDS = ("ndim", "dtype", "requires_grad", "length",
                  *(f"size of dim {i}" for i in range(_MAX_DIMS)))


def _problem(tensors: tuple[torch.Tensor, ...], dim: int, global_length: object,
             frame: object) -> str | None:
    """What is wrong with this rank's own arguments, or None (no communication)."""
    for t in tensors:
        problem = tensor_problem(t)
        if problem is not None:
            return problem
        if not -t.ndim <= dim < t.ndim or t.ndim > _MAX_DIMS:
            return f"dim {dim} is out of range for a {t.ndim}-D tensor (at most {_MAX_DIMS})"
    # 0: a rank without a row of a second sharded dim (H) gathers frames of no tokens
    # along T, with the ranks of its T group, which hold no row either
    if not isinstance(frame, int) or isinstance(frame, bool) or frame < 0:
        return f"frame must be a non-negative int, got {frame!r}"
    return length_problem(global_length) or (
        "global_length= is required" if global_length is None else None)


@maybe_run_for_local_tensor
def _meta_row(tensors: tuple[torch.Tensor, ...], dim: int, global_length: int, frame: int,
              error: bool) -> torch.Tensor:
    """One fixed-size row per rank: the same length on every rank whatever went wrong."""
    return torch.tensor(_row_values(tensors, dim, global_length, frame, error),
                        dtype=torch.int64)


def _row_values(tensors: tuple[torch.Tensor, ...], dim: int, global_length: int, frame: int,
                error: bool) -> list[Any]:
    """`_meta_row` as a list (sizes may be symbols under torch.compile)."""
    row = [int(error), as_int(global_length) if not error else -1,
           as_int(frame) if not error else -1]
    for t in tensors:
        if error:
            row += [-1] * len(_TENSOR_FIELDS)
            continue
        d = dim % t.ndim
        sizes = [-1 if i == d else n for i, n in enumerate(t.shape)]
        row += [t.ndim, dtype_code(t.dtype), int(t.requires_grad), t.shape[d], *sizes,
                *[-1] * (_MAX_DIMS - len(sizes))]
    return row


def _fields(names: tuple[str, ...]) -> Fields:
    """The row's fields for tensors called `names`: their lengths may differ."""
    return Fields(("error", "global_length", "frame",
                   *(f"{name} {f}" for name in names for f in _TENSOR_FIELDS)), "gather",
                  "every rank must pass the same arguments and tensors that differ only in "
                  "the length of the gathered dim",
                  may_differ=frozenset(f"{name} length" for name in names))


@maybe_run_for_local_tensor
def _check_lengths(rows: list[list[int]], names: tuple[str, ...]) -> None:
    """Every tensor's chunk lengths against the `Shard` split of the agreed global length."""
    n = len(_TENSOR_FIELDS)
    global_length, frame = rows[0][1], rows[0][2]
    want = [n_r * frame for n_r in shard_sizes(global_length, len(rows))]
    for k, name in enumerate(names):
        got = [row[3 + k * n + 3] for row in rows]
        if -1 not in got and got != want:  # -1: not sent (traced rows; see `_agree_traced`)
            raise HaloError(f"{name}: chunk lengths {got} (rank by rank) do not match "
                            f"global_length={global_length} (frames of {frame}), which "
                            f"splits as {want}")


def _agree(tensors: tuple[torch.Tensor, ...], names: tuple[str, ...], dim: int,
           grp: _comm.Group, global_length: int, frame: int, problem: str | None = None
           ) -> None:
    """Check every rank's tensors against `global_length` on every rank at once.

    Eager: one all-gather of a fixed-size row (`haloshard._agree`). Compiled: see
    `_agree_traced`.
    """
    problem = problem or _problem(tensors, dim, global_length, frame)
    if torch.compiler.is_compiling():
        _agree_traced(tensors, names, dim, grp, global_length, frame, problem)
        return
    row = _meta_row(tensors, dim, global_length, frame, problem is not None)
    rows = gather(row, grp, "gather metadata exchange")
    check_rows(rows, _fields(names), problem)
    _check_lengths(rows, names)


def agree_chunks(tensors: tuple[torch.Tensor, ...], dim: int, grp: _comm.Group, *,
                 global_length: int, frame: int = 1) -> None:
    """Check every rank's chunks of `tensors` along `dim` against `global_length` on every
    rank at once (`HaloError` on all of them when a rank's differ): one all-gather of a
    small row, at every call (nothing is cached)."""
    names = tuple(f"tensor {i}" for i in range(len(tensors)))
    _agree(tuple(tensors), names, dim, grp, global_length, frame)


def _agree_traced(tensors: tuple[torch.Tensor, ...], names: tuple[str, ...], dim: int,
                  grp: _comm.Group, global_length: int, frame: int, problem: str | None
                  ) -> None:
    """`_agree` under torch.compile: each rank checks its own chunks against the stated
    global length, then the ranks agree on their rows once per trace, so a mistake on one
    rank raises on every rank and the graph sends no metadata. Lengths and sizes stay out
    of the traced row (see `haloshard._agree`)."""
    lengths: tuple[int, ...] = ()
    if problem is None:
        lengths = tuple(n * frame for n in shard_sizes(global_length, grp.size))
    if not isinstance(grp.rank, int):  # simulated ranks: nothing real to agree with
        if problem is not None:
            raise HaloError(problem)
        for t in tensors:
            check_own_length(t.shape[dim], lengths, grp.rank, dim)
        return
    for t in tensors if problem is None else ():
        problem = problem or own_length_problem(t.shape[dim], lengths, grp.rank, dim)
    n = len(_TENSOR_FIELDS)
    unsent = {3 + k * n + i for k in range(len(tensors)) for i in range(3, n)}
    row = _row_values(tensors, dim, global_length, frame, problem is not None)
    rows = gather_while_tracing(row, grp, "gather metadata exchange", unsent)
    check_rows(rows, _fields(names), problem)
    _check_lengths(rows, names)


def _gather(tensors: tuple[torch.Tensor, ...], dim: int, grp: _comm.Group,
            global_length: int, frame: int, status: int | None = None
            ) -> tuple[torch.Tensor, ...]:
    """All-gather agreed tensors along `dim`: in one collective when they are plain eager
    tensors that differ only in their last dim (K and V), else one each. `status`: see
    `_gather_front`."""
    fronts, moved, names = _fronts(tensors, dim)
    # Concatenated along the last dim (dim 0, the gathered one, has the same length in all:
    # checked by `_agree`). Plain eager tensors only: LocalTensorMode's per-rank lengths do
    # not survive that cat's backward, and compiled code needs no metadata row to pay for.
    if _one_buffer(fronts):
        widths = [f.shape[-1] for f in fronts]
        every = _gather_front(torch.cat(fronts, -1) if len(fronts) > 1 else fronts[0], grp,
                              global_length, frame, status)
        parts = every.split(widths, -1)
    else:
        parts = tuple(_gather_front(f, grp, global_length, frame) for f in fronts)
    return tuple(rearrange(p, f"{moved} -> {' '.join(names)}") for p in parts)


def _fronts(tensors: tuple[torch.Tensor, ...], dim: int
            ) -> tuple[list[torch.Tensor], str, list[str]]:
    """Each tensor with `dim` moved to the front, and the einops patterns to move it back."""
    names = [f"d{i}" for i in range(tensors[0].ndim)]
    moved = " ".join([names[dim], *names[:dim], *names[dim + 1 :]])
    return [rearrange(t, f"{' '.join(names)} -> {moved}") for t in tensors], moved, names


def _one_buffer(fronts: list[torch.Tensor]) -> bool:
    return fronts[0].ndim > 1 and _comm.is_eager(fronts[0]) and all(
        f.shape[1:-1] == fronts[0].shape[1:-1] for f in fronts)


def _gather_front(front: torch.Tensor, grp: _comm.Group, global_length: int, frame: int,
                  status: int | None = None) -> torch.Tensor:
    """All-gather chunks of dim 0 (uneven and empty included) into the global dim 0.

    With `status` (0, or 1 from a rank that found a mistake and sends placeholder rows),
    each rank's block ends in one status row, so a call agreed before needs no metadata
    collective for a mistake on one rank to raise on every rank.
    """
    lengths = tuple(n * frame for n in shard_sizes(global_length, grp.size))
    chunk = max(lengths)
    # all-gather needs equal blocks: pad each chunk to the longest, then keep the real rows.
    pieces = [front, front.new_zeros((chunk - front.shape[0], *front.shape[1:]))]
    if status is not None:
        pieces.append(front.new_full((1, *front.shape[1:]), status))
    every = _comm.all_gather_autograd(torch.cat(pieces).contiguous(), grp,
                                      "all-gather along the dim")
    if status is not None:
        every = _without_status(every, grp.size)
    return every.index_select(0, _valid_rows(lengths, chunk, front.device))


def _without_status(every: torch.Tensor, size: int) -> torch.Tensor:
    """The gathered blocks without their status rows; `HaloError` on every rank when a
    peer raised one (on an accelerator: a deferred device assert, no host sync)."""
    blocks = every.unflatten(0, (size, -1))
    _comm.check_flags(blocks[:, -1].reshape(size, -1)[:, 0],
                      "this attention block tensors that differ from those")
    return blocks[:, :-1].flatten(0, 1)


@surfaces_errors
def gather_along(x: torch.Tensor, dim: int, group: GroupLike, *, global_length: int,
                 frame: int = 1) -> torch.Tensor:
    """All-gather `Shard(dim)` chunks (uneven and empty included) into the global tensor.

    Forward: `(..., T_r, ...) -> (..., T, ...)`; backward: each rank's chunk gets the sum over
    ranks of the gradient of its slices (a reduce-scatter).

    Args:
        global_length: the global number of frames along `dim`; checked against every
            rank's chunk (eager: on every rank at once; compiled: each rank its own chunk).
        frame: slices per frame: a rank holds `frame` times its `Shard` split of the frames
            (tokens of T*H*W come in frames of H*W).

    Raises:
        HaloError: on every rank, when any rank's chunk or arguments do not fit.

    Example::
        >>> full = torch.randn(1, 8, 13, 4, 4)  # 4 ranks hold T_r = 4, 4, 4, 1 of 13
        >>> x = rank_map(mesh, lambda r: shard(full, 2, 4, r))
        >>> gather_along(x, 2, mesh, global_length=13).shape
        torch.Size([1, 8, 13, 4, 4])
    """
    grp = _comm.resolve_group(group)
    _agree((x,), ("x",), dim, grp, global_length, frame)
    return _gather((x,), dim % x.ndim, grp, global_length, frame)[0]


def gather_many(tensors: tuple[torch.Tensor, ...], dim: int, group: GroupLike, *,
                global_length: int, frame: int = 1, reuse: Reuse | None = None,
                problem: str | None = None) -> tuple[torch.Tensor, ...]:
    """`gather_along` for several tensors of one split (e.g. K and V): one metadata row and
    one all-gather for all of them.

    `reuse`: a call site's store and the call's signature: agreed with the metadata row
    once per site, later calls compare this rank's row and signature with the agreed ones
    locally and carry a mistake or a change as a status row inside the all-gather (no
    metadata collective in steady state): `HaloError` on every rank when some ranks
    differ, a fresh agreement when every rank changed alike.

    `problem`: a mistake the caller found in its own arguments on this rank (e.g. a query
    that does not match K and V): it joins the agreement and raises on every rank.

    Example::
        >>> k = v = rank_map(mesh, lambda r: torch.randn(1, 8, (4, 4, 4, 1)[r], 4, 4))
        >>> k_all, v_all = gather_many((k, v), 2, mesh, global_length=13)
        >>> k_all.shape
        torch.Size([1, 8, 13, 4, 4])
    """
    grp = _comm.resolve_group(group)
    tensors = tuple(tensors)
    status = _agree_many(tensors, dim, grp, global_length, frame, reuse, blocks=False,
                         problem=problem)
    return _gather(tensors, dim % tensors[0].ndim, grp, global_length, frame, status)


def blocks_many(tensors: tuple[torch.Tensor, ...], dim: int, group: GroupLike, *,
                global_length: int, frame: int = 1, reuse: Reuse | None = None
                ) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """`gather_many` one source rank's block at a time, for inference (not differentiable).

    Yields `(src, blocks)` for src = 0 .. P - 1: rank src's chunks of `tensors`, padded
    along `dim` to the longest chunk (`frame` times `shard_sizes(global_length, P)[0]`);
    each is broadcast from src when it is due, so a rank holds its own chunk and one
    other, not the whole dim. Every rank must consume every block (each is a collective).
    Agreed as `gather_many` (same `reuse`); with a status, each block carries its source's
    status and `HaloError` is raised on every rank after the last block.

    Example::
        >>> k = v = rank_map(mesh, lambda r: torch.randn(1, 8, (4, 4, 4, 1)[r], 4, 4))
        >>> [src for src, (k_b, v_b) in blocks_many((k, v), 2, mesh, global_length=13)]
        [0, 1, 2, 3]
    """
    grp = _comm.resolve_group(group)
    tensors = tuple(tensors)
    status = _agree_many(tensors, dim, grp, global_length, frame, reuse, blocks=True)
    yield from _blocks(tensors, dim % tensors[0].ndim, grp, global_length, frame, status)


def _agree_many(tensors: tuple[torch.Tensor, ...], dim: int, grp: _comm.Group,
                global_length: int, frame: int, reuse: Reuse | None, *, blocks: bool,
                problem: str | None = None) -> int | None:
    """Agree on `tensors` on every rank at once (see `gather_many`); the status the
    transport carries: 0 at an agreed site (a mistake rides in the transport), None when
    this call's metadata row agreed and nothing is cached. `blocks`: the transport is
    `_blocks` (else one all-gather), part of the agreed signature so that a rank whose
    agreement is stale joins the transport its peers run."""
    names = tuple(f"tensor {i}" for i in range(len(tensors)))
    problem = problem or _problem(tensors, dim, global_length, frame)
    if reuse is None or torch.compiler.is_compiling() or enabled_local_tensor_mode() is not None:
        _agree(tensors, names, dim, grp, global_length, frame, problem)
        return None
    store, signature = reuse
    # One agreement per site (the same key on every rank); the signature, which may differ
    # between ranks, is compared locally (see `haloshard._agree`).
    key = (id(grp.pg), len(tensors))
    signature = (signature, dim, global_length, frame, blocks)
    row = None if problem else _meta_row(tensors, dim, global_length, frame, False).tolist()
    if _reuse_agreed(grp, store, key, row, signature, problem) is not None:
        return 0
    # agree (a mistake raises on every rank), then cache if one buffer
    _agree(tensors, names, dim, grp, global_length, frame, problem)
    fronts = _fronts(tensors, dim % tensors[0].ndim)[0]  # agreed: dim is in range
    if not _one_buffer(fronts):
        return None
    buffer = (*fronts[0].shape[1:-1], sum(f.shape[-1] for f in fronts))
    store[key] = Agreed(row, signature, (), buffer, tensors[0].dtype, tensors[0].device)
    return 0


def _blocks(tensors: tuple[torch.Tensor, ...], dim: int, grp: _comm.Group,
            global_length: int, frame: int, status: int | None
            ) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """Broadcast each rank's chunks (one buffer, padded to the longest chunk, then its
    status when not None) in turn; yield them as `blocks_many` does."""
    fronts, moved, names = _fronts(tensors, dim)
    widths = [f.shape[-1] for f in fronts]
    chunk = max(shard_sizes(global_length, grp.size)) * frame
    row = (*fronts[0].shape[1:-1], sum(widths))
    # Eager ranks pack their own block only when it is due (a block packed up front
    # would live beside every received one); simulated ranks pass their own to each.
    own = None if isinstance(grp.rank, int) else _block_buffer(fronts, chunk, status)
    flags = []
    for src in range(grp.size):
        send = own if own is not None else (
            _block_buffer(fronts, chunk, status) if src == grp.rank
            else fronts[0].new_empty(chunk * math.prod(row) + (status is not None)))
        buf = _comm.broadcast(send, src, grp, "broadcast of one rank's block along the dim")
        del send
        if status is not None:
            flags.append(buf[-1:].clone())  # a view would keep every block alive
            buf = buf[:-1]
        block = buf.view(-1, *row)
        yield src, tuple(rearrange(p, f"{moved} -> {' '.join(names)}")
                         for p in block.split(widths, -1))
        del buf, block  # before the next block is allocated (the consumer dropped its own)
    if status is not None:
        _comm.check_flags(torch.cat(flags), "this attention block tensors that differ from "
                          "those")


def _block_buffer(fronts: list[torch.Tensor], chunk: int, status: int | None
                  ) -> torch.Tensor:
    """`fronts` side by side along their last dim, padded along dim 0 to `chunk` rows,
    flat, then one status element. Eager: each written once into one buffer (no cat of a
    cat: one block of K/V in memory, not two)."""
    if not _comm.is_eager(fronts[0]):  # simulated ranks: per-rank lengths, as `_gather_front`
        front = torch.cat(fronts, -1) if len(fronts) > 1 else fronts[0]
        pieces = [front.reshape(-1),
                  front.new_zeros((chunk - front.shape[0], *front.shape[1:])).reshape(-1)]
        if status is not None:
            pieces.append(front.new_full((1,), status))
        return torch.cat(pieces)
    shape = (chunk, *fronts[0].shape[1:-1], sum(f.shape[-1] for f in fronts))
    flat = fronts[0].new_empty(math.prod(shape) + (status is not None))
    block, at = flat.narrow(0, 0, math.prod(shape)).view(shape), 0
    for f in fronts:
        block.narrow(0, 0, f.shape[0]).narrow(-1, at, f.shape[-1]).copy_(f)
        at += f.shape[-1]
    block.narrow(0, fronts[0].shape[0], chunk - fronts[0].shape[0]).zero_()  # the padding
    if status is not None:
        flat[-1] = status
    return flat


def _source_buffer(own: torch.Tensor, rank: int | torch.SymInt, src: int) -> torch.Tensor:
    """What this rank passes to the broadcast from `src`: its own block there, else a
    buffer to receive in (simulated ranks: their own block, which the broadcast replaces)."""
    if isinstance(rank, int) and rank != src:
        return torch.empty_like(own)
    return own


def _reuse_agreed(grp: _comm.Group, store: Agreements, key: Hashable,
                  row: list[int] | None, signature: Hashable, problem: str | None
                  ) -> Agreed | None:
    """`haloshard._agree.reuse_agreement` for a gather: on a mistake or a change this rank
    joins the all-gather (or the broadcasts) its peers are starting with placeholder rows
    and its status."""

    def join(agreed: Agreed, status: int) -> list[int]:
        called: tuple[Any, ...] = agreed.signature  # type: ignore[assignment]
        _, _, global_length, frame, blocks = called
        placeholder = _placeholder_blocks if blocks else _placeholder_gather
        return placeholder(grp, global_length, frame, agreed.shape, agreed.dtype,
                           agreed.device, status)

    def differs(agreed: Agreed, kept: list[int]) -> str:
        return (f"this rank's tensors or arguments differ from those agreed at this "
                f"attention block's last agreement: got the metadata row {row} and "
                f"signature {signature}, agreed {agreed.row} and {agreed.signature}; "
                f"rank(s) {kept} of the group kept the agreed ones")

    return reuse_agreement(store, key, row, signature, problem, join, differs)


# A gather site's agreements (its key is the gather's own: group and tensor count) and this
# call's signature.
Reuse = tuple[Agreements, Hashable]


def _placeholder_gather(grp: _comm.Group, global_length: int, frame: int,
                        buffer: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                        status: int) -> list[int]:
    """Join the all-gather the peers are starting with zero rows and `status`; every
    rank's status."""
    chunk = max(shard_sizes(global_length, grp.size)) * frame
    placeholder = torch.zeros((chunk + 1, *buffer), dtype=dtype, device=device)
    placeholder[-1] = status
    every = _comm.all_gather(placeholder, grp, "all-gather along the dim")
    blocks = every.unflatten(0, (grp.size, -1))
    return [int(v) for v in blocks[:, -1].reshape(grp.size, -1)[:, 0].tolist()]


def _placeholder_blocks(grp: _comm.Group, global_length: int, frame: int,
                        buffer: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                        status: int) -> list[int]:
    """`_placeholder_gather` for peers running `_blocks`: join each broadcast with a zero
    block and `status`; every rank's status."""
    chunk = max(shard_sizes(global_length, grp.size)) * frame
    own = _block_buffer([torch.zeros((chunk, *buffer), dtype=dtype, device=device)], chunk,
                        status)
    return [int(_comm.broadcast(_source_buffer(own, grp.rank, src), src, grp,
                                "broadcast of one rank's block along the dim")[-1].item())
            for src in range(grp.size)]


@surfaces_errors
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupLike, *,
              global_length: int, dim: int = 2, scale: float | None = None) -> torch.Tensor:
    """`F.scaled_dot_product_attention` over tokens sharded along `dim` of q, k and v.

    K and V travel in one all-gather, after one all-gather of a small fixed-size row that
    checks every rank's arguments and chunk lengths against `global_length`.

    Args:
        q, k, v: `(B, heads, L_r, E)` chunks of the token dim (`dim=2`), `Shard(dim)` split.
        group: the ranks sharing the token dim.
        global_length: the global number of tokens L.
        scale: as for `F.scaled_dot_product_attention`.

    Returns:
        This rank's chunk of the global attention output, `(B, heads, L_r, E)`.

    Raises:
        HaloError: on every rank, when any rank's arguments or chunks do not fit.

    Example::
        >>> q = k = v = torch.randn(1, 1, 24, 16)  # each of 4 ranks: 24 of 96 tokens
        >>> attention(q, k, v, mesh, global_length=96).shape
        torch.Size([1, 1, 24, 16])
    """
    problem = None
    if isinstance(q, torch.Tensor) and dim != q.ndim - 2:
        problem = (f"attention expects the token dim to be dim {q.ndim - 2} of "
                   f"{tuple(q.shape)} (B, heads, L, E), got dim={dim}")
    grp = _comm.resolve_group(group)
    _agree((q, k, v), ("q", "k", "v"), dim, grp, global_length, 1, problem)
    k_all, v_all = _gather((k, v), dim, grp, global_length, 1)
    return sdpa(q, k_all, v_all, scale)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
         ) -> torch.Tensor:
    """Unmasked attention of local queries over gathered keys and values.

    LocalTensorMode picks the SDPA kernel once for all simulated ranks, and the CPU flash
    kernel divides by zero on a rank without queries: the math is spelled out there."""
    if enabled_local_tensor_mode() is not None or q.shape[-2] == 0:
        s = scale if scale is not None else q.shape[-1] ** -0.5
        return torch.softmax(q @ k.transpose(-2, -1) * s, dim=-1) @ v
    return F.scaled_dot_product_attention(q, k, v, scale=scale)
