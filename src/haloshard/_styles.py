"""`HaloParallel` and plans: halos for an existing model through `parallelize_module`.

`HaloParallel` is the `ParallelStyle` that attaches a halo to one module; `halo_plan` builds
`{fqn: HaloParallel(...)}` from annotations (and, optionally, every conv); `reduce_grads`
sums the parameters' per-rank partial gradients over the cp axis for users without DDP/FSDP.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from haloshard import _comm
from haloshard._agree import Agreements, Fields, check_rows, digest, gather
from haloshard._annotation import annotation_of, resolve
from haloshard._errors import HaloError
from haloshard._exchange import join_agreed_move
from haloshard._forward import (
    HaloHandle,
    check_layouts,
    handle_of,
    install,
    names_errors,
    output_layouts,
)
from haloshard._halo_forward import HaloForward, LocalRun
from haloshard._layer_styles import GroupNormParallel
from haloshard._layout import HaloShard
from haloshard._specs import (
    CONVS,
    DERIVABLE,
    TRANSPOSED,
    Stencil,
    is_stencil,
    spatial_index,
    torch_forward,
)

_PLAIN_CONVS = CONVS + TRANSPOSED


class HaloParallel(ParallelStyle):
    """Run a module on `Shard(dim)` inputs, its halo exchanged first: the context-parallel conv.

    The input is a DTensor sharded along `dim` on one mesh axis (the other axes `Replicate`
    or `Shard(0)`), or a plain local chunk on the 1-D mesh given to `parallelize_module`. The
    output is the `Shard(dim)` chunk of the single-device output: a DTensor on the input's
    mesh with the exact global shape (a plain tensor for plain input). Parameters stay as
    they are; their gradients are per-rank partial sums (see `reduce_grads`).

    Args:
        spec: None derives the halo from a conv / transposed conv / pooling / upsampling
            module (or uses the module's annotation); a `HaloShard` applies that halo to any
            length-preserving module, e.g. a causal wrapper that pads T with `F.pad` itself;
            a stencil (any object implementing the public `haloshard.Stencil` protocol,
            e.g. a frozen dataclass of your own) describes a module that changes the length.
        dim: the sharded dim of the module's input; None: the spec's dim, or 2.
        overlap: run a stride-1 conv that keeps the length as `halo_conv` (the chunk's own
            conv runs while the halo travels, boundary corrections follow); False exchanges
            first, then runs the module; None (the default) picks the faster of the two once
            per input signature by timing both, forward and backward, at the layer's first
            call with it (as `cudnn.benchmark` does; the first step pays for it;
            exchange-first, whose backward holds a copy of the chunk, must be 10% faster
            summed over ranks), and overlaps where they cannot be timed (compiled or
            simulated, or under `torch.use_deterministic_algorithms`). Both are exact. A
            conv subclass with a forward of its own always runs that forward.
        local: how the module runs on its window, `local(forward, window, *args,
            **kwargs) -> output`, for a module whose rule along the dim lives in a protocol
            of its own (a feature cache, say); None calls `forward(window, ...)`.
        input_layouts: how a plain-tensor input is laid out: `Shard(dim)` (the default;
            nothing else is taken), as in torch's `ParallelStyle`s.
        output_layouts: the output's placement on the sharded mesh axis: `Shard(dim)` (the
            default) or `Replicate()` (gathered along dim).
        use_local_output: return the local tensor of a DTensor output.

    A module may return a tuple whose first element is its output (`(output, cache)`): that
    element is sharded and the others come back as None, since a window's cache is not the
    single-device one.

    Raises:
        HaloError: in `_apply`, for a module whose halo cannot be derived, a spec that does
            not fit it, or a module that already has a halo.

    Example::
        >>> model = nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.Conv3d(8, 8, 3, padding=1))
        >>> model = parallelize_module(model, mesh, {"*": HaloParallel()})
        >>> y = model(distribute_tensor(torch.randn(1, 3, 17, 32, 32), mesh, [Shard(2)]))
        >>> y.placements, y.shape
        ((Shard(dim=2),), torch.Size([1, 8, 17, 32, 32]))
    """

    def __init__(self, spec: HaloShard | Stencil | None = None, *, dim: int | None = None,
                 overlap: bool | None = None, local: LocalRun | None = None,
                 input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None,
                 use_local_output: bool = False) -> None:
        super().__init__()
        if spec is not None and not isinstance(spec, HaloShard) and not is_stencil(spec):
            raise HaloError(f"spec must be a HaloShard, a stencil or None, got "
                            f"{type(spec).__name__}")
        if isinstance(spec, HaloShard) and dim is not None and spec.dim != dim:
            raise HaloError(f"spec {spec!r} shards dim {spec.dim} but dim={dim}; expected "
                            "the same dim (or no dim: the spec states it)")
        self.spec, self.overlap, self.local = spec, overlap, local
        self.dim = spec.dim if isinstance(spec, HaloShard) else 2 if dim is None else dim
        check_layouts("HaloParallel", self.dim, input_layouts, output_layouts)
        self.output_layouts, self.use_local_output = output_layouts, use_local_output

    def __repr__(self) -> str:
        extra = "" if self.overlap is None else f", overlap={self.overlap}"
        extra += "" if self.local is None else f", local={self.local!r}"
        return f"HaloParallel(spec={self.spec!r}, dim={self.dim}{extra})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        annotation = resolve(module, self.spec, dim=self.dim)
        install(module, HaloForward.of(module, annotation, device_mesh, overlap=self.overlap,
                                       local=self.local))
        output_layouts(module, self.dim, self.output_layouts, self.use_local_output)
        return module


def _has_kernel_along(module: nn.Module, dim: int) -> bool:
    try:
        spatial_index(module, dim)
    except HaloError:
        return False
    return True


# Norms whose statistics run over the sharded dim (GroupNorm has a style: include_norms=).
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d,
          nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
          nn.LazyBatchNorm3d, nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d,
          nn.LazyInstanceNorm3d, nn.LocalResponseNorm, nn.CrossMapLRN2d)
# Parameter-free layers that read along every spatial dim with no halo haloshard derives.
_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
          nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.LPPool1d,
          nn.LPPool2d, nn.LPPool3d, nn.MaxUnpool1d, nn.MaxUnpool2d, nn.MaxUnpool3d,
          nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)


def _uncovered(module: nn.Module, dim: int) -> str | None:
    """Why `module`, left out of a plan, would not run right on a `Shard(dim)` input, or
    None: statistics or a kernel along dim (wrong values on a plain chunk), or parameters
    (a raw DTensor error on a DTensor input)."""
    if isinstance(module, nn.GroupNorm):
        return "statistics along the sharded dim (include_norms=True plans it)"
    if isinstance(module, _NORMS):
        return "statistics along the sharded dim"
    if isinstance(module, DERIVABLE) and _has_kernel_along(module, dim):
        return "a kernel along the sharded dim (HaloParallel() derives its halo)"
    if isinstance(module, _POOLS):
        return "pooling along the sharded dim"
    own = [name for name, _ in module.named_parameters(recurse=False)]
    return f"parameters {own}" if own else None


def halo_plan(
    model: nn.Module,
    *,
    dim: int = 2,
    include_convs: bool = False,
    include_norms: bool = False,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan for every annotated module of `model`.

    With `include_convs=True` it also covers every conv and transposed conv with a kernel
    dim at `dim` (kernel 1 included: DTensor's own conv would mislabel a `Shard(dim)`
    output as `Replicate`), and checks that nothing is left that the plan cannot run: a
    module outside the plan with statistics along `dim` (a norm), a kernel or pooling along
    it, or parameters of its own raises `HaloError` naming every such module by fqn (a
    module `module_filter_fn` rejects is the caller's to plan). With `include_norms=True`
    every `nn.GroupNorm` gets `GroupNormParallel` (exact global statistics), and a subclass
    with a forward of its own (which the style would skip) raises `HaloError`. Modules inside
    an annotated module are left to it. Each entry is validated here, once.

    Args:
        model: the model.
        dim: the sharded dim (annotations keep their own).
        include_convs: also plan the convs that carry no annotation, and check the rest.
        include_norms: also plan every `nn.GroupNorm` (torch's own forward).
        module_filter_fn: `fn(module, fqn) -> bool`; False leaves the module out (and to
            the caller).

    Returns:
        `{fqn: style}` (`HaloParallel(spec, dim=...)`, `GroupNormParallel(dim=...)`), in
        `model.named_modules()` order.

    Raises:
        HaloError: for an entry that does not fit its module, or (with `include_convs`)
            modules the plan leaves uncovered, named by fqn.

    Example::
        >>> halo_plan(nn.Sequential(nn.Conv3d(3, 8, 3, padding=1)), include_convs=True)
        {'0': HaloParallel(spec=None, dim=2)}
        >>> halo_plan(nn.Sequential(nn.Conv3d(3, 8, 3), nn.GroupNorm(2, 8)),
        ...           include_convs=True, include_norms=True)
        {'0': HaloParallel(spec=None, dim=2), '1': GroupNormParallel(dim=2)}
    """
    plan: dict[str, ParallelStyle] = {}
    covered: list[str] = []
    uncovered: list[str] = []
    for fqn, module in model.named_modules():
        if any(fqn.startswith(f"{outer}.") or outer == "" for outer in covered):
            continue
        kept = module_filter_fn is None or module_filter_fn(module, fqn)
        style = _entry(module, dim, include_convs, include_norms) if kept else None
        if style is not None:
            plan[fqn] = style
            note = annotation_of(module)
            if note is not None and not isinstance(module, DERIVABLE):
                covered.append(fqn)
        elif kept and include_norms and isinstance(module, nn.GroupNorm):  # not torch's forward
            uncovered.append(f"{fqn or '<root>'} ({type(module).__name__}: a GroupNorm with a "
                             "forward of its own, which GroupNormParallel would skip)")
        elif kept and include_convs and (why := _uncovered(module, dim)) is not None:
            uncovered.append(f"{fqn or '<root>'} ({type(module).__name__}: {why})")
    if uncovered:
        raise HaloError(f"halo_plan leaves {len(uncovered)} module(s) that touch the sharded "
                        f"dim {dim} uncovered: {'; '.join(uncovered)}. Plan them yourself and "
                        "leave them out with module_filter_fn, or annotate them")
    return plan


