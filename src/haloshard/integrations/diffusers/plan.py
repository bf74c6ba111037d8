"""`plan_for`: the `parallelize_module` plan of a diffusers video VAE (or its encoder or
decoder), built from the family modules' rules; the checks every plan makes.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard import _dtensor_ops
from haloshard._errors import HaloError
from haloshard.integrations.diffusers._base import (
    DIFFUSERS_VERSION,
    PASS_RULE,
    Along,
    Rule,
    family_rules,
    refused_rule,
)
from haloshard.integrations.diffusers.cogvideox import COGVIDEOX_ROWS, COGVIDEOX_RULES
from haloshard.integrations.diffusers.hunyuan import (
    HUNYUAN_NAMES,
    HUNYUAN_ROWS,
    HUNYUAN_RULES,
    HUNYUAN_TIME_ROWS,
)
from haloshard.integrations.diffusers.ltx import LTX_NAMES, LTX_ROWS, LTX_RULES, LTX_TIME_ROWS
from haloshard.integrations.diffusers.mochi import (
    MOCHI_NAMES,
    MOCHI_ROWS,
    MOCHI_RULES,
    MOCHI_TIME_ROWS,
)
from haloshard.integrations.diffusers.wan import WAN_NAMES, WAN_ROWS, WAN_RULES, check_wan_dims

_PLANS: dict[str, dict[str, Rule]] = {
    "AutoencoderKLLTXVideo": LTX_RULES,
    "LTXVideoEncoder3d": LTX_RULES,
    "LTXVideoDecoder3d": LTX_RULES,
    "AutoencoderKLMochi": MOCHI_RULES,
    "MochiEncoder3D": MOCHI_RULES,
    "MochiDecoder3D": MOCHI_RULES,
    "AutoencoderKLCogVideoX": COGVIDEOX_RULES,
    "CogVideoXEncoder3D": COGVIDEOX_RULES,
    "CogVideoXDecoder3D": COGVIDEOX_RULES,
    "AutoencoderKLHunyuanVideo": HUNYUAN_RULES,
    "HunyuanVideoEncoder3D": HUNYUAN_RULES,
    "HunyuanVideoDecoder3D": HUNYUAN_RULES,
    # Wan: planned on H only (`plan_for` refers T to wan_encoder_plan / wan_decoder_plan)
    "AutoencoderKLWan": WAN_RULES,
    "WanEncoder3d": WAN_RULES,
    "WanDecoder3d": WAN_RULES,
}
_ALONG: dict[tuple[int, ...], Along] = {
    (3,): {**family_rules(HUNYUAN_NAMES, HUNYUAN_ROWS), **family_rules(LTX_NAMES, LTX_ROWS),
           **family_rules(MOCHI_NAMES, MOCHI_ROWS),
           **family_rules(("AutoencoderKLCogVideoX", "CogVideoXEncoder3D", "CogVideoXDecoder3D"),
                     COGVIDEOX_ROWS),
           **family_rules(WAN_NAMES, WAN_ROWS)},
    (2, 3): {**family_rules(HUNYUAN_NAMES, HUNYUAN_TIME_ROWS),
             **family_rules(LTX_NAMES, LTX_TIME_ROWS),
             **family_rules(MOCHI_NAMES, MOCHI_TIME_ROWS)},
}


def _check_dims(dims: Any) -> tuple[int, ...]:
    got = tuple(dims) if isinstance(dims, (tuple, list)) else None
    if got not in ((2,), (3,), (2, 3)):
        raise HaloError(f"plan_for takes dims=(2,) (T), (3,) (H) or (2, 3) (T and H on a "
                        f"(t, h) mesh), got dims={dims!r}")
    return got  # type: ignore[return-value]


def _rules_along(name: str, dims: tuple[int, ...]) -> dict[str, Rule]:
    """The rules of `name`'s family for `dims`: the T rules, or those replacing them."""
    rules = _PLANS[name]
    if dims == (2,):
        return rules
    along = _ALONG[dims].get(name, {})
    return {**{cls: rule if rule is PASS_RULE else along.get(cls, refused_rule(cls, dims))
               for cls, rule in rules.items()}, **along}


# The VAE's own switches that change how `encode` / `decode` walk T, and how to turn each off.
_FLAGS = {
    "use_tiling": "disable_tiling(): spatial tiles would each be sharded on their own",
    "use_slicing": "disable_slicing(): batch slices would each be sharded on their own",
    "use_framewise_encoding": "vae.use_framewise_encoding = False: encode() of a clip longer "
                              "than tile_sample_min_num_frames would run overlapping "
                              "temporal tiles blended at their seams, not the sharded clip",
    "use_framewise_decoding": "vae.use_framewise_decoding = False: decode() (and LTX's "
                              "encode()) of a long clip would run overlapping temporal tiles "
                              "blended at their seams, not the sharded clip",
}


def _check_flags(module: nn.Module) -> None:
    for name, off in _FLAGS.items():
        if getattr(module, name, False):
            raise HaloError(f"{type(module).__name__}.{name} is on; turn it off before "
                            f"planning ({off})")


