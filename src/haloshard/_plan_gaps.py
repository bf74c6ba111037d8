"""Name the module a hand-written plan left out, in a plain run, at no cost to correct runs.

A layer with parameters that a plan leaves out meets the sharded DTensor its neighbour
returns with plain parameters, and DTensor refuses the mix from deep inside its dispatcher
("aten.convolution.default: got mixed torch.Tensor and DTensor"), naming an aten op but no
module. DTensor builds a spec for a plain tensor beside a DTensor in one method of its
dispatcher, `_try_replicate_spec_for_scalar_tensor`, which runs only on that mixed path
(a scalar tensor, or this refusal), never for an op on DTensors alone. `watch()` wraps that
method once a haloshard style is applied: when DTensor refuses there, the Python frames
of the running `nn.Module` calls say which module ran the op (the innermost) in which model
(the outermost). If that model carries a haloshard style and the module none, the refusal
becomes a `HaloError` naming the module by fqn and the plan entry it lacks; anything else
(a model without haloshard styles, an op outside any module) keeps DTensor's own error. No
module hook, no cost on any op that mixes nothing.

Most other ops (`native_group_norm`, `addmm`, `native_layer_norm`, ...) DTensor refuses in
C++, where no Python runs. For those, `guard()` gives each module of a styled model that
runs torch's own forward of a layer with parameters (`_KNOWN`: Linear, the norms,
Embedding, ...; convs are named above) a forward pre-hook that raises the same named error
when that module is about to meet DTensor's refusal: a DTensor input beside a plain
parameter or buffer. Only those classes, whose forward is torch's own and known: a user's
module may call `to_local()` itself. The hook costs about a microsecond per call of such a
module (a styled module drops it); a model without haloshard styles gets none.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from haloshard._compat import (
    MODULE_CALL_CODE,
    caller_frame,
    dtensor_op_dispatcher,
    forward_pre_hooks,
    implicit_replication,
)
from haloshard._errors import HaloError

# DTensor's refusal of a plain tensor (a parameter) beside a DTensor.
MIXED = "got mixed torch.Tensor and DTensor"
_METHOD = "_try_replicate_spec_for_scalar_tensor"


class MissingEntryError(HaloError, RuntimeError):
    """DTensor's mixed-tensor refusal, named by module: a `HaloError` that code catching
    DTensor's own `RuntimeError` still catches."""


def missing_entry(fqn: str, module: nn.Module, raw: str, *,
                  met: str = "it ran DTensor's default dispatch on the sharded input and met "
                             "a plain tensor (a parameter)") -> str:
    """The message for DTensor's mixed-tensor error `raw` (or "": none yet), raised while
    `module` ran (`met`: what the module met)."""
    name = fqn or "<root>"
    said = f" DTensor said: {raw}" if raw else ""
    return (f"{name} ({type(module).__name__}) has no plan entry: {met}. Add an entry "
            f"for {name!r} (GroupNormParallel() for a GroupNorm, HaloParallel() for a conv, "
            f"LocalParallel() for a per-slice layer).{said}")


def watch(handle_of: Callable[[nn.Module], Any]) -> None:
    """Wrap DTensor's mixed-tensor path (see the module docstring); idempotent.
    `handle_of(module)`: the haloshard style installed on `module`, or None (passed in by
    `_forward`, which imports this module)."""
    dispatcher = dtensor_op_dispatcher()
    previous = getattr(dispatcher, _METHOD, None)
    if previous is not None and not getattr(previous, "haloshard_names_gaps", False):
        # a torch without it: torch's error
        setattr(dispatcher, _METHOD, _naming(previous, handle_of))


def _naming(previous: Callable[..., Any], handle_of: Callable[[nn.Module], Any]
            ) -> Callable[..., Any]:
    def replicate_spec(op_call: Any, tensor_arg: Any, compute_mesh: Any) -> Any:
        try:
            return previous(op_call, tensor_arg, compute_mesh)
        except RuntimeError as error:
            message = _named(str(error), handle_of)
            if message is None:
                raise
            raise MissingEntryError(message) from error

    replicate_spec.haloshard_names_gaps = True  # type: ignore[attr-defined]
    return replicate_spec


