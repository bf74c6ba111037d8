"""A chunk's shard moved from T to rows and back (an all-to-all each way), differentiably.

Attention along T of each pixel's own sequence (Mochi's VAE) needs every frame of a pixel
and no other pixel. With T sharded, bringing K and V along T to each rank's queries is
causal-imbalanced (the last rank's queries read every frame) and sends each block to every
later rank. Moving the shard instead, as Ulysses-style sequence parallelism does for heads,
gives each rank its share of the rows with every frame (`time_to_rows`): the attention then
runs on whole sequences, one device's kernel on `1/P` of the pixels, balanced; its output
goes back to `Shard(T)` the same way (`rows_to_time`). Each direction sends `(P - 1) / P` of
the chunk once, and each is the other's backward.

The layout on the rows side is `(T, B, H_r, W, C)` (`along=3`; `along=4`: `(T, B, H, W_r, C)`),
frames outermost: each peer's frames arrive as one contiguous block of the buffer, so no
piece is copied again on arrival. Chunks are 5-D `(B, C, T_r, H, W)` of any strides (a
channels-last chunk is read in its own order); the result of `rows_to_time` takes the
layout of the chunk it stands for (`like`).

Eager, real ranks only: the caller has agreed the shapes (every rank's frames, the rows it
splits) before; the moves are plain all-to-alls of the agreed sizes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from haloshard import _comm
from haloshard._layout import shard_size_and_offset

# (B, C, T_r, H, W) -> (T_r, B, H, W, C): frames outermost, channels innermost
_ROWS_ORDER = (2, 0, 3, 4, 1)
_CHUNK_ORDER = (1, 4, 0, 2, 3)  # its inverse


def _splits(length: int, world: int) -> list[tuple[int, int]]:
    """Every rank's `(rows, first row)` of a `Shard` split of `length` rows."""
    return [shard_size_and_offset(length, world, r) for r in range(world)]


def _per_row(t: torch.Tensor, along: int) -> int:
    """The elements of one slice of `t` along `along`."""
    return t.numel() // t.shape[along] if t.shape[along] else 0


def _packed(pieces: list[torch.Tensor]) -> torch.Tensor:
    """`pieces` (any shapes and strides) side by side in one flat buffer, in order, each
    copied once: an all-to-all's message to each peer in turn."""
    flat = pieces[0].new_empty(sum(p.numel() for p in pieces))
    at = 0
    for piece in pieces:
        flat.narrow(0, at, piece.numel()).view(piece.shape).copy_(piece)
        at += piece.numel()
    return flat


def _to_rows(x: torch.Tensor, grp: _comm.Group, lengths: tuple[int, ...], along: int
             ) -> torch.Tensor:
    """This rank's `(B, C, T_r, H, W)` chunk -> its rows of every frame, `(T, B, H_r, W, C)`
    (`along=3`), every rank's frames in order."""
    splits = _splits(x.shape[along], grp.size)
    send = _packed([x.narrow(along, start, n).permute(_ROWS_ORDER) for n, start in splits])
    shape = [*x.shape]
    shape[along] = splits[int(grp.rank)][0]
    per_frame = math.prod(shape[:2] + shape[3:])  # B * C * H_r * W
    recv = _comm.all_to_all(send, [t * per_frame for t in lengths],
                            [_per_row(x, along) * n for n, _ in splits], grp)
    b, c, _, h, w = shape
    return recv.view(sum(lengths), b, h, w, c)


def _to_time(o: torch.Tensor, grp: _comm.Group, lengths: tuple[int, ...], along: int,
             like: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`(T, B, H_r, W, C)` rows of every frame -> this rank's frames of every row, a chunk
    shaped and laid out as `like` (any device: only its shape and strides are read;
    `residual` added, when given, as the pieces land)."""
    splits = _splits(like.shape[along], grp.size)
    per_frame = o[0].numel() if o.shape[0] else 0
    # each peer's frames are one block of dim 0: a contiguous `o` is its own message
    send = o.reshape(-1) if o.is_contiguous() else _packed(list(o.split(list(lengths))))
    per_row = _per_row(like, along)
    recv = _comm.all_to_all(send, [per_row * n for n, _ in splits],
                            [t * per_frame for t in lengths], grp)
    out = torch.empty_strided(like.shape, like.stride(), dtype=o.dtype, device=o.device)
    at, t_r = 0, lengths[int(grp.rank)]
    for n, start in splits:
        shape = [*like.shape]
        shape[along] = n
        b, c, _, h, w = shape
        piece = recv.narrow(0, at, per_row * n).view(t_r, b, h, w, c).permute(_CHUNK_ORDER)
        target = out.narrow(along, start, n)
        if residual is None:
            target.copy_(piece)
        else:
            torch.add(residual.narrow(along, start, n), piece, out=target)
        at += per_row * n
    return out


class _TimeToRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grp: _comm.Group,  # type: ignore[override]
                lengths: tuple[int, ...], along: int) -> torch.Tensor:
        ctx.grp, ctx.lengths, ctx.along = grp, lengths, along
        ctx.like = torch.empty_like(x, device="meta")  # the gradient's shape and layout
        return _to_rows(x, grp, lengths, along)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # the reverse move as a node of its own: a backward that builds a graph
        # (`create_graph=True`) differentiates through it in turn
        return _RowsToTime.apply(grad, ctx.grp, ctx.lengths, ctx.along, ctx.like), None, \
            None, None


class _RowsToTime(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, o: torch.Tensor, grp: _comm.Group,  # type: ignore[override]
                lengths: tuple[int, ...], along: int, like: torch.Tensor) -> torch.Tensor:
        ctx.grp, ctx.lengths, ctx.along = grp, lengths, along
        return _to_time(o, grp, lengths, along, like)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _TimeToRows.apply(grad, ctx.grp, ctx.lengths, ctx.along), None, None, None, \
            None


def time_to_rows(x: torch.Tensor, grp: _comm.Group, lengths: tuple[int, ...], along: int
                 ) -> torch.Tensor:
    """This rank's `Shard(T)` chunk `(B, C, T_r, H, W)` (every rank's frames `lengths`) as
    its `Shard(along)` share of every frame, `(T, B, H_r, W, C)` (`along=3`; 4: `W_r`).
    Backward: the reverse move."""
    return _TimeToRows.apply(x, grp, lengths, along)  # type: ignore[no-any-return]


def rows_to_time(o: torch.Tensor, grp: _comm.Group, lengths: tuple[int, ...], along: int,
                 like: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`time_to_rows` reversed: `(T, B, H_r, W, C)` rows of every frame -> this rank's
    chunk of frames, shaped and laid out as `like`. With `residual` (a chunk like `like`;
    inference only: not differentiable) the result is `residual + chunk`, each piece added
    as it lands (one pass, as one device's residual add)."""
    if residual is not None:
        return _to_time(o, grp, lengths, along, like, residual)
    return _RowsToTime.apply(o, grp, lengths, along,  # type: ignore[no-any-return]
                             torch.empty_like(like, device="meta"))
