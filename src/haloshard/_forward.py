"""One mechanism that runs a module sharded: its `forward` replaced by a `ShardedForward`.

Every haloshard style installs one with `install` (a halo layer's padding along the dim set
to what the halo supplies: `ShardedForward.attributes`), whose handle restores exactly the
forward and attributes it replaced (and removes the output hook of `output_layouts`). A call
goes: input site (`_site`: the local chunk of a `Shard(dim)` DTensor, or a plain chunk on the
style's 1-D mesh) -> the strategy's local computation -> the output chunk, rewrapped as the
input came. The strategies are subclasses, one `sharded` each:

- `HaloForward` (`_halo_forward`): a layer with a halo (conv, pooling, resampling, any stencil);
- `_LocalForward` and its subclasses (`_layer_styles`): per-slice layers, GroupNorm,
  attention, blocks meeting per-sample tensors;
- the diffusers integration's block forwards (mid-block attention, spatial norm, ...).

The base class owns what they share: the deep copy that rebinds to a copied model, the
module's own forward (`original`), the pass-through inside an enclosing halo module's window
(`inside`), and naming: a `HaloError` names the module by its fqn, and a collective that
times out waiting for another rank names it too.

The forward is an instance attribute rather than a forward pre-hook / post-hook pair: the
state a call sets up must be unwound even when `forward` raises, and torch does not call
forward hooks then.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import Placement
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from haloshard import _comm
from haloshard._errors import HaloError, named
from haloshard._plan_gaps import guard, guard_running, unguard, watch
from haloshard._tracing import surfaces_errors

_HANDLE = "_haloshard_handle"


class _Flag:
    """A ContextVar-like flag that torch.compile can trace (dynamo cannot trace ContextVar).

    Not thread-local: one forward runs at a time per process (LocalTensorMode simulates
    ranks in one thread).
    """

    def __init__(self) -> None:
        self.value = False

    def get(self) -> bool:
        return self.value

    def set(self, value: bool) -> bool:
        previous, self.value = self.value, value
        return previous

    def reset(self, token: bool) -> None:
        self.value = token


INSIDE = _Flag()
# The sites (`_site.Site`) of the blocks running their own forward on a chunk now
# (`AttentionParallel`), innermost last: a plain tensor a planned module meets inside one is
# a chunk of that site's layout, carrying its spare slices (`Site.spare`). A plain stack,
# not a ContextVar, which torch.compile cannot trace.
ENCLOSING: list[Any] = []


def enclosing(x: object) -> Any:
    """The site of the enclosing block whose chunk `x` is (its rank), or None."""
    if ENCLOSING and isinstance(x, torch.Tensor) and x.ndim == ENCLOSING[-1].local.ndim:
        return ENCLOSING[-1]
    return None


class ShardedForward:
    """A module's forward run sharded; subclasses implement `sharded` (and `inside`).

    An object, not a closure, so deep copies of a model rebind to the copy: `copied` names
    the attributes a deep copy copies (modules), everything else (the mesh, which names
    process groups; plain settings) is shared, and `fresh` resets per-copy caches.
    """

    style = "haloshard"
    name = ""
    previous: Callable[..., Any] | None = None
    guarded = False  # whether its first call guarded the running model (`_plan_gaps.guard`)
    copied: tuple[str, ...] = ("module", "previous")

    def __init__(self, module: nn.Module, dim: int, mesh: DeviceMesh | None = None) -> None:
        self.module, self.dim, self.mesh = module, dim, mesh
        self.fresh()

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedForward:
        new = copy.copy(self)
        for attr in self.copied:
            setattr(new, attr, copy.deepcopy(getattr(self, attr), memo))
        new.fresh()
        return new

    def fresh(self) -> None:
        """Reset what a copy must not share (agreements cached per input signature)."""

    def attributes(self) -> dict[str, Any]:
        """Module attributes `install` sets while the strategy is installed (their values
        then), restored by the handle; none by default."""
        return {}

    def original(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward (the one this replaced)."""
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    @surfaces_errors
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.guarded and not torch.compiler.is_compiling():
            # the model around this one may hold modules a plan left out (see `guard`)
            self.guarded = True
            guard_running()
        if INSIDE.get():
            # The enclosing halo module already supplied this module's halo.
            return self.inside(*args, **kwargs)
        name = self.name or type(self.module).__name__
        # A parametrized weight (spectral_norm, weight_norm, ...) is computed once per call,
        # as the module's own forward computes it: the halo paths read it more than once,
        # and spectral_norm in training would step its power iteration at each read.
        cache = (parametrize.cached() if parametrize.is_parametrized(self.module)
                 and not torch.compiler.is_compiling() else contextlib.nullcontext())
        # Collectives that time out waiting for another rank name this module.
        with _comm.labelled(name), cache:
            try:
                return self.sharded(*args, **kwargs)
            except HaloError as error:
                _comm.forget_openings()  # the ranks may have opened this forward unlike
                raise named(error, name) from error

    def sharded(self, *args: Any, **kwargs: Any) -> Any:
        """The strategy: this rank's part of the module's output."""
        raise NotImplementedError

    def inside(self, *args: Any, **kwargs: Any) -> Any:
        """Inside an enclosing halo module's window: the module's own forward."""
        return self.original(*args, **kwargs)


def planned_model() -> nn.Module | None:
    """The model being planned by `parallelize_module` (the outermost call's), or None."""
    frame, root = inspect.currentframe(), None
    while frame is not None:
        if frame.f_code is parallelize_module.__code__:
            root = frame.f_locals.get("module")
        frame = frame.f_back
    return root if isinstance(root, nn.Module) else None


