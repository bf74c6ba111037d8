"""Name the module where DTensor's default dispatch met a plain tensor in a planned model.

A module that no plan entry covers runs its own forward on the DTensor a styled module
returned; its plain parameters then make DTensor raise "got mixed torch.Tensor and DTensor"
from deep inside torch, naming an aten op but no module. A global forward hook with
`always_call=True` sees that error leave every module on its way out, innermost first: it
remembers the innermost module and, at each enclosing module that holds a haloshard style,
rewrites the error's message to name that module by its fqn and the missing plan entry (the
outermost such module gives the longest fqn). The error keeps its type: a hook cannot
replace the exception in flight. `missing_entry` says the same for `verify_plan`.

The hook is registered when the first haloshard style is applied, never at import: code that
never uses haloshard runs torch unchanged. It costs one Python call per module call, returns
at once unless such an error is in flight, and does nothing under `torch.compile`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

MIXED = "got mixed torch.Tensor and DTensor"
_registered = False


def is_mixed(error: BaseException | None) -> bool:
    """Whether `error` is DTensor's refusal of a plain tensor next to a DTensor."""
    return isinstance(error, RuntimeError) and MIXED in str(error)


def missing_entry(fqn: str, module: nn.Module, raw: str) -> str:
    """The message for DTensor's mixed-tensor error `raw` raised while `module` ran.

    Example::
        >>> missing_entry("norm", nn.GroupNorm(2, 4), "aten.native_group_norm.default got ...")
        "norm (GroupNorm) has no plan entry: it ran DTensor's default dispatch on ..."
    """
    name = fqn or "<root>"
    return (f"{name} ({type(module).__name__}) has no plan entry: it ran DTensor's default "
            "dispatch on the sharded input and met a plain tensor (a parameter). Add an entry "
            f"for {name!r} (GroupNormParallel() for a GroupNorm, HaloParallel() for a conv, "
            f"LocalParallel() for a per-slice layer). DTensor said: {raw}")


def register() -> None:
    """Install the naming hook, once per process."""
    global _registered
    if not _registered:
        register_module_forward_hook(_name_mixed, always_call=True)
        _registered = True


def _styled(module: nn.Module) -> bool:
    from haloshard._forward import handle_of  # _forward registers this hook

    return any(handle_of(m) is not None for m in module.modules())


def _fqn_in(root: nn.Module, inner: nn.Module) -> str | None:
    return next((fqn for fqn, m in root.named_modules() if m is inner), None)


def _name_mixed(module: nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling() or output is not None:
        return
    error = sys.exc_info()[1]
    if not is_mixed(error):
        return
    assert error is not None
    state = error.__dict__.setdefault("_haloshard", {"inner": module, "raw": str(error)})
    fqn = _fqn_in(module, state["inner"])
    if fqn is None or not _styled(module):
        return
    error.args = (missing_entry(fqn, state["inner"], state["raw"]),)
    error.haloshard_fqn = fqn  # type: ignore[attr-defined]
