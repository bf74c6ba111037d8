"""DTensor operators on `HaloShard` DTensors: right, or a `HaloError`, never silently wrong.

torch 2.13 knows nothing of custom placements. Left alone it relabels without moving data
(`DTensor.redistribute(mesh, [HaloShard(..)])`), returns local data labelled `Replicate`
(convolution), and keeps the `HaloShard` label on results it no longer describes (slicing,
`transpose`, `view`). `install()` closes every path:

- `DTensor.redistribute` with a `HaloShard` source or target runs `haloshard.redistribute`
  (so `full_tensor()` works too);
- `aten.convolution` / `aten.convolution_backward` get handlers that run the halo conv on
  the local tensors (other inputs go to torch's handlers, chained); torch's other custom
  handlers (argmax, as_strided, ...) raise `HaloError` for `HaloShard` inputs;
- every other op whose inputs carry a `HaloShard` goes through a guard in DTensor's sharding
  propagation: the ops listed below keep the layout, anything else raises `HaloError` naming
  the op and the placement. torch caches propagation results, so an op is judged once per
  input layout, and `install()` clears the caches a `HaloShard` may already have entered.

Supported on a `HaloShard` DTensor:

- convolution (`F.conv1d/2d/3d`, `nn.Conv1d/2d/3d`), forward and backward, when the halo
  supplies the padding along its dim: padding 0 and stride 1 there, `left + right ==
  dilation * (kernel - 1)`; weight and bias are DTensors replicated on the mesh. The result
  is the `Shard(dim)` DTensor of the convolution of the global tensor padded by the halo's
  pad mode. Weight and bias gradients are `Partial()` on the mesh axes that split the input.
- pointwise ops whose inputs share one layout, with Python scalars beside them: relu,
  leaky_relu, gelu, silu, tanh, sigmoid, neg, abs, exp, add, sub, mul, div, clone,
  zeros_like, dtype casts (`_to_copy`), in-place relu_/add_/mul_, and their backward ops.
  With `pad='zeros'` the edge halos must stay zero: ops that move zero (`sigmoid`, `exp`,
  `x * inf`) raise, and so does adding or subtracting a scalar (even 0). torch caches
  propagation by argument types, not scalar values, so ops whose effect on zero depends on a
  scalar (`x * c`, `x / c`, `add(alpha=)`) are also judged on every call by a handler.
- `to_local()`, differentiably (torch's own backward cannot rebuild a custom placement).
- detach and alias.

A gap torch leaves in DTensor's backward (the guard is installed, so the program uses
haloshard): the backward of a multi-output view (`torch.chunk`, `split`, `unbind`) fills the
gradient of an output nothing used with plain zeros (built from `TensorOptions`, which carry
no DTensor) and cats or stacks them with the DTensor gradients, which DTensor refuses ("got
mixed torch.Tensor and DTensor"). Inside exactly those backward nodes, plain tensors that
are zero (a tensor hook's own cat runs there too) become zero DTensors placed like the
gradients beside them: the same values, no communication, decided by the graph (the same
on every rank).
diffusers' `DiagonalGaussianDistribution` chunks the moments, so training through
`vae.encode(x).latent_dist.mode()` needs this.

Wherever a `HaloShard` DTensor enters (redistribute, `to_local`, convolution, scalar ops) its
local length is checked against the placement: `DTensor.from_local` checks nothing.

Gradients of a `HaloShard` DTensor carry the same placement and hold d(loss)/d(local
tensor), halos included; see `haloshard._redistribute`.

Installing only adds dict entries and wraps two Python attributes of torch's DTensor
dispatcher: no process group, no device. It runs when the first `HaloShard` placement is
built (a `HaloShard` DTensor needs one), so a program that never builds one runs torch
unchanged after `import haloshard`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor import zeros as dtensor_zeros

from haloshard._compat import (
    DTensorSpec,
    Handler,
    OpOverload,
    OpSchema,
    OutputSharding,
    TensorMeta,
    clear_sharding_cache,
    current_autograd_node,
    custom_op_handlers,
    maybe_disable_local_tensor_mode,
    maybe_run_for_local_tensor,
    set_sharding_slow_path,
    sharding_slow_path,
)
from haloshard._errors import HaloError
from haloshard._layout import HaloShard
from haloshard._redistribute import (
    check_local,
    contiguous_stride,
    halo_axes,
    halo_axis,
    redistribute,
    torch_redistribute,
    unwrap,
)
from haloshard._specs import halo_supplies_padding

aten = torch.ops.aten

# Layout-keeping ops (see the module docstring); the zero-pad rule is checked per call.
POINTWISE: frozenset[OpOverload] = frozenset({
    aten.relu.default, aten.relu_.default, aten.leaky_relu.default, aten.gelu.default,
    aten.silu.default, aten.tanh.default, aten.sigmoid.default, aten.neg.default,
    aten.abs.default, aten.exp.default, aten.add.Tensor, aten.add.Scalar, aten.add_.Tensor,
    aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor,
    aten.div.Tensor, aten.div.Scalar, aten.clone.default, aten.zeros_like.default,
    aten._to_copy.default,
    aten.threshold_backward.default, aten.leaky_relu_backward.default,
    aten.gelu_backward.default, aten.silu_backward.default, aten.tanh_backward.default,
    aten.sigmoid_backward.default,
})
# x + c keeps a zero halo only for c == 0, but torch's propagation cache may not tell one
# scalar from another: with pad='zeros' these are refused whatever the scalar.
SHIFTS: frozenset[OpOverload] = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.add_.Tensor, aten.sub.Tensor, aten.sub.Scalar,
})
# Layout-keeping ops whose value at a zero halo depends on a scalar argument (x * inf,
# x / 0, add(alpha=inf)). torch's propagation cache keys on the arguments' types, not on
# scalar values, so these are judged on every call, by a handler, with the actual scalars.
SCALAR_DEPENDENT: frozenset[OpOverload] = frozenset({
    aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.div.Tensor, aten.div.Scalar,
    aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.leaky_relu.default,
})
# Ops that change no element, shape, stride or dtype: the output has the input's spec. The
# guard answers for them itself: torch's own rule kept a HaloShard through 2.13, but 2.14's
# asks to redistribute an unknown placement to Replicate (which then raises).
KEEP: frozenset[OpOverload] = frozenset({aten.detach.default, aten.alias.default})
# torch's backward nodes of multi-output views that fill an unused output's gradient with
# plain zeros before a cat (split) or stack (unbind).
ZERO_FILLING: frozenset[str] = frozenset({
    "SplitBackward0", "SplitWithSizesBackward0", "UnsafeSplitBackward0",
    "UnsafeSplitWithSizesBackward0", "UnbindBackward0",
})
ZERO_FILLED: frozenset[OpOverload] = frozenset({aten.cat.default, aten.stack.default})
_installed: dict[str, Any] = {}


def _specs(tree: object) -> Iterator[DTensorSpec]:
    if isinstance(tree, DTensorSpec):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _specs(item)


def _halo_spec(schema: OpSchema) -> DTensorSpec | None:
    """The first input spec carrying a `HaloShard`, or None."""
    for spec in _specs([*schema.args_schema, *schema.kwargs_schema.values()]):
        if halo_axis(spec.placements) is not None:
            return spec
    return None


def unsupported(op: object, placements: Sequence[Placement], why: str = "") -> HaloError:
    """The error for an op that cannot run on a HaloShard DTensor."""
    axis = halo_axis(placements)
    dim = placements[axis].dim if axis is not None else "d"  # type: ignore[attr-defined]
    return HaloError(
        f"{op} is not supported on a DTensor placed {tuple(placements)}{why}: its local "
        f"tensors hold halo copies, so DTensor would return wrong data. Drop the halos first "
        f"(haloshard.redistribute(x, [... Shard({dim}) ...])); supported ops are listed in "
        "haloshard._dtensor_ops"
    )


def _probe(op: OpOverload, schema: OpSchema) -> torch.Tensor:
    """The op on zero scalars in place of the DTensor inputs: its value at a zero halo."""
    return _probe_args(op, schema.args_schema, schema.kwargs_schema)


def _probe_args(op: OpOverload, args: Sequence[object],
                kwargs: dict[str, object]) -> torch.Tensor:
    def zero(arg: object) -> object:
        if isinstance(arg, DTensorSpec):
            assert arg.tensor_meta is not None
            return torch.zeros((), dtype=arg.tensor_meta.dtype)
        if isinstance(arg, DTensor):
            return torch.zeros((), dtype=arg.dtype)
        return arg

    with maybe_disable_local_tensor_mode():
        return op(*[zero(a) for a in args], **{k: zero(v) for k, v in kwargs.items()})


def _without_handler(op_call: OpOverload, args: tuple[object, ...],
                     kwargs: dict[str, object]) -> object:
    """DTensor's default dispatch of `op_call` (the handler stood in its way)."""
    handlers = custom_op_handlers()
    handler = handlers.pop(op_call)
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = handler


