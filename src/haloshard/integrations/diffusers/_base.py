"""What the diffusers plans share: class and dim checks, the plan rules' form (`Rule`),
and the rules every family uses (causal convs, pointwise layers, timestep conditioning).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard._errors import HaloError
from haloshard._layer_styles import (
    CausalConvParallel,
    LocalParallel,
    ReplicatedArgsParallel,
)
from haloshard._layout import HaloShard
from haloshard._site import Site
from haloshard._styles import HaloParallel

DIFFUSERS_VERSION = "0.42.1"
_PAD = {"replicate": "replicate", "constant": "zeros", "zeros": "zeros"}


class DimStyle(ParallelStyle):
    """The form of the family modules' styles: `Style(dim=2)` shards the module along `dim`
    (2: T, 3: H); `_apply` checks the class and the dim it implements."""

    def __init__(self, *, dim: int = 2) -> None:
        super().__init__()
        self.dim = dim

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"


def check_class(module: nn.Module, name: str, style: str) -> None:
    if type(module).__name__ != name:
        raise HaloError(f"{style} applies to diffusers' {name}, got {type(module).__name__}")


def check_time_dim(dim: int, style: str) -> None:
    """The styles here implement their module's rule along T (dim 2 of `(B, C, T, H, W)`:
    first frames, causal masks, depth-to-space along T) and along H (dim 3, each its own
    way); along W that rule would be applied to the wrong axis (wrong numbers, no error),
    so another dim is refused."""
    if dim not in (2, 3):
        raise HaloError(f"{style} implements its module's rule along T (dim 2 of (B, C, T, "
                        f"H, W)) and H (dim 3) only, got dim={dim}; expected dim=2 or 3 "
                        "(shard W with the generic styles, e.g. HaloParallel for a conv)")


def also_rows(module: nn.Module, rows: Callable[[nn.Module], Any]) -> None:
    """With H sharded too (T and H on a `(t, h)` mesh), the module runs on a window of
    rows as well (`rows(module)`'s stencil); a module whose rows have no stencil here
    raises `HaloError` when its input is sharded on H too."""
    with contextlib.suppress(HaloError):
        module.forward.stencils = {3: rows(module)}


# Gathers (K/V, CogVideoX's latent) agreed per module and global signature: a later forward
# issues no metadata collective (see `gather_many`).
_AGREED: weakref.WeakKeyDictionary[nn.Module, dict[Any, Any]] = weakref.WeakKeyDictionary()


def agreements_of(module: nn.Module, site: Site) -> tuple[dict[Any, Any], Any]:
    """`module`'s agreements and the global signature of a gather of `site`'s chunk."""
    x = site.local
    return _AGREED.setdefault(module, {}), (site.shape, site.placements, id(site.mesh),
                                            site.axis, x.dtype, x.requires_grad,
                                            torch.is_grad_enabled())


# ---------------------------------------------------------------- plans
# class name -> (style for it, whether the style covers the module's children too: all of
# them, or the named ones)
# (or `{relative fqn: style}` for the module and its children)
Rule = tuple[Callable[[nn.Module], ParallelStyle | dict[str, ParallelStyle] | None],
              bool | tuple[str, ...]]


def causal_conv(module: nn.Module) -> ParallelStyle:
    mode = module.pad_mode
    if mode not in _PAD:
        raise HaloError(f"a causal conv with pad_mode {mode!r} is not supported; expected "
                        f"one of {sorted(_PAD)}")
    return CausalConvParallel(pad=_PAD[mode], pads=_own_hw(module))  # type: ignore[arg-type]


def _own_hw(module: nn.Module) -> dict[int, tuple[int, int]]:
    """The H and W widths of the wrapper's own `F.pad` (`time_causal_padding`, W first:
    HunyuanVideo's and CogVideoX's replicate causal conv): named, so that the chunk is
    padded before the T exchange and the wrapper's `F.pad` copies nothing."""
    w_left, w_right, h_left, h_right = module.time_causal_padding[:4]
    pads = {3: (h_left, h_right), 4: (w_left, w_right)}
    return {d: lr for d, lr in pads.items() if any(lr)}  # a 1-wide kernel pads nothing


def _runs_children(module: nn.Module) -> None:
    """A module whose own forward reads no frame but its own: a block that calls its
    children, adds residuals and applies activations; an elementwise activation; a VAE,
    whose encode/decode switches `_check_flags` checks (diffusers 0.42.1, class by class)."""
    return None


# containers and per-element layers every family uses
PASS_RULE: Rule = (_runs_children, False)
_GENERIC: dict[str, Rule] = {name: PASS_RULE for name in (
    "ModuleList", "Sequential", "Identity", "Dropout", "SiLU", "GELU", "ReLU", "Mish", "Tanh",
    "LeakyReLU")}


def passing(*names: str) -> dict[str, Rule]:
    return {**_GENERIC, **{name: PASS_RULE for name in names}}

