"""A halo conv on a DTensor input as one autograd node, and its steady state.

A conv with torch's own forward on a `Shard(dim)` DTensor runs its agreed formulation
(`_conv.ConvCall`) inside one autograd Function on the DTensor (`sharded_conv`): the
formulation's own forward and backward between the input's unwrap and the output's rewrap,
with no DTensor autograd node around them. It saves the DTensor in the place of its chunk (the
same storage): every call of the layer saves alike, so a checkpointed forward and its
recomputation match, and a backward that builds a graph (`create_graph=True`)
differentiates through it.

A call whose input signature is new takes the whole path (`HaloForward.sharded`): the input's
site, the window plan, the agreement of every rank (one small gather) and the choice of
formulation. Later calls with that signature reuse the agreement: each rank compares its call
with the agreed one locally, and the halo move carries a status flag, so a mistake on one rank
still raises on every rank. What such a call computes is then fixed: the agreed move, the
conv's arguments and formulation, the output's spec. `Steady` keeps them, from the first call
that reused the agreement, and runs a later call that matches them straight to
`sharded_conv`, without the site, plan and agreement lookups the agreement already settled.
The halo move is the same flagged move, so a peer's mistake raises here as on the whole path.

A call matches when everything the whole path reads for it is what it read then: the
DTensor's mesh, placements, global shape, stride and dtype, its local shape and device, its
`requires_grad` and the grad mode, the module's conv attributes and parameter shapes, and the
layer's agreement still being the one kept (a call with another signature agrees afresh and
replaces it). Anything else takes the whole path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from haloshard import _comm
from haloshard._agree import Agreed, Agreements
from haloshard._choice import grad_asked
from haloshard._compat import DTensorSpec, TensorMeta, dtensor_of, held
from haloshard._conv import ConvCall
from haloshard._redistribute import layout_strides, local_grad, unwrap


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
        return sharded_conv(x, module.weight, module.bias, self.call, self.output_spec)

    def output_spec(self, y: torch.Tensor) -> DTensorSpec:
        # one spec for every output, as torch's own dispatch shares its cached output specs
        return self.out_spec


def steady_of(x: Any, out: Any, module: nn.Module, call: ConvCall, store: Agreements,
              key: Hashable, opening: tuple[Any, ...]) -> Steady | None:
    """The steady state of a call that ran `call` on DTensor `x` and returned `out`, from
    the agreement `store[key]`; None unless the call reused that agreement (its move carries
    status flags: eager, real ranks) with a DTensor in and out."""
    move = call.move
    if not (move is not None and move.route.flagged and type(x) is DTensor
            and type(out) is DTensor and key in store):
        return None
    (local, spec), out_spec = held(x), held(out)[1]
    if type(local) is not torch.Tensor:
        return None
    return Steady(spec.mesh, spec.placements, spec.tensor_meta, local.shape, local.device,
                  (x.requires_grad, torch.is_grad_enabled()), conv_signature(module), call,
                  copy.copy(out_spec), store, key, store[key], move.route.group, opening)


def sharded_conv(x: DTensor, weight: torch.Tensor, bias: torch.Tensor | None, call: ConvCall,
                 output_spec: Callable[[torch.Tensor], DTensorSpec]) -> DTensor:
    """The agreed halo conv `call` (one that moves a halo) on `x`'s local chunk as one
    autograd node (in inference, its steps alone): this rank's output chunk, a DTensor on
    `output_spec(chunk)`."""
    if not grad_asked(x, weight, bias):
        y = call.infer(layout_strides(held(x)[0]), weight, bias)
        return dtensor_of(y, output_spec(y))
    return _ShardedConv.apply(x, weight, bias, call,  # type: ignore[no-any-return]
                              output_spec)


class _ShardedConv(torch.autograd.Function):
    """Forward: a `Shard(dim)` DTensor -> this rank's `Shard(dim)` DTensor of the global
    conv, the agreed formulation run on its local chunk. Backward: the formulation's
    backward on the output gradient's local chunk, the input gradient a DTensor on the
    input's spec. The DTensor is saved in the place of its chunk (see the module
    docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: DTensor, weight: torch.Tensor, bias: torch.Tensor | None,
        call: ConvCall, output_spec: Callable[[torch.Tensor], DTensorSpec],
    ) -> DTensor:
        ctx.set_materialize_grads(False)
        local, ctx.in_spec = held(x)
        local = layout_strides(local)  # as a site's unwrap sees it (channels-last kept)
        ctx.function = call.function
        assert call.move is not None
        y, saved = call.function.run(ctx, local, weight, bias, call.move, call.args)
        ctx.save_for_backward(x, *saved[1:])
        out = output_spec(y)
        ctx.out_placements = out.placements
        return dtensor_of(y, out)

    @staticmethod
    def backward(ctx: Any, grad: DTensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        if grad is None:
            return None, None, None, None, None
        x, *saved = ctx.saved_tensors
        graph = torch.is_grad_enabled()  # create_graph: differentiable in turn
        local, spec = held(grad)
        if spec.placements != ctx.out_placements:
            local = local_grad(grad, spec.mesh, ctx.out_placements)
        elif graph:
            local = grad.to_local()
        g_x, g_w, g_b = ctx.function.grads(ctx, (unwrap(x) if graph else held(x)[0], *saved),
                                           local)
        if g_x is not None:
            spec = ctx.in_spec
            g_x = (DTensor.from_local(g_x, spec.mesh, spec.placements, shape=spec.shape,
                                      stride=spec.stride)
                   if graph else dtensor_of(g_x, spec))
        return g_x, g_w, g_b, None, None