def _entry(module: nn.Module, dim: int, include_convs: bool, include_norms: bool
           ) -> ParallelStyle | None:
    """`module`'s plan entry, validated, or None."""
    note = annotation_of(module)
    if note is not None:
        resolve(module, note.spec, dim=note.dim)
        return HaloParallel(note.spec, dim=note.dim)
    if include_convs and isinstance(module, _PLAIN_CONVS) and _has_kernel_along(module, dim):
        resolve(module, None, dim=dim)
        return HaloParallel(None, dim=dim)
    if include_norms and torch_forward(module, nn.GroupNorm,
                                       attached=handle_of(module) is not None):
        return GroupNormParallel(dim=dim)
    return None


def halo_handles(model: nn.Module) -> dict[str, HaloHandle]:
    """The handles of every halo attached in `model`, by fqn; `remove()` undoes one.

    Example::
        >>> model = parallelize_module(nn.Sequential(nn.Conv3d(3, 8, 3, padding=1)), mesh,
        ...                            {"0": HaloParallel()})
        >>> handles = halo_handles(model)
        >>> list(handles)
        ['0']
        >>> for handle in handles.values():
        ...     handle.remove()
    """
    found = ((fqn, handle_of(m)) for fqn, m in model.named_modules())
    return {fqn: h for fqn, h in found if h is not None}