def scalar_handler(previous: Handler | None) -> Handler:
    """A scalar-dependent op (`SCALAR_DEPENDENT`): with a `pad='zeros'` HaloShard input, the
    actual scalars must keep the zero halo zero; then DTensor's dispatch (and the guard)."""

    def handler(op_call: OpOverload, args: tuple[object, ...],
                kwargs: dict[str, object]) -> object:
        for arg in (*args, *kwargs.values()):
            if _is_halo(arg):
                assert isinstance(arg, DTensor)
                check_local(arg)
                axis = halo_axis(arg.placements)
                zeros = arg.placements[axis].pad == "zeros"  # type: ignore[index,attr-defined]
                # A plain tensor argument is refused by the guard; nothing to probe here.
                plain = any(isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                            for a in (*args, *kwargs.values()))
                if zeros and not plain and bool(_probe_args(op_call, args, kwargs) != 0):
                    out = _probe_args(op_call, args, kwargs).item()
                    raise unsupported(op_call, arg.placements, f" (with these arguments it "
                                      f"maps the zero halo to {out}, so pad='zeros' would no "
                                      "longer hold)")
                break
        if previous is not None:
            return previous(op_call, args, kwargs)
        return _without_handler(op_call, args, kwargs)

    handler.haloshard_previous = previous  # type: ignore[attr-defined]
    return handler