def module_name(module: nn.Module) -> str:
    """How errors name `module`: `"fqn (Class)"` when it is being planned by
    `parallelize_module` (the fqn within the model passed to it), else `"Class"`."""
    cls = type(module).__name__
    root = planned_model()
    if root is not None:
        for fqn, inner in root.named_modules():
            if inner is module:
                return f"{fqn or '<root>'} ({cls})"
    return cls


def names_errors(apply: Callable[[Any, nn.Module, DeviceMesh], nn.Module]
                 ) -> Callable[[Any, nn.Module, DeviceMesh], nn.Module]:
    """A style's `_apply` whose HaloErrors name the module (see `module_name`)."""

    @functools.wraps(apply)
    def checked(style: Any, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        try:
            return apply(style, module, device_mesh)
        except HaloError as error:
            raise named(error, module_name(module)) from error

    return checked


class HaloHandle:
    """Undoes `install`: `remove()` restores the module's forward and padding exactly.

    Example::
        >>> model = parallelize_module(nn.Sequential(nn.Conv3d(3, 8, 3, padding=1)), mesh,
        ...                            {"0": HaloParallel()})
        >>> handle = halo_handles(model)["0"]
        >>> handle.remove()  # the module is as it was before parallelize_module
        >>> model[0].padding
        (1, 1, 1)
    """

    def __init__(self, module: nn.Module, saved: dict[str, Any], forward: Any) -> None:
        self._module: nn.Module | None = module
        self._saved, self._forward = saved, forward
        self._hooks: list[RemovableHandle] = []

    @property
    def attached(self) -> bool:
        return self._module is not None

    def remove(self) -> None:
        """Restore the module; a second call does nothing."""
        module, self._module = self._module, None
        if module is None:
            return
        for name, value in self._saved.items():
            setattr(module, name, value)
        if self._forward is None:
            del module.forward
        else:
            module.forward = self._forward
        for hook in self._hooks:
            hook.remove()
        delattr(module, _HANDLE)


def output_layouts(module: nn.Module, dim: int, layout: Placement | None,
                   use_local_output: bool) -> None:
    """Give a styled module's DTensor output the `layout` on its sharded mesh axis
    (`Replicate()` gathers it; None keeps `Shard(dim)`) and, with `use_local_output`, return
    the local tensor, as torch's `ParallelStyle`s do; the module's handle removes the hook.
    """
    if layout is None and not use_local_output:
        return

    def convert(y: Any) -> Any:
        if not isinstance(y, DTensor):
            return y
        if layout is not None:
            axis = next(i for i, p in enumerate(y.placements) if p == Shard(dim))
            placements = tuple(layout if i == axis else p for i, p in enumerate(y.placements))
            if placements != tuple(y.placements):
                y = y.redistribute(y.device_mesh, placements)
        return y.to_local() if use_local_output else y

    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, tuple) and out:
            return (convert(out[0]), *out[1:])
        return convert(out)

    handle = handle_of(module)
    assert handle is not None, "output_layouts after the style is installed"
    handle._hooks.append(module.register_forward_hook(hook))


def check_layouts(style: str, dim: int, input_layouts: Placement | None,
                  layout: Placement | None) -> None:
    """The layouts a haloshard style takes: input `Shard(dim)`; output `Shard(dim)` or
    `Replicate()`.

    Raises:
        HaloError: for any other.
    """
    if input_layouts is not None and input_layouts != Shard(dim):
        raise HaloError(f"{style} takes input_layouts=Shard({dim}) (or None), got "
                        f"{input_layouts!r}")
    if layout is not None and layout not in (Shard(dim), Replicate()):
        raise HaloError(f"{style} takes output_layouts=Shard({dim}), Replicate() or None, "
                        f"got {layout!r}")


def install(module: nn.Module, forward: Any, saved: dict[str, Any] | None = None
            ) -> HaloHandle:
    """Replace `module.forward` by `forward` (a `ShardedForward`, whose `previous` and
    `name` this sets) and set the attributes it names (`forward.attributes()`, e.g. a halo
    layer's padding along its dim); the returned handle (also `halo_handles(model)`)
    restores exactly the forward it replaced, those attributes, and the ones in `saved`
    (their values before the style changed them).

    Raises:
        HaloError: when a haloshard style is already applied to the module.
    """
    if handle_of(module) is not None:
        raise HaloError(f"a haloshard style is already applied to {type(module).__name__}: "
                        "its forward is already attached, and a second would run inside it "
                        "(a halo exchanged twice); call its handle's remove() first")
    watch(handle_of)  # a plan's gaps are named in plain runs (see `haloshard._plan_gaps`)
    attributes = forward.attributes()
    saved = {**{name: getattr(module, name) for name in attributes}, **(saved or {})}
    for name, value in attributes.items():
        setattr(module, name, value)
    forward.previous = module.__dict__.get("forward")
    forward.name = module_name(module)
    module.forward = forward
    guard(planned_model())  # the plan's other modules, named if left out (`_plan_gaps`)
    unguard(module)
    handle = HaloHandle(module, saved, forward.previous)
    setattr(module, _HANDLE, handle)
    return handle


def handle_of(module: nn.Module) -> HaloHandle | None:
    """The handle of the halo attached to `module`, or None."""
    found = module.__dict__.get(_HANDLE)
    return found if isinstance(found, HaloHandle) else None