def _grads_problem(named: list[tuple[str, nn.Parameter]]) -> str | None:
    for name, p in named:
        if isinstance(p, DTensor):
            return ("reduce_grads expects plain parameters; DTensor parameters (FSDP) are "
                    f"reduced by their own wrapper, got {name} as a DTensor")
        g = p.grad
        if g is not None and (g.shape != p.shape or g.dtype != p.dtype or g.is_sparse):
            return (f"reduce_grads: {name}'s gradient is {g.dtype} {tuple(g.shape)} "
                    f"(layout {g.layout}), expected dense {p.dtype} {tuple(p.shape)}")
    return None


def _signature(named: list[tuple[str, nn.Parameter]]) -> int:
    """A digest of the parameters that require grad: names, shapes and dtypes."""
    return digest(";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named))


# Every rank's trainable parameters, agreed before their gradients are summed.
_PARAMS = Fields(("error", "count", "signature", "bucket"), "reduce_grads", "every rank must "
                 "hold the same model with the same frozen parameters, and pass the same "
                 "bucket_cap_mb", prefix="reduce_grads: ",
                 show=lambda field, values: (
                     "the parameters that require grad (their count)" if field == "count"
                     else "bucket_cap_mb (in bytes)" if field == "bucket"
                     else "the parameters that require grad (a digest of their names, shapes "
                     "and dtypes)", values))


def _bucket_bytes(bucket_cap_mb: Any) -> tuple[int, str | None]:
    """`bucket_cap_mb` in bytes, or 0 and what is wrong with it."""
    if isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool) \
            and math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0:
        return max(1, min(int(bucket_cap_mb * 2**20), 2**62)), None  # an int64 in the row
    return 0, (f"reduce_grads: bucket_cap_mb must be a positive number of MiB, got "
               f"{bucket_cap_mb!r}")


def _agree_params(named: list[tuple[str, nn.Parameter]], bucket: int, problem: str | None,
                  group: _comm.Group) -> list[bool]:
    """Which parameters have a gradient on some rank, after every rank has agreed on the
    parameter list and the bucket size (`haloshard._agree`); `HaloError` on every rank
    otherwise (this rank's own `problem` first)."""
    problem = problem or _grads_problem(named)
    row = torch.tensor([int(problem is not None), len(named), _signature(named), bucket])
    try:
        rows = gather(row, group, "reduce_grads metadata exchange")
    except HaloError as error:
        if not isinstance(error.__cause__, RuntimeError):  # not the backend's timeout
            raise
        # A peer in a collective of another kind (see docs/failures.md): the timeout.
        raise HaloError(f"{error}. reduce_grads must follow the same forwards and "
                        "backwards on every rank: a rank that ran an extra forward or "
                        "skipped one may wait in a collective of a layer, which "
                        "reduce_grads' collectives cannot meet") from error
    check_rows(rows, _PARAMS, problem)
    mask = torch.tensor([int(p.grad is not None) for _, p in named], dtype=torch.int64)
    if not named:
        return []
    seen = gather(mask, group, "reduce_grads gradient-presence exchange")
    return [any(got[i] for got in seen) for i in range(len(named))]