def _zero_fills(tensors: object) -> DTensor | None:
    """The DTensor gradient beside plain zero fills in a `ZERO_FILLING` node's cat or
    stack (None anywhere else: torch's own error stands)."""
    if not isinstance(tensors, (list, tuple)):
        return None
    dtensors = [t for t in tensors if isinstance(t, DTensor)]
    if not dtensors or len(dtensors) == len(tensors):
        return None
    node = current_autograd_node()
    if node is None or type(node).__name__ not in ZERO_FILLING:
        return None
    ref = dtensors[0]
    if halo_axes(ref.placements) or any(t.device_mesh != ref.device_mesh for t in dtensors):
        return None
    # A tensor hook on a view's output runs inside the same node: a cat there is the
    # user's, so a plain tensor counts as a fill only if it is zero (one pass over it).
    if any(bool(t.any()) for t in tensors if not isinstance(t, DTensor)):
        return None
    return ref


def zero_fill_handler(previous: Handler | None) -> Handler:
    """`aten.cat` / `aten.stack` in the backward of a multi-output view: the plain zeros
    torch fills in for unused outputs become zero DTensors placed like the used ones'
    gradients (see the module docstring); everything else goes on unchanged."""

    def handler(op_call: OpOverload, args: tuple[object, ...],
                kwargs: dict[str, object]) -> object:
        ref = _zero_fills(args[0])
        if ref is not None:
            filled = [t if isinstance(t, DTensor) else dtensor_zeros(
                t.shape, dtype=t.dtype, device_mesh=ref.device_mesh,  # type: ignore[union-attr]
                placements=ref.placements) for t in args[0]]  # type: ignore[union-attr]
            args = (filled, *args[1:])
        if previous is not None:
            return previous(op_call, args, kwargs)
        return _without_handler(op_call, args, kwargs)

    handler.haloshard_previous = previous  # type: ignore[attr-defined]
    return handler


def _to_local_method(self: DTensor, *, grad_placements: Sequence[Placement] | None = None
                     ) -> torch.Tensor:
    """`DTensor.to_local`; for a `HaloShard` DTensor, differentiable (torch's backward
    cannot rebuild a custom placement) and checked against its placement."""
    if not halo_axes(self.placements):
        return _installed["to_local"](self, grad_placements=grad_placements)
    check_local(self)
    if not torch.is_grad_enabled():
        return _installed["to_local"](self, grad_placements=grad_placements)
    return unwrap(self, grad_placements)


