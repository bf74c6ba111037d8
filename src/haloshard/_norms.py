"""Exact GroupNorm over a dimension sharded across ranks.

GroupNorm's statistics run over (C/G, T, H, W) for each (batch, group): with T sharded, each
rank holds part of every group. Each rank reduces its part to (count, mean, M2) per
(batch, group), the ranks all-gather those few numbers (B * G * 3 per rank, no activations),
and every rank combines them in rank order with Chan's parallel update: shifted sums, so no
catastrophic cancellation, and the same result on every rank. The same all-gather carries a
row of each rank's arguments (C, groups, B, eps, dtype, affine) in a fixed-size first block,
so a mismatch on one rank raises `HaloError` on every rank. The backward is written out
(one all-reduce of the two group sums it needs), so only the input is kept for it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from haloshard import _comm
from haloshard._agree import (
    UNSENT,
    Fields,
    agree_while_tracing,
    check_rows,
    digest,
    dtype_code,
    float_bits,
    from_bits,
    shown,
)
from haloshard._comm import GroupLike
from haloshard._compat import maybe_run_for_local_tensor
from haloshard._errors import HaloError
from haloshard._exchange import length_problem, memory_format, tensor_problem
from haloshard._layout import shard_sizes
from haloshard._segments import Segments, local_segments
from haloshard._tracing import surfaces_errors

# The statistics all-gather has a fixed-size first block: a metadata row, then as many
# statistics as fit. Every rank sends the same number of values whatever its arguments, so a
# mismatch raises HaloError on every rank instead of aborting the backend; the rare model
# with more than fits (3 * B * G > _BLOCK - len(_META)) sends the rest in a second gather,
# once every rank has agreed on B and G.
_META = ("error", "ndim", "batch", "channels", "num_groups", "dtype", "eps", "weight",
         "bias", "requires_grad", "segments", "global_length", "length")
_LENGTH = _META.index("length")  # the only field that may differ between ranks


@dataclass(frozen=True)
class _Along:
    """What every rank must share about the sharded dim, where it is known: its global
    length (-1: unknown) and a code of the segment lengths (frame batches; 0: none)."""

    dim: int
    global_length: int
    segments: int


def _along(dim: int, global_length: int | None, segments: Sequence[int] | None) -> _Along:
    if segments is not None:
        lengths = tuple(int(n) for n in segments)
        code = digest(lengths) + 1
        return _Along(dim, sum(lengths) if global_length is None else global_length, code)
    return _Along(dim, -1 if global_length is None else global_length, 0)
_BLOCK = 1024


def _norm_problem(x: object, groups: object, weight: object, bias: object) -> str | None:
    """What is wrong with this rank's own group_norm arguments, or None."""
    problem = tensor_problem(x)
    if problem is not None:
        return problem
    assert isinstance(x, torch.Tensor)
    if x.ndim < 2 or not x.is_floating_point():
        return f"group_norm needs a floating-point (B, C, ...) tensor, got {x.dtype} " \
               f"{tuple(x.shape)}"
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or \
            x.shape[1] % groups:
        return (f"group_norm needs C divisible by num_groups={groups!r}, got shape "
                f"{tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (
                x.shape[1],)):
            return f"group_norm {name} must be None or of shape ({x.shape[1]},), got " \
                   f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}"
    return None


def _meta_row(x: Any, groups: Any, eps: Any, weight: Any, bias: Any, error: bool,
              along: _Along) -> list[float]:
    if error:
        return [1.0] + [-1.0] * (len(_META) - 1)
    # a per-rank (simulated) or traced length cannot travel: those ranks run one program
    length = x.shape[along.dim] if _comm.is_eager(x) and along.global_length >= 0 else -1
    return [0.0, x.ndim, x.shape[0], x.shape[1], groups, dtype_code(x.dtype), float(eps),
            weight is not None, bias is not None, x.requires_grad, along.segments,
            along.global_length, length]