def _refuse_unknown(fqn: str, sub: nn.Module, model: str) -> None:
    own = [n for n, _ in sub.named_parameters(recurse=False)]
    has = f"has parameters {own}" if own else "has no parameters but its own forward"
    raise HaloError(f"{fqn or '<root>'} ({type(sub).__name__}) {has}, and the {model} plan "
                    "does not know its class: a layer that reads across T would run "
                    "DTensor's default dispatch (the whole clip gathered, or an error)")


def _styles(rule: Rule, sub: nn.Module, fqn: str) -> dict[str, ParallelStyle]:
    """The styles a rule gives `sub` (and its children, by relative fqn); its refusal
    names the layer."""
    try:
        style = rule[0](sub)
    except HaloError as e:
        if fqn and str(e).startswith(f"{fqn} "):
            raise
        raise HaloError(f"{fqn or '<root>'} ({type(sub).__name__}): {e}") from None
    if isinstance(style, dict):
        return style
    return {} if style is None else {"": style}


def plan_for(module: nn.Module, *, dims: tuple[int, ...] = (2,)
             ) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of a diffusers video VAE, encoder or decoder.

    Every module is checked by class, with or without parameters: a class the plan knows
    gets its style, runs inside one, or is known to act per frame (containers,
    activations); any other is refused, since its own forward may read across T. The
    VAE's switches that change how `encode` / `decode` walk T (tiling, slicing, framewise
    encoding or decoding: HunyuanVideo's default) must be off. An `.encoder` or `.decoder`
    planned alone is for calling directly: only `plan_for(vae)` sees those switches.

    `dims` picks the sharded dims of `(B, C, T, H, W)`: `(2,)` T (every model but Wan,
    whose T plans are `wan_encoder_plan` / `wan_decoder_plan`); `(3,)` H (HunyuanVideo,
    CogVideoX and Wan 2.1 through their public `encode` / `decode`, whose frame loops and
    caches run unchanged on each rank's rows; Mochi; LTX-Video, whose patches of
    `patch_size` rows must lie whole on a rank: `LTXPatchRowsParallel`), applied on a 1-D
    mesh with the input `Shard(3)`; `(2, 3)` T and H at once (HunyuanVideo, Mochi,
    LTX-Video without timestep conditioning),
    applied on the `t` axis of a `(t, h)` mesh (`parallelize_module(vae, mesh["t"],
    plan)`) with the input `[Shard(2), Shard(3)]`. A layer that cannot be sharded on `dims`
    raises `HaloError` naming it and the dims when the plan is built (on T and H:
    CogVideoX's layers; Wan, whose loops walk T; Wan 2.2's residual blocks on H).

    Args:
        module: `AutoencoderKLHunyuanVideo`, `AutoencoderKLCogVideoX`, `AutoencoderKLMochi`,
            `AutoencoderKLLTXVideo` or `AutoencoderKLWan`, or its `.encoder` / `.decoder`.
        dims: `(2,)`, `(3,)` or `(2, 3)`.

    Returns:
        `{fqn: style}` for every layer that needs one, relative to `module`.

    Raises:
        HaloError: for an unsupported class, a switch that is on (named, with how to turn
            it off), a layer the plan does not know (named by fqn), other `dims`, or a
            layer that cannot be sharded on `dims` (named by fqn).

    Example::
        plan = plan_for(vae.decoder)
        parallelize_module(vae.decoder, mesh, plan)
        vae.decoder(distribute_tensor(z, mesh, [Shard(2)])).shape  # z: (1, 16, 5, 8, 8)
        # torch.Size([1, 3, 17, 64, 64])

        parallelize_module(wan, mesh, plan_for(wan, dims=(3,)))  # Wan 2.1, on H
        wan.decode(distribute_tensor(z, mesh, [Shard(3)])).sample.placements  # (Shard(3),)
    """
    dims = _check_dims(dims)
    rules = _PLANS.get(type(module).__name__)
    check_wan_dims(type(module).__name__, dims)
    if rules is None:
        raise HaloError(f"no haloshard plan for {type(module).__name__}; supported: "
                        f"{sorted(_PLANS)} (diffusers=={DIFFUSERS_VERSION})")
    _check_flags(module)
    rules = _rules_along(type(module).__name__, dims)
    plan: dict[str, ParallelStyle] = {}
    covered: list[str] = []
    for fqn, sub in module.named_modules():
        if any(fqn == c or fqn.startswith(f"{c}.") for c in covered):
            continue
        rule = rules.get(type(sub).__name__)
        if rule is None:
            _refuse_unknown(fqn, sub, type(module).__name__)
            continue
        for name, style in _styles(rule, sub, fqn).items():
            plan[".".join(n for n in (fqn, name) if n)] = style
        if rule[1] is True:
            covered.append(fqn)
        elif rule[1]:  # names of children the style runs itself
            covered.extend(f"{fqn}.{child}" for child in rule[1])
    # The public `encode` chunks its moments (`DiagonalGaussianDistribution`): the backward
    # of that chunk needs haloshard's zero fill of unused view outputs, which a plan that
    # builds no HaloShard (CogVideoX on H) would otherwise run without.
    _dtensor_ops.install()
    return plan
