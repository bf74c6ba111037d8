"""A convolution along a sharded dim whose halo exchange hides behind the chunk's own conv.

With the halo in flight, each rank runs the conv a single device would run on its chunk alone:
the same call, zero padding `p = left = right` along `dim` (same kernel, same FLOPs). Once
the halo arrives, the outputs that read it get boundary corrections added in place: for
output `o` and tap `j` whose input lies in the halo, the conv of that one halo slice with
the weight's slice at tap `j` (kernel 1 along `dim`, no bias); a halo slice that is zero
padding (a global edge) has none. Backward is the chunk conv's own backward and the
corrections' adjoints; the halo gradients travel back to their owners beside the chunk conv's
backward on long chunks, after it on short ones (while the corrections' weight gradients are
computed). Beside the chunk conv's own memory, forward and backward, this keeps the halo and
its transport buffers.

Halos of unequal sides (causal) cannot be a conv's own padding: their outputs are split into
an interior conv and two thin edge windows, concatenated. Chunks shorter than the kernel's
reach exchange first. Exchanging first, a conv3d whose window torch would convolve on its
slow path (on CPU, few channels, frames and rows: im2col columns many times the input) runs
as one conv2d per kernel tap along `dim`, the frames folded into the batch. In every
formulation the arithmetic is the single-device conv's, summed in another order (float
rounding may differ in the last bits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from einops import rearrange

from haloshard._choice import (
    CORRECTED,
    SPLIT,
    Choice,
    by_taps,
    formulation,
    grad_asked,
    onednn_kernel,
)
from haloshard._comm import GroupLike, Pending
from haloshard._compat import onednn_convolution
from haloshard._errors import HaloError
from haloshard._exchange import (
    HaloMove,
    Reuse,
    apply_move,
    empty_like_layout,
    memory_format,
    prepare_halo,
)
from haloshard._specs import halo_supplies_padding
from haloshard._tracing import planner_cache, surfaces_errors

_conv = torch.ops.aten.convolution.default
_conv_backward = torch.ops.aten.convolution_backward.default


def with_spare_slice(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with one zero slice appended along `dim` where it has none (per rank): an empty
    chunk (T < P) runs a conv or a per-slice module on one zero slice, whose output is
    dropped; convs and pooling refuse empty inputs.

    Example::
        >>> with_spare_slice(torch.ones(2, 0), 1).shape, with_spare_slice(torch.ones(2, 3), 1).shape
        (torch.Size([2, 1]), torch.Size([2, 3]))
    """
    shape = list(t.shape)
    shape[dim] = torch.sym_max(0, 1 - shape[dim])
    return torch.cat([t, t.new_zeros(shape)], dim)


