"""Halo layers under `haloshard.packed`: one conv per document, no halo across a boundary.

Packed sequences (several documents concatenated along the sharded dim, their boundaries
given by `haloshard.packed(cu_seqlens)`) must not mix: a plain conv runs as `varlen_conv`,
and a causal wrapper's one conv is replaced by it; any other halo layer raises.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from haloshard import _comm
from haloshard._errors import HaloError
from haloshard._exchange import leave_agreement
from haloshard._forward import INSIDE
from haloshard._layout import HaloShard
from haloshard._no_pad import CONV_FNS, NoPadAlong
from haloshard._site import Site, rewrap
from haloshard._specs import CONVS, DERIVABLE, torch_forward
from haloshard._varlen import active_boundaries, varlen_conv

# `forward` below is a `_halo_forward.HaloForward` (typed Any: that module imports this one)


def packed_conv(forward: Any, site: Site) -> Any:
    """Under `haloshard.packed`: a plain conv runs `varlen_conv` on its input chunk, with
    the module's own (saved) padding, so no halo crosses a document boundary. Any other
    halo layer would mix documents: it raises."""
    module, dim = forward.module, forward.annotation.dim
    spec = forward.annotation.spec
    # peers outside `packed` would run the halo move agreed before: join it
    leave_agreement(forward.agreed, _comm.resolve_group((site.mesh, site.axis)),
                    "per document (haloshard.packed)")
    if spec is not None and not isinstance(module, DERIVABLE):
        return rewrap(_packed_wrapper(forward, site, spec), site, dim, site.length)
    # the halo forward is attached to the instance: ask about the rest
    own = forward.previous is None and any(
        torch_forward(module, conv, attached=True) for conv in CONVS)
    if not (forward.annotation.spec is None and isinstance(module, CONVS) and own):
        raise HaloError(
            f"under haloshard.packed only plain nn.Conv1d/2d/3d halo layers (torch's own "
            f"forward, no explicit spec) run per document; {type(module).__name__} would "
            "mix documents across their boundaries: expected it outside the packed context")
    y = varlen_conv(site.local, module.weight, module.bias, dim=dim,
                    cu_seqlens=active_boundaries(), group=(site.mesh, site.axis),
                    padding=forward.saved["padding"], pad=module.padding_mode,
                    stride=module.stride, dilation=module.dilation, groups=module.groups,
                    global_length=site.length)
    return rewrap(y, site, dim, site.length)


def _packed_wrapper(forward: Any, site: Site, spec: HaloShard) -> torch.Tensor:
    """A causal wrapper (explicit spec: `F.pad` of dim by the spec, then one conv with no
    padding along dim) run on the chunk: its `F.pad` is dropped and its conv replaced by
    `varlen_conv` with the spec's padding, per document."""
    convs = _PackedConvs(spec, active_boundaries(), site)
    token = INSIDE.set(True)
    try:
        with NoPadAlong(spec.dim, spec, site.local), convs:
            y = forward.original(site.local)
    finally:
        INSIDE.reset(token)
    if convs.count != 1:
        raise HaloError(f"under haloshard.packed a module with an explicit spec must call "
                        f"exactly one conv along dim {spec.dim} (a causal wrapper), "
                        f"{type(forward.module).__name__} called {convs.count}")
    return y


class _PackedConvs(TorchFunctionMode):
    """Replaces a wrapper's conv call by `varlen_conv` with the spec's padding along dim;
    the conv's own padding of the other dims (zeros) is applied first."""

    def __init__(self, spec: HaloShard, cu: Any, site: Site) -> None:
        super().__init__()
        self.spec, self.cu, self.site, self.count = spec, cu, site, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func not in CONV_FNS:
            return func(*args, **kwargs)
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        call = {**dict(zip(names, args, strict=False)), **kwargs}
        x, weight, dim = call["input"], call["weight"], self.spec.dim
        n = weight.ndim - 2
        padding = call.get("padding", 0)
        pairs = [padding] * n if isinstance(padding, int) else list(padding)
        if isinstance(padding, str) or len(pairs) != n or pairs[dim - 2]:
            raise HaloError(f"under haloshard.packed the wrapped conv must have no padding "
                            f"along dim {dim} (the spec pads it), got padding={padding!r}")
        if any(pairs):
            x = F.pad(x, [w for p in reversed(pairs) for w in (p, p)])
        self.count += 1
        return varlen_conv(x, weight, call.get("bias"), dim=dim, cu_seqlens=self.cu,
                           group=(self.site.mesh, self.site.axis), left=self.spec.left,
                           right=self.spec.right, pad=self.spec.pad,
                           stride=call.get("stride", 1), dilation=call.get("dilation", 1),
                           groups=call.get("groups", 1), global_length=self.site.length)