def _named(raw: str, handle_of: Callable[[nn.Module], Any]) -> str | None:
    """The missing-entry message for DTensor's refusal `raw` raised here, or None when it
    is not one inside a module of a model that carries haloshard styles."""
    calls = _module_calls()
    if MIXED not in raw or not calls:
        return None
    module, root = calls[0], calls[-1]
    if handle_of(module) is not None or not any(handle_of(m) for m in root.modules()):
        return None
    fqn = next((name for name, m in root.named_modules() if m is module), None)
    return None if fqn is None else missing_entry(fqn, module, raw)


def _module_calls() -> list[nn.Module]:
    """The modules whose `__call__` is running, innermost first (from Python's frames)."""
    found, frame = [], caller_frame()
    while frame is not None:
        if frame.f_code is MODULE_CALL_CODE:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                found.append(module)
        frame = frame.f_back
    return found


# torch's own layers with parameters (or buffers) that DTensor refuses beside a DTensor in
# C++, by the forward they run: a subclass that keeps torch's forward counts, one with a
# forward of its own does not. Convs meet the refusal on DTensor's Python path (`watch`).
_KNOWN = (nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag, nn.GroupNorm, nn.LayerNorm,
          nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
          nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.PReLU,
          nn.MultiheadAttention)
_KNOWN_FORWARDS = frozenset(cls.forward for cls in _KNOWN)
# Models whose modules `guard` has walked (weakly: a model's life is the user's).
_GUARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# DTensor's own refusal, quoted in the hook's message (it raises before DTensor does).
_REFUSAL = f"{MIXED}, need to convert all torch.Tensor to DTensor"


def guard(root: nn.Module | None) -> None:
    """Give every module of `root` (a model carrying haloshard styles) that runs torch's
    own forward of a `_KNOWN` layer, and no style, the pre-hook `_refusing`; once per model
    (idempotent: a deep copy keeps its hooks)."""
    if root is None or root in _GUARDED:
        return
    _GUARDED.add(root)
    for fqn, module in root.named_modules():
        if _runs_known_forward(module) and not _guarded(module):
            module.register_forward_pre_hook(_refusing(fqn), with_kwargs=True)


def unguard(module: nn.Module) -> None:
    """Drop the pre-hook from a module a style runs now (the hook would return at once):
    planned modules keep torch's hook-free call."""
    hooks = forward_pre_hooks(module)
    for key in [k for k, h in hooks.items() if getattr(h, "haloshard_gap", False)]:
        del hooks[key]


def guard_running() -> None:
    """`guard` the outermost model being called now (a styled module's first call)."""
    calls = _module_calls()
    guard(calls[-1] if calls else None)


def _runs_known_forward(module: nn.Module) -> bool:
    return type(module).forward in _KNOWN_FORWARDS and "forward" not in module.__dict__


def _guarded(module: nn.Module) -> bool:
    return any(getattr(h, "haloshard_gap", False) for h in forward_pre_hooks(module).values())


def _refusing(fqn: str) -> Callable[..., None]:
    """The pre-hook of the module at `fqn`: `MissingEntryError` when its own forward is about
    to meet DTensor's refusal (a DTensor input, a plain parameter or buffer beside it);
    nothing otherwise. Two isinstance checks per tensor argument when nothing is wrong."""

    def refuse(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if "forward" in module.__dict__ or torch.compiler.is_compiling() or not any(
                isinstance(a, DTensor) for a in chain(args, kwargs.values())):
            return  # a style (or the user) replaced its forward; or no DTensor comes in
        plain = _plain_tensors(module)
        # Hooks after this one may convert the input (a torch style's PrepareModuleInput):
        # only the last hook knows what the forward meets.
        last = next(reversed(forward_pre_hooks(module).values())) is refuse
        if plain and last and not implicit_replication():
            met = (f"its input is a sharded DTensor, and torch's own {type(module).__name__}"
                   f" forward would mix it with the plain tensors {plain}, which DTensor "
                   f"refuses ({_REFUSAL!r})")
            raise MissingEntryError(missing_entry(fqn, module, "", met=met))

    refuse.haloshard_gap = True  # type: ignore[attr-defined]
    return refuse


def _plain_tensors(module: nn.Module) -> list[str]:
    """The module's own parameters and buffers DTensor would refuse beside a DTensor: plain
    tensors of more than one element (DTensor replicates a single element)."""
    own = chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
    return [name for name, t in own
            if t is not None and not isinstance(t, DTensor) and t.numel() != 1]