@dataclass(frozen=True)
class _ConvArgs:
    dim: int
    left: int
    right: int
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    groups: int
    path: str  # CORRECTED, SPLIT or WHOLE (`_choice.formulation`)
    spare: bool  # some rank's chunk is empty: every rank convolves one spare zero slice more
    tap_window: bool = True  # an exchanged window may run tap by tap (`_choice.by_taps`)

    @property
    def reach(self) -> int:
        """Input slices beyond one output's own: `dilation * (kernel - 1)` along `dim`."""
        return self.left + self.right

    @property
    def own_padding(self) -> list[int]:
        """The padding of the chunk's own conv: the halo's width (`left == right`) along dim."""
        return [self.left if i == self.dim - 2 else p for i, p in enumerate(self.padding)]

    def taps(self, weight: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
        """`(output, tap, halo slice)` for every tap that reads the halo; see `halo_taps`."""
        return halo_taps(self.left, self.right, self.dilation[self.dim - 2],
                         int(weight.shape[self.dim]))

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             padding: list[int] | None = None) -> torch.Tensor:
        zeros = [0] * len(self.stride)
        return _conv(x, weight, bias, self.stride, self.padding if padding is None else padding,
                     self.dilation, False, zeros, self.groups)

    def backward(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        g_x, g_w, _ = self.full_backward(grad, x, weight)
        return g_x, g_w

    def full_backward(
        self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
        padding: list[int] | None = None, mask: tuple[bool, bool, bool] = (True, True, False),
        bias_sizes: list[int] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The conv's own backward (what autograd runs for it): input, weight and bias
        gradients, each None where `mask` does not ask for it."""
        zeros = [0] * len(self.stride)
        return _conv_backward(grad, x, weight, bias_sizes, self.stride,
                              self.padding if padding is None else padding, self.dilation,
                              False, zeros, self.groups, list(mask))


@planner_cache(256)
def halo_taps(left: int, right: int, dilation: int, kernel: int
              ) -> tuple[tuple[int, int, int], ...]:
    """Which halo slice each boundary output reads, tap by tap, for a chunk at least
    `left + right` long: `(output, tap, slice)`.

    `output` counts from the chunk's start (`0 .. left-1`) or, negative, from its end
    (`-right .. -1`); `slice` indexes the halo buffer `[left halo ++ right halo]`. Output `o`
    reads the exchanged chunk at `o + tap * dilation`, so the left halo at that index when it
    is below `left`, the right halo past the chunk's end.

    Example::
        >>> halo_taps(1, 1, 1, 3)  # centred k3: first output's tap 0, last output's tap 2
        ((0, 0, 0), (-1, 2, 1))
    """
    reach = left + right
    assert dilation * (kernel - 1) == reach, (left, right, dilation, kernel)
    firsts = [(o, j, o + j * dilation) for o in range(left) for j in range(kernel)
              if o + j * dilation < left]
    lasts = [(q - right, j, left + q + j * dilation - reach) for q in range(right)
             for j in range(kernel) if q + j * dilation >= reach]
    return (*firsts, *lasts)


class _Formulated(torch.autograd.Function):
    """A formulation's autograd Function, `apply(x, weight, bias, move, args)`: the steps
    (`run`, `grads`) of the formulation `args.path` names (`formulation_of`), which
    `_steady`'s node on a DTensor runs too. One subclass per formulation, so a graph's node
    names which one ran."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        move: HaloMove, args: _ConvArgs,
    ) -> torch.Tensor:
        ctx.steps = formulation_of(args)
        y, saved = ctx.steps.run(ctx, x, weight, bias, move, args)
        ctx.save_for_backward(*saved)
        return y  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (*ctx.steps.grads(ctx, ctx.saved_tensors, grad), None, None)


def formulation_of(args: _ConvArgs) -> type[_CorrectedConv] | type[_HaloConv]:
    """The Function of the formulation `args.path` names."""
    return _CorrectedConv if args.path == CORRECTED else _HaloConv


class _CorrectedConv(_Formulated):
    """Forward: `(B, C, T_r, ...) -> (B, O, T_r, ...)`: `y = conv(x, W, b)` with zero padding
    `p` along T (the chunk's own conv), then `y[o] += conv(h[s], W[:, :, t])` for every
    `(o, t, s)` of `halo_taps`, `h = (B, C, 2p, ...)` the halo.
    Backward: `g_x (T_r) = conv's g_x (T_r) + owners' share of g_h (2p)`, where
    `g_h[s] += conv_input_grad(g_y[o], W[:, :, t])`; `g_W = conv's g_W (k along T)` with
    `g_W[:, :, t] += conv_weight_grad(g_y[o], h[s])` added in place; `g_b` is the conv's.
    (A conv1d computes the same sums for both edges in one conv: `_EdgeWindows`.)
    """

    @staticmethod
    def run(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            move: HaloMove, args: _ConvArgs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The forward: the output, and the tensors its backward reads (`x` first)."""
        moved = move.start(x)
        y = args.conv(x, weight, bias, args.own_padding)
        halo = _halo(x, move, moved, args)
        corrections = _corrections(args, weight, x.shape[args.dim], move.zero_slots(x, 0))
        corrections.add(y, halo, weight)
        ctx.move, ctx.args, ctx.corrections = move, args, corrections
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        return y, (x, weight, halo)

    @staticmethod
    def grads(ctx: Any, saved: tuple[torch.Tensor, ...], grad: torch.Tensor
              ) -> tuple[torch.Tensor | None, ...]:
        """The backward from `run`'s saved tensors: input, weight and bias gradients."""
        x, weight, halo = saved
        args, move, mask = ctx.args, ctx.move, tuple(ctx.needs_input_grad[:3])
        if torch.is_grad_enabled():
            return _graph_backward(grad, x, weight, move, args, mask)
        corrections = ctx.corrections
        # The chunk conv's backward is exactly the floor's. The halo gradients (small convs
        # on the output gradient's edges) travel back to their owners beside it when their
        # buffers are small next to the chunk (`_early`), else after it, while the
        # corrections' weight gradients are computed. Every rank agrees on requires_grad
        # (the exchange's agreement), so all or none of them send halo gradients back.
        early = mask[0] and _early(move, x.shape[args.dim])
        if early:
            moved, g_own = move.start_backward(corrections.input_grad(grad, halo, weight), 0)
        g_x, g_w, g_b = args.full_backward(grad, x, weight, args.own_padding, mask,
                                           ctx.bias_sizes)
        if mask[0] and not early:
            moved, g_own = move.start_backward(corrections.input_grad(grad, halo, weight), 0)
        if mask[1]:
            corrections.add_weight_grad(g_w, grad, halo, weight)
        if mask[0]:
            move.fold(g_x, moved, g_own)
        return g_x, g_w, g_b


# Halo gradients travel during the chunk conv's backward when the slices in transit (sent
# and received, each an input frame) are at most this share of the chunk's slices. Their
# buffers then sit beside that backward's own, which holds at least the chunk and its
# gradient (twice the chunk's bytes), so they add at most 5% to its peak: the memory target
# (the floor's peak plus the halo, plus 5%). Otherwise they travel after it.
_EARLY_SHARE = 0.1


def _early(move: HaloMove, length: Any) -> bool:
    """Whether the halo gradients can travel during the chunk conv's backward (see above)."""
    route = move.route
    transit = [*route.send_splits, *route.recv_splits]
    if not route.transport.backward_overlaps or not all(
            isinstance(n, int) for n in (*transit, length)):
        return False  # every rank's slices in transit; symbolic sizes (compiled, simulated)
    return sum(transit) <= _EARLY_SHARE * length


def _halo(x: torch.Tensor, move: HaloMove, moved: Pending, args: _ConvArgs) -> torch.Tensor:
    """Wait for the halo: `[left halo ++ right halo]` in `x`'s memory format."""
    shape = list(x.shape)
    shape[args.dim] = args.reach
    halo = empty_like_layout(x, shape)
    move.fill(halo, x, moved, 0)
    return halo


def _corrections(args: _ConvArgs, weight: torch.Tensor, length: Any, zeros: frozenset[int]
                 ) -> _FrameTaps | _EdgeWindows:
    """How the halo's contributions are computed: per tap on single frames for 2-D and 3-D
    convs, skipping the halo slices that are zero padding (`zeros`: a global edge); for
    conv1d, whose one-position convs oneDNN runs slowly (a depthwise one costs half the
    whole chunk's conv), one conv over both edges' zero-extended halos."""
    if weight.ndim == 3:
        return _EdgeWindows(args, length)
    return _FrameTaps(args, tuple(t for t in args.taps(weight) if t[2] not in zeros), length)


class _FrameTaps:
    """The corrections of a 2-D or 3-D conv, one tap at a time: `conv_{N-1}d` of one halo
    frame with the weight's frame at that tap, the other dims as the conv has them."""

    def __init__(self, args: _ConvArgs, taps: tuple[tuple[int, int, int], ...], length: Any
                 ) -> None:
        along = args.dim - 2
        self.dim, self.groups, self.taps, self.length = args.dim, args.groups, taps, length
        self.frame = [[v for i, v in enumerate(values) if i != along]
                      for values in (args.stride, args.padding, args.dilation)]

    def _conv(self, frame: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        stride, padding, dilation = self.frame
        return _conv(frame, weight, None, stride, padding, dilation, False, [0] * len(stride),
                     self.groups)

    def _backward(self, grad: torch.Tensor, frame: torch.Tensor, weight: torch.Tensor,
                  mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
        stride, padding, dilation = self.frame
        return _conv_backward(grad, frame, weight, None, stride, padding, dilation, False,
                              [0] * len(stride), self.groups, mask)

    def add(self, y: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor) -> None:
        for o, t, s in self.taps:
            y.select(self.dim, _at(o, self.length)).add_(
                self._conv(halo.select(self.dim, s), weight.select(self.dim, t)))

    def input_grad(self, grad: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor
                   ) -> torch.Tensor:
        g_halo = torch.zeros_like(halo)
        for o, t, s in self.taps:
            g_frame = self._backward(grad.select(self.dim, _at(o, self.length)),
                                     halo.select(self.dim, s), weight.select(self.dim, t),
                                     [True, False, False])[0]
            g_halo.select(self.dim, s).add_(g_frame)
        return g_halo

    def add_weight_grad(self, g_w: torch.Tensor, grad: torch.Tensor, halo: torch.Tensor,
                        weight: torch.Tensor) -> None:
        for o, t, s in self.taps:
            g_w.select(self.dim, t).add_(self._backward(
                grad.select(self.dim, _at(o, self.length)), halo.select(self.dim, s),
                weight.select(self.dim, t), [False, True, False])[1])


class _EdgeWindows:
    """The corrections of a conv1d (`p = left = right`), both edges in one conv: the left
    halo followed by `2p` zeros and `2p` zeros followed by the right halo, stacked along the
    batch, `(2B, C, 3p)`, convolved with no padding along T into the first and last `p`
    outputs `(2B, O, p)`. The zeros stand for the chunk, which the chunk's own conv read."""

    def __init__(self, args: _ConvArgs, length: Any) -> None:
        self.args, self.p, self.length = args, args.left, length

    def _windows(self, halo: torch.Tensor) -> torch.Tensor:
        p, batch = self.p, halo.shape[0]
        windows = halo.new_zeros((2 * batch, halo.shape[1], 3 * p))
        windows.narrow(0, 0, batch).narrow(2, 0, p).copy_(halo.narrow(2, 0, p))
        windows.narrow(0, batch, batch).narrow(2, 2 * p, p).copy_(halo.narrow(2, p, p))
        return windows

    def _edges(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.cat([grad.narrow(2, 0, self.p), grad.narrow(2, self.length - self.p,
                                                                 self.p)])

    def add(self, y: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor) -> None:
        p, batch = self.p, y.shape[0]
        out = self.args.conv(self._windows(halo), weight, None)
        y.narrow(2, 0, p).add_(out.narrow(0, 0, batch))
        y.narrow(2, self.length - p, p).add_(out.narrow(0, batch, batch))

    def input_grad(self, grad: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor
                   ) -> torch.Tensor:
        p, batch = self.p, halo.shape[0]
        g_windows = self.args.full_backward(self._edges(grad), self._windows(halo), weight,
                                           mask=(True, False, False))[0]
        assert g_windows is not None
        return torch.cat([g_windows.narrow(0, 0, batch).narrow(2, 0, p),
                          g_windows.narrow(0, batch, batch).narrow(2, 2 * p, p)], 2)

    def add_weight_grad(self, g_w: torch.Tensor, grad: torch.Tensor, halo: torch.Tensor,
                        weight: torch.Tensor) -> None:
        g_w.add_(self.args.full_backward(self._edges(grad), self._windows(halo), weight,
                                         mask=(False, True, False))[1])


def _at(output: int, length: Any) -> Any:
    """Index of a `halo_taps` output in a chunk `length` long."""
    return output if output >= 0 else length + output


class _HaloConv(_Formulated):
    """Forward: `(B, C, T_r, ...) -> (B, O, T_r, ...)`, this rank's chunk of the global conv.
    Backward: input gradients of the halos go back to their owners; weight and bias
    gradients are this rank's partial sums."""

    @staticmethod
    def run(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            move: HaloMove, args: _ConvArgs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The forward: the output, and the tensors its backward reads (`x` first)."""
        dim, left, length = args.dim, args.left, x.shape[args.dim]
        moved = move.start(x)
        if args.path == SPLIT:
            interior = args.conv(x, weight, bias)
            windows = _edge_windows(x, move, moved, args)
            # A side without halo (causal: right=0) has no boundary outputs and no window.
            y = torch.cat([*([args.conv(windows[0], weight, bias)] if left else []), interior,
                           *([args.conv(windows[-1], weight, bias)] if args.right else [])],
                          dim)
        else:
            # An empty chunk would ask the conv for zero outputs, which it refuses: one zero
            # slice more gives it one output, dropped again (and its gradient is zero).
            slow = by_taps(x, weight, args)
            # in inference, oneDNN's kernel on the window where torch would take its slow path
            direct = slow and not any(ctx.needs_input_grad) and onednn_kernel(x, weight, bias)
            ctx.taps = slow and args.tap_window and not direct
            if direct:
                y = onednn_convolution(move.assemble(x, moved), weight, bias, args.padding,
                                       args.stride, args.dilation, args.groups)
            elif ctx.taps:
                frames, buf = _frames_first(x, args)
                move.assemble(x, moved, out=buf)
                y = _taps_conv(frames, weight, bias, args, length)
            else:
                buf = move.assemble(x, moved,
                                    torch.sym_max(0, 1 - length) if args.spare else None)
                y = args.conv(buf, weight, bias)
                if args.spare:  # its spare output dropped; a fresh tensor, not a view (a
                    # Function's output that is a view refuses in-place ops after it)
                    y = y.narrow(dim, 0, length).clone()
            # Backward rebuilds the window from the chunk and its halo slices: kept whole,
            # it would hold a copy of the chunk beside the chunk itself.
            windows = (_halo_slices(buf, args, length),) if any(ctx.needs_input_grad) else ()
        ctx.move, ctx.args, ctx.has_bias = move, args, bias is not None
        return y, (x, weight, *windows)

    @staticmethod
    def grads(ctx: Any, saved: tuple[torch.Tensor, ...], grad: torch.Tensor
              ) -> tuple[torch.Tensor | None, ...]:
        """The backward from `run`'s saved tensors: input, weight and bias gradients."""
        x, weight, *windows = saved
        args: _ConvArgs = ctx.args
        if torch.is_grad_enabled():
            return _graph_backward(grad, x, weight, ctx.move, args,
                                   tuple(ctx.needs_input_grad[:3]))
        if args.path == SPLIT:
            g_x, g_w = _split_backward(grad, x, weight, windows, ctx.move, args)
        else:
            g_x, g_w = _whole_backward(grad, x, weight, windows, ctx.move, args, ctx.taps)
        g_b = grad.sum([d for d in range(grad.ndim) if d != 1]) if ctx.has_bias else None
        return g_x, g_w, g_b


def _graph_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    move: HaloMove, args: _ConvArgs, mask: tuple[bool, ...]
                    ) -> tuple[torch.Tensor | None, ...]:
    """The backward under `create_graph=True`, as a graph that can be differentiated again.

    The hand-written backwards move halo gradients outside autograd, so their gradients
    would miss every term that crosses a rank. Here autograd differentiates the conv of the
    exchanged chunk (what every formulation computes), whose exchange is differentiable to
    any order. It repeats the forward's exchange: create_graph is the same on every rank.
    """
    length = x.shape[args.dim]
    inputs = [t for t, need in zip((x, weight), mask[:2], strict=True) if need]
    with torch.enable_grad():
        buf = apply_move(x, move)
        if args.spare:  # an empty chunk: one zero slice more, its output dropped
            shape = list(buf.shape)
            shape[args.dim] = torch.sym_max(0, 1 - length)
            buf = torch.cat([buf, buf.new_zeros(shape)], args.dim)
            y = args.conv(buf, weight, None).narrow(args.dim, 0, length)
        else:  # the halo is the conv's reach: exactly `length` outputs
            y = args.conv(buf, weight, None)
        found = iter(torch.autograd.grad(y, inputs, grad, create_graph=True))
    g_x, g_w = (next(found) if need else None for need in mask[:2])
    g_b = grad.sum([d for d in range(grad.ndim) if d != 1]) if mask[2] else None
    return g_x, g_w, g_b


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


def _halo_slices(buf: torch.Tensor, args: _ConvArgs, length: Any) -> torch.Tensor:
    """The exchanged window's halo slices, `[left halo ++ right halo]` along `dim`."""
    dim, left = args.dim, args.left
    return torch.cat([buf.narrow(dim, 0, left), buf.narrow(dim, left + length, args.right)],
                     dim)


def _rebuilt(x: torch.Tensor, halos: torch.Tensor, args: _ConvArgs, shape: list[Any]
             ) -> torch.Tensor:
    """The window `assemble` built in forward, from the chunk and its halo slices."""
    buf = empty_like_layout(x, shape)
    _fill_window(buf, x, halos, args)
    spare = shape[args.dim] - (args.left + x.shape[args.dim] + args.right)
    if not isinstance(spare, int) or spare:  # eager, most calls: no spare slice to zero
        buf.narrow(args.dim, args.left + x.shape[args.dim] + args.right, spare).zero_()
    return buf


def _fill_window(buf: torch.Tensor, x: torch.Tensor, halos: torch.Tensor, args: _ConvArgs
                 ) -> None:
    """`buf[:left + T_r + right] = [left halo ++ chunk ++ right halo]` along `dim`."""
    dim, left, right, length = args.dim, args.left, args.right, x.shape[args.dim]
    buf.narrow(dim, 0, left).copy_(halos.narrow(dim, 0, left))
    buf.narrow(dim, left, length).copy_(x)
    buf.narrow(dim, left + length, right).copy_(halos.narrow(dim, left, right))




def _other_dims(args: _ConvArgs) -> tuple[list[int], list[int], list[int]]:
    """Stride, padding and dilation of the dims other than `dim`."""
    along = args.dim - 2
    return tuple([v for i, v in enumerate(values) if i != along]  # type: ignore[return-value]
                 for values in (args.stride, args.padding, args.dilation))


def _axes(dim: int) -> tuple[str, str]:
    """einops names of a conv3d tensor with `dim` as `t`, and of its two other spatial dims."""
    names = ["b", "c", "x", "y", "z"]
    names[dim] = "t"
    return " ".join(names), " ".join(n for n in names[2:] if n != "t")


def _frames_first(x: torch.Tensor, args: _ConvArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """A window buffer `(T', B, C, *others)`, frames outermost, and its `(B, C, ...)` view
    (`T' = left + T_r + right` along `dim`), for `_taps_conv`: a tap's frames, folded into
    the batch, are then one dense slice of it."""
    full, rest = _axes(args.dim)
    others = [n for i, n in enumerate(x.shape) if i >= 2 and i != args.dim]
    frames = x.new_empty([args.left + x.shape[args.dim] + args.right, *x.shape[:2], *others])
    return frames, rearrange(frames, f"t b c {rest} -> {full}")


def _taps_conv(frames: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               args: _ConvArgs, length: int) -> torch.Tensor:
    """`(T', B, C, ...) -> (B, O, T_r, ...)`: the window's conv3d as the sum over taps `j`
    of `conv2d(frames[j d : j d + T_r], weight[:, :, j])`, the frames folded into the batch
    (see `_choice.by_taps`)."""
    dim, dilation = args.dim, args.dilation[args.dim - 2]
    stride, padding, dil = _other_dims(args)
    y = None
    for j in range(weight.shape[dim]):
        out = _conv(frames.narrow(0, j * dilation, length).flatten(0, 1),
                    weight.select(dim, j), bias if j == 0 else None, stride, padding, dil,
                    False, [0, 0], args.groups)
        y = out if y is None else y.add_(out)
    assert y is not None
    full, rest = _axes(dim)
    # always a copy: `contiguous()` returns the rearranged view itself when it is already
    # contiguous (a one-frame chunk), and a Function's output that is a view refuses
    # in-place ops after it
    return rearrange(y, f"(t b) c {rest} -> {full}", t=length).clone(
        memory_format=torch.contiguous_format)


def _taps_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   halos: torch.Tensor, args: _ConvArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """`_taps_conv`'s window gradient (a `(B, C, T', ...)` view, frames outermost; frames no
    tap reads, between dilated taps, get zero) and weight gradient, tap by tap: the weight
    gradient from the window rebuilt frames first, dropped before the window's gradient is
    made (as `_whole_backward` does)."""
    dim, dilation, length = args.dim, args.dilation[args.dim - 2], x.shape[args.dim]
    stride, padding, dil = _other_dims(args)
    full, rest = _axes(dim)
    g = rearrange(grad, f"{full} -> (t b) c {rest}").contiguous()
    frames, window = _frames_first(x, args)
    _fill_window(window, x, halos, args)
    g_w = torch.empty_like(weight)
    for j in range(weight.shape[dim]):
        g_w.select(dim, j).copy_(torch.nn.grad.conv2d_weight(
            frames.narrow(0, j * dilation, length).flatten(0, 1),
            list(weight.select(dim, j).shape), g, stride, padding, dil, args.groups))
    shape = list(frames.shape)
    del frames, window
    g_frames = x.new_zeros(shape)
    tap_shape = [length * shape[1], *shape[2:]]
    for j in range(weight.shape[dim]):
        g_frames.narrow(0, j * dilation, length).add_(torch.nn.grad.conv2d_input(
            tap_shape, weight.select(dim, j), g, stride, padding, dil, args.groups
        ).unflatten(0, (length, -1)))
    return rearrange(g_frames, f"t b c {rest} -> {full}"), g_w


def _whole_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    windows: list[torch.Tensor], move: HaloMove, args: _ConvArgs, taps: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exchanged window's conv backward in two calls, so that the window and its
    gradient are never held at once beside the conv's workspace: the weight gradient from
    the window rebuilt, which is then dropped; the input gradient from the window's shape
    alone (as `torch.nn.grad.conv*_input`), its halo gradients sent to their owners while the
    chunk's part is copied out, then added in. A window convolved tap by tap (`taps`, see
    `_choice.by_taps`) takes both tap by tap (`_taps_backward`)."""
    dim, length = args.dim, x.shape[args.dim]
    if taps:
        g_buf, g_w = _taps_backward(grad, x, weight, windows[0], args)
    else:
        grad = with_spare_slice(grad, dim) if args.spare else grad
        grad = grad.contiguous(memory_format=memory_format(grad))  # once, for both calls
        shape = list(x.shape)
        shape[dim] = grad.shape[dim] + args.reach  # stride 1 along dim: one output a window
        _, g_w, _ = args.full_backward(grad, _rebuilt(x, windows[0], args, shape), weight,
                                       mask=(False, True, False))
        # the input gradient from the window's shape alone (as `torch.nn.grad.conv3d_input`)
        g_buf = args.full_backward(grad, grad.new_empty(1).expand(shape), weight,
                                   mask=(True, False, False))[0]
    moved, g_own = move.start_backward(g_buf)
    g_x = empty_like_layout(x, list(x.shape))
    g_x.copy_(g_buf.narrow(dim, args.left, length))
    del g_buf
    move.fold(g_x, moved, g_own)
    assert g_w is not None
    return g_x, g_w


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
    if not halo_supplies_padding(args[0][along], args[1][along], args[2][along],
                                 weight.shape[dim], left, right):
        return (f"halo_conv along dim {dim} needs stride 1 and padding 0 there and "
                f"left + right = dilation * (kernel - 1) = {reach}; got stride {stride}, "
                f"padding {padding}, left={left}, right={right}"), None
    return None, args


@surfaces_errors
def halo_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, dim: int,
    left: int, right: int, group: GroupLike, stride: int | tuple[int, ...] = 1,
    padding: int | tuple[int, ...] = 0, dilation: int | tuple[int, ...] = 1, groups: int = 1,
    pad: str = "zeros", transport: str | None = None, global_length: int | None = None,
    overlap: bool = True, _reuse: Reuse | None = None, _path: str | None = None,
    _choose: Callable[[], Choice] | None = None,
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
        overlap: convolve while the halo travels (the default): with `left == right`, the
            chunk's own conv (zero padding along `dim`, the kernel one device would run on
            the chunk) plus boundary corrections from the halo once it arrives; otherwise
            the interior, then two thin edge windows. It needs every chunk at least
            `left + right` long (`+ 1` for unequal halos); shorter chunks fall back to
            exchanging first, for all ranks alike. False always exchanges first.
        _path: force a formulation (`CORRECTED`, `SPLIT` or `WHOLE`; for measurements);
            one that does not fit the chunks falls back as above.
        _choose: decides `overlap` (and whether an exchanged window may run tap by tap)
            once the exchange has agreed (haloshard's layers: the choice must be looked up
            alike on every rank).

    Returns:
        This rank's `Shard(dim)` chunk of the global convolution's output.

    Example::
        >>> x = rank_map(mesh, lambda r: torch.randn(1, 8, 4, 16, 16))  # T = 16 on 4 ranks
        >>> w, b = torch.randn(8, 8, 3, 3, 3), torch.randn(8)  # causal along T: left=2
        >>> y = halo_conv(x, w, b, dim=2, left=2, right=0, group=mesh, padding=(0, 1, 1))
        >>> y.shape
        torch.Size([1, 8, 4, 16, 16])
    """
    return conv_call(x, weight, bias, dim=dim, left=left, right=right, group=group,
                     stride=stride, padding=padding, dilation=dilation, groups=groups,
                     pad=pad, transport=transport, global_length=global_length,
                     overlap=overlap, _reuse=_reuse, _path=_path,
                     _choose=_choose).apply(x, weight, bias)


def conv_call(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, dim: int,
    left: int, right: int, group: GroupLike, stride: int | tuple[int, ...] = 1,
    padding: int | tuple[int, ...] = 0, dilation: int | tuple[int, ...] = 1, groups: int = 1,
    pad: str = "zeros", transport: str | None = None, global_length: int | None = None,
    overlap: bool = True, _reuse: Reuse | None = None, _path: str | None = None,
    _choose: Callable[[], Choice] | None = None, _taps: bool = True,
) -> ConvCall:
    """`halo_conv`'s agreement (every rank at once) and choice of formulation, not run yet:
    the call `halo_conv` runs (`ConvCall.apply`), which haloshard's layers run on a DTensor
    in one autograd node instead (`_steady`)."""
    problem, args = _conv_problem(x, weight, dim, left, right, stride, padding, dilation)
    move, lengths = prepare_halo(x, left, right, dim, group, pad=pad, transport=transport,
                                 global_length=global_length, problem=problem, reuse=_reuse)
    assert args is not None  # a problem raised on every rank in prepare_halo
    if _choose is not None and move is not None:  # agreed: every rank chooses alike
        overlap, _taps = _choose()
    path = formulation(overlap, _path, min(lengths), left, right)
    conv_args = _ConvArgs(dim, left, right, *args, groups, path, min(lengths) == 0, _taps)
    return ConvCall(move, conv_args)


@dataclass(frozen=True)
class ConvCall:
    """An agreed halo conv: the autograd Function of its formulation (`_HaloConv` or
    `_CorrectedConv`: `apply(x, weight, bias, move, args)`, or its steps `run` and `grads`),
    the prepared move (None: a kernel of one along dim, no halo) and the conv's arguments."""

    move: HaloMove | None
    args: _ConvArgs

    @property
    def function(self) -> type[_HaloConv] | type[_CorrectedConv]:
        return formulation_of(self.args)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        """This rank's chunk of the global conv, differentiably."""
        a, dim = self.args, self.args.dim
        if self.move is None:  # no halo (and, for an empty chunk, a spare slice)
            y = torch.ops.aten.convolution(with_spare_slice(x, dim) if a.spare else x, weight,
                                           bias, a.stride, a.padding, a.dilation, False,
                                           [0] * len(a.stride), a.groups)
            return y.narrow(dim, 0, x.shape[dim])
        if not grad_asked(x, weight, bias):
            return self.infer(x, weight, bias)
        return self.function.apply(x, weight, bias, self.move,  # type: ignore[no-any-return]
                                   self.args)

    def infer(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        """This rank's chunk of the global conv in inference (no gradient asked, a halo to
        move): the formulation's steps alone, no graph node, nothing kept for a backward."""
        assert self.move is not None
        context = SimpleNamespace(needs_input_grad=(False,) * 5)
        return self.function.run(context, x, weight, bias, self.move, self.args)[0]