def _pointwise(op: OpOverload, schema: OpSchema, spec: DTensorSpec) -> OutputSharding:
    """Sharding for a layout-keeping op: every input shares `spec`'s layout, output too."""
    for other in _specs([*schema.args_schema, *schema.kwargs_schema.values()]):
        if other.placements != spec.placements or other.shape != spec.shape:
            raise unsupported(op, spec.placements, f" together with one placed "
                              f"{tuple(other.placements)} of shape {tuple(other.shape)}")
    if any(isinstance(a, torch.Tensor) for a in schema.args_schema):
        raise unsupported(op, spec.placements, " with a plain tensor argument")
    out = _probe(op, schema)
    axis = halo_axis(spec.placements)
    assert axis is not None and spec.tensor_meta is not None
    if spec.placements[axis].pad == "zeros":  # type: ignore[attr-defined]
        if op in SHIFTS and not all(isinstance(a, DTensorSpec) for a in schema.args_schema[:2]):
            raise unsupported(op, spec.placements, " with a scalar (with pad='zeros' the "
                              "zero halo must stay zero)")
        if bool(out != 0):
            raise unsupported(op, spec.placements, f" (it maps the zero halo to {out.item()}, "
                              "so pad='zeros' would no longer hold)")
    meta = TensorMeta(spec.shape, spec.tensor_meta.stride, out.dtype)
    return OutputSharding(DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta))


def _guard(previous: Callable[..., object]) -> Callable[..., object]:
    """Wrap DTensor's sharding propagation: HaloShard inputs are judged here, not by torch."""

    def propagate(op_call: OpOverload, args: tuple[object, ...],
                  kwargs: dict[str, object], op_info: Any, try_cache: bool) -> object:
        spec = _halo_spec(op_info.schema) if op_info.schema is not None else None
        if spec is None:
            return previous(op_call, args, kwargs, op_info, try_cache)
        if op_call in KEEP:
            return OutputSharding(DTensorSpec(spec.mesh, spec.placements,
                                              tensor_meta=spec.tensor_meta))
        if op_call in POINTWISE:
            return _pointwise(op_call, op_info.schema, spec)
        raise unsupported(op_call, spec.placements)

    propagate.haloshard_previous = previous  # type: ignore[attr-defined]
    return propagate


def _is_halo(arg: object) -> bool:
    return isinstance(arg, DTensor) and halo_axis(arg.placements) is not None


def _check_conv(x: DTensor, weight: object, bias: object, conv: tuple[Any, ...]) -> HaloShard:
    """Raise unless the halo supplies exactly the conv's padding along its dim."""
    stride, padding, dilation, transposed = conv[:4]
    axis = halo_axis(x.placements)
    assert axis is not None
    p = x.placements[axis]
    assert isinstance(p, HaloShard)
    op = "aten.convolution"
    for i, q in enumerate(x.placements):
        if i != axis and not (isinstance(q, Replicate) or q == Shard(0)):
            raise unsupported(op, x.placements, f": mesh axis {i} must be Replicate or Shard(0)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, DTensor) or t.device_mesh != x.device_mesh
                              or not all(isinstance(q, Replicate) for q in t.placements)):
            got = tuple(t.placements) if isinstance(t, DTensor) else type(t).__name__
            raise HaloError(f"{op} on a HaloShard input needs a {name} replicated on the same "
                            f"mesh (e.g. distribute_module(conv, mesh)), got {got}")
    s = p.dim - 2
    assert isinstance(weight, DTensor)
    span = dilation[s] * (weight.shape[p.dim] - 1)
    if transposed or p.dim < 2 or not halo_supplies_padding(
            stride[s], padding[s], dilation[s], weight.shape[p.dim], p.left, p.right):
        raise unsupported(op, x.placements, (
            f" with stride {list(stride)}, padding {list(padding)}, dilation {list(dilation)}, "
            f"transposed={transposed}: along dim {p.dim} the halo must supply the padding "
            f"(stride 1, padding 0, left + right = dilation * (kernel - 1) = {span})"))
    return p