def cog_causal_conv(module: nn.Module) -> ParallelStyle:
    """CogVideoX's causal conv: `F.pad` (replicate) or a `torch.cat` of the first frame
    (`k - 1` times, i.e. replicate padding) before a conv of stride 1 along T; it returns
    `(output, conv_cache)`, whose cache comes back as None under a halo."""
    k, stride = module.time_kernel_size, module.conv.stride[0]
    if module.pad_mode == "replicate":  # F.pad then the conv: any stride (Mochi's down)
        return CausalConvParallel(pad="replicate", pads=_own_hw(module))
    if stride != 1 or module.conv.dilation[0] != 1:
        raise HaloError(f"a CogVideoXCausalConv3d with stride {stride} and dilation "
                        f"{module.conv.dilation[0]} along T is not planned; expected 1 and 1")
    return HaloParallel(HaloShard(2, left=k - 1, pad="replicate"))

def timestep_conditioned(module: nn.Module, name: str) -> ParallelStyle | None:
    if getattr(module, "per_channel_scale1", None) is not None:
        raise HaloError(f"{type(module).__name__} injects noise drawn per call (its own "
                        "generator): no sharded run reproduces one device's draw")
    return ReplicatedArgsParallel() if getattr(module, name, None) is not None else None


def pointwise(module: nn.Module) -> ParallelStyle:
    if any(k != 1 for k in module.kernel_size) or any(s != 1 for s in module.stride):
        raise HaloError(f"a bare Conv3d outside a causal wrapper is planned only with kernel "
                        f"and stride 1, got kernel {module.kernel_size}, stride "
                        f"{module.stride}")
    return LocalParallel()


# ---------------------------------------------------------------- H, and T and H at once
# Per dims setting, the rules that replace a family's T rules (keyed by the classes
# `_PLANS` knows). A class with a T rule of its own and none here is refused when the plan
# is built (`refused_rule`); containers, activations and blocks that only call their children
# (`PASS_RULE`) read no row but their own and keep their rule.
Along = dict[str, dict[str, Rule]]


def refused_rule(cls: str, dims: tuple[int, ...]) -> Rule:
    def refuse(module: nn.Module) -> None:
        raise HaloError(f"{cls} cannot be sharded on dims {dims} by this plan: its rule "
                        "is planned along T only (dims=(2,)); expected dims=(2,), or a plan "
                        "entry of your own for it")
    return refuse, True


def rows_causal_conv(module: nn.Module) -> ParallelStyle:
    """HunyuanVideo's (and Mochi's replicate) causal conv with H sharded: its `F.pad` of
    H is centred, so `CausalConvParallel(dim=3)` with those widths (any stride). Its causal
    `F.pad` of T and its `F.pad` of W are named too, so that the rows are padded along
    them before the H exchange and the wrapper's `F.pad` copies nothing (one window per
    rank, not the window and its padded copy)."""
    if module.pad_mode not in _PAD:
        raise HaloError(f"a causal conv with pad_mode {module.pad_mode!r} is not supported; "
                        f"expected one of {sorted(_PAD)}")
    w_left, w_right, left, right, t_left, t_right = module.time_causal_padding
    pads = {2: (t_left, t_right), 3: (left, right), 4: (w_left, w_right)}
    return CausalConvParallel(pad=_PAD[module.pad_mode], dim=3,  # type: ignore[arg-type]
                              pads={d: lr for d, lr in pads.items() if d == 3 or any(lr)})


def time_rows_causal_conv(module: nn.Module) -> ParallelStyle:
    """The same with T and H sharded: the T halo causal, the H halo holds its `F.pad`. Its
    `F.pad` of W is named too, so that the chunk is padded along W before the exchanges
    and the wrapper's `F.pad` copies nothing (one window per rank)."""
    if module.pad_mode != "replicate":
        raise HaloError(f"a causal conv with pad_mode {module.pad_mode!r} is planned on T "
                        "and H with pad_mode 'replicate' only (F.pad of T and H)")
    w_left, w_right, left, right = module.time_causal_padding[:4]
    pads = {3: (left, right), 4: (w_left, w_right)}
    return CausalConvParallel(pad="replicate",
                              pads={d: lr for d, lr in pads.items() if d == 3 or any(lr)})


def rows_pointwise(module: nn.Module) -> ParallelStyle:
    pointwise(module)  # refuses a conv that is not 1x1x1
    return LocalParallel(dim=3)


def timestep_rows(module: nn.Module, name: str) -> ParallelStyle | None:
    timestep_conditioned(module, name)  # refuses noise injection
    return ReplicatedArgsParallel(dim=3) if getattr(module, name, None) is not None else None


def no_timestep(module: nn.Module) -> None:
    if getattr(module, "scale_shift_table", None) is not None:
        raise HaloError(f"{type(module).__name__} with timestep conditioning is planned on "
                        "T or on H, not on both at once")


def family_rules(names: tuple[str, ...], rules: dict[str, Rule]) -> Along:
    return dict.fromkeys(names, rules)
