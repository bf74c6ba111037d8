"""A halo conv layer's steady state: one autograd node per call on a DTensor input.

A call whose input signature is new takes the whole path (`HaloForward.sharded`): the
input's site, the window plan, the agreement of every rank (one small gather) and the choice
of formulation. Later calls with that signature reuse the agreement: each rank compares its
call with the agreed one locally, and the halo move carries a status flag, so a mistake on one
rank still raises on every rank. What such a call computes is then fixed: the agreed move, the
conv's arguments and formulation, the output's spec. `Steady` keeps them, from the first call
that reused the agreement, and runs a later call that matches them as one autograd Function on
the DTensor (`_SteadyConv`: the formulation's own forward and backward between the input's
unwrap and the output's rewrap), without the site, plan and agreement lookups the agreement
already settled and without the two DTensor autograd nodes around the conv. The halo move is
the same flagged move, so a peer's mistake raises here as on the whole path.

A call matches when everything the whole path reads for it is what it read then: the
DTensor's mesh, placements, global shape, stride and dtype, its local shape and device, its
`requires_grad` and the grad mode, the module's conv attributes and parameter shapes, and the
layer's agreement still being the one kept (a call with another signature agrees afresh and
replaces it). Anything else takes the whole path.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from haloshard import _comm
from haloshard._agree import Agreed, Agreements
from haloshard._compat import DTensorSpec, TensorMeta, dtensor_of, held
from haloshard._conv import ConvCall
from haloshard._redistribute import local_grad, unwrap


def conv_signature(module: nn.Module) -> tuple[Any, ...]:
    """What a conv module's forward reads besides its input: its conv attributes and the
    shapes of its weight and bias."""
    bias = module.bias
    return (module.stride, module.padding, module.dilation, module.groups,
            module.padding_mode, module.weight.shape, None if bias is None else bias.shape)


@dataclass(frozen=True, eq=False)
class Steady:
    """What a halo conv layer's steady call computes, and the signature it holds for."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    meta: TensorMeta  # the input's global shape, stride and dtype
    local_shape: torch.Size
    device: torch.device
    grad: tuple[bool, bool]  # the input's requires_grad, the grad mode
    conv: tuple[Any, ...]  # `conv_signature`
    call: ConvCall
    in_spec: DTensorSpec  # the input's (its gradient's)
    out_spec: DTensorSpec
    store: Agreements  # the layer's agreements: `store[key] is agreed` while it holds
    key: Hashable
    agreed: Agreed
    group: _comm.Group
    opening: tuple[Any, ...]  # the site this layer's move opens a forward as (`_comm.opens`)

    def matches(self, x: DTensor, module: nn.Module) -> bool:
        local, spec = held(x)
        return (spec.mesh is self.mesh and spec.tensor_meta == self.meta
                and spec.placements == self.placements and type(local) is torch.Tensor
                and local.shape == self.local_shape and local.device == self.device
                and (x.requires_grad, torch.is_grad_enabled()) == self.grad
                and not torch.compiler.is_compiling()
                and self.store.get(self.key) is self.agreed
                and conv_signature(module) == self.conv)

    def run(self, x: DTensor, module: nn.Module) -> DTensor:
        """This rank's `Shard(dim)` output of `module` on `x` (`matches(x, module)`)."""
        _comm.opens(self.group, self.opening)
        return _SteadyConv.apply(x, module.weight, module.bias, self)  # type: ignore[no-any-return]


def steady_of(x: Any, out: Any, module: nn.Module, call: ConvCall, store: Agreements,
              key: Hashable, opening: tuple[Any, ...]) -> Steady | None:
    """The steady state of a call that ran `call` on DTensor `x` and returned `out`, from
    the agreement `store[key]`; None unless the call reused that agreement (its move carries
    status flags: eager, real ranks) with a DTensor in and out."""
    route = call.move.route
    if not (type(x) is DTensor and type(out) is DTensor and route.flagged and key in store):
        return None
    (local, spec), out_spec = held(x), held(out)[1]
    if type(local) is not torch.Tensor:
        return None
    return Steady(spec.mesh, spec.placements, spec.tensor_meta, local.shape, local.device,
                  (x.requires_grad, torch.is_grad_enabled()), conv_signature(module), call,
                  copy.copy(spec), copy.copy(out_spec), store, key, store[key], route.group,
                  opening)


class _SteadyConv(torch.autograd.Function):
    """Forward: a `Shard(dim)` DTensor -> this rank's `Shard(dim)` DTensor of the global
    conv, the agreed formulation run on its local chunk. Backward: the formulation's
    backward on the output gradient's local chunk, the input gradient a DTensor on the
    input's spec. The DTensor is saved in the place of its chunk (the same storage), so a
    backward that builds a graph (`create_graph=True`) differentiates through it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: DTensor, weight: torch.Tensor, bias: torch.Tensor | None,
        steady: Steady,
    ) -> DTensor:
        ctx.set_materialize_grads(False)
        ctx.steady = steady
        call = steady.call
        y, saved = call.function.run(ctx, held(x)[0], weight, bias, call.move, call.args)
        ctx.save_for_backward(x, *saved[1:])
        # a fresh spec per output, as torch's own wrappers make (specs may be edited)
        return dtensor_of(y, copy.copy(steady.out_spec))

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        if grad is None:
            return None, None, None, None
        steady: Steady = ctx.steady
        x, *saved = ctx.saved_tensors
        graph = torch.is_grad_enabled()  # create_graph: differentiable in turn
        local, spec = held(grad)
        if spec.placements != steady.placements:
            local = local_grad(grad, steady.mesh, steady.placements)
        elif graph:
            local = grad.to_local()
        g_x, g_w, g_b = steady.call.function.grads(
            ctx, (unwrap(x) if graph else held(x)[0], *saved), local)
        if g_x is not None:
            spec = steady.in_spec
            g_x = (DTensor.from_local(g_x, spec.mesh, spec.placements, shape=spec.shape,
                                      stride=spec.stride)
                   if graph else dtensor_of(g_x, copy.copy(spec)))
        return g_x, g_w, g_b, None
