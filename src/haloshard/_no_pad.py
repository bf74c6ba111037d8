"""A halo module's own padding of the sharded dim, dropped (or refused) while it runs.

With a halo the window already holds what a module pads its input with along the sharded
dim. A module with torch's own forward reads that padding from an attribute, which the halo
style sets to 0; any other module (a causal wrapper that calls `F.pad` or concatenates
repeated frames) pads in code, which `NoPadAlong` sees as a `TorchFunctionMode`, however the
model imported those functions, so the wrapper runs unedited.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from haloshard._errors import HaloError
from haloshard._layout import F_PAD_MODES, HaloShard

_CATS = (torch.cat, torch.concat, torch.concatenate)
# the conv functions a module's forward may call (`NoPadAlong` reads their padding)
CONV_FNS = (F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d)
# `F.pad`'s mode -> the pad mode it applies
_PAD_OF_F_PAD = {f_pad: pad for pad, f_pad in F_PAD_MODES.items()}


class NoPadAlong(TorchFunctionMode):
    """Drops the module's own padding along `dim` inside an explicit-spec module: the halo
    holds it. Two forms are recognised:
    - `F.pad` with widths along `dim`: those widths become 0;
    - `torch.cat` along `dim` of the module's input with `left` slices before it and `right`
      after it (e.g. repeated first frames): the result is the input itself.

    A dropped `F.pad` must be the spec's own (same widths, same mode), or the result would
    differ from the single-device module at the global ends; a `torch.cat` must add exactly
    the spec's widths (its values cannot be checked: they are taken to be `spec.pad`'s).

    With `watch` (a derived halo on a module with a forward of its own) nothing is dropped:
    any padding of `dim` the forward adds beyond its padding attribute (an `F.pad`, a conv
    call's own padding, a `torch.cat` onto its input) would shift the result, so it raises.
    """

    def __init__(self, dim: int, spec: HaloShard | None, window: torch.Tensor, *,
                 watch: bool = False, plain: bool = False) -> None:
        # plain: a conv or pooling with torch's own forward, whose padding attribute the
        # halo already replaced (nothing for the mode to drop)
        if spec is not None and not plain and torch.compiler.is_compiling():
            # dynamo (torch 2.13) does not route F.pad through a mode entered in the graph:
            # the wrapper's own padding would stay, shifting every output
            raise HaloError(f"a module whose own padding of dim {dim} the halo replaces (an "
                            "explicit HaloShard spec, CausalConvParallel) cannot run under "
                            "torch.compile: run that module eager (torch.compiler.disable "
                            "on its forward) or compile the layers around it")
        super().__init__()
        self.dim, self.spec, self.window, self.watch = dim, spec, window, watch

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if self.watch:
            self._refuse_own_padding(func, args, kwargs)
        elif self.spec is not None and func is F.pad:
            args, kwargs = self._strip(list(args), kwargs)
            if not any(args[1]):  # nothing left to pad: F.pad would copy the window
                return args[0]
        elif self.spec is not None and func in _CATS:
            pieces = args[0] if args else kwargs["tensors"]
            along = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
            if self._is_halo_cat(list(pieces), along):
                return self.window
        return func(*args, **kwargs)

    def _refuse_own_padding(self, func: Any, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> None:
        x = args[0] if args else kwargs.get("input", kwargs.get("tensors"))
        if func is F.pad:
            widths = list(args[1] if len(args) > 1 else kwargs["pad"])
            k = 2 * (x.ndim - 1 - self.dim)
            own = tuple(widths[k : k + 2]) if k + 1 < len(widths) else (0, 0)
        elif func in CONV_FNS and x.ndim == self.window.ndim:
            padding = args[4] if len(args) > 4 else kwargs.get("padding", 0)
            along = padding if isinstance(padding, (int, str)) else padding[
                min(self.dim - 2, len(padding) - 1)]
            own = (along, along) if along not in (0, "valid") else (0, 0)
        elif func in _CATS:
            pieces = list(args[0] if args else kwargs["tensors"])
            along = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
            held = any(t is self.window for t in pieces)
            own = (len(pieces) - 1, 0) if held and along % self.window.ndim == self.dim else (
                0, 0)
        else:
            return
        if any(own):
            raise HaloError(
                f"the module has a forward of its own that pads dim {self.dim} itself "
                f"({getattr(func, '__name__', func)} adds {own}), which its padding attribute "
                "does not show, so the derived halo would be wrong; expected an explicit "
                "HaloShard spec (HaloParallel(HaloShard(dim, left, right, pad)))")

    def _is_halo_cat(self, pieces: list[torch.Tensor], along: int) -> bool:
        ids = [i for i, t in enumerate(pieces) if t is self.window]
        if len(ids) != 1 or along % self.window.ndim != self.dim:
            return False
        before = sum(int(t.shape[self.dim]) for t in pieces[: ids[0]])
        after = sum(int(t.shape[self.dim]) for t in pieces[ids[0] + 1 :])
        assert self.spec is not None
        if (before, after) != (self.spec.left, self.spec.right):
            raise HaloError(f"the module concatenates {before} slices before and {after} after "
                            f"its input along dim {self.dim} but is annotated with "
                            f"{self.spec!r}; expected the spec's widths")
        return True

    def _strip(self, args: list[Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...],
                                                                        dict[str, Any]]:
        x, widths = args[0], list(args[1] if len(args) > 1 else kwargs.pop("pad"))
        mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
        value = args[3] if len(args) > 3 else kwargs.get("value")
        k = 2 * (x.ndim - 1 - self.dim)
        if k + 1 < len(widths) and (widths[k] or widths[k + 1]):
            assert self.spec is not None
            own = (widths[k], widths[k + 1]), _PAD_OF_F_PAD.get(mode), value or 0
            if own != ((self.spec.left, self.spec.right), self.spec.pad, 0):
                raise HaloError(
                    f"the module pads dim {self.dim} by {tuple(own[0])} with mode={mode!r} "
                    f"(value={value}) but is annotated with {self.spec!r}; expected the "
                    "spec to match its own padding")
            widths[k] = widths[k + 1] = 0
        return (x, widths, *args[2:]), kwargs