def _conv_out(x: DTensor, weight: DTensor, conv: tuple[Any, ...],
              p: HaloShard) -> tuple[list[Placement], tuple[int, ...]]:
    """Output placements (halo axis -> Shard(dim)) and the global output shape."""
    stride, padding, dilation = conv[:3]
    shape = [x.shape[0], weight.shape[0]]
    for s in range(x.ndim - 2):
        span = dilation[s] * (weight.shape[s + 2] - 1)
        shape.append(x.shape[s + 2] if s + 2 == p.dim
                     else (x.shape[s + 2] + 2 * padding[s] - span - 1) // stride[s] + 1)
    placements = [Shard(q.dim) if isinstance(q, HaloShard) else q for q in x.placements]
    return placements, tuple(shape)


def _local(t: object) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _with_zero_slice(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros([1 if i == dim else n for i, n in enumerate(t.shape)])],
                     dim)


@maybe_run_for_local_tensor
def _conv_local(op: OpOverload, x: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None, conv: tuple[Any, ...], dim: int,
                span: int) -> torch.Tensor:
    """The local conv; an empty chunk (only halos) gives an empty output, which aten's conv
    refuses to compute: it runs on one extra zero slice and drops that output."""
    if x.shape[dim] > span:
        return op(x, w, b, *conv)
    return op(_with_zero_slice(x, dim), w, b, *conv).narrow(dim, 0, 0)


@maybe_run_for_local_tensor
def _conv_backward_local(op: OpOverload, g: torch.Tensor, x: torch.Tensor,
                         w: torch.Tensor, bias_sizes: Any, conv: tuple[Any, ...], dim: int,
                         span: int) -> tuple[torch.Tensor | None, ...]:
    """The local conv backward; an empty chunk as in `_conv_local` (a zero output gradient
    on the extra slice adds nothing to the weight and bias gradients)."""
    if x.shape[dim] > span:
        return tuple(op(g, x, w, bias_sizes, *conv))
    gx, gw, gb = op(_with_zero_slice(g, dim), _with_zero_slice(x, dim), w, bias_sizes, *conv)
    return (None if gx is None else gx.narrow(dim, 0, span), gw, gb)


def conv_handler(previous: Handler) -> Handler:
    """`aten.convolution` on a HaloShard input: local conv, `Shard(dim)` output."""

    def handler(op_call: OpOverload, args: tuple[object, ...],
                kwargs: dict[str, object]) -> object:
        if not _is_halo(args[0]):
            return refuse_halo(previous)(op_call, args, kwargs)  # a halo weight: refused
        x, weight, bias, *conv = args
        assert isinstance(x, DTensor) and not kwargs
        check_local(x)
        p = _check_conv(x, weight, bias, tuple(conv))
        assert isinstance(weight, DTensor)
        span = p.left + p.right
        y = _conv_local(op_call, x.to_local(), weight.to_local(), _local(bias), tuple(conv),
                        p.dim, span)
        placements, shape = _conv_out(x, weight, tuple(conv), p)
        return DTensor.from_local(y, x.device_mesh, placements, shape=torch.Size(shape),
                                  stride=contiguous_stride(shape))

    handler.haloshard_previous = previous  # type: ignore[attr-defined]
    return handler


def _grad_placements(x: DTensor) -> list[Placement]:
    """Parameters' gradient placements: partial sums over every axis that splits the input."""
    return [Replicate() if isinstance(q, Replicate) else Partial() for q in x.placements]


def conv_backward_handler(previous: Handler) -> Handler:
    """`aten.convolution_backward` with a HaloShard input: local backward.

    The input gradient keeps the input's HaloShard (halo gradients not yet folded into
    their owners: the halo's producer does that); weight and bias gradients are `Partial()`.
    """

    def handler(op_call: OpOverload, args: tuple[object, ...],
                kwargs: dict[str, object]) -> object:
        if not _is_halo(args[1]):
            return refuse_halo(previous)(op_call, args, kwargs)
        grad, x, weight, bias_sizes, *conv = args
        assert isinstance(x, DTensor) and isinstance(weight, DTensor) and not kwargs
        check_local(x)
        p = _check_conv(x, weight, None, tuple(conv))
        placements, _ = _conv_out(x, weight, tuple(conv), p)
        if not isinstance(grad, DTensor):
            raise unsupported(op_call, x.placements, " with a plain-tensor output gradient")
        if list(grad.placements) != placements:
            grad = torch_redistribute(grad, x.device_mesh, placements)
        gx, gw, gb = _conv_backward_local(op_call, grad.to_local(), x.to_local(),
                                          weight.to_local(), bias_sizes, tuple(conv), p.dim,
                                          p.left + p.right)
        mesh, partial = x.device_mesh, _grad_placements(x)
        return (
            None if gx is None else DTensor.from_local(
                gx, mesh, x.placements, shape=x.shape, stride=x.stride()),
            None if gw is None else DTensor.from_local(
                gw, mesh, partial, shape=weight.shape, stride=weight.stride()),
            None if gb is None else DTensor.from_local(
                gb, mesh, partial, shape=gb.shape, stride=gb.stride()),
        )

    handler.haloshard_previous = previous  # type: ignore[attr-defined]
    return handler