def _shown(field: str, values: list[Any]) -> tuple[str, list[Any]]:
    """A field of the statistics' float row as a message shows it: ints but eps."""
    if field == "segments":  # codes: what they stand for is in the message
        return "segments (a code of the segment / frame_batches lengths)", values
    return field, shown(field, [int(v) if field != "eps" else v for v in values])


def _shown_traced(field: str, values: list[Any]) -> tuple[str, list[Any]]:
    """A field of the traced int row as a message shows it: eps from its bits."""
    return _shown(field, [from_bits(v) for v in values] if field == "eps" else values)


_HINT = ("every rank must pass the same num_groups, eps, affine parameters and tensors that "
         "differ only in the sharded dim")
_ROW = Fields(_META, "group_norm", _HINT, frozenset({"length"}), "group_norm: ", show=_shown)
# Under torch.compile: the arguments every rank must share, agreed once per trace (eps as
# its bits). B and C stay out: a traced size is a symbol (the statistics' row checks them
# in eager mode).
_TRACED = Fields(("error", "ndim", "num_groups", "dtype", "eps", "weight", "bias",
                  "requires_grad", "dim", "segments", "global_length"), "group_norm", _HINT,
                 prefix="group_norm: ", show=_shown_traced)


@maybe_run_for_local_tensor
def _check_meta(rows: list[list[float]], own: str | None) -> None:
    """The same `HaloError` on every rank when any rank's row is bad or the rows differ."""
    check_rows(rows, _ROW, own)
    _check_lengths([int(row[_LENGTH]) for row in rows], int(rows[0][_META.index(
        "global_length")]))


def _agree_traced(x: torch.Tensor, groups: Any, eps: Any, weight: Any, bias: Any,
                  along: _Along, grp: _comm.Group, problem: str | None) -> None:
    """Under torch.compile the statistics' row cannot be read in the graph: the ranks
    agree on the arguments they must share once per trace (`haloshard._agree`). `dim` is
    sent where it is used: with segments or a global length."""
    values = None if problem is not None else [
        0, x.ndim, groups, dtype_code(x.dtype), float_bits(eps), weight is not None,
        bias is not None, x.requires_grad, along.dim if along.global_length >= 0 else UNSENT,
        along.segments, along.global_length]
    agree_while_tracing(values, _TRACED, grp, "group_norm metadata exchange", problem)


def _check_lengths(lengths: list[int], global_length: int) -> None:
    """Every rank's chunk against the `Shard` split of the global length, where known: a
    chunk of another length would be normalised as part of another tensor."""
    if global_length < 0 or -1 in lengths:
        return
    expected = list(shard_sizes(global_length, len(lengths)))
    if lengths != expected:
        raise HaloError(f"group_norm: chunk lengths {lengths} (rank by rank) along the sharded "
                        f"dim do not match its global length {global_length}, which splits "
                        f"as {expected}")


def _gather_stats(x: torch.Tensor, groups: int, eps: float, weight: Any, bias: Any,
                  problem: str | None, grp: _comm.Group, seg: Segments | None,
                  along: _Along) -> torch.Tensor:
    """Every rank's `(3, B, G)` statistics, `(P, 3, B, G)`, after every rank has agreed on
    the arguments (in the same all-gather: see `_BLOCK`)."""
    if problem is None and seg is not None and _comm.is_eager(x) and (
            seg.ids.shape[0] != x.shape[along.dim]):
        problem = (f"group_norm: this rank's chunk has {x.shape[along.dim]} slices along dim "
                   f"{along.dim}, but its Shard split of the segments' {along.global_length} "
                   f"has {seg.ids.shape[0]}")
    meta = torch.tensor(_meta_row(x, groups, eps, weight, bias, problem is not None, along),
                        dtype=torch.float64, device=_device(x))
    if problem is None:
        local = _local_stats(x, groups, seg)
        flat = local.reshape(-1).to(torch.float64)
    else:
        flat = meta.new_zeros(0)
    head = _BLOCK - len(_META)
    first = torch.cat([meta, flat[:head], flat.new_zeros(max(0, head - flat.numel()))])
    what = "group_norm statistics all-gather"
    block = _comm.all_gather(first.unsqueeze(0), grp, what)
    if not torch.compiler.is_compiling():
        _check_meta(block[:, : len(_META)].tolist(), problem)
    elif problem is not None:
        raise HaloError(problem)
    stats = block[:, len(_META) : len(_META) + flat.numel()]
    if flat.numel() > head:
        stats = torch.cat([stats, _comm.all_gather(flat[head:].unsqueeze(0), grp, what)], 1)
    return stats.reshape(grp.size, *local.shape).to(local.dtype)


