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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from haloshard._compat import MODULE_CALL_CODE, caller_frame, dtensor_op_dispatcher
from haloshard._errors import HaloError

# DTensor's refusal of a plain tensor (a parameter) beside a DTensor.
MIXED = "got mixed torch.Tensor and DTensor"
_METHOD = "_try_replicate_spec_for_scalar_tensor"


class MissingEntryError(HaloError, RuntimeError):
    """DTensor's mixed-tensor refusal, named by module: a `HaloError` that code catching
    DTensor's own `RuntimeError` still catches."""


def missing_entry(fqn: str, module: nn.Module, raw: str) -> str:
    """The message for DTensor's mixed-tensor error `raw`, raised while `module` ran."""
    name = fqn or "<root>"
    return (f"{name} ({type(module).__name__}) has no plan entry: it ran DTensor's default "
            "dispatch on the sharded input and met a plain tensor (a parameter). Add an entry "
            f"for {name!r} (GroupNormParallel() for a GroupNorm, HaloParallel() for a conv, "
            f"LocalParallel() for a per-slice layer). DTensor said: {raw}")


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