def refuse_halo(previous: Handler) -> Handler:
    """Another torch handler (argmax, as_strided, ...): HaloShard inputs raise `HaloError`."""

    def handler(op_call: OpOverload, args: tuple[object, ...],
                kwargs: dict[str, object]) -> object:
        for arg in (*args, *kwargs.values()):
            if _is_halo(arg):
                raise unsupported(op_call, arg.placements)  # type: ignore[union-attr]
        return previous(op_call, args, kwargs)

    handler.haloshard_previous = previous  # type: ignore[attr-defined]
    return handler


def _redistribute_method(
    self: DTensor, device_mesh: Any = None, placements: Sequence[Placement] | None = None,
    *, async_op: bool = False, forward_dtype: torch.dtype | None = None,
    backward_dtype: torch.dtype | None = None,
) -> DTensor:
    """`DTensor.redistribute`, with `HaloShard` sources and targets sent to haloshard."""
    wanted = self.placements if placements is None else placements
    if not halo_axes(self.placements) and not halo_axes(wanted):
        return torch_redistribute(self, device_mesh, placements, async_op=async_op,
                                  forward_dtype=forward_dtype, backward_dtype=backward_dtype)
    if device_mesh not in (None, self.device_mesh) or forward_dtype or backward_dtype:
        raise HaloError(f"redistribute between {tuple(self.placements)} and {tuple(wanted)} "
                        "supports neither a change of mesh nor forward/backward dtypes")
    return redistribute(self, wanted)


def install() -> None:
    """Route DTensor's redistribute, convolution and op dispatch for `HaloShard` inputs.

    Idempotent. Chains to the handlers already installed for non-halo inputs.

    Example::
        >>> install()  # done when the first HaloShard is built
        >>> x = distribute_tensor(torch.randn(1, 4, 9), mesh, [Shard(2)])
        >>> x = redistribute(x, [HaloShard(2, 1, 1)])
        >>> w = distribute_tensor(torch.randn(4, 4, 3), mesh, [Replicate()])
        >>> F.conv1d(x, w).placements
        (Shard(dim=2),)
    """
    if _installed:
        return
    handlers = custom_op_handlers()
    _installed.update(handlers=dict(handlers), redistribute=DTensor.redistribute,
                      propagate=sharding_slow_path(),
                      to_local=DTensor.to_local)
    makers = {aten.convolution.default: conv_handler,
              aten.convolution_backward.default: conv_backward_handler,
              aten.is_same_size.default: lambda previous: previous}  # shapes only: right
    for op, previous in list(handlers.items()):
        handlers[op] = makers.get(op, refuse_halo)(previous)
    for op in SCALAR_DEPENDENT:
        handlers[op] = scalar_handler(handlers.get(op))
    for op in ZERO_FILLED:
        handlers[op] = zero_fill_handler(handlers.get(op))
    set_sharding_slow_path(_guard(_installed["propagate"]))
    DTensor.redistribute = _redistribute_method  # type: ignore[method-assign]
    DTensor.to_local = _to_local_method  # type: ignore[method-assign]
    # Results torch propagated for HaloShard inputs before now must be judged again.
    clear_sharding_cache()


def uninstall() -> None:
    """Undo `install()` (for tests); HaloShard DTensors are unguarded afterwards."""
    if not _installed:
        return
    handlers = custom_op_handlers()
    for op in (SCALAR_DEPENDENT | ZERO_FILLED) - set(_installed["handlers"]):
        handlers.pop(op, None)
    handlers.update(_installed["handlers"])
    DTensor.to_local = _installed["to_local"]  # type: ignore[method-assign]
    set_sharding_slow_path(_installed["propagate"])
    DTensor.redistribute = _installed["redistribute"]  # type: ignore[method-assign]
    _installed.clear()
    clear_sharding_cache()
