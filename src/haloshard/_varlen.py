"""Convolutions over packed variable-length sequences: no halo value crosses a document.

Sequence models under context parallelism pack documents into one sequence, described by
flash-attention's `cu_seqlens` (`[0, l0, l0 + l1, ..., total]`). Their short convs must run
on each document alone: padded at the document's own edges in the layer's pad mode, never
reading a neighbouring document. `varlen_conv` gives each rank its `Shard(dim)` chunk of
exactly that. It exchanges the halo (`halo_exchange`), then gathers, for every output and
every kernel tap, the slice that tap reads inside its own document (positions are pure
arithmetic on `cu_seqlens`), and runs one conv whose kernel along `dim` is 1, with the taps
folded into the input channels. `circular` documents also read their far end: those edge
slices come from a small all-gather. `packed(cu_seqlens)` makes halo conv layers
(`HaloParallel`) do the same inside a model.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from haloshard import _comm
from haloshard._agree import Fields, agree_while_tracing, check_rows, digest, gather
from haloshard._comm import Group, GroupLike
from haloshard._compat import maybe_run_for_local_tensor
from haloshard._errors import HaloError
from haloshard._exchange import halo_exchange
from haloshard._layout import F_PAD_MODES, PAD_MODES, check_pad_fits, shard_sizes
from haloshard._tracing import planner_cache, surfaces_errors


class _Boundaries:
    """The `cu_seqlens` active under `packed` (None outside); an object, not a ContextVar,
    so that torch.compile can trace reads of it."""

    def __init__(self) -> None:
        self.value: tuple[int, ...] | None = None


_ACTIVE = _Boundaries()


def active_boundaries() -> tuple[int, ...] | None:
    """The document boundaries of the innermost `packed` context, or None."""
    return _ACTIVE.value


@contextmanager
def packed(cu_seqlens: Sequence[int] | torch.Tensor) -> Iterator[tuple[int, ...]]:
    """Run halo conv layers on packed documents: each along its sharded dim runs
    `varlen_conv` with these global boundaries instead of one conv over the whole sequence.

    Plain `nn.Conv1d/2d/3d` halo layers (torch's own forward, stride 1 along the sharded
    dim, length kept) and causal wrappers annotated with an explicit `HaloShard` (`F.pad`
    of the dim, then one conv) are supported; any other halo layer raises `HaloError`
    naming it.

    Args:
        cu_seqlens: global document boundaries `[0, l0, l0 + l1, ..., total]`, the same on
            every rank (ints or a 1-D int tensor; a list or tuple under torch.compile).

    Example::
        >>> model = parallelize_module(nn.Conv1d(4, 4, 3, padding=1), mesh, HaloParallel())
        >>> x = distribute_tensor(torch.randn(1, 4, 16), mesh, [Shard(2)])  # 3 documents
        >>> with packed([0, 5, 12, 16]):
        ...     y = model(x)  # no halo crosses a document boundary
        >>> y.shape
        torch.Size([1, 4, 16])
    """
    cu = _as_tuple(cu_seqlens)
    previous, _ACTIVE.value = _ACTIVE.value, cu
    try:
        yield cu
    finally:
        _ACTIVE.value = previous


def _as_tuple(cu_seqlens: object) -> tuple[int, ...]:
    if isinstance(cu_seqlens, torch.Tensor):
        if torch.compiler.is_compiling():
            raise HaloError("under torch.compile pass cu_seqlens as a list or tuple of ints "
                            "(a tensor's values cannot be read inside a graph)")
        if cu_seqlens.ndim != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise HaloError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")
        return tuple(int(v) for v in cu_seqlens.tolist())
    if not isinstance(cu_seqlens, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in cu_seqlens):
        raise HaloError(f"cu_seqlens must be a list or tuple of ints or a 1-D integer "
                        f"tensor, got {cu_seqlens!r}")
    return tuple(cu_seqlens)


def _boundary_problem(cu: tuple[int, ...]) -> str | None:
    if len(cu) < 2 or cu[0] != 0:
        return f"cu_seqlens must start at 0 and hold at least [0, total], got {list(cu)}"
    drops = [i for i in range(1, len(cu)) if cu[i] < cu[i - 1]]
    if drops:
        return (f"cu_seqlens must be non-decreasing, got {list(cu)} (entry {drops[0]} is "
                f"{cu[drops[0]]} < {cu[drops[0] - 1]})")
    return None


@planner_cache(256)
def _document_problem(cu: tuple[int, ...], left: int, right: int, pad: str) -> str | None:
    """The first document its pad mode cannot pad by (left, right), as F.pad would refuse."""
    for d in range(len(cu) - 1):
        n = cu[d + 1] - cu[d]
        try:
            if n:  # an empty document has no outputs
                check_pad_fits(n, left, right, pad)
        except HaloError as error:
            return f"document {d} (slices {cu[d]}:{cu[d + 1]}): {error}"
    return None


@dataclass(frozen=True)
class _Geometry:
    """One conv along `dim` of a packed sequence: everything but the tensors."""

    cu: tuple[int, ...]
    lengths: tuple[int, ...]
    kernel: int
    dilation: int
    left: int  # the conv's padding along dim, before each document
    right: int
    pad: str

    @property
    def halo(self) -> tuple[int, int]:
        """Slices to exchange: reflect reads up to `left` slices past a document's start
        (and `right` before its end), so it needs both sides' widest reach."""
        if self.pad == "reflect":
            wide = max(self.left, self.right)
            return wide, wide
        return self.left, self.right

    @property
    def spare(self) -> int:
        # An empty chunk would ask the conv for zero outputs, which it refuses.
        return int(min(self.lengths) == 0)

    def offset(self, rank: int) -> int:
        return sum(self.lengths[:rank])


