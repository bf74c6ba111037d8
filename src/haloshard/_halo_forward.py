"""The strategy of a layer with a halo: `HaloForward`, installed by `_forward.install`.

A halo layer runs on `Shard(dim)` inputs: the input's chunk (`_site`) is extended by its
halo (`halo_exchange`), narrowed to the window this rank's outputs need (`halo_window`), the
module runs with its own padding along `dim` removed, and its output is narrowed to this
rank's `Shard(dim)` chunk of the single-device output. A conv with torch's own forward runs
as `halo_conv` instead, in the formulation `_choice` picks. Inside the forward:
- nested halo modules (a conv inside an annotated wrapper) pass straight through with their
  own padding, because the enclosing module already received its halo;
- for an explicit spec, the module's own padding along `dim` (`F.pad`, or `torch.cat` of
  repeated frames around its input) is neutralised by `_no_pad.NoPadAlong`, so a causal
  wrapper runs unedited;
- under `haloshard.packed` a conv runs per document (`_packed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from haloshard import _comm, _segments
from haloshard._agree import padded_reuse
from haloshard._annotation import Annotation
from haloshard._choice import Choice, ConvChoice, TrialRun, overlappable
from haloshard._compat import (
    enabled_local_tensor_mode,
    maybe_run_for_local_tensor,
)
from haloshard._conv import ConvCall, conv_call
from haloshard._errors import HaloError
from haloshard._exchange import (
    Reuse,
    empty_like_layout,
    exchange,
    memory_format,
    prepare_halo,
)
from haloshard._forward import INSIDE as _INSIDE
from haloshard._forward import (
    ShardedForward,
    module_name,
)
from haloshard._layout import (
    HaloShard,
    check_pad_fits,
    shard_size_and_offset,
)
from haloshard._no_pad import NoPadAlong
from haloshard._packed import packed_conv
from haloshard._site import (
    Site,
    check_same_length,
    output_spec,
    pick,
    rewrap,
    site_of,
    with_spare,
)
from haloshard._specs import (
    CONVS,
    DERIVABLE,
    SPATIAL,
    TRANSPOSED,
    ConvStencil,
    Stencil,
    WindowPlan,
    conv_padding,
    derive_stencil,
    known_forward,
    local_attrs,
    plan_windows,
    spatial_index,
)
from haloshard._steady import Steady, sharded_conv, steady_of
from haloshard._varlen import active_boundaries

# How a module runs on its window: `local(forward, window, *args, **kwargs) -> output`.
LocalRun = Callable[..., Any]


class HaloForward(ShardedForward):
    """The strategy of a layer with a halo: exchange, run the module on its window (or as
    `halo_conv`), keep this rank's outputs (see the module docstring)."""

    copied = ("module", "saved", "previous")
    # a causal wrapper around one conv (`CausalConvParallel`): see `across`
    wraps_one_conv = False

    def __init__(self, module: nn.Module, annotation: Annotation, mesh: DeviceMesh | None,
                 saved: dict[str, Any], previous: Callable[..., Any] | None, *,
                 overlap: bool | None = None, watch: bool = False, name: str = "",
                 local: LocalRun | None = None, known: bool = False) -> None:
        super().__init__(module, annotation.dim, mesh)
        self.annotation, self.saved, self.previous = annotation, saved, previous
        self.overlap, self.watch, self.local = overlap, watch, local
        self.name = name or type(module).__name__
        self.known = known  # the module runs torch's own forward for its kind
        self.follows_mode = False  # the halo's pad follows the conv's padding_mode (`of`)
        # other sharded dims the module treats slice by slice (no halo along them)
        self.per_slice: tuple[int, ...] = ()
        # other sharded dims a causal wrapper pads itself (`F.pad`): the halo replaces it
        self.own_pads: dict[int, HaloShard] = {}
        # other sharded dims along which a style knows the module's stencil: it runs
        # unedited on its window there too (its own padding kept, reaching dropped outputs)
        self.stencils: dict[int, Stencil] = {}

    @classmethod
    def of(cls, module: nn.Module, annotation: Annotation, mesh: DeviceMesh | None, *,
           overlap: bool | None = None, local: LocalRun | None = None) -> HaloForward:
        """The halo strategy that makes `module` run on `Shard(dim)` inputs (see the module
        docstring), to install with `_forward.install`, which sets the module's padding
        along `dim` to what the halo supplies (`attributes`) and restores it on `remove()`.

        Args:
            module: the module, already validated into `annotation` by `resolve`.
            annotation: its halo.
            mesh: used for plain-tensor inputs (1-D); DTensor inputs bring their own mesh.
            overlap: run stride-1 convs that keep the length as `halo_conv`, which
                convolves the chunk while the halo is in flight; False exchanges first;
                None chooses per input signature (see `_choice.ConvChoice.choose`).
            local: how the module runs on its window, `local(forward, window, *args,
                **kwargs)`; None calls `forward(window, *args, **kwargs)`.

        Example::
            >>> from haloshard._annotation import resolve
            >>> from haloshard._forward import install
            >>> conv = nn.Conv1d(2, 2, 3, padding=1)
            >>> handle = install(conv, HaloForward.of(conv, resolve(conv), None))
            >>> conv.padding, handle.remove(), conv.padding
            ((0,), None, (1,))
        """
        saved = {name: getattr(module, name) for name in local_attrs(module, annotation.dim)}
        # A forward of its own may pad `dim` in ways no attribute shows: it is never
        # replaced by halo_conv, and a derived halo is checked against what it does at run
        # time.
        known = known_forward(module)
        forward = cls(module, annotation, mesh, saved, module.__dict__.get("forward"),
                      overlap=overlap if known else False,
                      watch=(annotation.spec is None and not known
                             and isinstance(module, DERIVABLE)),
                      name=module_name(module), local=local, known=known)
        # torch's own conv padding `dim`: its halo pads as its `padding_mode` reads at each
        # call (a user may set it after planning; the changed mode is agreed like any other)
        forward.follows_mode = (known and isinstance(module, CONVS)
                                and any(conv_padding(module)[spatial_index(module, forward.dim)]))
        return forward

    def attributes(self) -> dict[str, Any]:
        """The module's padding along `dim` while the halo is installed: none (the halo
        supplies it)."""
        return local_attrs(self.module, self.annotation.dim)

    def fresh(self) -> None:
        # The last agreement of each exchange (see `Reuse`): a layer validates its arguments
        # on every rank when its signature changes, later calls issue no metadata collective.
        self.agreed: dict[Any, Any] = {}
        self.choice = ConvChoice()  # overlapped or exchange-first, by input signature
        self.steady: Steady | None = None  # the last steady call (`_steady`)
        self.windows_agreed: set[Any] = set()  # signatures whose stencil windows were agreed

    def reuse(self, site: Site) -> Reuse:
        """This layer's store, its key and the call's signature (global shape, dtype, grad
        mode...), which the exchange compares with the agreed one on each rank (a
        signature may differ between ranks: DTensor metadata is per rank)."""
        x = site.local
        return self.agreed, "layer", (site.shape, x.dtype, x.requires_grad,
                                      torch.is_grad_enabled(), site.placements,
                                      id(site.mesh), site.axis)

    @property
    def plain(self) -> bool:
        """A conv or pooling running torch's own forward (no padding of its own to drop)."""
        return self.known and isinstance(self.module, DERIVABLE)

    def inside(self, *args: Any, **kwargs: Any) -> Any:
        # The module's own padding is back for the enclosing window.
        with _swapped(self.module, self.saved):
            return self.original(*args, **kwargs)

    def sharded(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        steady = self.steady
        if (steady is not None and not args and not kwargs and type(x) is DTensor
                and active_boundaries() is None and steady.matches(x, self.module)):
            return steady.run(x, self.module)  # what the agreement already settled
        try:
            return self.whole(x, *args, **kwargs)
        except HaloError as error:
            changed = self.changed_since_planned()
            if changed is None:
                raise
            raise HaloError(f"{changed}; {error}") from error

    def whole(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """A call the steady state does not cover: site, plan, agreement, formulation."""
        annotation = self.annotation
        if self.follows_mode and annotation.stencil.pad != self.module.padding_mode:
            annotation = self.annotation = replace(
                annotation, stencil=replace(annotation.stencil, pad=self.module.padding_mode))
        if isinstance(self.module, TRANSPOSED) and (args or "output_size" in kwargs):
            raise HaloError("ConvTranspose with output_size= is not supported under a halo "
                            "(it would size each rank's local output); expected no output_size")
        site = site_of(x, annotation.dim, self.mesh, several=True)
        if site.others:
            return self.several(site, *args, **kwargs)
        if active_boundaries() is not None:  # haloshard.packed: one conv per document
            return packed_conv(self, site)
        plan = plan_windows(annotation.stencil, site.length, site.mesh.size(site.axis),
                            uniform=enabled_local_tensor_mode() is not None)
        _segments.follow(site.length, plan.out_length, annotation.stencil)
        reuse = self.reuse(site)
        if self.known and self.local is None and overlappable(self.module, annotation, plan,
                                                              site):
            # torch's own conv, as `halo_conv`: overlapped, or exchanging first in a
            # function whose backward never holds the window and its gradient at once
            # chosen once the exchange has agreed (every rank then holds one signature)
            choose = None if self.overlap is not None else (
                lambda: self.choice.choose(self.module, site, plan,
                                           self.conv_run(site, plan, reuse)))
            # compiled, the conv and DTensor's own autograd nodes trace as usual
            if isinstance(x, DTensor) and not torch.compiler.is_compiling():
                return self.conv_on_dtensor(x, site, plan, reuse, choose,
                                            steady=not args and not kwargs)
            y = _overlapped_conv(self.module, site, plan, annotation, reuse,
                                 whole=self.overlap is False, choose=choose)
            return with_spare(_output(y, site, plan, annotation), site)
        y = self.exchange_first(site, plan, reuse, *args, **kwargs)
        self.check_windows(y, site, plan, reuse)
        return with_spare(_output(y, site, plan, annotation), site)

    def changed_since_planned(self) -> str | None:
        """How torch's own conv now differs along `dim` from the halo it was planned with
        (its kernel, stride, dilation or padding set after `parallelize_module`), or None."""
        module, stencil, dim = self.module, self.annotation.stencil, self.dim
        if not (self.plain and isinstance(module, CONVS) and isinstance(stencil, ConvStencil)
                and self.annotation.spec is None):
            return None
        si = spatial_index(module, dim)
        span = module.dilation[si] * (module.weight.shape[dim] - 1) + 1
        now = (span, module.stride[si], conv_padding(module)[si])
        if now == (stencil.span, stencil.stride, (0, 0)):
            return None
        return (f"its kernel, dilation, stride or padding along dim {dim} changed after "
                f"parallelize_module: planned for a kernel span of {stencil.span}, stride "
                f"{stencil.stride} and padding {(stencil.pad_left, stencil.pad_right)} (the "
                f"halo holds that padding: the conv's own reads 0 along dim {dim} while "
                f"planned), now a span of {now[0]}, stride {now[1]} and padding {now[2]} of "
                "its own; remove its halo (`halo_handles(model)[fqn].remove()`) and plan it "
                "again")

    def conv_on_dtensor(self, x: DTensor, site: Site, plan: WindowPlan, reuse: Reuse,
                        choose: Callable[[], Choice] | None, *, steady: bool) -> Any:
        """The conv as `halo_conv` on a DTensor, in one autograd node (`sharded_conv`);
        with `steady`, kept as the layer's steady state once its agreement is reused."""
        module = self.module
        chunk, call = _conv_call(module, site, plan, self.annotation, reuse,
                                 whole=self.overlap is False, choose=choose)
        if call.move is None or chunk is not site.local:  # no halo, or padded first
            y = call.apply(chunk, module.weight, module.bias)
            return with_spare(_output(y, site, plan, self.annotation), site)
        out = sharded_conv(x, module.weight, module.bias, call,
                           lambda y: output_spec(y, site, self.dim, plan.out_length))
        if steady:  # what later calls like this one run
            key = (reuse[1], id(call.move.route.group.pg))
            self.steady = steady_of(x, out, module, call, reuse[0], key,
                                    (reuse[0], key, _comm.current_label))
        return out

    @property
    def chosen(self) -> dict[Any, Choice]:
        """Overlapped or not, and taps or not, by global input signature (`ConvChoice`)."""
        return self.choice.chosen

    @property
    def trials(self) -> dict[Any, int]:
        """The rounds the trial timed each formulation, by global input signature."""
        return self.choice.trials

    def conv_run(self, site: Site, plan: WindowPlan, reuse: Reuse) -> TrialRun:
        """How the formulation trial runs this layer's conv on detached copies."""
        def run(leaf: torch.Tensor, params: list[torch.Tensor | None], choice: Choice
                ) -> torch.Tensor:
            return _overlapped_conv(self.module, replace(site, local=leaf), plan,
                                    self.annotation, reuse, whole=not choice.overlap,
                                    taps=choice.taps, params=params)
        return run

    def check_windows(self, y: Any, site: Site, plan: WindowPlan, reuse: Reuse) -> None:
        """A user's stencil against what the module returned on its windows: every rank's
        output must reach `offset + count` along dim, or cutting this rank's outputs would
        fail on that rank alone. Agreed once per input signature (a small gather), so a
        window too short on one rank raises the same `HaloError` on every rank; haloshard's
        own stencils are tested against their modules and skip it."""
        if type(self.annotation.stencil).__module__.startswith("haloshard."):
            return
        out = y[0] if isinstance(y, tuple) and y else y
        got = out.shape[self.dim] if isinstance(out, torch.Tensor) else -1
        rank = site.mesh.get_local_rank(site.axis)
        key = reuse[1]
        if key in self.windows_agreed or not _comm.is_eager(site.local):
            # agreed earlier, or simulated / compiled: each rank checks its own output
            _check_window_output(rank, got, plan, self.annotation.stencil)
            return
        rows = _comm.gather_ints(_window_row(rank, got, plan), _comm.resolve_group(
            (site.mesh, site.axis)), what="check of the stencil's windows")
        for r, (length, short) in enumerate(rows):
            if short:
                _check_window_output(r, length, plan, self.annotation.stencil)
        self.windows_agreed.add(key)

    def several(self, site: Site, *args: Any, **kwargs: Any) -> Any:
        """Spatial dims sharded on several mesh axes (T and H): the halo exchanged along
        each in turn, so the second exchange also moves the first one's halo slices (the
        corners a 3x3x3 kernel reads from its diagonal neighbour); the module runs once on
        the window with its padding removed along each dim; each dim keeps this rank's
        outputs. Along the other dims the stencil is `across`'s; a dim the layer treats
        slice by slice takes no halo. Agreed as one dim is; a rank that raises along one axis
        still joins the later axes' exchanges, flagged (`halo_windows`)."""
        if active_boundaries() is not None:
            raise HaloError("packed documents (haloshard.packed) need an input sharded on "
                            f"one dim, got one sharded on dims "
                            f"{[site.dim, *(d for _, d in site.others)]}")
        across = {d: self.across(d, site.local.ndim) for _, d in site.others}
        reuse, uniform = self.reuse(site), enabled_local_tensor_mode() is not None
        plans, stencils = [], []
        for axis, d in ((site.axis, site.dim), *site.others):
            found = across.get(d)
            stencil = self.annotation.stencil if d == site.dim else found and found[0]
            if stencil is None:  # slice by slice along d: the local chunk is its window
                continue
            plan = plan_windows(stencil, site.shape[d], site.mesh.size(axis), uniform=uniform)
            plans.append((axis, d, plan))
            stencils.append(stencil)
        x = self.windows_across(site, plans, stencils, reuse)
        y = self.run_across(x, across, *args, **kwargs)
        if isinstance(y, torch.Tensor) and self.annotation.spec is not None:
            sizes = tuple(n + z for n, z in zip(plans[0][2].win_len, plans[0][2].win_zeros,
                                                strict=True))
            _check_length(site.mesh.get_local_rank(site.axis), y.shape[site.dim], sizes,
                          self.annotation.spec)
        return _several_output(y, site, plans, per_slice=[d for d, f in across.items()
                                                          if f is None])

    def windows_across(self, site: Site, plans: list[tuple[int, int, WindowPlan]],
                       stencils: list[Stencil], reuse: Reuse) -> torch.Tensor:
        """The window `several` runs the module on: `halo_windows` (a style may build it
        otherwise)."""
        return halo_windows(site, plans, stencils, reuse)

    def across(self, d: int, ndim: int) -> tuple[Stencil, nn.Module] | None:
        """The layer's stencil along `d`, a second sharded dim, and the module whose padding
        along `d` the halo replaces; None for a dim in `per_slice` (no halo). A conv,
        pooling or resampling with torch's own forward gives its own; a causal wrapper
        (explicit spec, or `CausalConvParallel`) the one conv inside it, which must take
        the wrapper's input as it is (any `F.pad` or `torch.cat` of `d` raises at run time)
        unless the style names the wrapper's own `F.pad` of `d` (`own_pads`): the halo then
        holds that padding, and the conv's kernel and stride along `d` give the reach. A
        style that knows the module's stencil along `d` (`stencils`) gives it: the module
        runs unedited on its window along `d` too.
        """
        if d in self.per_slice:
            return None
        if d in self.stencils:
            return self.stencils[d], self.module
        module = self.module
        own = self.annotation.spec is None and not self.wraps_one_conv
        convs = [module] if own else [m for m in module.modules() if isinstance(m, DERIVABLE)]
        kind = SPATIAL.get(type(convs[0])) if convs else None  # conv1d/2d/3d: 1/2/3
        ok = (len(convs) == 1 and self.local is None and isinstance(convs[0], DERIVABLE)
              # a wrapper whose padding of d the style names (`own_pads`): the style
              # vouches for the conv inside, as it does along the sharded dim
              and (self.known if convs[0] is module
                   else known_forward(convs[0]) or d in self.own_pads)
              and (kind is None or kind + 2 == ndim))
        if not ok:
            raise HaloError(
                f"{self.name} got an input also sharded on dim {d}: expected a layer whose "
                f"halo along dim {d} is known: a conv, pooling or resampling with torch's own "
                "forward, a causal wrapper around one such conv (explicit spec or "
                f"CausalConvParallel), or a style told the layer is per-slice along dim {d} "
                f"(local_dims=({d},)); it has no local= rule")
        stencil = derive_stencil(convs[0], d)
        own = self.own_pads.get(d)
        if own is not None:  # the wrapper's F.pad along d, then its conv's kernel and stride
            assert isinstance(stencil, ConvStencil)
            stencil = replace(stencil, pad_left=own.left, pad_right=own.right, pad=own.pad)
        return stencil, convs[0]

    def run_across(self, x: torch.Tensor, across: dict[int, tuple[Stencil, nn.Module] | None],
                   *args: Any, **kwargs: Any) -> Any:
        """The module on its window, with no padding of its own along any sharded dim."""
        annotation = self.annotation
        token = _INSIDE.set(True)
        try:
            with ExitStack() as stack:
                for d, found in across.items():
                    if d in self.stencils:  # the module keeps its own padding along d
                        continue
                    if found is not None:
                        stack.enter_context(_swapped(found[1], local_attrs(found[1], d)))
                    # padding d any other way would shift the halo (or pad a chunk's edge);
                    # a wrapper's own F.pad of d (`own_pads`) is dropped: the halo holds it
                    own = self.own_pads.get(d)
                    stack.enter_context(NoPadAlong(d, own, x, watch=own is None))
                stack.enter_context(NoPadAlong(annotation.dim, annotation.spec, x,
                                               watch=self.watch, plain=self.plain))
                return (self.original(x, *args, **kwargs) if self.local is None
                        else self.local(self.original, x, *args, **kwargs))
        finally:
            _INSIDE.reset(token)

    def exchange_first(self, site: Site, plan: WindowPlan, reuse: Reuse, *args: Any,
                       **kwargs: Any) -> Any:
        """Exchange the halo, then run the module's own forward on this rank's window."""
        annotation = self.annotation
        window = halo_window(site, plan, annotation, reuse)
        token = _INSIDE.set(True)
        try:
            with NoPadAlong(annotation.dim, annotation.spec, window, watch=self.watch,
                            plain=self.plain):
                return (self.original(window, *args, **kwargs) if self.local is None
                        else self.local(self.original, window, *args, **kwargs))
        finally:
            _INSIDE.reset(token)


def halo_windows(site: Site, plans: list[tuple[int, int, WindowPlan]],
                 stencils: list[Stencil], reuse: Reuse,
                 pads: dict[int, HaloShard] | None = None) -> torch.Tensor:
    """The chunk's window along each planned `(mesh axis, dim)` in turn, the later exchange
    over the earlier one's window (so it also moves the corners a kernel reads from its
    diagonal neighbour). A rank that raises along one axis still joins the later axes'
    exchanges, flagged (`_fail_later_axes`), so their peers raise at once too.

    `pads`: dims no plan shards, padded first as a causal wrapper's `F.pad` pads them
    (each slice alone, so the halo slices arrive padded alike; `reuse` is the padded
    chunk's, `padded_reuse`)."""
    # `site` no longer holds the chunk: a chunk made for this call (padded first) is freed
    # once the first window is built
    x, site = site.local, replace(site, local=_NO_CHUNK)
    if _in_one_buffer(x, site, plans, pads or {}):
        return _windows_in_one_buffer(x, site, plans, stencils, reuse, pads or {})
    if pads:
        x = _padded_chunk(x, pads)
    for i, ((axis, d, plan), stencil) in enumerate(zip(plans, stencils, strict=True)):
        try:
            x = halo_window(replace(site, local=x, axis=axis, dim=d), plan,
                            Annotation(None, d, stencil), reuse)
        except HaloError:
            _fail_later_axes(replace(site, local=x), plans[i + 1 :], stencils[i + 1 :],
                             reuse)
            raise
    return x


_NO_CHUNK = torch.empty(0)


def _in_one_buffer(x: torch.Tensor, site: Site, plans: list[tuple[int, int, WindowPlan]],
                   pads: dict[int, HaloShard]) -> bool:
    """Whether `halo_windows` builds the windows in one buffer: inference (no autograd
    node to keep per axis) on real ranks, several axes or pads (replicate or zeros) to
    write in place, each window the whole exchanged chunk (no strided or trimmed window)."""
    if torch.is_grad_enabled() or len(plans) < (1 if pads else 2) or not _comm.is_eager(x):
        return False
    if any(spec.pad not in ("replicate", "zeros") for spec in pads.values()):
        return False
    for axis, d, plan in plans:
        rank = site.mesh.get_local_rank(axis)
        start, length, zeros = pick(rank, plan.win_start, plan.win_len, plan.win_zeros)
        if (start, length, zeros) != (0, plan.left + x.shape[d] + plan.right, 0):
            return False
    return True


def _windows_in_one_buffer(x: torch.Tensor, site: Site,
                           plans: list[tuple[int, int, WindowPlan]], stencils: list[Stencil],
                           reuse: Reuse, pads: dict[int, HaloShard]) -> torch.Tensor:
    """`halo_windows` in inference: the chunk copied once into a buffer of the last window's
    shape (padded there along `pads`' dims), then each axis's halos written into it in
    turn, the later axis sending the rows of the earlier one's window (a view of the
    buffer), as the exchanges one after the other would; each of those copied the whole
    window again, and a chunk padded apart first was one more copy."""
    sizes, shape = list(x.shape), list(x.shape)
    for _, d, plan in plans:
        shape[d] += plan.left + plan.right
    for d, spec in pads.items():
        shape[d] += spec.left + spec.right
    buf = empty_like_layout(x, shape)

    def center(t: torch.Tensor, axes: list[tuple[int, int, WindowPlan]]) -> torch.Tensor:
        for _, d, plan in axes:
            t = t.narrow(d, plan.left, sizes[d])
        return t

    _pad_into(x, pads, center(buf, plans))
    del x
    for i, ((axis, d, plan), stencil) in enumerate(zip(plans, stencils, strict=True)):
        window = center(buf, plans[i + 1 :])  # this axis's window: later axes not yet added
        chunk = window.narrow(d, plan.left, window.shape[d] - plan.left - plan.right)
        try:
            move, _ = prepare_halo(chunk, plan.left, plan.right, d, (site.mesh, axis),
                                   pad=_exchange_pad(stencil, plan), global_length=plan.length,
                                   reuse=reuse)
            if move is not None:
                move.fill(window, chunk, move.start(chunk))
        except HaloError:
            _fail_later_axes(replace(site, local=window), plans[i + 1 :], stencils[i + 1 :],
                             reuse)
            raise
        if stencil.fill is not None and plan.left + plan.right:
            rank = site.mesh.get_local_rank(axis)
            window.masked_fill_(_outside(rank, plan.length, site.mesh.size(axis), plan.left,
                                         plan.right, window.ndim, d, window.device),
                                stencil.fill)
    return buf


def _padded_chunk(x: torch.Tensor, pads: dict[int, HaloShard]) -> torch.Tensor:
    """The chunk padded along `pads`' dims as a causal wrapper's `F.pad` pads them."""
    widths = [0] * (2 * x.ndim - 4)
    for d, spec in pads.items():
        k = 2 * (x.ndim - 1 - d)
        widths[k : k + 2] = [spec.left, spec.right]
    mode = next(iter(pads.values())).pad
    return F.pad(_canonical(x), widths, mode="constant" if mode == "zeros" else mode)


def _canonical(x: torch.Tensor) -> torch.Tensor:
    """`x` viewed with its memory format's own strides. A DTensor's local chunk of batch 1
    can carry another stride on that size-1 dim; `F.pad` then takes a channels-last chunk
    for a contiguous one and pads it into a contiguous copy, which the conv reorders
    again (one more chunk-sized buffer)."""
    fmt = memory_format(x)
    if fmt == torch.contiguous_format or not _comm.is_eager(x):
        return x
    strides = torch.empty(x.shape, device="meta").contiguous(memory_format=fmt).stride()
    return x if x.stride() == strides else x.as_strided(x.shape, strides, x.storage_offset())


def _pad_into(x: torch.Tensor, pads: dict[int, HaloShard], out: torch.Tensor) -> None:
    """Write `x` padded along `pads`' dims (replicate or zeros, as `_padded_chunk`) into
    `out`: `x` into the middle, then each dim's edges over the whole extent of the others
    (edges of a later dim are rewritten by its own pass, from its middle slices, which
    the earlier passes completed: the corners come out as `F.pad`'s)."""
    middle = out
    for d, spec in pads.items():
        middle = middle.narrow(d, spec.left, x.shape[d])
    middle.copy_(x)
    for d, spec in pads.items():
        n = x.shape[d]
        for start, width, source in ((0, spec.left, spec.left),
                                     (spec.left + n, spec.right, spec.left + n - 1)):
            if not width:
                continue
            edge = out.narrow(d, start, width)
            if spec.pad == "zeros":
                edge.zero_()
            else:
                edge.copy_(out.narrow(d, source, 1).expand_as(edge))


def _fail_later_axes(site: Site, plans: list[tuple[int, int, WindowPlan]],
                     stencils: list[Stencil], reuse: Reuse) -> None:
    """This rank raised in an exchange along one mesh axis: join the exchanges along the
    later axes with its error flagged (the agreed move with placeholder rows, or the
    metadata gather), so the peers of those axes, which never saw the first one, raise at
    once instead of waiting for it."""
    for (axis, d, plan), stencil in zip(plans, stencils, strict=True):
        with suppress(HaloError):
            exchange(site.local, plan.left, plan.right, d, (site.mesh, axis),
                     pad=_exchange_pad(stencil, plan), global_length=plan.length,
                     reuse=reuse, problem="a peer on another mesh axis raised HaloError in "
                     "its halo exchange for this layer (see the error on that rank)")


def _overlapped_conv(module: nn.Module, site: Site, plan: WindowPlan,
                     annotation: Annotation, reuse: Reuse, *, whole: bool = False,
                     taps: bool = True, params: list[torch.Tensor | None] | None = None,
                     choose: Callable[[], Choice] | None = None) -> torch.Tensor:
    """The conv as `halo_conv`: the chunk's own conv runs while the halo travels (`whole`:
    the conv of the exchanged window, `overlap=False`, tap by tap where `taps` allows),
    with the module's weight and bias or `params` in their place."""
    x, call = _conv_call(module, site, plan, annotation, reuse, whole=whole, taps=taps,
                         choose=choose)
    weight, bias = (module.weight, module.bias) if params is None else params
    return call.apply(x, weight, bias)


def _conv_call(module: nn.Module, site: Site, plan: WindowPlan, annotation: Annotation,
               reuse: Reuse, *, whole: bool, choose: Callable[[], Choice] | None,
               taps: bool = True) -> tuple[torch.Tensor, ConvCall]:
    """The chunk the conv runs on and its agreed call (`conv_call`).

    A padding mode other than zeros pads the other dims first, as the module's own forward
    does (its padding along `dim` is 0 while the halo is attached): each slice is padded
    alone, so its halo copies arrive padded alike, and the exchange pads `dim` in that mode.
    """
    x, padding = site.local, module.padding
    if module.padding_mode != "zeros" and any(padding):
        x = F.pad(x, [w for p in reversed(padding) for w in (p, p)], mode=module.padding_mode)
        padding = (0,) * len(padding)
        reuse = padded_reuse(reuse, x.requires_grad)
    return x, conv_call(x, module.weight, module.bias, dim=annotation.dim, left=plan.left,
                        right=plan.right, group=(site.mesh, site.axis), stride=module.stride,
                        padding=padding, dilation=module.dilation, groups=module.groups,
                        pad=annotation.stencil.pad, global_length=plan.length,
                        overlap=not whole, _reuse=reuse, _choose=choose, _taps=taps)


@contextmanager
def _swapped(module: nn.Module, values: dict[str, Any]) -> Iterator[None]:
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def _exchange_pad(stencil: Stencil, plan: WindowPlan) -> str:
    """The pad mode to exchange with.

    Every rank gets the widest rank's halo, which for a short global length can exceed what
    reflect / circular can fill although no window reads past the layer's own padding. When
    that padding itself fits (the single-device layer accepts it), the unread slices are
    exchanged as zeros; otherwise the exchange raises, as the single-device layer would.
    """
    pad, widest = stencil.pad, max(plan.left, plan.right)
    too_wide = (pad == "reflect" and widest >= plan.length) or (
        pad == "circular" and widest > plan.length)
    if not too_wide or not isinstance(stencil, ConvStencil):
        return pad
    try:
        check_pad_fits(plan.length, stencil.pad_left, stencil.pad_right, pad)
    except HaloError:
        return pad
    return f"{pad}-or-zeros"


def halo_window(site: Site, plan: WindowPlan, annotation: Annotation, reuse: Reuse
                ) -> torch.Tensor:
    """Exchange the halo, fill beyond the global ends if needed, cut this rank's window."""
    stencil, dim = annotation.stencil, annotation.dim
    rank = site.mesh.get_local_rank(site.axis)
    x = exchange(site.local, plan.left, plan.right, dim, (site.mesh, site.axis),
                 pad=_exchange_pad(stencil, plan), global_length=plan.length, reuse=reuse)
    if stencil.fill is not None and plan.left + plan.right:
        outside = _outside(rank, plan.length, site.mesh.size(site.axis), plan.left,
                           plan.right, x.ndim, dim, x.device)
        x = x.masked_fill(outside, stencil.fill)
    start, length, zeros = pick(rank, plan.win_start, plan.win_len, plan.win_zeros)
    # A window that is the whole exchanged buffer stays as it is: a narrow() view's backward
    # would write the buffer's gradient whole (zeros, then a copy) before the exchange's own.
    x = _narrowed(x, dim, start, length)
    # Symbolic per-rank counts (LocalTensorMode) cannot be tested; padding by 0 is harmless.
    if isinstance(zeros, torch.SymInt) or zeros:
        x = F.pad(x, [0, 0] * (x.ndim - 1 - dim) + [0, zeros])
    return x


@maybe_run_for_local_tensor
def _outside(rank: int, length: int, world: int, left: int, right: int, ndim: int, dim: int,
             device: torch.device) -> torch.Tensor:
    """Mask of the exchanged slices that lie beyond the global ends (max pooling: -inf)."""
    size, offset = shard_size_and_offset(length, world, rank)
    position = torch.arange(offset - left, offset + size + right, device=device)
    shape = [1] * ndim
    shape[dim] = -1
    return ((position < 0) | (position >= length)).reshape(shape)


def _output(y: torch.Tensor, site: Site, plan: WindowPlan, annotation: Annotation) -> Any:
    """Narrow to this rank's output chunk; rebuild a `Shard(dim)` DTensor for DTensor input.

    A tuple `(output, extra, ...)` (a conv returning its cache) has its first element
    narrowed; the others describe this rank's window, not the global tensor, and come back
    as None so that no caller can use them as the single-device values.
    """
    if isinstance(y, tuple) and y and isinstance(y[0], torch.Tensor):
        return (_output(y[0], site, plan, annotation), *(None for _ in y[1:]))
    if not isinstance(y, torch.Tensor) or isinstance(y, DTensor):
        raise HaloError(f"a halo module must return a plain tensor (or a tuple whose first "
                        f"element is one) from its local forward, got {type(y).__name__}")
    dim, rank = annotation.dim, site.mesh.get_local_rank(site.axis)
    if annotation.spec is not None:
        sizes = tuple(n + z for n, z in zip(plan.win_len, plan.win_zeros, strict=True))
        _check_length(rank, y.shape[dim], sizes, annotation.spec)
    start, length = pick(rank, plan.out_start, plan.out_len)
    # Keep the module's own output when it is already the chunk: a narrow() view would make
    # an in-place op on it drop FSDP2's pre-backward hook.
    return rewrap(_narrowed(y, dim, start, length), site, dim, plan.out_length)


@maybe_run_for_local_tensor
def _window_row(rank: int, got: int, plan: WindowPlan) -> torch.Tensor:
    """This rank's module output length and whether it is too short for its outputs."""
    return torch.tensor([got, got < plan.out_start[rank] + plan.out_len[rank]])


@maybe_run_for_local_tensor
def _check_window_output(rank: int, got: int, plan: WindowPlan, stencil: Stencil) -> None:
    """`HaloError` when rank `rank`'s module output (`got` slices, -1: not a tensor) ends
    before the outputs its stencil window promised."""
    start, count = plan.out_start[rank], plan.out_len[rank]
    if got < start + count:
        window = plan.win_len[rank] + plan.win_zeros[rank]
        raise HaloError(
            f"{stencil!r}.window() gave rank {rank} an input window of {window} slices whose "
            f"outputs should hold its {count} output(s) from offset {start}, but the module "
            f"returned {f'{got} slices' if got >= 0 else 'no tensor'} on it; expected at "
            f"least {start + count} slices: the stencil's window is too short or its offset "
            "too large for this module")


def _narrowed(t: torch.Tensor, dim: int, start: Any, length: Any) -> torch.Tensor:
    """`t.narrow(dim, start, length)`, or `t` itself where that is all of it (a view would
    add a node to autograd's graph; per-rank symbolic counts always narrow)."""
    if (isinstance(start, int) and isinstance(length, int) and start == 0
            and length == t.shape[dim]):
        return t
    return t.narrow(dim, start, length)


def _several_output(y: Any, site: Site, plans: list[tuple[int, int, WindowPlan]], *,
                    per_slice: list[int]) -> Any:
    """Narrow along each dim with a halo to this rank's outputs (a dim taken slice by slice
    must keep its length); a DTensor with the global output shape on the input's mesh and
    placements. A tuple's other elements come back as None, as in `_output`."""
    if isinstance(y, tuple) and y and isinstance(y[0], torch.Tensor):
        return (_several_output(y[0], site, plans, per_slice=per_slice),
                *(None for _ in y[1:]))
    if not isinstance(y, torch.Tensor) or isinstance(y, DTensor):
        raise HaloError(f"a halo module must return a plain tensor from its local forward, "
                        f"got {type(y).__name__}")
    shape = list(site.shape)
    for d in per_slice:
        check_same_length(y.shape[d], site.local.shape[d], "a module taken as per-slice "
                          "(local_dims)", d)
    for axis, d, plan in plans:
        start, length = pick(site.mesh.get_local_rank(axis), plan.out_start, plan.out_len)
        y = y.narrow(d, start, length)
        shape[d] = plan.out_length
    # the other sharded dims' global lengths are the output's: `rewrap` reads them there
    return rewrap(y, replace(site, shape=tuple(shape)), site.dim, shape[site.dim])


@maybe_run_for_local_tensor
def _check_length(rank: int, got: int, win_len: tuple[int, ...], spec: HaloShard) -> None:
    expected = win_len[rank] - spec.left - spec.right
    if got != expected:
        raise HaloError(f"a module annotated with {spec!r} returned {got} slices along dim "
                        f"{spec.dim} from a window of {win_len[rank]}; an explicit spec is "
                        f"for layers that keep the length: expected {expected}")
