"""A convolution along a sharded dim whose halo exchange hides behind the interior compute.

With the halo in flight, each rank convolves its own chunk (the interior outputs need no
halo), then the two thin boundary windows `[left halo ++ first e-1 slices]` and
`[last e-1 slices ++ right halo]`, where `e` is the kernel's extent along `dim`. Backward
mirrors it: the boundary windows' input gradients go first, their halo parts start back to
their owners, the interior's input and weight gradients are computed while they travel, and
the halo gradients are folded in last. The arithmetic is the single-device conv's, split
into three convs (float rounding of a blocked kernel may differ in the last bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from haloshard._comm import GroupLike, Pending
from haloshard._errors import HaloError
from haloshard._exchange import (
    HaloMove,
    Reuse,
    empty_like_layout,
    memory_format,
    prepare_halo,
)

_conv = torch.ops.aten.convolution.default
_conv_backward = torch.ops.aten.convolution_backward.default


@dataclass(frozen=True)
class _ConvArgs:
    dim: int
    left: int
    right: int
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    groups: int
    split: bool
    spare: bool  # some rank's chunk is empty: every rank convolves one spare zero slice more

    @property
    def reach(self) -> int:
        """Input slices beyond one output's own: `dilation * (kernel - 1)` along `dim`."""
        return self.left + self.right

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
             ) -> torch.Tensor:
        zeros = [0] * len(self.stride)
        return _conv(x, weight, bias, self.stride, self.padding, self.dilation, False, zeros,
                     self.groups)

    def backward(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = [0] * len(self.stride)
        g_x, g_w, _ = _conv_backward(grad, x, weight, None, self.stride, self.padding,
                                     self.dilation, False, zeros, self.groups,
                                     [True, True, False])
        return g_x, g_w


class _HaloConv(torch.autograd.Function):
    """Forward: `(B, C, T_r, ...) -> (B, O, T_r, ...)`, this rank's chunk of the global conv.
    Backward: input gradients of the halos go back to their owners; weight and bias
    gradients are this rank's partial sums."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        move: HaloMove, args: _ConvArgs,
    ) -> torch.Tensor:
        dim, left, length = args.dim, args.left, x.shape[args.dim]
        moved = move.start(x)
        if args.split:
            interior = args.conv(x, weight, bias)
            windows = _edge_windows(x, move, moved, args)
            # A side without halo (causal: right=0) has no boundary outputs and no window.
            y = torch.cat([*([args.conv(windows[0], weight, bias)] if left else []), interior,
                           *([args.conv(windows[-1], weight, bias)] if args.right else [])],
                          dim)
        else:
            # An empty chunk would ask the conv for zero outputs, which it refuses: one zero
            # slice more gives it one output, dropped again (and its gradient is zero).
            buf = move.assemble(x, moved, torch.sym_max(0, 1 - length) if args.spare else None)
            windows = (buf,)
            y = args.conv(buf, weight, bias).narrow(dim, 0, length)
        ctx.save_for_backward(x, weight, *windows)
        ctx.move, ctx.args, ctx.has_bias = move, args, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, *windows = ctx.saved_tensors
        args: _ConvArgs = ctx.args
        g_x, g_w = (_split_backward if args.split else _whole_backward)(
            grad, x, weight, windows, ctx.move, args)
        g_b = grad.sum([d for d in range(grad.ndim) if d != 1]) if ctx.has_bias else None
        return g_x, g_w, g_b, None, None


def _spare(x: torch.Tensor, dim: int) -> torch.Tensor:
    """One zero slice along `dim` for an empty chunk, none otherwise (per rank)."""
    shape = list(x.shape)
    shape[dim] = torch.sym_max(0, 1 - shape[dim])
    return x.new_zeros(shape)


def _gap(args: _ConvArgs) -> int:
    """The chunk slices between the halos in the edge-window buffer: `reach` per side."""
    return args.reach * (bool(args.left) + bool(args.right))


def _edge_windows(x: torch.Tensor, move: HaloMove, moved: Pending, args: _ConvArgs
                  ) -> tuple[torch.Tensor, ...]:
    """The boundary outputs' inputs: `[left halo ++ first reach slices]` and `[last reach
    slices ++ right halo]` (a side without halo left out).

    Filled in one thin buffer `left + gap + right` long, halos written in place once they
    arrive, then each window made dense in `x`'s memory format: a conv on a strided window
    takes a slower path than the copy of a few slices costs.
    """
    dim, reach, left, gap, length = args.dim, args.reach, args.left, _gap(args), x.shape[
        args.dim]
    shape = list(x.shape)
    shape[dim] = left + gap + args.right
    buf = empty_like_layout(x, shape)
    if left:
        buf.narrow(dim, left, reach).copy_(x.narrow(dim, 0, reach))
    if args.right:
        buf.narrow(dim, left + gap - reach, reach).copy_(x.narrow(dim, length - reach, reach))
    move.fill(buf, x, moved, gap)
    fmt = memory_format(x)
    spans = ([(0, left + reach)] if left else []) + (
        [(left + gap - reach, reach + args.right)] if args.right else [])
    return tuple(buf.narrow(dim, start, n).contiguous(memory_format=fmt) for start, n in spans)


def _split_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    windows: list[torch.Tensor], move: HaloMove, args: _ConvArgs
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    dim, left, right, reach, length = args.dim, args.left, args.right, args.reach, x.shape[
        args.dim]
    sides = []  # (window gradient, its weight gradient) per side with a halo
    if left:
        sides.append(args.backward(grad.narrow(dim, 0, left), windows[0], weight))
    if right:
        sides.append(args.backward(grad.narrow(dim, length - right, right), windows[-1],
                                   weight))
    moved, g_own = move.start_backward(torch.cat([g for g, _ in sides], dim), _gap(args))
    g_x, g_w = args.backward(grad.narrow(dim, left, length - reach), x, weight)
    if left:
        g_x.narrow(dim, 0, reach).add_(sides[0][0].narrow(dim, left, reach))
    if right:
        g_x.narrow(dim, length - reach, reach).add_(sides[-1][0].narrow(dim, 0, reach))
    for _, g_w_side in sides:
        g_w = g_w + g_w_side
    move.fold(g_x, moved, g_own)
    return g_x, g_w


def _whole_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    windows: list[torch.Tensor], move: HaloMove, args: _ConvArgs
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    grad = torch.cat([grad, _spare(grad, args.dim)], args.dim) if args.spare else grad
    g_buf, g_w = args.backward(grad, windows[0], weight)
    return move.adjoint(g_buf, x.shape[args.dim]), g_w


def _per_dim(value: int | tuple[int, ...], n: int, name: str) -> list[int]:
    values = [value] * n if isinstance(value, int) else list(value)
    if len(values) != n:
        raise HaloError(f"{name} needs {n} values (one per spatial dim), got {value!r}")
    return values


def _conv_problem(
    x: torch.Tensor, weight: torch.Tensor, dim: int, left: int, right: int,
    stride: int | tuple[int, ...], padding: int | tuple[int, ...],
    dilation: int | tuple[int, ...],
) -> tuple[str | None, list[list[int]] | None]:
    """What is wrong with this rank's conv arguments (None: nothing), and the per-dim
    stride, padding and dilation. Reported through the exchange's agreement, so a mistake
    on one rank raises on every rank."""
    if not isinstance(weight, torch.Tensor) or not isinstance(x, torch.Tensor) or \
            weight.ndim != x.ndim or weight.ndim < 3:
        return (f"halo_conv needs x and weight of the same rank >= 3, got "
                f"{getattr(x, 'shape', x)!r} and {getattr(weight, 'shape', weight)!r}"), None
    n = weight.ndim - 2
    try:
        args = [_per_dim(v, n, k) for v, k in ((stride, "stride"), (padding, "padding"),
                                               (dilation, "dilation"))]
    except HaloError as exc:
        return str(exc), None
    along = dim - 2 if isinstance(dim, int) else -1
    if not 0 <= along < n:
        return f"halo_conv along dim {dim} needs a spatial dim (2 to {n + 1})", None
    reach = args[2][along] * (weight.shape[dim] - 1)
    if not all(isinstance(v, int) for v in (left, right)):
        return None, args  # the exchange names a bad halo itself
    if args[0][along] != 1 or args[1][along] != 0 or left + right != reach:
        return (f"halo_conv along dim {dim} needs stride 1 and padding 0 there and "
                f"left + right = dilation * (kernel - 1) = {reach}; got stride {stride}, "
                f"padding {padding}, left={left}, right={right}"), None
    return None, args


def halo_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, dim: int,
    left: int, right: int, group: GroupLike, stride: int | tuple[int, ...] = 1,
    padding: int | tuple[int, ...] = 0, dilation: int | tuple[int, ...] = 1, groups: int = 1,
    pad: str = "zeros", transport: str | None = None, global_length: int | None = None,
    overlap: bool = True, _reuse: Reuse | None = None,
) -> torch.Tensor:
    """`F.conv1d/2d/3d` on a `Shard(dim)` chunk, padded along `dim` by the halo.

    The padding along `dim` is the halo (`left` and `right` slices, edge mode `pad`), so
    `left + right` must equal `dilation * (kernel - 1)` along `dim` (causal: `right=0`);
    `padding` gives the other spatial dims' padding and must be 0 along `dim`.

    Args:
        x: `(B, C, *spatial)` chunk of the global input along `dim` (a spatial dim).
        weight, bias, stride, padding, dilation, groups: as for `F.conv3d`; stride 1
            along `dim`.
        left, right, pad, group, transport, global_length, _reuse: as for
            `halo_exchange`.
        overlap: compute the interior while the halo travels (the default). It needs every
            chunk at least one kernel extent long; shorter chunks fall back to exchanging
            first, for all ranks alike. False always exchanges first.

    Returns:
        This rank's `Shard(dim)` chunk of the global convolution's output.

    Example::
        >>> y = halo_conv(x, w, b, dim=2, left=2, right=0, group=mesh, padding=(0, 1, 1))
        >>> y.shape  # x: (1, 8, T_r, 16, 16), w: (8, 8, 3, 3, 3)
        torch.Size([1, 8, T_r, 16, 16])
    """
    problem, args = _conv_problem(x, weight, dim, left, right, stride, padding, dilation)
    move, lengths = prepare_halo(x, left, right, dim, group, pad=pad, transport=transport,
                                 global_length=global_length, problem=problem, reuse=_reuse)
    assert args is not None  # a problem raised on every rank in prepare_halo
    n = weight.ndim - 2
    split = overlap and min(lengths) >= left + right + 1 and move is not None
    spare = min(lengths) == 0
    conv_args = _ConvArgs(dim, left, right, *args, groups, split, spare)
    if move is None:  # a kernel of one along dim: no halo (and, for an empty chunk, a spare)
        y = torch.ops.aten.convolution(torch.cat([x, _spare(x, dim)], dim) if spare else x,
                                       weight, bias, *args, False, [0] * n, groups)
        return y.narrow(dim, 0, x.shape[dim])
    return _HaloConv.apply(x, weight, bias, move, conv_args)