@planner_cache(64)
def _edges(g: _Geometry) -> tuple[tuple[int, ...], ...]:
    """`circular` only: the global slices each rank contributes to the edge all-gather, the
    last `left` and first `right` slices of every document (rank by rank, ascending)."""
    want: set[int] = set()
    for s, e in zip(g.cu, g.cu[1:], strict=False):
        want.update(range(max(s, e - g.left), e))
        want.update(range(s, min(e, s + g.right)))
    per_rank = []
    for r, n in enumerate(g.lengths):
        o = g.offset(r)
        per_rank.append(tuple(sorted(p for p in want if o <= p < o + n)))
    return tuple(per_rank)


def _sources(g: _Geometry, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each tap j and output t of `rank`: the global slice it reads within its own
    document (`(kernel, T_r)`), and whether it reads a value (False: zero padding)."""
    o, n_out = g.offset(rank), g.lengths[rank]
    cu = torch.tensor(g.cu, dtype=torch.int64)
    t = torch.arange(o, o + n_out, dtype=torch.int64)
    doc = torch.searchsorted(cu, t, right=True) - 1
    start, size = cu[doc], cu[(doc + 1).clamp(max=len(g.cu) - 1)] - cu[doc]
    taps = torch.arange(g.kernel, dtype=torch.int64).unsqueeze(1) * g.dilation
    rel = t - g.left + taps - start  # position inside the document, before padding
    inside = (rel >= 0) & (rel < size)
    if g.pad == "reflect":
        rel = torch.where(rel < 0, -rel, torch.where(rel >= size, 2 * (size - 1) - rel, rel))
    elif g.pad == "circular":
        rel = torch.remainder(rel, size.clamp(min=1))
    else:  # replicate; for zeros a masked tap reads its document's nearest slice (in range)
        rel = torch.minimum(rel.clamp(min=0), size - 1)
    return start + rel, inside


@planner_cache(64)
def _tap_index(g: _Geometry, rank: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per tap and output, the slice of the gather buffer `[window ++ edges ++ spare]` it
    reads (flat, tap-major), and for `zeros` the mask of taps that read a value."""
    src, inside = _sources(g, rank)
    hl, hr = g.halo
    o, n_out = g.offset(rank), g.lengths[rank]
    index = src - (o - hl)
    window = n_out + hl + hr
    if g.pad == "circular":
        edges = _edges(g)
        width = max(len(e) for e in edges)
        ordered = torch.tensor([p for e in edges for p in e], dtype=torch.int64)
        slot = torch.tensor([r * width + i for r, e in enumerate(edges) for i in range(len(e))],
                            dtype=torch.int64)
        far = (index < 0) | (index >= window)
        found = slot[torch.searchsorted(ordered, src).clamp(max=max(len(ordered) - 1, 0))] \
            if len(ordered) else torch.zeros_like(src)
        index = torch.where(far, window + found, index)
        window += len(edges) * width
    if g.spare:
        spare = torch.full((g.kernel, g.spare), window, dtype=torch.int64)
        index, inside = torch.cat([index, spare], 1), torch.cat([inside, spare < 0], 1)
    mask = inside.to(device) if g.pad == "zeros" else None
    return index.reshape(-1).to(device), mask


_rank_tap_index = maybe_run_for_local_tensor(_tap_index)


@maybe_run_for_local_tensor
def _edge_send(g: _Geometry, rank: int, device: torch.device) -> tuple[torch.Tensor, int]:
    edges = _edges(g)
    o = g.offset(rank)
    mine = torch.tensor([p - o for p in edges[rank]], dtype=torch.int64, device=device)
    return mine, max(len(e) for e in edges) - len(edges[rank])


def _gather_edges(x: torch.Tensor, g: _Geometry, dim: int, group: Group) -> torch.Tensor:
    """Every rank's document-edge slices (`circular`), `P * width` long along `dim`."""
    mine, filler = _edge_send(g, group.rank, x.device)
    local = x.index_select(dim, mine).movedim(dim, 0)
    local = torch.cat([local, local.new_zeros((filler, *local.shape[1:]))])
    return _comm.all_gather_autograd(local, group, "varlen_conv edge all-gather").movedim(0, dim)


@dataclass(frozen=True)
class _ConvArgs:
    """A validated conv: per-spatial-dim stride, (lo, hi) padding and dilation."""

    dim: int
    stride: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]
    groups: int
    pad: str

    @property
    def along(self) -> int:
        return self.dim - 2


