"""Attention over tokens grouped in frames, with an optional frame-causal mask, on Shard(T).

Causal video VAEs attend over all T*H*W tokens with a block-causal mask (a token of frame t
sees every token of frames <= t: HunyuanVideo's mid-block), or along T per pixel with a
causal mask (Mochi). Built on one device, that mask is a dense `(T*H*W)^2` tensor; serving
stacks have run out of memory building it. Here each rank builds only its queries' part,
`(T_r, T)` frame indices, compared by broadcasting: no `(N_r, N)` tensor of booleans is ever
materialised apart from the scores themselves. Keys and values are all-gathered along T
(one `gather_many` for both); the backward reduce-scatters their gradients. When no gradient
of K or V is wanted (inference), they come one source rank's block at a time instead
(`blocks_many`) and the softmax is merged block by block (a running max and sum): a rank
holds two blocks of K/V and one block's scores, never the whole T.

Tokens stay in `(..., T_r, S, E)` form (S tokens per frame) throughout: flattening a
per-rank T_r into tokens is a reshape that `LocalTensorMode` cannot run, and keeping the
frame axis makes the mask a broadcast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from haloshard._attention import Reuse, blocks_many, gather_many
from haloshard._comm import Group, GroupLike, resolve_group
from haloshard._compat import (
    enabled_local_tensor_mode,
    maybe_run_for_local_tensor,
    sdpa_flash_cpu,
)
from haloshard._exchange import length_problem
from haloshard._layout import lack, shard_size_and_offset, shard_sizes
from haloshard._tracing import surfaces_errors


@maybe_run_for_local_tensor
def _later(rank: int, length: int, world: int, per_frame: int, padded: bool,
           device: torch.device) -> torch.Tensor:
    """`(S * rows, T * S)`: True where a key's frame is after the query's frame; queries in
    (s, t) order, keys in (t, s) order. Padding rows beyond the chunk count on (they see
    every key, so no row is all -inf)."""
    size, offset = shard_size_and_offset(length, world, rank)
    rows = shard_sizes(length, world)[0] if padded else size
    queries = torch.arange(offset, offset + rows, device=device).repeat(per_frame)
    keys = torch.arange(length, device=device).repeat_interleave(per_frame)
    return keys[None, :] > queries[:, None]


@surfaces_errors
def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupLike, *,
                    global_length: int, causal: bool = True, scale: float | None = None,
                    frames: int | torch.SymInt | None = None, _reuse: Reuse | None = None
                    ) -> torch.Tensor:
    """Softmax attention of this rank's frames' queries over every frame's keys and values.

    Forward: q, k, v `(..., T_r, S, E)` -> `(..., T_r, S, E)`, keys and values all-gathered
    along T; with `causal`, a query of global frame t attends to the tokens of frames <= t
    only (block-causal over `T*S` tokens). Backward: exact; dK and dV are reduce-scattered.
    When neither k nor v requires grad (e.g. under `torch.no_grad()`), K/V are not gathered:
    each rank's block is broadcast in turn and merged by online softmax (exact up to the
    order of the sums; blocks wholly in a query's future are skipped), so no rank holds more
    than two blocks; the output is still differentiable in q.

    Args:
        q, k, v: this rank's `Shard(T)` chunk, frames at dim -3, S tokens per frame at -2.
        group: the ranks sharing T.
        global_length: the global number of frames T.
        causal: mask keys of later frames.
        scale: the score scale; default `E ** -0.5` (as `scaled_dot_product_attention`).
        frames: this rank's real frames when q, k, v are padded (at the end) to the longest
            chunk, `shard_sizes(T, P)[0]` frames; None: no padding. Padding keeps shapes
            equal across simulated ranks (under `LocalTensorMode` some kernels branch on
            sizes); its outputs are to be dropped.
        _reuse: for haloshard's styles: their agreements and the call's global signature
            (see `gather_many`); K and V travel in one gather either way.

    Returns:
        This rank's chunk of the attention output, `(..., T_r, S, E)`.

    Raises:
        HaloError: on every rank, when any rank's q, k, v are not at least 3-D or differ in
            shape, or its arguments or chunks do not fit `global_length`.

    Example::
        >>> q = torch.randn(1, 2, 3, 16, 4)  # each of 4 ranks: 3 of 12 frames of 16 tokens
        >>> frame_attention(q, q, q, mesh, global_length=12).shape
        torch.Size([1, 2, 3, 16, 4])
    """
    problem = _own_problem(q, k, v, global_length, frames)
    grp = resolve_group(group)
    if problem is not None:  # join the agreement the peers run, so all raise at once
        gather_many((k, v), -3, group, global_length=global_length, reuse=_reuse,
                    problem=problem)
        raise AssertionError("unreachable: an agreement with a problem raises")
    longest = shard_sizes(global_length, grp.size)[0]
    if frames is None and enabled_local_tensor_mode() is not None:
        n = q.shape[-3]
        padded = F.pad(q, (0, 0, 0, 0, 0, lack(n, longest)))
        out = _attend(padded, k, v, group, grp, global_length, causal, scale, True, _reuse)
        return out.narrow(-3, 0, n)
    if frames is not None:
        k, v = k.narrow(-3, 0, frames), v.narrow(-3, 0, frames)
    return _attend(q, k, v, group, grp, global_length, causal, scale, frames is not None,
                   _reuse)


def _own_problem(q: object, k: object, v: object, global_length: object, frames: object
                 ) -> str | None:
    """What is wrong with this rank's own arguments before anything is computed from them,
    or None (no communication; reported on every rank by the agreement)."""
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
              for t in (q, k, v)]
    # `!=`, not a set: simulated ranks' sizes are unhashable SymInts
    if not isinstance(shapes[0], tuple) or len(shapes[0]) < 3 or shapes[0] != shapes[1] or \
            shapes[1] != shapes[2]:
        return (f"frame_attention expects q, k, v of one shape (..., T_r, S, E), got "
                f"{', '.join(map(str, shapes))}")
    if (problem := length_problem(global_length)) is not None or global_length is None:
        return problem or "frame_attention needs global_length="
    n = shapes[0][-3]
    if isinstance(frames, int) and isinstance(n, int) and not 0 <= frames <= n:
        return f"frames={frames} is out of range for a chunk of {shapes[0][-3]} frames"
    return None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupLike, grp: Group,
            length: int, causal: bool, scale: float | None, padded: bool,
            reuse: Reuse | None) -> torch.Tensor:
    """Queries `(..., rows, S, E)` (padded: the longest chunk) over the gathered k, v."""
    # No gradient of K or V wanted (under no_grad, or frozen): blocks. Decided by what the
    # agreement compares (requires_grad of k and v), never by a rank's own grad mode, so
    # every rank picks the same collectives.
    if not (k.requires_grad or v.requires_grad) and not torch.compiler.is_compiling():
        return _attend_blocks(q, k, v, group, grp, length, causal, scale, padded, reuse)
    k_all, v_all = gather_many((k, v), k.ndim - 3, group, global_length=length, reuse=reuse)
    s = scale if scale is not None else q.shape[-1] ** -0.5
    # Queries as rows (s, t): (..., S * rows, E), one plain matmul against every key. The
    # per-rank T_r must stay out of broadcast batch dims: under LocalTensorMode matmul
    # branches on those sizes, which then differ between simulated ranks.
    per_frame = q.shape[-2]
    rows = shard_sizes(length, grp.size)[0] if padded else q.shape[-3]
    queries = q.transpose(-3, -2).contiguous().flatten(-3, -2)
    k_flat, v_flat = (t.flatten(-3, -2) for t in (k_all, v_all))
    scores = (queries @ k_flat.transpose(-2, -1)) * s  # (..., S * rows, T * S)
    if causal:
        later = _later(grp.rank, length, grp.size, per_frame, padded, q.device)
        scores = scores.masked_fill(later, float("-inf"))
    # frame t always sees itself: no row is all -inf
    out = torch.softmax(scores, dim=-1) @ v_flat
    return out.unflatten(-2, (per_frame, rows)).transpose(-3, -2)


def _attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupLike,
                   grp: Group, length: int, causal: bool, scale: float | None, padded: bool,
                   reuse: Reuse | None) -> torch.Tensor:
    """`_attend` for inference: over one source rank's K/V block at a time (`blocks_many`),
    merged with a running max and sum (online softmax), so a rank holds two K/V blocks and
    one block's scores instead of the whole T. Exact up to rounding (sums in another order).
    """
    s = scale if scale is not None else q.shape[-1] ** -0.5
    per_frame = q.shape[-2]
    if (per_frame == 1 and not padded and isinstance(grp.rank, int) and q.ndim >= 5
            and q.device.type == "cpu" and not (torch.is_grad_enabled() and q.requires_grad)):
        return _attend_tokens(q, k, v, group, grp, length, causal, s, reuse)
    rows = shard_sizes(length, grp.size)[0] if padded else q.shape[-3]
    queries = q.transpose(-3, -2).contiguous().flatten(-3, -2)  # (..., S * rows, E)
    # low-precision inputs: the running statistics and sums in float32, as SDPA's kernels
    dtype = torch.promote_types(q.dtype, torch.float32)
    state = (queries.new_full((*queries.shape[:-1], 1), float("-inf"), dtype=dtype),
             queries.new_zeros((*queries.shape[:-1], 1), dtype=dtype),
             queries.new_zeros(queries.shape, dtype=dtype))
    for src, (k_b, v_b) in blocks_many((k, v), k.ndim - 3, group, global_length=length,
                                       reuse=reuse):
        if _unseen(grp.rank, src, length, grp.size, rows, causal):
            continue  # every rank still joined the block's broadcast
        scores = (queries @ k_b.flatten(-3, -2).transpose(-2, -1)).to(dtype) * s
        hidden = _hidden(grp.rank, src, length, grp.size, per_frame, padded, causal,
                         q.device)
        fill = scores.masked_fill if scores.requires_grad else scores.masked_fill_
        state = _merge(state, fill(hidden, float("-inf")), v_b.flatten(-3, -2).to(dtype))
        # before the next block arrives: one block of K/V alive at a time, not two
        del k_b, v_b, scores
    _, total, out = state
    del state
    out = (out / total if out.requires_grad else out.div_(total)).to(q.dtype)
    return out.unflatten(-2, (per_frame, rows)).transpose(-3, -2)


def _attend_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupLike,
                   grp: Group, length: int, causal: bool, scale: float, reuse: Reuse | None
                   ) -> torch.Tensor:
    """`_attend_blocks` for one token per frame (Mochi's per-pixel attention along T) on
    eager CPU ranks, without a gradient for q: each K/V block through CPU's fused attention
    kernel, as `F.scaled_dot_product_attention` runs on one device (causal within this
    rank's own block, whose frames start where its queries do; earlier blocks wholly
    seen), merged by the log-sum-exp it returns (exact up to rounding). q, k, v may be
    strided views (heads split off a linear's output): nothing is copied into rows."""
    n = q.shape[-3]
    queries = q.squeeze(-2).flatten(0, -4)  # (N, heads, rows, E): a view
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = top = None
    for src, (k_b, v_b) in blocks_many((k, v), k.ndim - 3, group, global_length=length,
                                       reuse=reuse):
        if _unseen(grp.rank, src, length, grp.size, n, causal):
            continue  # every rank still joined the block's broadcast
        size = shard_size_and_offset(length, grp.size, src)[0]  # the rest is padding
        keys, values = (t.narrow(-3, 0, size).squeeze(-2).flatten(0, -4) for t in (k_b, v_b))
        o_b, lse_b = sdpa_flash_cpu(queries, keys, values, 0.0, causal and src == grp.rank,
                                    scale=scale)
        del k_b, v_b, keys, values
        if out is None or top is None:
            out, top = o_b.to(dtype), lse_b
            continue
        merged = torch.logaddexp(top, lse_b)
        out = out.mul_(torch.exp(top - merged).unsqueeze(-1)).add_(
            o_b.to(dtype) * torch.exp(lse_b - merged).unsqueeze(-1))
        top = merged
        del o_b, lse_b
    if out is None:  # no rows here (a rank of no frames): its empty output
        out = queries.new_zeros(queries.shape, dtype=dtype)
    return out.to(q.dtype).unflatten(0, q.shape[:-4]).unsqueeze(-2)


def _unseen(rank: int | torch.SymInt, src: int, length: int, world: int, rows: int,
            causal: bool) -> bool:
    """Whether no query of this rank sees a key of rank `src`'s block (eager ranks only:
    simulated ranks run every block, masked)."""
    if not isinstance(rank, int):
        return False
    src_size, src_offset = shard_size_and_offset(length, world, src)
    offset = shard_size_and_offset(length, world, rank)[1]
    return rows == 0 or src_size == 0 or (causal and src_offset > offset + rows - 1)


@maybe_run_for_local_tensor
def _hidden(rank: int, src: int, length: int, world: int, per_frame: int, padded: bool,
            causal: bool, device: torch.device) -> torch.Tensor:
    """`(S * rows, chunk * S)`: True where a key of rank `src`'s padded block is padding,
    or (causal) of a frame after the query's; queries in (s, t) order, keys in (t, s)."""
    size, offset = shard_size_and_offset(length, world, rank)
    longest = shard_sizes(length, world)[0]
    src_size, src_offset = shard_size_and_offset(length, world, src)
    queries = torch.arange(offset, offset + (longest if padded else size),
                           device=device).repeat(per_frame)
    keys = torch.arange(longest, device=device).repeat_interleave(per_frame)
    hidden = (keys >= src_size)[None, :].expand(queries.shape[0], -1)
    return hidden | ((keys + src_offset)[None, :] > queries[:, None]) if causal else hidden


def _merge(state: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scores: torch.Tensor,
           values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one block's masked scores and values into (running max, sum, output sum)."""
    top, total, out = state
    new_top = torch.maximum(top, scores.amax(-1, keepdim=True))
    # a row that has seen no key yet keeps the max -inf: shift it by 0, not by -inf (NaN)
    shift = new_top.masked_fill(new_top == float("-inf"), 0)
    # in place (one block of scores, not two) unless autograd needs them (q's gradient)
    weights = torch.exp(scores - shift) if scores.requires_grad else scores.sub_(shift).exp_()
    rescale = torch.exp(top - shift)
    total = total * rescale + weights.sum(-1, keepdim=True)
    if out.requires_grad or weights.requires_grad:
        return new_top, total, out * rescale + weights @ values
    # inference: the output sum updated in place, one block's product beside it (not the
    # rescaled copy and the sum as well: three output-sized buffers)
    return new_top, total, out.mul_(rescale).add_(weights @ values)