def _device(x: Any) -> torch.device:
    if not isinstance(x, torch.Tensor) or x.device.type == "meta":
        return torch.device("cpu")
    return x.device


def _local_stats(x: torch.Tensor, num_groups: int, seg: Segments | None = None
                 ) -> torch.Tensor:
    """`(B, C, ...) -> (3, B, G)`: count, mean and M2 (sum of squared deviations); with
    segments, `(3, B * S, G)`: one row per (batch, segment).

    Reduced per channel first, with `x` left in its own layout (no reshape of a strided,
    possibly empty shard), then channels are combined into groups on `(B, C)`-sized tensors.
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if seg is not None:
        return _segment_stats(xf, num_groups, seg)
    within = tuple(range(2, x.ndim))
    per_channel = math.prod(x.shape[2:])
    if x.ndim > 2 and isinstance(per_channel, int) and per_channel > 0:
        if memory_format(xf) != torch.contiguous_format:
            # channels-last: C innermost, so `(B, S, C)` rows are a view, reduced along S
            # faster than the strided dims of `(B, C, *S)` (a third less time for M2)
            xf, within = xf.movedim(1, -1).flatten(1, -2), (1,)
        at = xf.sum(within, keepdim=True) / per_channel
        return _group_stats(at.flatten(1), _squared_deviations(xf, at, within), per_channel,
                            num_groups)
    # an empty chunk (count 0, mean 0, M2 0), or per-rank sizes (simulated)
    mean_c = xf.sum(within) / torch.sym_max(per_channel, 1)
    at = mean_c.view(*mean_c.shape, *([1] * len(within)))
    return _group_stats(mean_c, ((xf - at) ** 2).sum(within), per_channel, num_groups)


# blocks per chunk in `_squared_deviations`, and the fewest elements a block holds (a smaller
# one costs more in per-op overhead than its temporary saves)
_BLOCKS = 16
_MIN_BLOCK = 1 << 18


def _squared_deviations(xf: torch.Tensor, mean: torch.Tensor, within: tuple[int, ...]
                        ) -> torch.Tensor:
    """`((xf - mean) ** 2).sum(within)`, block by block along `within`'s first dim: the
    deviations go to one block-sized buffer (a 16th of the chunk, at least `_MIN_BLOCK`
    elements) reused for every block, not chunk-sized, squared in place. Where the
    reduced dims are a dense float32 chunk's innermost, the squares are summed by
    `vector_norm`, without a second temporary (it accumulates wider than float32);
    elsewhere (rows reduced along a dim that is not innermost, or float64, which
    `vector_norm` sums without `sum`'s cascade: 1e-11 apart over 1e5 values) they are
    squared and summed. The temporaries, not the arithmetic, are what cost here: one pass
    over the chunk more than one device's GroupNorm makes."""
    along = within[0]
    n = xf.shape[along]
    size = max(-(-n // _BLOCKS), -(-_MIN_BLOCK * n // max(xf.numel(), 1)), 1)
    dense = (memory_format(xf) == torch.contiguous_format and xf.dtype == torch.float32
             and within[-1] == xf.ndim - 1)
    blocks = xf.split(size, along)
    # one block-sized buffer for every block's deviations: a fresh temporary per block is
    # fresh pages per block, where the allocator hands large blocks back to the system
    buf = xf.new_empty(blocks[0].numel())
    total = None
    for block in blocks:
        d = torch.sub(block, mean, out=buf[: block.numel()].view(block.shape))
        part = torch.linalg.vector_norm(d, 2, within).square_() if dense else \
            d.square_().sum(within)
        total = part if total is None else total.add_(part)
    assert total is not None
    return total


def _group_stats(mean_c: torch.Tensor, m2_c: torch.Tensor, per_channel: Any,
                 num_groups: int) -> torch.Tensor:
    """Per-channel `(R, C)` means and M2 over `per_channel` values each (a number, or an
    `(R, 1)` tensor) -> `(3, R, G)` statistics of the channel groups."""
    mean_c, m2_c = (t.unflatten(1, (num_groups, -1)) for t in (mean_c, m2_c))
    mean = mean_c.mean(-1)
    m2 = m2_c.sum(-1) + per_channel * ((mean_c - mean.unsqueeze(-1)) ** 2).sum(-1)
    count = mean.new_ones(mean.shape) * (per_channel * mean_c.shape[-1])
    return torch.stack([count, mean, m2])


def _segment_stats(xf: torch.Tensor, num_groups: int, seg: Segments) -> torch.Tensor:
    """`_local_stats` per (batch, segment): each local slice along `seg.dim` counts in the
    segment `seg.ids` gives it; a segment with no local slice has count 0."""
    per_slice = math.prod(n for i, n in enumerate(xf.shape) if i >= 2 and i != seg.dim)
    count = torch.zeros(seg.count, dtype=xf.dtype, device=xf.device).index_add_(
        0, seg.ids, torch.ones_like(seg.ids, dtype=xf.dtype)) * per_slice  # (S,)
    mean_c = _per_segment(xf, seg) / count.clamp(min=1.0)
    m2_c = _per_segment((xf - _at_slices(mean_c, seg, xf.ndim)) ** 2, seg)
    rows = (mean_c, m2_c)  # (B, C, S) -> (B * S, C): segments as extra batch rows
    mean_c, m2_c = (t.movedim(2, 1).flatten(0, 1) for t in rows)
    per_channel = count.repeat(xf.shape[0]).unsqueeze(-1)
    return _group_stats(mean_c, m2_c, per_channel, num_groups)


def _per_segment(t: torch.Tensor, seg: Segments) -> torch.Tensor:
    """`(B, C, ...) -> (B, C, S)`: per-channel sums of `t` over each segment's slices."""
    rest = tuple(i for i in range(2, t.ndim) if i != seg.dim)
    sums = t.sum(rest) if rest else t  # (B, C, T_r)
    return sums.new_zeros(*sums.shape[:2], seg.count).index_add_(2, seg.ids, sums)


def _at_slices(t: torch.Tensor, seg: Segments, ndim: int) -> torch.Tensor:
    """`(B, C, S) -> (B, C, ...)` broadcastable to x: each slice's segment value."""
    picked = t.index_select(2, seg.ids)  # (B, C, T_r)
    shape = [1] * ndim
    shape[0], shape[1], shape[seg.dim] = picked.shape
    return picked.reshape(shape)  # the other dims are 1: the order of B, C, T_r stays


def _expand(t: torch.Tensor, channels: int, ndim: int, seg: Segments | None
            ) -> torch.Tensor:
    """A per-(row, group) value `(R, G)` for every channel, broadcastable to x: rows are
    batches, or (batch, segment) pairs whose value each slice of the segment takes."""
    if seg is None:
        return _per_channel(t, channels, ndim)
    return _at_rows(t.repeat_interleave(channels // t.shape[1], dim=1), ndim, seg)


def _at_rows(t: torch.Tensor, ndim: int, seg: Segments | None) -> torch.Tensor:
    """A per-(row, channel) value `(R, C)` broadcastable to x (see `_expand`)."""
    if seg is None:
        return t.view(*t.shape, *([1] * (ndim - 2)))
    return _at_slices(t.unflatten(0, (-1, seg.count)).movedim(1, 2), seg, ndim)


def _segment_sums(t: torch.Tensor, within: tuple[int, ...], seg: Segments | None
                  ) -> torch.Tensor:
    """Per-channel sums of `t` over `within`, `(B, C)`; with segments `(B * S, C)`."""
    if seg is None:
        return t.sum(within)
    return _per_segment(t, seg).movedim(2, 1).flatten(0, 1)


def _combine(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(P, 3, B, G)` per-rank stats -> global mean and biased variance, each `(B, G)`."""
    count, mean, m2 = _combined(stats)
    return mean, m2 / count.clamp(min=1.0)


def _combined(stats: torch.Tensor) -> torch.Tensor:
    """`(P, 3, B, G)` per-rank stats -> their `(3, B, G)` (count, mean, M2): the count-weighted
    mean, and M2 as the ranks' own plus each rank's `count * (mean - global mean) ** 2`
    (Chan's pairwise update applied to all P at once: the same result on every rank, from the
    same gathered rows). A dozen ops whatever P, where the rank-by-rank update takes ten
    per rank: on simulated ranks each op runs once per rank."""
    count, mean, m2 = stats.unbind(1)  # (P, B, G) each
    total = count.sum(0)
    grand = (count / total.clamp(min=1.0) * mean).sum(0)
    delta = mean - grand
    return torch.stack([total, grand, m2.sum(0) + (count * delta * delta).sum(0)])


def _per_channel(t: torch.Tensor, channels: int, ndim: int) -> torch.Tensor:
    """`(B, G) -> (B, C, 1, ...)`: a per-group value for each channel of its group."""
    out = t.repeat_interleave(channels // t.shape[1], dim=1)
    return out.view(*out.shape, *([1] * (ndim - 2)))


def _normalized(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                mean: torch.Tensor, var: torch.Tensor, eps: float, seg: Segments | None
                ) -> torch.Tensor:
    """`(x - mean) * rstd * weight + bias` with the `(R, G)` statistics. Without segments,
    as one pass over x, `x * a + b` with per-(batch, channel) `a = rstd * weight` and
    `b = bias - mean * a` (the form torch's own CPU GroupNorm kernel computes): the step
    by step form makes four chunk-sized passes and temporaries. On eager ranks, where the
    batch's channels are one dim of a view (batch 1, or a contiguous x) and x is in the
    working dtype, by torch's inference BatchNorm kernel over `(1, B * C, *S)`, which
    computes exactly that per channel: a broadcast `addcmul` over `(B, C, *S)` takes twice
    its time on CPU."""
    work = torch.promote_types(x.dtype, torch.float32)
    c, n = x.shape[1], x.ndim
    if (seg is None and x.dtype == work and n > 2 and _comm.is_eager(x)
            and (x.shape[0] == 1 or x.is_contiguous()) and x.numel() > 0):
        def per_row(t: torch.Tensor) -> torch.Tensor:  # (B, G) -> (B * C,)
            return _per_channel(t, c, 2).flatten()

        def repeated(t: torch.Tensor | None) -> torch.Tensor | None:  # (C,) -> (B * C,)
            return None if t is None else t.to(work).repeat(x.shape[0])

        rows = x.view(1, -1, *x.shape[2:])
        return F.batch_norm(rows, per_row(mean), per_row(var), repeated(weight),
                            repeated(bias), False, 0.0, eps).view(x.shape)
    rstd = torch.rsqrt(var + eps)
    if seg is None:
        a = _expand(rstd, c, n, None)
        if weight is not None:
            a = a * weight.to(work).view(-1, *([1] * (n - 2)))
        b = -_expand(mean, c, n, None) * a
        if bias is not None:
            b = b + bias.to(work).view(-1, *([1] * (n - 2)))
        # a strided x's output written into a buffer of its layout: given b and a first, it
        # would take theirs (contiguous), where one device's GroupNorm keeps a channels-last
        # input's
        out = None if x.is_contiguous() else torch.empty_like(x, dtype=work)
        return torch.addcmul(b, x.to(work), a, out=out).to(x.dtype)
    y = (x.to(work) - _expand(mean, c, n, seg)) * _expand(rstd, c, n, seg)
    if weight is not None:
        y = y * weight.to(work).view(-1, *([1] * (n - 2)))
    if bias is not None:
        y = y + bias.to(work).view(-1, *([1] * (n - 2)))
    return y.to(x.dtype)


class _GroupNormFn(torch.autograd.Function):
    """GroupNorm with global statistics, saving only x (as `F.group_norm` does).

    Forward: `(B, C, *S_r) -> (B, C, *S_r)` normalised with global (B, G) statistics
    (per-rank (count, mean, M2) all-gathered and combined, as in `haloshard._norms`).
    Backward: `dx = rstd * (dxh - mean(dxh) - xh * mean(dxh * xh))` with the group means
    over all ranks (one all-reduce of 2 * B * G numbers); dw, db are per-rank partial sums.
    Plain autograd through these ops would keep x and `x - mean` (twice the activation):
    the difference is what brings the example VAE under (1/P) * 1.15 of the single device.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,  # type: ignore[override]
                bias: torch.Tensor | None, groups: int, eps: float, grp: _comm.Group,
                seg: Segments | None, more: tuple[_comm.Group, ...], along: _Along,
                problem: str | None) -> torch.Tensor:
        stats = _gather_stats(x, groups, eps, weight, bias,
                              problem or _norm_problem(x, groups, weight, bias), grp, seg,
                              along)
        for other in more:  # another mesh axis shards a second dim: combine over it too
            stats = _comm.all_gather(_combined(stats).unsqueeze(0), other,
                                     "group_norm statistics all-gather")
        mean, var = _combine(stats)
        ctx.save_for_backward(x, weight, mean, torch.rsqrt(var + eps), stats[:, 0].sum(0))
        ctx.grp, ctx.bias_dtype, ctx.seg = grp, None if bias is None else bias.dtype, seg
        ctx.more = more
        return _normalized(x, weight, bias, mean, var, eps, seg)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            # create_graph: this backward is written out with the statistics as constants,
            # so its own gradient would miss their dependence on x (silently wrong).
            raise HaloError("group_norm is differentiable once: a backward with "
                            "create_graph=True (double backward) through it is not supported")
        return (*_fused_backward(ctx, dy), *(None,) * 7)


def _all_reduced(sums: torch.Tensor, ctx: Any) -> torch.Tensor:
    """The backward's group sums over every rank holding part of the groups."""
    for grp in (ctx.grp, *ctx.more):
        sums = _comm.all_reduce_sum(sums, grp, "group_norm backward all-reduce")
    return sums


def _fused_backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, Any, Any]:
    """`(dx, dw, db)` in the form torch's own CPU GroupNorm backward computes: per (row,
    channel) `e_c = sum(dy * xh)` and `db_c = sum(dy)` (`_channel_sums`), their group sums
    (all-reduced), then `dx = a * dy + b * x + c` with per (row, channel) `a`, `b`, `c`,
    written once; rows are batches, or (batch, segment) pairs. The step by step form made
    nine chunk-sized temporaries (`x - mean`, `xh`, `dy * w`, `dxh * xh`, ...) and as many
    passes.

    With `xh = (x - mean) rstd`, `g` the weight: `sum(dxh) = sum_c g db_c` and
    `sum(dxh xh) = sum_c g e_c` per group; `dx = rstd (g dy - m1 - xh m2)` for their means
    `m1`, `m2`; `dw = sum_rows e_c`, `db = sum_rows db_c`.
    """
    x, weight, mean, rstd, count = ctx.saved_tensors
    seg, work = ctx.seg, torch.promote_types(x.dtype, torch.float32)
    c, n = x.shape[1], x.ndim
    xw, dyw = x.to(work), dy.to(work)
    e_c, db_c = _channel_sums(dyw, xw, mean, rstd, seg)  # (R, C) each
    g = None if weight is None else weight.to(work)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        gdb, gde = (t if g is None else t * g for t in (db_c, e_c))
        sums = torch.stack([gdb, gde]).unflatten(2, (mean.shape[1], -1)).sum(-1)
        m1, m2 = _all_reduced(sums, ctx) / count.clamp(min=1.0)  # (R, G) each
        coef_x = -rstd * rstd * m2
        coef_1 = -coef_x * mean - rstd * m1
        a = rstd.repeat_interleave(c // rstd.shape[1], dim=1)
        a = a if g is None else a * g
        dx = torch.addcmul(_expand(coef_1, c, n, seg), _expand(coef_x, c, n, seg), xw)
        dx = dx.addcmul_(_at_rows(a, n, seg), dyw).to(x.dtype)
    if weight is not None and ctx.needs_input_grad[1]:
        dw = e_c.sum(0).to(weight.dtype)
    db = db_c.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
    return dx, dw, db


def _channel_sums(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                  seg: Segments | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, channel), `(R, C)`: `sum(dy * xh)` and `sum(dy)`, `xh = (x - mean) rstd`.

    Without segments, on dense float32/float64 rows, torch's own GroupNorm backward kernel
    computes both (its weight and bias gradients, given our statistics), one batch row at a
    time: one pass over `dy` and `x`, no temporary. Otherwise `sum(dy * x)` block by block
    (`_row_dots`) and `rstd (ds - mean db)`.
    """
    c, groups = x.shape[1], mean.shape[1]
    per_row = math.prod(x.shape[2:])
    if (seg is None and x.dtype in (torch.float32, torch.float64) and dy.dtype == x.dtype
            and isinstance(per_row, int) and per_row > 0 and x.is_contiguous()
            and dy.is_contiguous()):
        ones = x.new_ones(c)  # torch's kernel reads the weight only for dx, not asked here
        rows = [torch.ops.aten.native_group_norm_backward(
            dy[i : i + 1], x[i : i + 1], mean[i : i + 1], rstd[i : i + 1], ones, 1, c,
            per_row, groups, [False, True, True])[1:] for i in range(x.shape[0])]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    db_c = _segment_sums(dy, tuple(range(2, x.ndim)), seg)
    ds_c = _row_dots(dy, x, seg)
    mean_c, rstd_c = (t.repeat_interleave(c // groups, dim=1) for t in (mean, rstd))
    return rstd_c * (ds_c - mean_c * db_c), db_c


def _row_dots(a: torch.Tensor, b: torch.Tensor, seg: Segments | None) -> torch.Tensor:
    """`_segment_sums(a * b)`, `(R, C)`, with the products block-sized temporaries (blocks
    along the segments' dim, or dim 2), not chunk-sized."""
    dim = 2 if seg is None else seg.dim
    rest = tuple(i for i in range(2, a.ndim) if i != dim)
    if not isinstance(a.shape[dim], int):  # per-rank sizes (simulated): one block
        dots = _summed(a * b, rest)
    else:
        size = max(-(-a.shape[dim] // _BLOCKS), 1)
        dots = torch.cat([_summed(block_a * block_b, rest) for block_a, block_b in
                          zip(a.split(size, dim), b.split(size, dim), strict=True)], -1)
    if seg is None:  # (B, C, T_r) per slice
        return dots.sum(-1)
    per_segment = dots.new_zeros(*dots.shape[:2], seg.count).index_add_(2, seg.ids, dots)
    return per_segment.movedim(2, 1).flatten(0, 1)


def _summed(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """`t` summed over `dims` (none: `t`; `sum(())` would sum it all)."""
    return t.sum(dims) if dims else t


@surfaces_errors
def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group: GroupLike,
    *,
    segments: Sequence[int] | None = None,
    dim: int = 2,
    other_groups: Sequence[GroupLike] = (),
    global_length: int | None = None,
) -> torch.Tensor:
    """`F.group_norm` of the global tensor, on this rank's shard of any non-channel dim.

    Forward: `(B, C, *S_r) -> (B, C, *S_r)` normalised with the global statistics (an
    all-gather of B*G*3 numbers). Backward: one all-reduce of 2*B*G numbers; weight and bias
    gradients are this rank's partial sums. Only x is kept for backward.

    Args:
        x: this rank's shard `(B, C, ...)`, sharded on a dim other than 0 and 1.
        num_groups: groups, dividing C.
        weight, bias: per-channel affine parameters `(C,)` or None.
        eps: added to the variance.
        group: the ranks sharing the sharded dim (as for `halo_exchange`).
        segments: None, or the global lengths of consecutive segments along `dim` (the
            `Shard` chunks of their sum): each segment is normalised with its own
            statistics, as a loop calling `F.group_norm` on each would (frame batches).
        dim: the sharded dim, for `segments`.
        other_groups: the ranks sharding other dims of x (T and H on two mesh axes, as a
            `(mesh, mesh_axis)` each): the statistics combine over them too.
        global_length: the global length of `dim`, None if unknown (then the sum of
            `segments`, where given): every rank's chunk is checked against its `Shard`
            split, on every rank at once.

    Raises:
        HaloError: on every rank, when C is not divisible by num_groups or the ranks
            disagree on C, B, num_groups, eps, the affine parameters, the dtype or the
            segments, the global length, or when a chunk does not fit it.

    Example::
        >>> gn = nn.GroupNorm(4, 8)
        >>> x = torch.randn(2, 8, 3, 16, 16)  # each of 4 ranks: 3 of 12 frames
        >>> y = group_norm(x, 4, gn.weight, gn.bias, gn.eps, mesh)
        >>> y.shape
        torch.Size([2, 8, 3, 16, 16])
    """
    grp = _comm.resolve_group(group)
    more = tuple(_comm.resolve_group(g) for g in other_groups)
    problem = _call_problem(x, eps, dim, segments, global_length)
    seg, along = None, _Along(dim, -1, 0)
    if problem is None:  # else nothing is built from them: the agreement raises
        if segments is not None:
            seg = local_segments(segments, grp.rank, grp.size, dim, _device(x))
        along = _along(dim, global_length, segments)
    if torch.compiler.is_compiling():
        problem = problem or _norm_problem(x, num_groups, weight, bias)
        _agree_traced(x, num_groups, eps, weight, bias, along, grp, problem)
    return _GroupNormFn.apply(x, weight, bias, num_groups, eps, grp, seg, more, along,
                              problem)


def _call_problem(x: object, eps: object, dim: object, segments: object,
                  global_length: object) -> str | None:
    """What is wrong with this rank's arguments along the sharded dim, or None: found
    before anything is built from them, reported on every rank by the agreement."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        return f"group_norm eps must be a real number, got {eps!r}"
    if (segments is not None or global_length is not None) and not (
            isinstance(x, torch.Tensor) and isinstance(dim, int) and 2 <= dim < x.ndim):
        return (f"group_norm with segments or global_length needs 2 <= dim < "
                f"{getattr(x, 'ndim', '?')}, got {dim!r}")
    if (problem := length_problem(global_length)) is not None:
        return f"group_norm {problem}"
    if segments is not None:
        try:
            lengths = [int(n) for n in segments]  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            lengths = [-1]
        if not lengths or min(lengths) < 0:
            return f"group_norm segments must be non-negative ints, got {segments!r}"
    return None