def _per_dim(value: object, n: int, name: str) -> tuple[int, ...]:
    values = [value] * n if isinstance(value, int) else list(value)  # type: ignore[call-overload]
    if len(values) != n or not all(isinstance(v, int) and v >= 0 for v in values):
        raise HaloError(f"{name} needs {n} non-negative ints (one per spatial dim), got "
                        f"{value!r}")
    return tuple(values)


def _padding_pairs(padding: object, kernel: tuple[int, ...], dilation: tuple[int, ...]
                   ) -> tuple[tuple[int, int], ...]:
    if padding in ("same", "valid"):
        totals = [d * (k - 1) if padding == "same" else 0
                  for k, d in zip(kernel, dilation, strict=True)]
        return tuple((t // 2, t - t // 2) for t in totals)
    return tuple((p, p) for p in _per_dim(padding, len(kernel), "padding"))


def _conv_args(x: object, weight: object, dim: object, left: int | None, right: int | None,
               padding: object, pad: object, stride: object, dilation: object, groups: object,
               ) -> _ConvArgs:
    """This rank's conv arguments, validated (raises HaloError, reported on every rank)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or \
            weight.ndim != x.ndim or x.ndim < 3:
        raise HaloError(f"varlen_conv needs x and weight of the same rank >= 3, got a "
                        f"{getattr(x, 'ndim', type(x).__name__)}-D x and a weight of shape "
                        f"{tuple(getattr(weight, 'shape', ()))}")
    n = x.ndim - 2
    if not isinstance(dim, int) or not 2 <= dim % x.ndim < x.ndim or dim < -n:
        raise HaloError(f"varlen_conv along dim {dim!r} needs a spatial dim (2 to {n + 1})")
    dim = dim % x.ndim
    if pad not in PAD_MODES:
        raise HaloError(f"pad must be one of {PAD_MODES}, got {pad!r}")
    if not isinstance(groups, int) or groups < 1 or weight.shape[1] * groups != x.shape[1]:
        raise HaloError(f"weight {tuple(weight.shape)} with groups={groups!r} expects "
                        f"{weight.shape[1] * groups if isinstance(groups, int) else '?'} "
                        f"input channels, x has {x.shape[1]}")
    strides, dils = _per_dim(stride, n, "stride"), _per_dim(dilation, n, "dilation")
    pairs = list(_padding_pairs(padding, tuple(weight.shape[2:]), dils))
    si, reach = dim - 2, dils[dim - 2] * (weight.shape[dim] - 1)
    if left is not None or right is not None:
        if any(pairs[si]):
            raise HaloError(f"give the padding along dim {dim} either as left/right or in "
                            f"padding, not both; got padding={padding!r}, left={left}, "
                            f"right={right}")
        pairs[si] = (left or 0, right or 0)
    if strides[si] != 1 or sum(pairs[si]) != reach or min(pairs[si]) < 0:
        raise HaloError(
            f"varlen_conv along dim {dim} keeps each document's length: it needs stride 1 "
            f"there and left + right = dilation * (kernel - 1) = {reach}; got stride "
            f"{strides[si]}, padding {pairs[si]} along dim {dim}")
    return _ConvArgs(dim, strides, tuple(pairs), dils, groups, str(pad))


# Every rank's row: its error flag, a digest of its boundaries, its chunk length (the one
# field that may differ) and the static arguments the halo exchange's own row does not hold.
_ROW = Fields(("error", "cu_seqlens", "length", "pad", "kernel", "dilation", "left", "right"),
              "varlen_conv", "every rank must pass the same global document boundaries and "
              "conv arguments", may_differ=frozenset({"length"}),
              show=lambda field, values: (
                  ("cu_seqlens (a digest of the boundaries)", values) if field == "cu_seqlens"
                  else (field, [PAD_MODES[v] for v in values] if field == "pad" else values)))


def _row_values(x: object, weight: object, args: _ConvArgs | None, cu: tuple[int, ...],
                problem: bool) -> list[Any] | None:
    """This rank's row (None: only its error flag); the length is a size (a symbol when
    traced)."""
    if problem or args is None or not isinstance(x, torch.Tensor) or not isinstance(
            weight, torch.Tensor):
        return None
    lo, hi = args.pairs[args.along]
    return [0, digest(tuple(operator.index(v) for v in cu)), x.shape[args.dim],
            PAD_MODES.index(args.pad), weight.shape[args.dim], args.dilation[args.along], lo,
            hi]


@maybe_run_for_local_tensor
def _row(x: object, weight: object, args: _ConvArgs | None, cu: tuple[int, ...],
         problem: bool) -> torch.Tensor:
    """`_row_values` as the int64 row to gather (per simulated rank: lengths differ)."""
    values = _row_values(x, weight, args, cu, problem)
    return torch.tensor(_ROW.error_row() if values is None else values, dtype=torch.int64)


def _lengths(x: object, weight: object, args: _ConvArgs | None, cu: tuple[int, ...],
             problem: str | None, group: Group, global_length: int | None
             ) -> tuple[int, ...]:
    """Every rank's chunk length, after all ranks agreed on the arguments and boundaries
    (`haloshard._agree`). Under torch.compile, the split of `cu_seqlens[-1]`, agreed once
    per trace: `cu_seqlens` is a list or tuple of ints there, a constant of the trace (a
    changed one retraces and agrees again); a tensor is refused, as its values could only
    be agreed by a new collective in every compiled call."""
    total = cu[-1] if problem is None else -1
    if problem is None and global_length is not None and global_length != total:
        problem = f"global_length={global_length} but cu_seqlens ends at {total}"
    if torch.compiler.is_compiling():
        values = _row_values(x, weight, args, cu, problem is not None)
        agree_while_tracing(values, _ROW, group, "varlen_conv metadata exchange", problem,
                            {_ROW.at("length")})
        return shard_sizes(total, group.size)
    rows = gather(_row(x, weight, args, cu, problem is not None), group,
                  "varlen_conv metadata exchange")
    check_rows(rows, _ROW, problem)
    assert args is not None  # a problem raised on every rank
    lengths = tuple(row[_ROW.at("length")] for row in rows)
    if sum(lengths) != total:
        raise HaloError(f"cu_seqlens ends at {total} but the chunks along dim {args.dim} add up to "
                        f"{sum(lengths)} (lengths {list(lengths)}); expected the global length")
    return lengths


def _pad_other_dims(x: torch.Tensor, args: _ConvArgs) -> tuple[torch.Tensor, list[int]]:
    """Pad the dims other than `dim` (they are whole on every rank): by the conv itself for
    symmetric zeros, else by F.pad in the pad mode. Returns the input and conv padding."""
    pairs = [(0, 0) if i == args.along else p for i, p in enumerate(args.pairs)]
    if args.pad == "zeros" and all(lo == hi for lo, hi in pairs):
        return x, [lo for lo, _ in pairs]
    if any(lo or hi for lo, hi in pairs):
        widths = [w for lo, hi in reversed(pairs) for w in (lo, hi)]
        x = F.pad(x, widths, mode=F_PAD_MODES[args.pad])
    return x, [0] * len(pairs)


def _folded_weight(weight: torch.Tensor, dim: int) -> torch.Tensor:
    """`(O, C/g, ..., k, ...) -> (O, C/g * k, ..., 1, ...)`: the taps along `dim` become
    input channels (channel `c * k + j` holds tap j of channel c)."""
    return weight.movedim(dim, 2).flatten(1, 2).unsqueeze(dim)


def _fold_taps(buf: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None,
               kernel: int, n: Any, dim: int) -> torch.Tensor:
    """`(B, C, ..., window, ...) -> (B, C * k, ..., T_r, ...)`: tap j of output t is the
    slice `index[j, t]` of the buffer (zero where the mask says zeros padding)."""
    taps = buf.index_select(dim, index)
    shape = list(taps.shape)
    taps = taps.reshape([*shape[:dim], kernel, n, *shape[dim + 1 :]])
    if mask is not None:
        # `where`, not a product: a masked tap reads some slice of its document, and
        # 0 * inf (or nan) there would reach outputs one device keeps finite.
        keep = mask.reshape([1] * dim + [kernel, n] + [1] * (buf.ndim - dim - 1))
        taps = torch.where(keep, taps, 0)
    return taps.movedim(dim, 2).flatten(1, 2)


@surfaces_errors
def varlen_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, dim: int,
    cu_seqlens: Sequence[int] | torch.Tensor, group: GroupLike, left: int | None = None,
    right: int | None = None, padding: int | tuple[int, ...] | str = 0, pad: str = "zeros",
    stride: int | tuple[int, ...] = 1, dilation: int | tuple[int, ...] = 1, groups: int = 1,
    transport: str | None = None, global_length: int | None = None,
) -> torch.Tensor:
    """`F.conv1d/2d/3d` run on each packed document alone, on a `Shard(dim)` chunk.

    Rank r's output is its `Shard(dim)` chunk of the concatenation, over the documents
    `[cu_seqlens[d], cu_seqlens[d + 1])`, of the conv of each document alone on one device,
    padded at its own edges along `dim` by (left, right) in mode `pad` (other spatial dims:
    `padding`, same mode). No value crosses a document boundary; documents may span ranks,
    be shorter than the kernel (zeros, replicate) or empty; chunks may be uneven or empty.

    Cost: one halo exchange (`reflect` exchanges `max(left, right)` per side; `circular`
    also all-gathers each document's first `right` and last `left` slices), then a
    gathered copy of the input k times (k: kernel along `dim`) and one conv whose kernel
    along `dim` is 1 over `k * C` channels: the conv's FLOPs, k times its input memory.

    Args:
        x: `(B, C, *spatial)` chunk of the packed sequence along `dim` (a spatial dim).
        weight, bias, stride, dilation, groups: as for `F.conv3d`; stride 1 along `dim`.
        dim: the sharded sequence dim.
        cu_seqlens: global document boundaries `[0, l0, l0 + l1, ..., total]` (flash
            attention's varlen convention), the same on every rank: ints, or a 1-D int
            tensor (a list or tuple under torch.compile).
        group: a ProcessGroup, a 1-D DeviceMesh or a `(mesh, mesh_axis)` pair.
        left, right: padding along `dim` before / after each document (causal: `left=k-1`);
            if given, `padding` must be 0 along `dim`. `left + right` must equal
            `dilation * (kernel - 1)` along `dim`: each document keeps its length.
        padding: per spatial dim, as for `F.conv*d` (int, tuple, "same" or "valid"); along
            `dim` (when `left` and `right` are not given) it pads each document.
        pad: `zeros`, `replicate`, `reflect` or `circular`, at each document's edges (and
            the other dims' edges), as `padding_mode`.
        transport: the halo exchange's transport (see `halo_exchange`).
        global_length: optional; must equal `cu_seqlens[-1]`.

    Returns:
        This rank's `Shard(dim)` chunk of the per-document convolution, `(B, O, ...)`.

    Raises:
        HaloError: on every rank, for malformed `cu_seqlens` (not ints, not starting at 0,
            decreasing, not ending at the global length), boundaries that differ between
            ranks, kernel dims that do not match `x`, a length-changing padding, or a
            document its pad mode cannot pad (reflect: shorter than the padding + 1).

    Example::
        >>> full = torch.randn(1, 8, 9)  # documents of 3, 2, 4; 4 ranks hold 3, 3, 3, 0
        >>> x = rank_map(mesh, lambda r: shard(full, 2, 4, r))
        >>> w, b = torch.randn(8, 1, 4), torch.randn(8)  # causal depthwise kernel 4
        >>> y = varlen_conv(x, w, b, dim=2, cu_seqlens=[0, 3, 5, 9], group=mesh, left=3,
        ...                 groups=8)
        >>> {rank: t.shape[2] for rank, t in per_rank(y).items()}
        {0: 3, 1: 3, 2: 3, 3: 0}
    """
    grp = _comm.resolve_group(group)
    problem, cu, args = None, (0,), None
    try:
        cu = _as_tuple(cu_seqlens)
        problem = _boundary_problem(cu)
        args = _conv_args(x, weight, dim, left, right, padding, pad, stride, dilation, groups)
        # before the agreement: the pad mode and padding are this rank's own
        problem = problem or _document_problem(cu, *args.pairs[args.along], args.pad)
    except HaloError as error:
        problem = problem or str(error)
    lengths = _lengths(x, weight, args, cu, problem, grp, global_length)
    assert args is not None  # a problem raised on every rank
    lo, hi = args.pairs[args.along]
    g = _Geometry(cu, lengths, weight.shape[args.dim], args.dilation[args.along], lo, hi,
                  args.pad)
    return _conv(x, weight, bias, g, args, group, grp, transport)


def _conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, g: _Geometry,
          args: _ConvArgs, group: GroupLike, grp: Group, transport: str | None
          ) -> torch.Tensor:
    dim = args.dim
    left, right = g.halo
    buf = halo_exchange(x, left=left, right=right, dim=dim, group=group, transport=transport,
                        global_length=g.cu[-1])
    extra = [_gather_edges(x, g, dim, grp)] if g.pad == "circular" else []
    if g.spare:
        shape = list(buf.shape)
        shape[dim] = 1
        extra.append(buf.new_zeros(shape))
    if extra:
        buf = torch.cat([buf, *extra], dim)
    # After the exchange: fewer bytes move, and the buffer is never empty (F.pad refuses).
    buf, conv_padding = _pad_other_dims(buf, args)
    index, mask = _rank_tap_index(g, grp.rank, x.device)
    taps = _fold_taps(buf, index, mask, g.kernel, x.shape[dim] + g.spare, dim)
    stride = [1 if i == args.along else s for i, s in enumerate(args.stride)]
    dilation = [1 if i == args.along else d for i, d in enumerate(args.dilation)]
    y = torch.ops.aten.convolution(taps, _folded_weight(weight, dim), bias, stride,
                                   conv_padding, dilation, False, [0] * len(stride),
                                   args.groups)
    return y.narrow(dim, 0, x.shape[dim]) if g.spare else y