def _meet_forwards(model: nn.Module, site: tuple[Agreements, Hashable, str | None] | None,
                   group: _comm.Group) -> None:
    """Join the halo move that opened `model`'s last forward on `group` (`_comm.opening`),
    where a peer that runs an extra forward starts: it receives `REDUCING` and raises;
    every rank here sees its status and raises too, at once (no metadata in any forward).
    Nothing when no such move opened it: a forward that opens with a gather meets
    reduce_grads' own gathers, and another model's move may not be the one a peer runs."""
    if site is None:
        return
    store, key, label = site
    stores = (getattr(m.__dict__.get("forward"), "agreed", None) for m in model.modules())
    if not any(found is store for found in stores):
        return
    statuses = join_agreed_move(store, key, group, _comm.REDUCING)
    others = [r for r, status in enumerate(statuses) if status != _comm.REDUCING]
    if others:
        raise HaloError(
            f"reduce_grads: rank(s) {others} of the group ran a forward ({label or 'a halo'}"
            " layer's halo move) while this rank called reduce_grads: every rank must run "
            "the same forwards and backwards before reduce_grads (an extra forward on those "
            "ranks, e.g. under torch.no_grad(), or one this rank skipped)")


def reduce_grads(model: nn.Module, mesh: DeviceMesh, *, mesh_axis: int | str | None = None,
                 bucket_cap_mb: float = _comm.BUCKET_MB) -> None:
    """Sum every parameter's gradient over the cp ranks, in place (one all-reduce per bucket
    of at most `bucket_cap_mb` MiB, as DDP's: a model whose gradients fit one bucket pays one
    all-reduce per dtype).

    Under a halo, each rank's parameter gradient is the partial sum over its own outputs;
    the single-device gradient is their sum. DDP or FSDP over the cp ranks does this already.
    A gradient that is None on every rank stays None (an optimizer then leaves that
    parameter alone, as on one device); one that exists on some ranks only counts as zeros
    on the others. Two small all-gathers first check that every rank holds the same
    trainable parameters (names, shapes, dtypes) and learn which have gradients. Before
    them it joins the halo move that opened the last forward (placeholder rows of that
    layer's halo, once per call), where a rank running an extra forward instead starts: it
    raises there, and so does every rank here, at once.

    Args:
        model: the model after `backward()`.
        mesh: the cp mesh (1-D), or a larger mesh with `mesh_axis` naming the cp axis.
        mesh_axis: the cp axis of an N-D mesh.
        bucket_cap_mb: the most gradient bytes (MiB) packed into one all-reduce; beside the
            gradients, the call holds at most two buckets (DDP's default size, 25).

    Raises:
        HaloError: on every rank, when bucket_cap_mb is not a positive number or differs
            between ranks, when the ranks' trainable parameters differ (a parameter
            frozen on one rank, another dtype) or a gradient does not match its parameter,
            or when a rank runs a forward instead (an extra one, e.g. under no_grad).

    Example::
        >>> model = parallelize_module(nn.Sequential(nn.Conv3d(3, 8, 3, padding=1)), mesh,
        ...                            {"0": HaloParallel()})
        >>> y = model(distribute_tensor(torch.randn(1, 3, 9, 8, 8), mesh, [Shard(2)]))
        >>> y.to_local().sum().backward()  # each rank: its frames' share of the gradients
        >>> reduce_grads(model, mesh)  # now every rank holds the full gradients
    """
    group = _comm.resolve_group(mesh if mesh_axis is None else (mesh, mesh_axis))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    site = _comm.opening(group)
    try:
        _meet_forwards(model, site, group)
        bucket, problem = _bucket_bytes(bucket_cap_mb)
        _sum_grads(named, _agree_params(named, bucket, problem, group), group, bucket)
    finally:
        _comm.reopen(group, site)  # the next forward opens afresh, not these collectives


def _sum_grads(named: list[tuple[str, nn.Parameter]], present: list[bool],
               group: _comm.Group, bucket: int) -> None:
    """Sum the gradients that exist on some rank (`present`) over `group`, in place."""
    params = [p for (_, p), has in zip(named, present, strict=True) if has]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for dtype in sorted({p.dtype for p in params}, key=str):
        grads = [p.grad for p in params if p.dtype == dtype and p.grad is not None]
        _comm.all_reduce_sum_(grads, group, "reduce_grads all-reduce", bucket)
