"""Which formulation a halo conv runs: every choice of it, in one place.

A conv along a sharded dim can run as `halo_conv` (`_conv`) in several formulations, each
exact: the chunk's own conv while the halo travels, plus boundary corrections (`CORRECTED`,
equal halos) or two thin edge windows (`SPLIT`, unequal halos); or the conv of the exchanged
window (`WHOLE`, exchange-first), which on torch's slow conv3d path runs tap by tap. This
module decides, and nothing else does:
- `overlappable`: whether a halo layer's conv can run as `halo_conv` at all (from its class,
  stencil and the plan);
- `ConvChoice.choose`: overlapped or exchange-first, and whether an exchanged window may run
  tap by tap, once per global input signature of a layer (from shapes where no trial runs,
  else a timed trial on CPU);
- `formulation`: which of the three `halo_conv` runs, from the shortest chunk;
- `by_taps`: whether an exchanged window's conv3d runs tap by tap (per rank, where allowed).
Every choice that changes what moves between ranks is taken alike on every rank (from the
global shape, or from agreed rows); `by_taps` changes only this rank's arithmetic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from haloshard import _comm
from haloshard._annotation import Annotation
from haloshard._compat import SLOW_CONV3D, select_conv_backend
from haloshard._errors import HaloError
from haloshard._exchange import memory_format
from haloshard._layout import shard_sizes
from haloshard._specs import CONVS, ConvStencil, WindowPlan

# The formulations of `halo_conv` (`_ConvArgs.path`): the chunk's own conv plus boundary
# corrections (equal halos), an interior conv and two edge windows (unequal halos), or the
# conv of the exchanged chunk (chunks shorter than the kernel's reach, or overlap=False).
CORRECTED, SPLIT, WHOLE = "corrected", "split", "whole"

# How much faster (summed over ranks) exchange-first must be to replace the overlapped conv
# in the first-call trial. Its backward holds a window copying the chunk (oneDNN also
# reorders it whole): up to 1.56 of the floor's peak memory where oneDNN runs both within a
# few % of each other. Where it is clearly faster, the floor's conv takes torch's slow
# T-padded path for short chunks, whose im2col columns (k^d times the chunk) dwarf the copy
# (measured within the peak target there).
_EXCHANGE_FIRST_MARGIN = 0.1
# Timed rounds of each formulation after an untimed one: at least, at most, and the CPU
# time that sets their number in between (a 15 ms step varies by 30% between rounds on a
# shared 2-core machine; a 1 s step by a few %).
_TRIAL_ROUNDS = 3
_TRIAL_MAX_ROUNDS = 9
_TRIAL_SECONDS = 0.15


class Choice(NamedTuple):
    """A layer's choice for one input signature: `overlap` (the chunk's own conv while the
    halo travels) or exchange-first, and whether an exchanged window may run tap by tap
    (`taps`: where `by_taps` says so on a rank; False: the window's conv3d as torch runs
    it)."""

    overlap: bool
    taps: bool = True


# How the trial runs one formulation of a layer's conv: `run(leaf, params, choice)`, on a
# detached copy of the chunk (`leaf`) and of the module's weight and bias (`params`).
TrialRun = Callable[[torch.Tensor, list[torch.Tensor | None], Choice], torch.Tensor]
# A `site` below is a `_site.Site` (typed Any: `_site` needs `_conv`, which needs this module)


def overlappable(module: nn.Module, annotation: Annotation, plan: WindowPlan, site: Any
                 ) -> bool:
    """A derived, stride-1, length-keeping conv running torch's own forward: its window is
    exactly the halo exchange's output, so `halo_conv` can run it. A subclass with its own
    forward always runs that forward. With a padding mode other than zeros on the other
    dims every chunk must hold a slice (`F.pad` refuses to pad an empty one that way)."""
    if (not isinstance(module, CONVS) or annotation.spec is not None
            or isinstance(module.padding, str)):
        return False
    stencil = annotation.stencil
    padded = module.padding_mode != "zeros" and any(module.padding)
    return (isinstance(stencil, ConvStencil) and stencil.stride == 1 and stencil.fill is None
            and plan.out_length == plan.length and plan.left + plan.right == stencil.span - 1
            and not (padded and min(shard_sizes(site.length, site.mesh.size(site.axis))) == 0))


class ConvChoice:
    """A layer's choice of formulation (`Choice`) by global input signature (`chosen`), with
    the rounds its trial timed (`trials`): per model copy."""

    def __init__(self) -> None:
        self.chosen: dict[Any, Choice] = {}  # by global input signature
        self.trials: dict[Any, int] = {}  # rounds each formulation was timed, by signature

    def choose(self, module: nn.Module, site: Any, plan: WindowPlan, run: TrialRun
               ) -> Choice:
        """How this call runs `module`'s conv, for a layer given `overlap=None`: decided once
        per global input signature.

        A conv3d whose window torch would convolve on its slow path on every rank
        (`_taps_everywhere`, from shapes alone) exchanges first: there the chunk's own
        padded conv3d, the overlapped formulation's, is on that slow path too. Whether its
        window then runs tap by tap (`by_taps`: oneDNN's conv2d per tap) or as torch's own
        conv3d is timed where a graph is built (CPU, eager, not deterministic): the taps
        took 0.3 to 0.7 of the slow conv3d's time at C32 to C64 over 32 to 48 px, and 2.1
        to 3.2 of it at C128 to C512 over 8 x 8 px (a rank's rows of LTX-Video's deepest
        decoder convs, H sharded), where oneDNN copies the whole weight for each tap's
        few positions. In inference there is no trial: such a window runs oneDNN's conv3d
        directly where oneDNN takes its tensors (`_conv`), else tap by tap.

        Otherwise, on CPU (eager c10d, not deterministic mode) the overlapped conv and
        exchange-first are timed once, as `cudnn.benchmark` does: no engine moves the
        halo beside the conv there, and which formulation runs faster depends on the
        shape (2 frames of C256 exchanged first: 0.58 of the chunk's own padded conv; 8
        frames of C64 48x48: 1.03 of the overlapped conv). Exchange-first, whose backward
        holds a copy of the chunk, must be `_EXCHANGE_FIRST_MARGIN` faster. Elsewhere
        (GPUs, where the halo travels beside the conv; compiled, simulated, deterministic)
        it overlaps, or exchanges first tap by tap where `_taps_everywhere`.

        Every rank takes the same choice: it is called once the exchange has agreed on the
        signature (so every rank looks the choice up alike), the settings each rank reads
        for it (memory format, deterministic mode, parameters requiring grad) ride in one
        small gather at the first call, and a trial's times are summed over ranks from a
        gather."""
        x = site.local
        key = (site.shape, x.dtype, x.device.type, torch.is_grad_enabled(), x.requires_grad)
        if key not in self.chosen:
            timed = (_comm.is_eager(x) and x.device.type == "cpu"
                     and not torch.are_deterministic_algorithms_enabled())
            # where torch would run the conv3d on its slow path, exchanging first runs it
            # without the chunk's own slow conv: no trial of the overlapped conv
            taps = _taps_everywhere(module, site, plan)
            graph = grad_asked(x, module.weight, module.bias)
            if _comm.is_eager(x):  # per-rank settings: agreed (one rank's would desync)
                rows = _comm.gather_ints(torch.tensor([int(timed), int(taps), int(graph)]),
                                         _comm.resolve_group((site.mesh, site.axis)),
                                         what="choice of formulation")
                timed, taps, graph = (all(r[i] for r in rows) for i in range(3))
            if taps:
                self.chosen[key] = Choice(False, not timed or not graph or _sum_first(
                    self.trial(module, site, run, key, Choice(False), Choice(False, False))))
            else:
                self.chosen[key] = Choice(not timed or _overlap_kept(
                    self.trial(module, site, run, key, Choice(True), Choice(False))))
        return self.chosen[key]

    def trial(self, module: nn.Module, site: Any, run: TrialRun, key: Any, first: Choice,
              second: Choice) -> list[list[int]]:
        """Every rank's fastest `(first, second)` times (us), from one gather: both
        formulations timed forward and (where this call builds a graph) backward, in this
        process's CPU time (ranks sharing cores wait for each other, which wall time would
        count): an untimed warm-up, then rounds alternating which leads, as many as fill
        `_TRIAL_SECONDS` per formulation at the slowest rank's warm-up pace
        (`_TRIAL_ROUNDS` to `_TRIAL_MAX_ROUNDS`, agreed by one gather: every rank runs the
        same moves). They run on detached copies of the input and parameters: no gradient
        reaches the model, and no tensor hook or saved-tensor hook (FSDP, checkpointing,
        offloading) sees the trial. Each formulation's fastest round counts (contention
        only adds time)."""
        x = site.local
        group = _comm.resolve_group((site.mesh, site.axis))

        def step(choice: Choice) -> int:
            start = time.process_time()
            leaf = x.detach().requires_grad_(x.requires_grad)  # the agreed signature
            params = [p if p is None else p.detach().requires_grad_(p.requires_grad)
                      for p in (module.weight, module.bias)]
            y = run(leaf, params, choice)
            inputs = [t for t in (leaf, *params) if t is not None and t.requires_grad]
            if y.requires_grad and inputs:
                torch.autograd.grad(y, inputs, y.detach())
            return max(round((time.process_time() - start) * 1e6), 1)  # us

        # Its own saved-tensor hooks, innermost: an enclosing checkpoint or offload never
        # sees what the trial saves (a recomputed forward, which runs no trial, must save
        # what the original did).
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            warm = _comm.gather_ints(torch.tensor([step(first), step(second)]), group,
                                     what="trial of formulations")
            pace = max(max(row) for row in warm)
            rounds = min(max(math.ceil(_TRIAL_SECONDS * 1e6 / pace), _TRIAL_ROUNDS),
                         _TRIAL_MAX_ROUNDS)
            times: dict[Choice, list[int]] = {first: [], second: []}
            for i in range(rounds):
                for choice in (first, second) if i % 2 == 0 else (second, first):
                    times[choice].append(step(choice))
        self.trials[key] = rounds
        mine = torch.tensor([min(times[first]), min(times[second])])
        return _comm.gather_ints(mine, group, what="choice of formulation")


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _overlap_kept(rows: list[list[int]]) -> bool:
    """From every rank's `(overlapped, exchange-first)` fastest trial times: whether the
    overlapped conv stays, i.e. exchange-first is not `_EXCHANGE_FIRST_MARGIN` faster
    summed over ranks.

    Example::
        >>> _overlap_kept([[100, 95], [100, 93]]), _overlap_kept([[100, 85], [100, 88]])
        (True, False)
    """
    first = sum(r[1] for r in rows)
    return first >= (1 - _EXCHANGE_FIRST_MARGIN) * sum(r[0] for r in rows)


def _sum_first(rows: list[list[int]]) -> bool:
    """From every rank's `(first, second)` fastest trial times: whether the first is no
    slower summed over ranks.

    Example::
        >>> _sum_first([[100, 95], [100, 110]]), _sum_first([[100, 95], [100, 100]])
        (True, False)
    """
    return sum(r[0] for r in rows) <= sum(r[1] for r in rows)


def _taps_everywhere(module: nn.Module, site: Any, plan: WindowPlan) -> bool:
    """Whether exchanging first can run this conv3d tap by tap on every rank: torch would
    convolve even the longest chunk's window on its slow path (`halo_conv`'s `by_taps`,
    from the global shape, so every rank takes the same choice). There the chunk's own
    padded conv3d, the overlapped formulation's, is on that slow path too: exchange-first
    measured 0.19 to 0.86 of its time (`benchmarks.matrix`, the shapes it takes), with no
    trial of the overlapped conv, and in deterministic mode too (the rule reads only
    shapes)."""
    x = site.local
    if not taps_layout(x):
        return False
    along = site.dim - 2
    padded = module.padding_mode != "zeros"
    shape, padding = list(x.shape), []
    for i, p in enumerate(module.padding):
        if padded and i != along:  # padded before the conv, as `_overlapped_conv` does
            shape[2 + i] += 2 * p
        padding.append(0 if padded or i == along else p)
    shape[site.dim] = max(shard_sizes(site.length, site.mesh.size(site.axis))) + (
        plan.left + plan.right)
    return slow_window(x, shape, module.weight, list(module.stride), padding,
                       list(module.dilation), module.groups)


def formulation(overlap: bool, forced: str | None, shortest: int, left: int, right: int
                ) -> str:
    """The formulation every rank runs (from the shortest chunk, so all ranks alike)."""
    if forced not in (None, CORRECTED, SPLIT, WHOLE):
        raise HaloError(f"_path must be None, {CORRECTED!r}, {SPLIT!r} or {WHOLE!r}, got "
                        f"{forced!r}")
    if not overlap or forced == WHOLE:
        return WHOLE
    if forced != SPLIT and left == right and shortest >= left + right:
        return CORRECTED
    return SPLIT if shortest >= left + right + 1 else WHOLE


def by_taps(x: torch.Tensor, weight: torch.Tensor, args: Any) -> bool:
    """Whether the exchanged window's conv3d runs as one conv2d per kernel tap along `dim`
    (`_conv._taps_conv`): for a 5-D contiguous eager chunk, where torch would run the window's
    conv3d on its slow path (asked of torch's own choice of kernel) or the chunk is one
    frame long. Each tap reads `T_r` frames of the window, folded into the batch, so
    oneDNN runs it. Measured fwd+bwd, 1 thread, against the chunk's own padded conv3d:
    0.30 to 0.63 of its time (C32 to C128, 2 to 16 frames, 32x32 to 64x64), where the
    window's conv3d took 0.95 to 1.21; where oneDNN runs the window (C256 T2, C128 T8
    64x64, bf16) it stays: the taps took 1.04 to 1.33 of its time there. A layer's choice
    (`Choice.taps`, timed) may keep the window's conv3d where the taps cost more."""
    length = x.shape[args.dim]
    if not taps_layout(x) or not isinstance(length, int) or length < 1 or args.spare:
        return False
    if length == 1:
        return True
    shape = list(x.shape)
    shape[args.dim] = length + args.reach
    return slow_window(x, shape, weight, args.stride, args.padding, args.dilation,
                       args.groups)


