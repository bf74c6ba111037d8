"""ParallelStyles for the layers of a video model that are not plain convs.

A causal video VAE mixes convs with GroupNorm, attention over every token and temporal
resampling. Under a `Shard(T)` layout each of them needs its own treatment, and DTensor's
default dispatch is wrong or wasteful for most: `nn.GroupNorm` on a `Shard(2)` DTensor
all-gathers the activation and returns `Replicate`, a conv returns a mislabelled `Replicate`
(or refuses plain parameters), `F.pad` all-gathers. The styles here run each module on its
local chunk and rebuild the `Shard(dim)` DTensor on the input's mesh, as `HaloParallel` does:

- `GroupNormParallel`: exact statistics over the whole T from one all-gather of B*G*3 numbers;
- `LocalParallel`: modules that act on each frame alone (per-frame norms, 1x1 convs, any
  pointwise block): no communication at all;
- `AttentionParallel`: a block that attends over all T*H*W tokens, with K/V all-gathered;
- `CausalConvParallel`: a causal wrapper (`F.pad` of `k - 1` frames, then a conv of any
  stride along T): the halo of its conv, the wrapper's own padding dropped;
- `FirstFrameParallel`: "keep the first frame, resample the rest" (CogVideoX / Hunyuan /
  Mochi temporal down- and upsampling).

Parameter-free pointwise ops, residual adds, channel concatenation and channel-only norms
without affine parameters (`F.layer_norm` over C, `F.normalize(x, dim=1)`) need no plan
entry: DTensor keeps `Shard(2)` through them, forward and backward, with no communication
(checked in the tests). Modules with plain parameters (a LayerNorm with weights, a 1x1
conv) refuse a DTensor input, and a per-frame `F.group_norm` on `(b t) c h w` has no
DTensor backward in torch 2.13: those take `LocalParallel`. Everything is undone by the
handle that `halo_handles(model)` returns, like a halo.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement
from torch.overrides import TorchFunctionMode

from haloshard import _comm, _segments
from haloshard._agree import Fields, Reuse, check_rows, gather, padded_reuse
from haloshard._annotation import Annotation
from haloshard._attention import gather_many, sdpa
from haloshard._compat import (
    LocalTensor,
    local_tensors,
    maybe_run_for_local_tensor,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from haloshard._conv import with_spare_slice
from haloshard._errors import HaloError
from haloshard._forward import (
    ENCLOSING,
    ShardedForward,
    check_layouts,
    enclosing,
    handle_of,
    install,
    names_errors,
    output_layouts,
)
from haloshard._forward import INSIDE as _INSIDE
from haloshard._halo_forward import HaloForward, LocalRun, halo_windows
from haloshard._layout import HaloShard, PadMode, lack, shard_sizes
from haloshard._no_pad import NoPadAlong
from haloshard._norms import group_norm
from haloshard._site import (
    Site,
    check_same_length,
    dtensor_site,
    has_spare,
    rewrap,
    site_of,
    with_spare,
)
from haloshard._specs import (
    CONVS,
    DERIVABLE,
    SPATIAL,
    ConvStencil,
    ResampleStencil,
    Stencil,
    WindowPlan,
    conv_padding,
    derive_stencil,
    known_forward,
    spatial_index,
    torch_forward,
)


# ---------------------------------------------------------------- local forward machinery
class _LocalForward(ShardedForward):
    """The strategy of a per-slice module: it runs on the local chunk of a `Shard(dim)`
    input. DTensor in: the output comes back as a DTensor on the input's mesh and
    placements with the input's global length along `dim`. Plain chunk in: plain chunk
    out, the group is the 1-D mesh given at `_apply`. Inside a halo module's window local
    ops pass through; anything with global statistics raises (see subclasses)."""

    style = "LocalParallel"
    local_dims: tuple[int, ...] = ()  # other dims the module treats slice by slice
    # the convs and poolings inside a per-slice block, checked once per input rank
    kernels: tuple[_Kernel, ...] = ()
    kernels_checked: frozenset[int] = frozenset()
    # the InstanceNorms and BatchNorms inside: (fqn, the rank of their inputs' spatial dims)
    norms: tuple[tuple[str, int], ...] = ()

    def site(self, x: torch.Tensor) -> Site:
        if isinstance(x, DTensor):
            site = dtensor_site(x, self.dim, several=True)
            along = [d for _, d in site.others if d not in self.local_dims]
            if along:
                raise HaloError(f"{self.style} got an input also sharded on dim {along[0]}, "
                                f"but {self.name or type(self.module).__name__} is not known "
                                f"to treat slices along it alone; expected local_dims="
                                f"({along[0]},) for a module that does (a 1x1 conv is found "
                                "by itself)")
            return site
        outer = enclosing(x)
        if outer is not None:
            # a chunk of the enclosing attention block's input: its mesh axes and lengths
            return replace(outer, local=x, placements=None)
        if self.mesh is None or self.mesh.ndim != 1:
            raise HaloError(f"{self.style} got a plain tensor and needs a 1-D mesh for it, got "
                            f"{self.mesh}; pass a DTensor or apply it to the cp sub-mesh")
        # The global length is not needed here: no collective to find it.
        return Site(x, self.mesh, 0, None, tuple(x.shape), self.dim)

    def local(self, site: Site, *args: Any, **kwargs: Any) -> torch.Tensor:
        x, n = site.local, site.local.shape[self.dim]
        _refuse_mixing(self.module, self.dim, x.ndim, self.style)
        first = x.ndim not in self.kernels_checked
        if first:
            self.check_kernels(x.ndim)
        for fqn, rank in self.norms:  # a BatchNorm's statistics follow its mode: each call
            if rank + 2 == x.ndim and not self.styled(fqn):
                _refuse_mixing(self.module.get_submodule(fqn), self.dim, x.ndim,
                               f"{self.style} on {self.name or type(self.module).__name__} "
                               f"(its {fqn})")
        # An empty chunk (T < P) runs as one zero slice, dropped after: convs and pooling
        # refuse empty inputs. Per-rank counts (LocalTensorMode) cannot be tested: pad by
        # what each rank lacks, zero mostly.
        # decided alike on every rank where the global length is known (a DTensor input)
        if isinstance(n, torch.SymInt) or (n == 0 if site.placements is None
                                           else site.length < site.mesh.size(site.axis)):
            self.refuse_styled_inside()
        if isinstance(n, torch.SymInt) and site.placements is not None:
            x = _equal_chunks(x, self.dim, site)
        elif isinstance(n, torch.SymInt) or n == 0:
            x = with_spare_slice(x, self.dim)
        # the same along a second sharded dim (H): a rank may hold no row (per-rank
        # counts, simulated: one spare row where a rank has none, cut after)
        spare = [d for _, d in site.others if isinstance(site.local.shape[d], torch.SymInt)
                 or site.local.shape[d] == 0]
        for d in spare:
            x = with_spare_slice(x, d)
        with self.watching(x) if first else contextlib.nullcontext():
            y = self.original(x, *args, **kwargs)
        self.kernels_checked = self.kernels_checked | {x.ndim}
        check_same_length(y.shape[self.dim], x.shape[self.dim], self.style, self.dim)
        for d in spare:
            y = y.narrow(d, 0, site.local.shape[d])
        return y.narrow(self.dim, 0, n) if x is not site.local else y

    def check_kernels(self, ndim: int) -> None:
        """A conv or pooling inside that takes inputs of this rank (`ndim` dims, the block's
        own: T still at `dim`, as far as a module can tell) must read one slice along `dim`:
        on this rank's slices alone, a wider kernel would miss its neighbours' (and pad
        where one device reads real frames). A block that folds T away first (per-frame
        convs on `(B*T, C, H, W)`) passes."""
        bad = [k for k in self.kernels
               if k.rank + 2 == ndim and (k.kernel, k.stride, k.padding) != (1, 1, 0)
               and not self.styled(k.fqn)]
        if bad:
            k = bad[0]
            raise HaloError(
                f"{self.style} runs {self.name or type(self.module).__name__} on this rank's "
                f"slices along dim {self.dim} alone, but its {k.fqn} ({k.kind}) reads kernel "
                f"{k.kernel}, stride {k.stride}, padding {k.padding} along dim {self.dim}; "
                "expected kernel 1, stride 1 and no padding there: plan that layer with "
                "HaloParallel (and this block's other layers with their own entries)")

    @contextlib.contextmanager
    def watching(self, x: torch.Tensor) -> Iterator[None]:
        """A block's first call per input rank: a GroupNorm inside whose input keeps the
        block's rank and batch (T is still among the dims it normalizes over), or a softmax
        along `dim` of such an input, raises; one that T was folded away from first (into
        the batch, per frame) passes. Read off the block's own call, then unhooked."""
        if self.module_is_leaf:
            yield
            return

        def check(module: nn.Module, args: tuple[Any, ...]) -> None:
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if t is None or t.ndim != x.ndim or t.shape[0] != x.shape[0]:
                return
            mixing = isinstance(module, nn.GroupNorm) or (
                module.dim is not None and module.dim % t.ndim == self.dim)
            if mixing:
                fqn = next(f for f, m in self.module.named_modules() if m is module)
                what = ("normalizes" if isinstance(module, nn.GroupNorm)
                        else "takes a softmax")
                raise HaloError(
                    f"{self.style} runs {self.name or type(self.module).__name__} on this "
                    f"rank's slices along dim {self.dim} alone, but its {fqn} "
                    f"({type(module).__name__}) gets an input of the block's rank and batch "
                    f"{tuple(t.shape)}, so it {what} along dim {self.dim} too; expected it "
                    "on per-frame inputs (T folded into the batch) or a style of its own "
                    "(GroupNormParallel)")

        handles = [m.register_forward_pre_hook(check) for m in self.module.modules()
                   if m is not self.module and isinstance(m, (nn.GroupNorm, *_SOFTMAXES))
                   and handle_of(m) is None]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def refuse_styled_inside(self) -> None:
        """The zero slices this block's chunk is padded with would reach a layer inside that
        runs sharded itself (its own entry) as frames: refused."""
        inside = next((fqn for fqn, m in self.module.named_modules()
                       if m is not self.module and handle_of(m) is not None), None)
        if inside is not None:
            raise HaloError(
                f"{self.style} runs {self.name or type(self.module).__name__} on an empty chunk "
                "(or, under simulated ranks, on chunks of unequal lengths) padded with zero "
                f"slices, but its {inside} has an entry of its own and would take them as "
                "frames; expected every rank to hold a slice (T >= ranks), equal chunks under "
                "simulated ranks, or the block's layers planned one by one")

    def styled(self, fqn: str) -> bool:
        """Whether the module at `fqn` inside has a style of its own (a child's entry in the
        plan: it runs sharded itself)."""
        return fqn != "<module>" and handle_of(self.module.get_submodule(fqn)) is not None

    @property
    def module_is_leaf(self) -> bool:
        return next(iter(self.module.children()), None) is None

    def sharded(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        site = self.site(x)
        y = self.local(site, *args, **kwargs)
        if not isinstance(y, torch.Tensor) or isinstance(y, DTensor):
            raise HaloError(f"{self.style} expects the module to return one plain tensor "
                            f"from its local forward, got {type(y).__name__}")
        return rewrap(y, site, self.dim, site.length)

def _equal_chunks(x: torch.Tensor, dim: int, site: Site) -> torch.Tensor:
    """Under simulated ranks, every rank's chunk zero-padded to the longest (at least one
    slice): a per-slice module that folds T into the batch and back (`flatten(0, 1)` ...
    `unflatten(0, (B, -1))`, per-frame attention) cannot run on per-rank lengths. The
    padding slices' outputs touch no real slice and are dropped."""
    longest = max(1, shard_sizes(site.length, site.mesh.size(site.axis))[0])
    x = F.pad(x, [0, 0] * (x.ndim - 1 - dim) + [0, lack(x.shape[dim], longest)])
    # a fresh tensor of the padded shape: the pad's own strides may stay per-rank
    shape = (*x.shape[:dim], longest, *x.shape[dim + 1 :])
    return torch.empty(shape, dtype=x.dtype, device=x.device).copy_(x)


# torch modules whose output slice along some dim reads other slices along it, which a
# per-slice style would silently compute from this rank's slices only
_NORMS_OVER_SPATIAL = (nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
_SEQUENCE_MODELS = (nn.MultiheadAttention, nn.RNNBase, nn.TransformerEncoderLayer,
                    nn.TransformerDecoderLayer, nn.TransformerEncoder, nn.TransformerDecoder,
                    nn.Transformer)
_SOFTMAXES = (nn.Softmax, nn.LogSoftmax, nn.Softmin)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)
# norms inside a per-slice block whose inputs' rank tells whether T is among their dims
_NORM_RANKS = {nn.InstanceNorm1d: 1, nn.InstanceNorm2d: 2, nn.InstanceNorm3d: 3,
               nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}


def _mixing(module: nn.Module, dim: int, ndim: int | None) -> str | None:
    """Why `module` (a torch class) does not treat slices along `dim` alone, or None. With
    `ndim` None (at `_apply`) only what needs no input rank is decided."""
    if isinstance(module, _NORMS_OVER_SPATIAL):
        return "normalizes over every spatial dim (use GroupNormParallel for nn.GroupNorm)"
    if isinstance(module, _SEQUENCE_MODELS):
        batch = 0 if getattr(module, "batch_first", False) else 1
        if dim != batch or not hasattr(module, "batch_first"):
            return ("mixes its sequence (nn.MultiheadAttention takes AttentionParallel); "
                    f"only its batch dim {batch} is per-slice where batch_first says so")
    if isinstance(module, _SOFTMAXES) and module.dim is not None and (
            module.dim == dim or (ndim is not None and module.dim % ndim == dim)):
        return f"normalizes along its dim {module.dim}"
    if ndim is None:
        return None
    # batch statistics (torch's own rule: training, or no running statistics) run over B
    # and every spatial dim; eval() with running statistics is an affine map per channel
    if isinstance(module, _BATCH_NORMS) and (module.training or module.running_mean is None):
        return ("normalizes with batch statistics over every spatial dim (in training, or "
                "without running statistics; eval() with running statistics is per-slice)")
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        first = ndim - len(module.normalized_shape)
        if dim >= first:
            return f"normalizes over dims {first}..{ndim - 1}"
    if isinstance(module, (nn.Linear, nn.Bilinear)) and dim == ndim - 1:
        return "mixes its last dim (its features)"
    return None


def _refuse_mixing(module: nn.Module, dim: int, ndim: int | None, style: str) -> None:
    reason = _mixing(module, dim, ndim)
    if reason is not None:
        raise HaloError(f"{style} runs a module on this rank's slices along dim {dim} alone, "
                        f"but {type(module).__name__} {reason}; expected a module that "
                        "treats each slice alone")


def _check_dim(module: nn.Module, dim: int, style: str, *, least: int = 2) -> None:
    if dim < least:
        after = "batch" if least == 1 else "batch and channels"
        raise HaloError(f"{style} shards a dim after {after}, got dim={dim}; expected "
                        f"dim >= {least}")


class LocalParallel(ParallelStyle):
    """Run a module that treats every slice along `dim` alone on the local chunk: no comms.

    For per-frame norms, 1x1 convs, pointwise blocks and anything else whose output slice t
    depends only on input slice t. A conv with kernel 1 along T needs an entry (this or
    `HaloParallel`): DTensor's own conv refuses plain parameters or mislabels the output.

    Args:
        dim: the sharded dim of the module's input.
        local_dims: other dims the module treats slice by slice, so that its input may be
            sharded on them too (T and H at once); found by itself for a conv or pooling
            with torch's own forward and kernel 1 along them.
        input_layouts, output_layouts, use_local_output: as for `HaloParallel` (input
            `Shard(dim)`; output `Shard(dim)` or `Replicate()`; the local tensor out).

    Raises:
        HaloError: in `_apply` for dim < 1 (dim < 2 for the subclasses), a module that
            already has a style, or a torch module known to mix slices along dim (GroupNorm
            and InstanceNorm, attention, RNN and transformer layers other than along their
            batch dim, a softmax along dim); at run time when the module changes the length
            of `dim` (it is not per-slice), or for a LayerNorm / RMSNorm normalizing over
            dim, a Linear on its last dim, or a BatchNorm with batch statistics (training,
            or no running statistics); inside a block, named by fqn, for a conv or pooling
            that takes inputs of the block's rank with a kernel, stride or padding along
            dim, an InstanceNorm, a batch-statistics BatchNorm, or a GroupNorm (or softmax
            along dim) whose input keeps the block's rank and batch (per-frame layers, T
            folded into the batch, pass), and for a layer inside with an entry of its own
            when the chunk is padded with zero slices (empty, or unequal simulated chunks).
            These see modules only: the block's own functional calls along dim (`F.softmax`,
            a mean or pooling over T, its local length) are the plan's claim;
            `verify_plan` checks them against one device.

    Example::
        >>> skip = parallelize_module(nn.Conv3d(8, 4, 1), mesh, LocalParallel())  # kernel 1
        >>> skip(distribute_tensor(torch.randn(1, 8, 13, 4, 4), mesh, [Shard(2)])).placements
        (Shard(dim=2),)
    """

    forward_type: type[_LocalForward] = _LocalForward
    per_slice = True  # runs the module on local slices alone (not a global-statistics style)

    def __init__(self, *, dim: int = 2, local_dims: tuple[int, ...] = (),
                 input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = False
                 ) -> None:
        super().__init__()
        self.dim = dim
        self.local_dims = _local_dims(local_dims, dim, type(self).__name__)
        check_layouts(type(self).__name__, dim, input_layouts, output_layouts)
        self.output_layouts, self.use_local_output = output_layouts, use_local_output

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"

    def _validate(self, module: nn.Module) -> None:
        # Per-slice modules may see T at dim 1: channels-last `(B, T, H, W, C)` norms and
        # per-token `(B, T, C)` linears.
        least = 1 if type(self) is LocalParallel else 2
        _check_dim(module, self.dim, type(self).__name__, least=least)
        if self.per_slice:
            _refuse_mixing(module, self.dim, None, type(self).__name__)
        if isinstance(module, DERIVABLE) and not isinstance(self, GroupNormParallel):
            stencil = derive_stencil(module, self.dim)
            if stencil != ConvStencil(span=1):
                raise HaloError(f"LocalParallel is for per-slice modules, but "
                                f"{type(module).__name__} reads {stencil} along dim "
                                f"{self.dim}; use HaloParallel for it")

    def _forward_type(self, module: nn.Module) -> type[_LocalForward]:
        return self.forward_type

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._validate(module)
        forward = self._forward_type(module)(module, self.dim, device_mesh)
        forward.local_dims = self.local_dims + _per_slice_dims(module, self.dim)
        if self.per_slice:
            forward.kernels = _kernels(module, self.dim)
            forward.norms = tuple((fqn, _NORM_RANKS[type(m)]) for fqn, m in module.named_modules()
                                  if fqn and type(m) in _NORM_RANKS)
        install(module, forward)
        output_layouts(module, self.dim, self.output_layouts, self.use_local_output)
        return module


def _local_dims(dims: tuple[int, ...], dim: int, style: str) -> tuple[int, ...]:
    if not (isinstance(dims, tuple) and all(isinstance(d, int) and d >= 2 and d != dim
                                            for d in dims)):
        raise HaloError(f"{style} takes local_dims as a tuple of spatial dims (>= 2) other "
                        f"than dim={dim}, got {dims!r}")
    return dims


def _per_slice_dims(module: nn.Module, dim: int) -> tuple[int, ...]:
    """The spatial dims other than `dim` along which a conv or pooling with torch's own
    forward reads one slice (kernel 1, stride 1, no padding)."""
    n = SPATIAL.get(type(module))
    if n is None or not known_forward(module):
        return ()
    found = []
    for d in range(2, n + 2):
        try:
            if d != dim and derive_stencil(module, d) == ConvStencil(span=1):
                found.append(d)
        except HaloError:  # not exact along d at all: not per-slice either
            pass
    return tuple(found)


# ---------------------------------------------------------------- GroupNorm
class _GroupNormForward(_LocalForward):
    style = "GroupNormParallel"

    def local(self, site: Site, *args: Any, **kwargs: Any) -> torch.Tensor:
        gn, x = self.module, site.local
        assert isinstance(gn, nn.GroupNorm)
        if has_spare(site.spare):  # an enclosing block's spare slice counts in no statistic
            x = x.narrow(self.dim, 0, x.shape[self.dim] - site.spare)
        # `_GroupNormFn` checks C against the groups on every rank, inside its gather.
        y = group_norm(x, gn.num_groups, gn.weight, gn.bias, gn.eps,
                       (site.mesh, site.axis), segments=_segments.at(site.length),
                       dim=self.dim, other_groups=[(site.mesh, axis) for axis, _ in site.others],
                       # a DTensor's global length: every rank's chunk is checked
                       global_length=None if site.placements is None else site.length)
        return with_spare(y, site)

    def site(self, x: torch.Tensor) -> Site:
        # statistics combine over every mesh axis that shards a spatial dim (T and H)
        if isinstance(x, DTensor):
            return dtensor_site(x, self.dim, several=True)
        return super().site(x)

    def inside(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise HaloError("GroupNormParallel cannot run inside a halo module (its input is a "
                        "window with halo slices, whose statistics would count them twice); "
                        "plan the enclosing module's convs instead of the whole module")


class GroupNormParallel(LocalParallel):
    """`nn.GroupNorm` over a `Shard(dim)` input with exact global statistics.

    Each rank reduces its chunk to (count, mean, M2) per (batch, group) and the ranks
    all-gather those B*G*3 numbers (no activations), as `haloshard.group_norm` does; the
    backward all-reduces 2*B*G numbers, and autograd keeps only the input (as for
    `nn.GroupNorm`; `group_norm` keeps twice that). The output
    is this rank's `Shard(dim)` chunk of the single-device output. Forward and backward are
    exact; the affine parameters' gradients are per-rank partial sums (`reduce_grads`).
    Without this entry, DTensor's own group norm all-gathers the whole activation and
    returns `Replicate`.

    Args:
        dim: the sharded dim of the module's input (not 0 or 1).

    Raises:
        HaloError: in `_apply` for a module that is not `nn.GroupNorm` or dim < 2.

    Example::
        >>> norm = parallelize_module(nn.GroupNorm(2, 8), mesh, GroupNormParallel())
        >>> norm(distribute_tensor(torch.randn(1, 8, 13, 4, 4), mesh, [Shard(2)])).placements
        (Shard(dim=2),)
    """

    forward_type = _GroupNormForward
    per_slice = False

    def _validate(self, module: nn.Module) -> None:
        if not isinstance(module, nn.GroupNorm):
            raise HaloError(f"GroupNormParallel applies to nn.GroupNorm, got "
                            f"{type(module).__name__}")
        # it computes `F.group_norm` only (a style already attached is refused at install)
        if not torch_forward(module, nn.GroupNorm, attached=handle_of(module) is not None):
            raise HaloError(f"GroupNormParallel runs nn.GroupNorm's own forward; "
                            f"{type(module).__name__} has a forward of its own, which it "
                            "would skip: expected a plain nn.GroupNorm (plan this module's "
                            "pieces, or give it a style that runs its forward)")
        super()._validate(module)


# ---------------------------------------------------------------- attention over all tokens
class _TokenAttention(TorchFunctionMode):
    """Inside an attention block's local forward: SDPA over the all-gathered keys/values.

    The block's tokens must be its `(t, h, w)` positions with t outermost (`b c t h w ->
    b (t h w) c`), so each rank's queries, keys and values are `T_r * S` contiguous tokens,
    S = H * W. K and V are unflattened to `(..., T_r, S, E)`, gathered along T into
    `(..., T, S, E)` and flattened back: every rank's queries see every token.
    """

    def __init__(self, site: Site, dim: int, agreed: dict[Any, Any]) -> None:
        super().__init__()
        self.site, self.dim, self.calls, self.agreed = site, dim, 0, agreed
        # Tokens per slice along dim: the other spatial dims. Unmasked attention does not
        # depend on the order of its keys, so the sharded dim need not lead the flattening
        # (H sharded under a (t h w) token order gathers each rank's tokens as one block).
        shape = site.local.shape
        self.frame = math.prod(n for i, n in enumerate(shape) if i >= 2 and i != dim)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return self._attend(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            # its SDPA call runs inside it, where this mode does not see it
            raise HaloError("the block calls F.multi_head_attention_forward (an "
                            "nn.MultiheadAttention inside it), whose attention this block's "
                            "AttentionParallel cannot see; give that nn.MultiheadAttention "
                            "its own AttentionParallel entry, with dim its sequence dim")
        if func is F.group_norm and args[0].ndim == self.site.local.ndim:
            raise HaloError("an attention block's F.group_norm over (C, T, H, W) would use "
                            "this rank's frames only; give that nn.GroupNorm its own "
                            "GroupNormParallel entry in the plan")
        return func(*args, **kwargs)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None or dropout_p or is_causal or enable_gqa:
            raise HaloError("AttentionParallel supports scaled_dot_product_attention without "
                            f"mask, dropout, causal or GQA, got attn_mask={attn_mask is not None}"
                            f", dropout_p={dropout_p}, is_causal={is_causal}, "
                            f"enable_gqa={enable_gqa}")
        _check_tokens(q.shape[-2], self.site.local.shape[self.dim], self.frame)
        if has_spare(self.site.spare):
            # the spare slice's tokens (last, t outermost) are no keys; its queries' outputs
            # are dropped with the slice
            k, v = (t.narrow(-2, 0, t.shape[-2] - self.site.spare * self.frame)
                    for t in (k, v))
        # Tokens gathered in frames of S, not as a (..., T_r, S, E) view: that reshape of a
        # per-rank length is not supported under LocalTensorMode. With H sharded too, the
        # T-gathered tokens are gathered again over H's mesh axis, in frames of the other
        # dims' sizes (global T): key order does not matter to unmasked attention.
        site, gathered = self.site, [self.dim]
        for axis, d in ((site.axis, self.dim), *site.others):
            frame = math.prod(site.shape[i] if i in gathered and i != d else site.local.shape[i]
                              for i in range(2, site.local.ndim) if i != d)
            k, v = gather_many((k, v), k.ndim - 2, (site.mesh, axis),
                               global_length=site.shape[d], frame=frame,
                               reuse=self.reuse(d))
            gathered.append(d)
        return sdpa(q, k, v, scale)


    def reuse(self, d: int) -> tuple[dict[Any, Any], Any] | None:
        """The block's agreements and this gather's global signature (DTensor input: the
        same on every rank); None for a plain chunk (its length was gathered anyway)."""
        site, x = self.site, self.site.local
        if site.placements is None:
            return None
        return self.agreed, (site.shape, site.placements, id(site.mesh), d, x.dtype,
                             x.requires_grad, torch.is_grad_enabled())


@maybe_run_for_local_tensor
def _check_tokens(tokens: int, frames: int, frame: int) -> None:
    if tokens != frames * frame:
        raise HaloError(f"AttentionParallel expects the block to attend over its T*H*W "
                        f"tokens: {frames} local frames of {frame} positions make "
                        f"{frames * frame} tokens, but scaled_dot_product_attention got "
                        f"{tokens}")


class _AttentionForward(_LocalForward):
    style = "AttentionParallel"

    def fresh(self) -> None:
        # K/V gathers agreed by global signature: later calls issue no metadata collective
        self.agreed: dict[Any, Any] = {}

    def site(self, x: torch.Tensor) -> Site:
        if isinstance(x, DTensor):  # T, H or both sharded: K/V gathered over each
            return dtensor_site(x, self.dim, several=True)
        # Plain input: the global T comes from one small all-gather of the chunk lengths.
        return site_of(x, self.dim, self.mesh)

    def local(self, site: Site, *args: Any, **kwargs: Any) -> torch.Tensor:
        x, n = site.local, site.local.shape[self.dim]
        if isinstance(n, torch.SymInt) or n == 0:
            # An empty chunk runs as one zero slice (a block's `view(b, c, -1)` or conv
            # refuses 0 elements); styles inside it and its keys leave the slice out, and
            # its output is dropped. Per-rank counts (simulated): pad where a rank lacks one.
            padded = with_spare_slice(x, self.dim)
            site = replace(site, local=padded, spare=padded.shape[self.dim] - n)
        mode = _TokenAttention(site, self.dim, self.agreed)
        ENCLOSING.append(site)
        try:
            with mode:
                y = self.original(site.local, *args, **kwargs)
        finally:
            ENCLOSING.pop()
        if mode.calls != 1:
            raise HaloError(f"AttentionParallel expects the block to call "
                            f"F.scaled_dot_product_attention once, it called it {mode.calls} "
                            "times; a hand-written softmax(q @ k.T) would attend to this "
                            "rank's tokens only")
        if site.local is not x and isinstance(y, torch.Tensor):
            y = y.narrow(self.dim, 0, n)  # the spare frame's output
        return y

    def inside(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise HaloError("AttentionParallel cannot run inside a halo module: its input is a "
                        "window, not a shard")


# ---------------------------------------------------------------- nn.MultiheadAttention
class _FullKeys(TorchFunctionMode):
    """Inside `nn.MultiheadAttention.forward` on a chunk of the sequence: its one
    `F.multi_head_attention_forward` call takes the whole sequence as key and value.

    A mode cannot see the SDPA call inside that function (a mode is off while it handles a
    call, and the function is handled as one), so the call is replaced whole: the local
    queries attend over every position, projected from the gathered input by the module's
    own weights, as on one device (bias_k, bias_v and add_zero_attn append once).
    """

    def __init__(self, keys: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.calls = keys, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.multi_head_attention_forward:
            self.calls += 1
            return func(args[0], self.keys, self.keys, *args[3:], **kwargs)
        return func(*args, **kwargs)


class _MultiheadForward(_LocalForward):
    """`nn.MultiheadAttention` self-attention on a `Shard(dim)` chunk of its sequence: the
    input all-gathered along dim, each rank's queries over every key.

    Forward: `(N, L_r, E)` queries, `(N, L, E)` keys and values -> `(N, L_r, E)` (and the
    attention weights' rows, `(N, L_r, L)`). Backward: the gather's adjoint, a
    reduce-scatter of the keys' and values' input gradient, added to the queries'.
    """

    style = "AttentionParallel"

    def fresh(self) -> None:
        self.agreed: dict[Any, Any] = {}

    def site(self, x: torch.Tensor) -> Site:
        if isinstance(x, DTensor):  # the sequence on one axis; Replicate or batch elsewhere
            return dtensor_site(x, self.dim)
        return site_of(x, self.dim, self.mesh)

    def sharded(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Any:
        problem = _mha_problem(self.module, query, key, value, key_padding_mask, attn_mask,
                               is_causal)
        site = self.site(query)
        x, n = site.local, site.local.shape[self.dim]
        full = self.gather(site, problem)
        # simulated ranks: equal lengths; an empty chunk: one spare query (outputs dropped)
        q = (_equal_chunks(x, self.dim, site) if isinstance(n, torch.SymInt)
             else with_spare_slice(x, self.dim) if n == 0 else x)
        mode = _FullKeys(full.transpose(0, 1) if self.dim == 1 else full)
        with mode:
            out, weights = self.original(q, q, q, need_weights=need_weights,
                                         average_attn_weights=average_attn_weights)
        if mode.calls != 1:
            raise HaloError(f"AttentionParallel expects nn.MultiheadAttention.forward to "
                            f"call F.multi_head_attention_forward once, it called it "
                            f"{mode.calls} times")
        out = rewrap(out.narrow(self.dim, 0, n) if q is not x else out, site, self.dim,
                     site.length)
        return out, None if weights is None else _weight_rows(weights, q is not x, n, site)

    def gather(self, site: Site, problem: str | None) -> torch.Tensor:
        """The input all-gathered along dim. A call refused on some rank sends its input
        in another dtype instead: the ranks' tensors then disagree, so every rank raises
        in the gather at once, rather than the others waiting for this rank."""
        x = site.local
        reuse = None if site.placements is None else (self.agreed, (
            site.shape, site.placements, id(site.mesh), x.dtype, x.requires_grad,
            torch.is_grad_enabled()))
        if problem is not None:
            x = x.detach().to(torch.float32 if x.dtype == torch.float64 else torch.float64)
        try:
            (full,) = gather_many((x,), self.dim, (site.mesh, site.axis),
                                  global_length=site.length, reuse=reuse)
        except HaloError:
            if problem is not None:
                raise HaloError(problem) from None
            raise
        if problem is not None:  # refused on every rank alike
            raise HaloError(problem)
        return full


def _weight_rows(w: torch.Tensor, padded: bool, n: Any, site: Site) -> Any:
    """This rank's rows of the attention weights `(N, [heads,] L, L)`: `Shard` on their
    query dim where the input was sharded along its sequence."""
    rows = w.ndim - 2
    w = w.narrow(rows, 0, n) if padded else w
    if site.placements is None:
        return w
    batch = site.shape[0 if site.dim == 1 else 1]
    shape = (batch, *w.shape[1:rows], site.length, w.shape[-1])
    placements = [Shard(rows) if p == Shard(site.dim) else p for p in site.placements]
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(w, site.mesh, placements, run_check=False, shape=shape,
                              stride=stride)


def _mha_problem(module: nn.Module, query: Any, key: Any, value: Any,
                 key_padding_mask: Any, attn_mask: Any, is_causal: bool) -> str | None:
    """What the sharded self-attention does not implement in this call, or None: it takes
    the same batched tensor as query, key and value; no masks (a mask's columns would have
    to be agreed as global); no dropout in training (its draws would differ from one
    device's)."""
    if not (query is key and key is value):
        return ("AttentionParallel runs nn.MultiheadAttention as self-attention on a sharded "
                "sequence: expected mha(x, x, x) with one tensor, got different query, key "
                "and value")
    if not isinstance(query, torch.Tensor):
        return None  # the site refuses it, on every rank
    if query.ndim != 3:
        return (f"AttentionParallel expects a batched nn.MultiheadAttention input (3-D), "
                f"got {query.ndim}-D")
    if key_padding_mask is not None or attn_mask is not None or is_causal:
        return (f"AttentionParallel supports nn.MultiheadAttention without masks, got "
                f"key_padding_mask={key_padding_mask is not None}, attn_mask="
                f"{attn_mask is not None}, is_causal={is_causal}")
    if module.training and module.dropout > 0:
        return (f"AttentionParallel cannot run nn.MultiheadAttention's dropout "
                f"(p={module.dropout}) in training: its draws would not be one device's; "
                "expected eval() or dropout=0")
    return None


def _check_mha(module: nn.Module, dim: int, local_dims: tuple[int, ...]) -> None:
    """An `nn.MultiheadAttention` running torch's own forward, sharded along its sequence
    dim: 1 with batch_first, else 0."""
    if "forward" in module.__dict__ or type(module).forward is not nn.MultiheadAttention.forward:
        raise HaloError(f"AttentionParallel knows nn.MultiheadAttention's own forward; "
                        f"{type(module).__name__} has a forward of its own")
    expected = 1 if module.batch_first else 0
    if dim != expected or local_dims:
        raise HaloError(f"AttentionParallel shards nn.MultiheadAttention (batch_first="
                        f"{module.batch_first}) along its sequence dim {expected}, got "
                        f"dim={dim}, local_dims={local_dims}; expected dim={expected} and no "
                        "local_dims")


class AttentionParallel(LocalParallel):
    """A block that attends over all T*H*W tokens of a `Shard(T)` input: K/V all-gathered.

    The block's own forward runs on the local chunk `(B, C, T_r, H, W)`: its projections are
    per-token, so they run locally, and its one `F.scaled_dot_product_attention` call (no
    mask, dropout or causal flag) is replaced by attention of the local queries over the
    keys and values all-gathered along T (as `haloshard.gather_along` does). The block must order
    tokens as `(t h w)` with t outermost (the usual `b c t h w -> b (t h w) c`); a GroupNorm
    inside it needs its own `GroupNormParallel` entry (an un-planned one raises). A rank that
    holds no frame (torch.chunk splits: T=9 on 4 ranks is 3, 3, 3, 0) runs the block on one
    zero frame (its convs and `view(b, c, -1)` refuse an empty input), which gives no keys,
    counts in no statistic of the styles inside it and is dropped. Exact, forward and
    backward (the backward of the gather is a reduce-scatter of dK and dV).

    Memory: every rank holds the full K and V of the block, `2 * B * T * H * W * C`
    elements, and autograd keeps them for the backward: that part does not shrink with P.
    Queries, scores (`B * heads * N / P * N` on the math path) and outputs stay sharded.
    Traffic: `2 * (P - 1) / P` of the global K/V bytes per rank, forward and backward.
    A VAE puts this block at the lowest resolution, where K/V are a small share of the peak
    (see benchmarks/vae_memory.py); ring attention would remove it, at more code.

    torch's `nn.MultiheadAttention` (its own forward) is supported as self-attention
    `mha(x, x, x)` sharded along its sequence dim (`dim=1` with batch_first, else 0), no
    masks, no dropout in training: the input is all-gathered along the sequence and each
    rank's queries attend over all of it through the module's own
    `F.multi_head_attention_forward` (the attention weights, if asked for, come back as
    this rank's rows, sharded on their query dim). Exact, forward and backward.

    Args:
        dim: the sharded dim (T) of the block's `(B, C, T, H, W)` input; for
            `nn.MultiheadAttention`, its sequence dim.

    Raises:
        HaloError: in `_apply` for dim < 2 (a block) or, for `nn.MultiheadAttention`, a dim
            other than its sequence dim or a forward of its own; at run time when the block
            calls SDPA other than once, with a mask, dropout or causal flag, over tokens
            that are not its T*H*W positions, or calls `F.multi_head_attention_forward`
            (an inner `nn.MultiheadAttention` needs its own entry); for
            `nn.MultiheadAttention`, a call other than `mha(x, x, x)` without masks, or
            dropout in training.

    Example::
        parallelize_module(vae, mesh, {"encoder.mid.attn": AttentionParallel(),
                                       "encoder.mid.attn.norm": GroupNormParallel()})
        vae.encoder.mid.attn(x).placements  # x: Shard(2); (Shard(dim=2),)

        >>> mha = nn.MultiheadAttention(16, 2, batch_first=True)
        >>> mha = parallelize_module(mha, mesh, AttentionParallel(dim=1))
        >>> x = distribute_tensor(torch.randn(2, 13, 16), mesh, [Shard(1)])
        >>> mha(x, x, x, need_weights=False)[0].placements
        (Shard(dim=1),)
    """

    forward_type = _AttentionForward
    per_slice = False

    def _validate(self, module: nn.Module) -> None:
        if isinstance(module, nn.MultiheadAttention):
            _check_mha(module, self.dim, self.local_dims)
        else:
            super()._validate(module)

    def _forward_type(self, module: nn.Module) -> type[_LocalForward]:
        if isinstance(module, nn.MultiheadAttention):
            return _MultiheadForward
        return self.forward_type


# ---------------------------------------------------------------- temporal resampling
class _StripPadForward(HaloForward):
    """The halo forward of a causal wrapper whose own `F.pad` along dim is dropped.

    Its `F.pad` of other dims that are not sharded (`pads` of the style) is applied to the
    chunk before the exchange instead (`padded_first`), and dropped from the wrapper's call:
    the window then holds the whole padding, so the wrapper's `F.pad` returns it as it is.
    Otherwise the wrapper would copy the window to pad those dims, and the chunk-sized
    window and its padded copy would live at once (one device holds the padded input only).
    """

    strip: HaloShard
    active = False
    wraps_one_conv = True  # a second sharded dim takes the halo of its one conv
    # the wrapper's own F.pad along dims other than dim, as HaloShard(d, left, right, pad)
    pads_first: dict[int, HaloShard]
    padded: dict[int, HaloShard]  # those applied to this call's chunk (set per call)

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # Nested in another halo module, the wrapper keeps its padding (pass-through).
        self.active = not _INSIDE.get()
        self.padded = {}
        return super().__call__(x, *args, **kwargs)

    def original(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return super().original(*args, **kwargs)
        # args[0] is the window the halo forward hands the module
        with ExitStack() as stack:
            dropped = [stack.enter_context(_DroppedPad(d, spec, args[0]))
                       for d, spec in self.padded.items()]
            stack.enter_context(NoPadAlong(self.annotation.dim, self.strip, args[0]))
            y = super().original(*args, **kwargs)
        for mode in dropped:
            if not mode.seen:  # the chunk was padded along a dim the wrapper does not pad
                raise HaloError(f"CausalConvParallel was given pads {{{mode.dim}: "
                                f"{(mode.spec.left, mode.spec.right)}}} but "
                                f"{type(self.module).__name__} does not F.pad dim "
                                f"{mode.dim} itself; expected pads only for the dims its "
                                "forward pads")
        return y

    def exchange_first(self, site: Site, plan: WindowPlan, reuse: Reuse, *args: Any,
                       **kwargs: Any) -> Any:
        self.padded = self.padded_first(site)
        if not self.padded:
            return super().exchange_first(site, plan, reuse, *args, **kwargs)
        window = _padded_window(site, plan, self.annotation, reuse, self.padded)
        token = _INSIDE.set(True)
        try:
            return self.original(window, *args, **kwargs)
        finally:
            _INSIDE.reset(token)

    def several(self, site: Site, *args: Any, **kwargs: Any) -> Any:
        self.padded = self.padded_first(site)
        return super().several(site, *args, **kwargs)

    def windows_across(self, site: Site, plans: list[tuple[int, int, WindowPlan]],
                       stencils: list[Stencil], reuse: Reuse) -> torch.Tensor:
        """T and H sharded at once: the chunk padded first along the dims neither shards (W),
        then exchanged along each: the window holds all of the wrapper's padding, and the
        padded chunk is freed once the window is built, or, in inference, never built
        apart (`halo_windows`)."""
        if not self.padded:
            return super().windows_across(site, plans, stencils, reuse)
        grad = site.local.requires_grad and torch.is_grad_enabled()  # the padded chunk's
        return halo_windows(site, plans, stencils, padded_reuse(reuse, grad),
                            pads=self.padded)

    def padded_first(self, site: Site) -> dict[int, HaloShard]:
        """The wrapper's own pads along dims this call does not shard, where the chunk can
        take them: replicate (any mode but zeros) cannot pad a chunk with no slice, and
        whether any rank holds none is known alike on every rank (the global lengths)."""
        if not self.active or not self.pads_first:
            return {}
        sharded = [(site.axis, site.dim), *site.others]
        empty = any(min(shard_sizes(site.shape[d], site.mesh.size(axis))) == 0
                    for axis, d in sharded)
        if empty and any(s.pad != "zeros" for s in self.pads_first.values()):
            return {}
        dims = {d for _, d in sharded}
        return {d: s for d, s in self.pads_first.items()
                if (s.left or s.right) and d not in dims}


class _DroppedPad(NoPadAlong):
    """`NoPadAlong` that records whether the wrapper padded its dim at all."""

    seen = False

    def _strip(self, args: list[Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...],
                                                                        dict[str, Any]]:
        widths = list(args[1] if len(args) > 1 else kwargs.get("pad", ()))
        k = 2 * (args[0].ndim - 1 - self.dim)
        self.seen = self.seen or any(widths[k : k + 2])
        return super()._strip(args, kwargs)


def _padded_window(site: Site, plan: WindowPlan, annotation: Annotation, reuse: Reuse,
                   pads: dict[int, HaloShard]) -> torch.Tensor:
    """The chunk padded along `pads`' dims (each slice alone, as the single-device `F.pad`
    pads it, so the halo slices arrive padded alike), then exchanged along dim: this
    rank's window (`halo_windows` with one axis: in inference the padded chunk is written
    straight into the window)."""
    grad = site.local.requires_grad and torch.is_grad_enabled()  # the padded chunk's
    return halo_windows(site, [(site.axis, annotation.dim, plan)], [annotation.stencil],
                        padded_reuse(reuse, grad), pads=pads)


def _one_conv(module: nn.Module, dim: int) -> nn.Conv1d:
    convs = [m for m in module.modules() if isinstance(m, CONVS)]
    if len(convs) != 1:
        raise HaloError(f"CausalConvParallel expects a wrapper around exactly one conv, "
                        f"{type(module).__name__} holds {len(convs)}")
    conv = convs[0]
    # Anything else inside would run on the window, halo slices included: a norm's
    # statistics would count them; only the conv and modules holding it are known.
    others = [f"{fqn} ({type(m).__name__})" for fqn, m in module.named_modules()
              if m is not conv and not any(c is conv for c in m.modules())]
    if others:
        raise HaloError(f"CausalConvParallel expects a wrapper around exactly one conv and "
                        f"nothing else, {type(module).__name__} also holds {others}; plan "
                        "those modules and the conv separately")
    si = spatial_index(conv, dim)
    if any(conv_padding(conv)[si]):
        raise HaloError(f"CausalConvParallel expects the wrapped conv to have no padding "
                        f"along dim {dim} (the wrapper pads it with F.pad), got padding "
                        f"{conv.padding}")
    return conv


class CausalConvParallel(ParallelStyle):
    """A causal conv wrapper (`F.pad` by `k - 1` frames on the left, then a conv with no T
    padding, any stride and dilation): exact on `Shard(T)`, e.g. the stride-2 downsampler.

    The halo and output windows come from the wrapped conv (`span - 1` frames of `pad` on
    the left, its stride): each rank's output chunk is the `Shard(dim)` chunk of the
    single-device output, uneven and odd lengths included. The wrapper's own `F.pad` along
    dim is dropped (the halo holds it), after checking it is exactly `(span - 1, 0)` of mode
    `pad`. `HaloParallel(HaloShard(...))` covers only length-preserving wrappers.

    A wrapper that pads other dims itself too (HunyuanVideo's and Mochi's `F.pad` of H and
    W, replicate) names those widths in `pads`: when such a dim is sharded as well (T and H
    on a `(t, h)` mesh) its halo holds that padding, as along dim. `pads` may also give
    dim's own widths: `CausalConvParallel(dim=3, pads={3: (1, 1)})` is such a wrapper with H
    sharded (its centred `F.pad` of H dropped, the conv's stride along H kept). Naming
    the widths of a dim that is not sharded saves memory: the chunk is padded along it
    before the exchange, so the window holds all of the wrapper's padding and the
    wrapper's `F.pad` copies nothing (one window per rank, not the window and its padded
    copy); the diffusers plans name HunyuanVideo's and Mochi's H and W widths.

    Args:
        pad: the wrapper's padding mode: "replicate" (video VAEs) or "zeros".
        dim: the sharded dim.
        pads: `{dim: (left, right)}`, the widths of the wrapper's own `F.pad` (mode `pad`)
            along dims it pads itself; along dim, `(span - 1, 0)` (causal) when not given.

    Raises:
        HaloError: in `_apply`, for a module that does not hold exactly one conv (and no
            other module) with no padding of its own along dim or a dim in `pads`, or
            widths that are not two ints >= 0; at run time, when the wrapper pads otherwise
            (or does not pad a dim named in `pads`).

    Example::
        >>> causal = CausalConv3d(8, k=3)  # F.pad (2, 0) replicate, then conv
        >>> causal = parallelize_module(causal, mesh, CausalConvParallel())
        >>> x = distribute_tensor(torch.randn(1, 8, 13, 4, 4), mesh, [Shard(2)])
        >>> causal(x).placements, causal(x).shape[2]
        ((Shard(dim=2),), 13)
    """

    def __init__(self, *, pad: PadMode = "replicate", dim: int = 2,
                 pads: dict[int, tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.pad, self.dim = pad, dim
        self.pads = _own_pads(pads or {})

    def __repr__(self) -> str:
        pads = f", pads={self.pads}" if self.pads else ""
        return f"CausalConvParallel(pad={self.pad!r}, dim={self.dim}{pads})"

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        conv = _one_conv(module, self.dim)
        for d in self.pads:
            _one_conv(module, d)  # no padding of its own along a dim the wrapper pads
        si = spatial_index(conv, self.dim)
        span = conv.dilation[si] * (conv.kernel_size[si] - 1) + 1
        left, right = self.pads.get(self.dim, (span - 1, 0))
        stencil = ConvStencil(span=span, stride=conv.stride[si], pad_left=left,
                              pad_right=right, pad=self.pad)
        halo = HaloForward.of(module, Annotation(None, self.dim, stencil), device_mesh)
        plain = install(module, halo)
        base = module.forward
        assert isinstance(base, HaloForward) and plain.attached
        forward = _StripPadForward(module, base.annotation, base.mesh, base.saved,
                                   base.previous, overlap=False, name=base.name)
        forward.strip = HaloShard(self.dim, left=left, right=right, pad=self.pad)
        forward.own_pads = {d: HaloShard(d, left=lr[0], right=lr[1], pad=self.pad)
                            for d, lr in self.pads.items() if d != self.dim}
        forward.pads_first = dict(forward.own_pads)
        module.forward = forward  # the handle restores base.previous, not this object
        return module


def _own_pads(pads: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """`CausalConvParallel`'s `pads`, checked: spatial dims to two widths >= 0."""
    for d, widths in pads.items():
        ok = (isinstance(d, int) and d >= 2 and isinstance(widths, tuple)
              and len(widths) == 2 and all(isinstance(w, int) and w >= 0 for w in widths))
        if not ok:
            raise HaloError(f"CausalConvParallel takes pads as {{dim: (left, right)}} with a "
                            f"spatial dim >= 2 and two ints >= 0, got {d!r}: {widths!r}")
    return dict(pads)


@dataclass(frozen=True)
class FirstFrameStencil:
    """"Keep the first frame, resample the rest" along dim, by an integer factor.

    down: outputs `[x0, pool(x1..xf), pool(x_{f+1}..x_{2f}), ...]`, length `1 + (T-1) // f`;
    up: outputs `[x0, x1 * f times, x2 * f times, ...]`, length `1 + (T-1) * f`.
    The module runs on a window that starts one input early (a throw-away "first frame")
    when the rank's outputs do not start at 0; `window` returns where the wanted outputs
    start in the module's output.

    `even` says what the module does with an even T: "first" keeps the first frame for any
    T (the formulas above); "all" resamples every frame (`T // 2` or `2 * T` outputs: the
    CogVideoX samplers, which branch on the parity of their input, so every window gets the
    parity of the global T); None raises for an even T, since either would be a guess.

    Example::
        >>> FirstFrameStencil(2, "down").window(2, 4), FirstFrameStencil(2, "up").window(3, 6)
        ((2, 7, 1), (1, 4, 1))
    """

    factor: int
    direction: Literal["down", "up"]
    pad: PadMode = "zeros"  # only read by windows widened to an odd length (dropped outputs)
    fill: float | None = None
    min_input: int = 1
    even: Literal["first", "all"] | None = "first"
    odd_windows: bool = False

    def __post_init__(self) -> None:
        if self.factor < 1 or self.direction not in ("down", "up"):
            raise HaloError(f"FirstFrameStencil needs factor >= 1 and direction 'down' or "
                            f"'up', got factor={self.factor}, direction={self.direction!r}")
        if self.even not in ("first", "all", None) or (self.even == "all" and self.factor != 2):
            raise HaloError(f"FirstFrameStencil needs even='first', 'all' (factor 2 only) or "
                            f"None, got even={self.even!r} with factor={self.factor}")

    def at_length(self, length: int) -> Stencil:
        """The stencil for a global length: the parity of T may change the computation."""
        if self.even == "first" or length % 2:
            return replace(self, odd_windows=self.even == "all")
        if self.even is None:
            raise HaloError(
                f"FirstFrameParallel({self.factor}, {self.direction!r}) got an even length "
                f"{length} along the sharded dim and does not know what the module does "
                "then; expected even='first' (it keeps the first frame for any length) or "
                "even='all' (it resamples every frame, as CogVideoX's samplers do)")
        plain: Stencil = (ConvStencil(span=2, stride=2) if self.direction == "down"
                          else ResampleStencil(2))
        return Parity(plain, 0)

    def out_length(self, length: int) -> int:
        if length <= 0:
            return 0
        f = self.factor
        return 1 + (length - 1) // f if self.direction == "down" else 1 + (length - 1) * f

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        f = self.factor
        if self.direction == "down":
            last = 1 + (stop - 1) * f
            return (0, last, 0) if start == 0 else ((start - 1) * f, last, 1)
        i0 = 0 if start == 0 else (start - 1) // f
        i1 = 1 if stop == 1 else (stop - 2) // f + 2
        # A module that branches on parity sees an odd window: one more frame on the right,
        # whose outputs are dropped.
        return i0, i1 + (self.odd_windows and (i1 - i0) % 2 == 0), start - i0 * f


@dataclass(frozen=True)
class Parity:
    """`inner`'s windows, widened on the right to the given parity (0: even, 1: odd) for a
    module that branches on the parity of its input; the extra outputs are dropped.

    Example::
        >>> Parity(ResampleStencil(2), 0).window(2, 4)
        (1, 3, 0)
    """

    inner: Stencil
    parity: int

    @property
    def pad(self) -> PadMode:
        return self.inner.pad

    @property
    def fill(self) -> float | None:
        return self.inner.fill

    @property
    def min_input(self) -> int:
        return self.inner.min_input + (self.inner.min_input % 2 != self.parity)

    def out_length(self, length: int) -> int:
        return self.inner.out_length(length)

    def window(self, start: int, stop: int) -> tuple[int, int, int]:
        i0, i1, offset = self.inner.window(start, stop)
        return i0, i1 + ((i1 - i0) % 2 != self.parity), offset


# Classes whose rule along T is not "keep the first frame, resample the rest" (a causal
# conv before or after the resampling), and the style that implements theirs.
_FITTING_STYLE = {
    "LTXVideoUpsampler3d": "LTXUpsamplerParallel (haloshard.integrations.diffusers)",
    "HunyuanVideoUpsampleCausal3D": "HunyuanUpsampleParallel (haloshard.integrations.diffusers)",
}


@dataclass(frozen=True)
class _Kernel:
    """A conv or pooling inside a resampler: where it is and what it reads along dim."""

    fqn: str
    kind: str
    rank: int  # spatial dims: it reads dim only on inputs of rank + 2 dims
    kernel: int
    stride: int
    padding: int


def _kernels(module: nn.Module, dim: int) -> tuple[_Kernel, ...]:
    """The convs and poolings inside `module` with a kernel dim at `dim`, as plain data (a
    deep copy of the model shares the style's run rule, which must not hold modules)."""
    found = []
    for fqn, m in module.named_modules():
        rank = SPATIAL.get(type(m)) or next(
            (n for cls, n in SPATIAL.items() if isinstance(m, cls)), None)
        if rank is None or not 2 <= dim < rank + 2:
            continue
        found.append(_Kernel(fqn or "<module>", type(m).__name__, rank,
                             *(_along(v, dim - 2) for v in
                               (m.kernel_size, m.stride or m.kernel_size, m.padding))))
    return tuple(found)


def _along(value: int | str | tuple[int, ...], i: int) -> int:
    """A kernel attribute's entry for spatial index i; string paddings: "valid" is 0,
    "same" counts as padding (it pads whenever the kernel is longer than 1)."""
    if isinstance(value, str):
        return 0 if value == "valid" else 1
    return int(value if isinstance(value, int) else value[i])


def _reads_beyond(k: _Kernel, stencil: FirstFrameStencil, own_rule: bool) -> bool:
    """Whether a kernel along dim reads frames the window does not hold: only per-frame
    kernels and, down, a kernel pooling exactly each group (kernel = stride = factor, no
    padding) fit; with a `local` rule of its own (Wan's cached path) the window's
    throw-away first frame is the group's context, so `factor + 1` frames fit too."""
    if k.kernel == 1:  # per frame (a padding would change the length: checked after)
        return False
    f = stencil.factor
    if stencil.direction != "down" or k.stride != f or k.padding:
        return True
    return k.kernel > (f + 1 if own_rule else f)


@dataclass(frozen=True)
class _Meeting:
    """Where a call's ranks meet: their group (mesh, axis) and the call's global signature."""

    group: Any
    key: Any


class _FirstFrameRun:
    """How a `FirstFrameParallel` module runs on its window: checked, then as given.

    The window holds one input frame before the first group the rank's outputs read (a
    throw-away first frame), nothing more: a conv or pooling along dim that reads further
    would read the window's own padding instead of the neighbours' frames (wrong numbers),
    so it raises at the first call (when the input's rank tells which kernels run along
    dim), on every rank alike. The module's output on its window must also have the rule's
    length; windows differ by rank, so that is agreed once per input signature (a small
    gather): a module off the rule on one rank's window raises on every rank at once.
    """

    def __init__(self, stencil: FirstFrameStencil, dim: int, local: LocalRun | None,
                 kernels: tuple[_Kernel, ...], name: str) -> None:
        self.stencil, self.dim, self.local = stencil, dim, local
        self.kernels, self.name = kernels, name
        self.meet: _Meeting | None = None  # set by the halo forward before each run
        self.agreed: set[Any] = set()  # signatures whose output lengths were agreed

    def __call__(self, forward: Any, window: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.check_kernels(window.ndim)
        y = (forward(window, *args, **kwargs) if self.local is None
             else self.local(forward, window, *args, **kwargs))
        out = y[0] if isinstance(y, tuple) and y else y
        got = out.shape[self.dim] if isinstance(out, torch.Tensor) else -1
        self.check_length(window, got)
        return y

    def check_kernels(self, ndim: int) -> None:
        own_rule = self.local is not None
        bad = [k for k in self.kernels
               if k.rank + 2 == ndim and _reads_beyond(k, self.stencil, own_rule)]
        if bad:
            k = bad[0]
            raise HaloError(
                f"FirstFrameParallel({self.stencil.factor}, {self.stencil.direction!r}) runs "
                f"{self.name} on windows holding one input frame of context, but its {k.fqn} "
                f"({k.kind}) reads kernel {k.kernel}, stride {k.stride}, padding {k.padding} "
                f"along dim {self.dim}; expected kernel 1 (or, down, kernel = stride = "
                "factor): give the module a stencil of its own (HaloParallel(stencil)) or "
                "plan that conv on its own")

    def check_length(self, window: torch.Tensor, got: Any) -> None:
        length, meet = window.shape[self.dim], self.meet
        if meet is None or not _comm.is_eager(window) or meet.key in self.agreed:
            # simulated or compiled, or agreed before: each rank checks its own
            _check_rule_length(got, length, self.stencil, self.dim, None)
            return
        rows = _comm.gather_ints(torch.tensor([got, length]), _comm.resolve_group(meet.group),
                                 what="check of the first-frame rule's output lengths")
        for rank, (got_r, length_r) in enumerate(rows):
            _check_rule_length(got_r, length_r, self.stencil, self.dim, rank)
        self.agreed.add(meet.key)


class _FirstFrameForward(HaloForward):
    """The halo forward of a `FirstFrameParallel` module: it tells the module's run rule
    where each call's ranks meet."""

    def exchange_first(self, site: Site, plan: WindowPlan, reuse: Reuse, *args: Any,
                       **kwargs: Any) -> Any:
        self.meet(site)
        return super().exchange_first(site, plan, reuse, *args, **kwargs)

    def several(self, site: Site, *args: Any, **kwargs: Any) -> Any:
        self.meet(site)
        return super().several(site, *args, **kwargs)

    def meet(self, site: Site) -> None:
        assert isinstance(self.local, _FirstFrameRun)
        self.local.meet = _Meeting((site.mesh, site.axis), self.reuse(site)[1])


@maybe_run_for_local_tensor
def _check_rule_length(got: int, length: int, stencil: FirstFrameStencil, dim: int,
                       rank: int | None) -> None:
    """The module's output length on a window of `length` frames must be the rule's: the
    first frame kept and the rest resampled, or, with even="all" and an even window,
    every frame resampled (the module branches on its input's parity)."""
    f = stencil.factor
    if stencil.even == "all" and length % 2 == 0:
        expected = length // f if stencil.direction == "down" else length * f
    else:
        expected = stencil.out_length(length)
    if got != expected:
        where = "" if rank is None else f" on rank {rank}"
        raise HaloError(
            f"FirstFrameParallel({f}, {stencil.direction!r}, even={stencil.even!r}) expects "
            f"{expected} slices along dim {dim} from a window of {length}{where} (the first "
            f"frame kept, the rest resampled by {f}), the module returned {got}: it does "
            "not follow that rule")


class FirstFrameParallel(ParallelStyle):
    """A module that keeps the first frame and resamples the rest along T, exact on Shard(T).

    Covers CogVideoX-style temporal down- and upsamplers: `down` pools each group of
    `factor` frames after the first (any pooling, or a conv of kernel = stride = factor
    along T, that maps `1 + n * factor` frames to `1 + n`), `up` repeats each frame after
    the first `factor` times; any other layer inside works frame by frame. The module itself
    runs unedited on a window of its input holding one input frame of context; only the
    outputs this rank owns are kept. Any odd length T is exact (down drops the
    `(T - 1) % factor` trailing frames, as the module does on one device); for an even T the
    module's own rule must be declared with `even`. A resampler with a temporal conv that
    reads more context (LTX-Video's upsampler, HunyuanVideo's) has a style of its own.

    Args:
        factor: the temporal factor.
        direction: "down" or "up".
        even: what the module does with an even T: "first" keeps the first frame for any T
            (HunyuanVideo's upsampler); "all" resamples every frame, pairs pooled from
            frame 0 or every frame repeated (CogVideoX's `DownSample3D` / `Upsample3D`,
            factor 2); None (the default) raises `HaloError` at run time on an even T.
        dim: the sharded dim.
        local_dims: other dims the module treats slice by slice (each output slice along
            them reads only the same input slice: pooling or repeating frames), so the
            input may also be sharded on them (T and H at once); the module then runs on
            its local chunk along them, with no halo.
        local: how the module runs on its window, `local(forward, window) -> output`, for
            a module whose first-frame rule lives in a protocol of its own rather than in
            one call (Wan's `WanResample` keeps the first frame only when called on it alone,
            with a frame cache: see `haloshard.integrations.diffusers`); None: one call.

    Raises:
        HaloError: for factor < 1 or another direction; in `_apply` for dim < 2 or a
            module that is or holds one whose rule is known to be another (LTX-Video's and
            HunyuanVideo's upsamplers: the error names their style); at the first call,
            for a conv or pooling inside that reads along dim more than the window holds
            (kernel > 1, other than kernel = stride = factor down; `factor + 1` with a
            `local` rule); at run time for an even T with even=None, or when the module's
            output on its window does not have the rule's length (on any rank: every rank
            raises).

    Example::
        >>> class Down(nn.Module):  # keeps frame 0, averages the others in pairs
        ...     def forward(self, x):
        ...         rest = F.avg_pool3d(x[:, :, 1:], (2, 1, 1))
        ...         return torch.cat([x[:, :, :1], rest], dim=2)
        >>> down = parallelize_module(Down(), mesh, FirstFrameParallel(2, "down"))
        >>> down(distribute_tensor(torch.randn(1, 8, 9, 4, 4), mesh, [Shard(2)])).shape[2]
        5
    """

    def __init__(self, factor: int, direction: Literal["down", "up"], *,
                 even: Literal["first", "all"] | None = None, dim: int = 2,
                 local_dims: tuple[int, ...] = (), local: LocalRun | None = None) -> None:
        super().__init__()
        self.stencil = FirstFrameStencil(factor, direction, even=even)
        self.dim, self.local = dim, local
        self.local_dims = _local_dims(local_dims, dim, "FirstFrameParallel")

    def __repr__(self) -> str:
        s = self.stencil
        return (f"FirstFrameParallel({s.factor}, {s.direction!r}, even={s.even!r}, "
                f"dim={self.dim})")

    @names_errors
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_dim(module, self.dim, "FirstFrameParallel")
        for fqn, inner in module.named_modules():
            fitting = _FITTING_STYLE.get(type(inner).__name__)
            if fitting is not None:
                where = f" (at {fqn})" if fqn else ""
                raise HaloError(f"FirstFrameParallel does not know {type(inner).__name__}'s "
                                f"rule along T{where}: a causal conv beside the resampling "
                                f"reads more than one frame of context; use {fitting}")
        run = _FirstFrameRun(self.stencil, self.dim, self.local, _kernels(module, self.dim),
                             type(module).__name__)
        install(module, HaloForward.of(module, Annotation(None, self.dim, self.stencil),
                                       device_mesh, local=run))
        base = module.forward
        assert isinstance(base, HaloForward)
        forward = _FirstFrameForward(module, base.annotation, base.mesh, base.saved,
                                     base.previous, overlap=False, name=base.name, local=run)
        forward.per_slice = self.local_dims
        module.forward = forward  # the handle restores base.previous, not this object
        return module


# ---------------------------------------------------------------- per-sample tensors
class _AsReplicate(torch.autograd.Function):
    """A plain tensor taken as `Replicate` on a mesh, for an op with `Shard(T)` DTensors.

    Forward: `t -> DTensor(t, [Replicate()])`. Backward: the gradient's local value is this
    rank's partial sum (a `Partial` gradient: the op summed over this rank's frames), as
    haloshard's parameter gradients are; a `Replicate` gradient counts once, on rank 0.
    """

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, mesh: DeviceMesh) -> DTensor:  # type: ignore[override]
        ctx.mesh = mesh
        return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:  # type: ignore[override]
        if not isinstance(grad, DTensor):
            return grad, None
        local = _diagonal(grad.to_local())
        if any(p.is_partial() for p in grad.placements):
            return local, None
        return _on_first(local, *(ctx.mesh.get_local_rank(a) for a in range(ctx.mesh.ndim))), None


def _diagonal(t: torch.Tensor) -> torch.Tensor:
    """Under simulated ranks DTensor's backward may nest per-rank values (a LocalTensor of
    LocalTensors); rank r's value is then its own rank's entry."""
    if not isinstance(t, LocalTensor) or not any(
            isinstance(v, LocalTensor) for v in local_tensors(t).values()):
        return t
    return LocalTensor({r: local_tensors(v)[r] if isinstance(v, LocalTensor) else v
                        for r, v in local_tensors(t).items()})


@maybe_run_for_local_tensor
def _on_first(t: torch.Tensor, *coordinates: int) -> torch.Tensor:
    """`t` on the mesh's first rank (every coordinate 0), zeros on the others; per rank
    under simulated ranks (whose coordinates differ by rank)."""
    return t if all(c == 0 for c in coordinates) else torch.zeros_like(t)


class _Replicating(TorchFunctionMode):
    """Plain tensors that meet a DTensor in one op are taken as replicated (`_AsReplicate`).
    One that spans the sharded dim (more than one slice along it, at the DTensor's rank)
    could be a local chunk, which taken as replicated would be silently wrong: it raises."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        dt = next((t for t in flat if isinstance(t, DTensor)), None)
        if dt is not None and any(_plain(t) for t in flat):
            for t in flat:
                if _plain(t) and t.ndim == dt.ndim and t.shape[self.dim] > 1:
                    raise HaloError(
                        f"ReplicatedArgsParallel: a plain tensor of shape {tuple(t.shape)} "
                        f"spans the sharded dim {self.dim} of a DTensor of shape "
                        f"{tuple(dt.shape)} in {getattr(func, '__name__', func)}; expected "
                        "per-sample tensors (size 1 along it), or pass it as a DTensor")
            flat = [_AsReplicate.apply(t, dt.device_mesh) if _plain(t) else t for t in flat]
            args, kwargs = tree_unflatten(flat, spec)
            return tree_map(lambda y: _resharded(y, dt, self.dim), func(*args, **kwargs))
        return func(*args, **kwargs)


def _resharded(y: Any, dt: DTensor, dim: int) -> Any:
    """`y` (an op's output) with `dt`'s placements where DTensor returned it replicated
    along `dim`. DTensor shards an op's output along a dim only where every operand can
    be: with fewer slices along `dim` than ranks (a chunk empty: one latent row on two
    ranks), a per-sample tensor taken as replicated (one slice along it) cannot be, so
    DTensor gathers the input and returns `Replicate()`, which the next halo layer
    refuses. Its rows are cut back to `dt`'s layout: a local slice, no communication."""
    if (isinstance(y, DTensor) and y.ndim == dt.ndim and y.shape[dim] == dt.shape[dim]
            and y.placements != dt.placements
            and all(p == q or isinstance(p, Replicate)
                    for p, q in zip(y.placements, dt.placements, strict=True))):
        return y.redistribute(dt.device_mesh, dt.placements)
    return y


def _plain(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor)


class _ReplicatedArgsForward(_LocalForward):
    style = "ReplicatedArgsParallel"

    def sharded(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, DTensor):
            return self.original(x, *args, **kwargs)  # plain chunks: nothing is mixed
        placements = list(x.placements)
        if (placements.count(Shard(self.dim)) != 1
                or any(p != Shard(self.dim) and not isinstance(p, Replicate)
                       for p in placements)):
            raise HaloError(f"ReplicatedArgsParallel takes tensors as replicated, so its "
                            f"input must be Shard({self.dim}) on one mesh axis and "
                            f"Replicate on the others, got {tuple(x.placements)}")
        _agree_per_sample(x, self.dim, args, kwargs, self.name or type(self.module).__name__)
        with _Replicating(self.dim):
            return self.original(x, *args, **kwargs)


def _agree_per_sample(x: DTensor, dim: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                      name: str) -> None:
    """`HaloError` on every rank unless the plain tensors passed beside `x` (timestep
    tables) are the same on every rank of its `Shard(dim)` axis: each rank takes them as
    replicated, so a table that differs between ranks would be silently wrong. Their
    checksums ride in one small all-gather per call (no collective runs anyway here).
    Simulated and compiled ranks run one program with one table: no gather."""
    if not _comm.is_eager(x.to_local()):
        return
    plain = [t for t in tree_flatten((args, kwargs))[0] if _plain(t)]
    digest = [0, 0, 0]
    if plain:  # one fixed-size row whatever the count (a gather of rows of one size)
        sums = torch.stack([_checksum(t).cpu() for t in plain])
        order = torch.arange(1, len(plain) + 1, dtype=torch.int64).unsqueeze(1)
        digest = (sums * order).sum(0).tolist()
    row = torch.tensor([len(plain), *digest])
    axis = list(x.placements).index(Shard(dim))
    rows = gather(row, _comm.resolve_group((x.device_mesh, axis)),
                  "per-sample tensors exchange")
    check_rows(rows, replace(_PER_SAMPLE, prefix=f"{name}: "), None)


# The plain tensors beside a sharded input: their count, then a digest of their values,
# shapes and dtypes (`_checksum`), the same on every rank.
_PER_SAMPLE = Fields(
    ("count", "values 0", "values 1", "values 2"), "ReplicatedArgsParallel",
    "expected the same per-sample tensors on every rank", error=None,
    show=lambda field, values: (
        "the plain tensors passed beside the sharded input (ReplicatedArgsParallel takes "
        "them as replicated): " + ("their counts" if field == "count" else
                                   "a checksum of their values, shapes and dtypes"), values))


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Two position-weighted sums of `t`'s bytes, with its shape and dtype (int64)."""
    raw = t.detach().contiguous().view(-1)
    raw = (raw.to(torch.uint8) if raw.dtype == torch.bool else raw).view(torch.uint8)
    weights = torch.arange(1, raw.numel() + 1, device=raw.device, dtype=torch.int64)
    values = raw.to(torch.int64)
    meta = zlib.crc32(f"{tuple(t.shape)}:{t.dtype}".encode())
    return torch.stack([(values * weights).sum(), (values * weights * weights).sum(),
                        values.new_tensor(meta)])


class ReplicatedArgsParallel(LocalParallel):
    """Run a container's own forward on its `Shard(dim)` DTensor activations where plain
    tensors without the sharded dim meet them: a timestep embedding, per-sample scale and
    shift tables (LTX-Video's timestep-conditioned decoder and resnets).

    Those plain tensors are taken as `Replicate` on the input's mesh for the ops that mix
    them with DTensors, as torch's `implicit_replication` does, but differentiably in
    haloshard's convention: their gradients (and the parameters' they come from) are this
    rank's partial sums, summed over the cp ranks by `reduce_grads`, DDP or FSDP. The
    container's children keep their own plan entries. Every call checks that the plain
    tensors passed to the container are the same on every rank (one all-gather of a
    4-int checksum row): taken as replicated, a table that differs would be silently wrong.

    Raises:
        HaloError: at run time for a DTensor input sharded or partial on another mesh axis
            (a replicated per-sample tensor would not match a batch shard); on every rank
            at once when the plain tensors passed beside the input differ between ranks.

    Example::
        >>> class Block(nn.Module):  # scales each sample's frames by its own temb value
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.conv = nn.Conv3d(8, 8, 3, padding=1)
        ...     def forward(self, x, temb):
        ...         return self.conv(x) * temb[:, None, None, None, None]
        >>> plan = {"": ReplicatedArgsParallel(), "conv": HaloParallel()}
        >>> block = parallelize_module(Block(), mesh, plan)
        >>> x = distribute_tensor(torch.randn(2, 8, 13, 4, 4), mesh, [Shard(2)])
        >>> block(x, torch.ones(2)).placements  # temb: a plain (B,) tensor
        (Shard(dim=2),)
    """

    forward_type = _ReplicatedArgsForward