def taps_layout(x: torch.Tensor) -> bool:
    """A chunk whose window can be convolved tap by tap: a 5-D, contiguous, eager tensor
    (the frames-first window is built for that layout)."""
    return x.ndim == 5 and _comm.is_eager(x) and memory_format(x) == torch.contiguous_format


def slow_window(x: torch.Tensor, shape: list[int], weight: torch.Tensor, stride: list[int],
                padding: list[int], dilation: list[int], groups: int) -> bool:
    """Whether torch would run the conv3d of a window of `shape` (`x`'s dtype and device)
    on its slow path: on CPU, float64, or a batch of one with dilation or with few
    channels, frames and rows (`C * T * H <= 20480`); its im2col columns are 27 times the
    input for k3. Asked of torch's own choice of kernel, which reads sizes and dtype, not
    data."""
    window = x.new_empty(1).expand(shape)
    return select_conv_backend(window, weight, None, stride, padding, dilation, False,
                               [0, 0, 0], groups) in SLOW_CONV3D


def onednn_direct(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a conv3d that torch would run on its slow path (`slow_window`) can call
    oneDNN's kernel directly instead: inference (no gradient asked: torch's backward of
    it would take the slow path again), plain float32 CPU tensors, oneDNN built and
    enabled. torch's rule sends a batch of one with few channels, frames and rows to the
    slow path whatever its width, where oneDNN took 0.3 to 1.1 of its time and 0.7 to 0.9
    of the conv2d taps' (CPU, 1 thread, Wan's decoder convs on 8 to 64 rows a rank); the
    same sums in another order (float rounding only)."""
    return not grad_asked(x, weight, bias) and onednn_kernel(x, weight, bias)


def onednn_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether oneDNN's conv kernel can be called on these tensors: plain float32 CPU
    tensors, oneDNN built and enabled."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (all(type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu"
                and t.dtype == torch.float32 for t in tensors)
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def grad_asked(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on these tensors builds a graph: grad mode on and one of them
    requiring grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in tensors)
