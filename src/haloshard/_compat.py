"""Every private or version-new torch name haloshard touches, in one place.

haloshard extends DTensor where torch offers no public hook (custom op handlers, the
sharding-propagation slow path), simulates ranks with `LocalTensorMode`, and moves halos
with functional collectives; all of these live in torch's private modules and change between
releases. This module checks the installed torch at import, then imports each private name
once and gives it a stable local name; every other module imports it from here. A name that
torch renamed inside the supported range is bound to whichever spelling the installed release
has. Moving to a new torch release means editing this file (and `SUPPORTED_TORCH`), nowhere
else.

Importing it changes nothing in torch: it only reads names (the `fake` backend, which
registers itself on import, is imported by `fake_store()` when called).
"""

# ruff: noqa: E402  (the version check must run before the private imports can fail)

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

# The torch releases (major, minor) this module was written and tested against, oldest and
# newest: every name below exists in each of them (some under an older spelling, see
# `renamed`), and `scripts/torch_versions.sh` ran the fast test subset on each.
SUPPORTED_TORCH = ((2, 12), (2, 14))


def torch_release(version: str) -> tuple[int, int] | None:
    """The (major, minor) of a torch version string (any patch, local build tag or
    pre-release), or None if it has none.

    Example::
        >>> torch_release("2.13.0+cpu"), torch_release("2.15.0a0+git1"), torch_release("x")
        ((2, 13), (2, 15), None)
    """
    found = re.match(r"(\d+)\.(\d+)(?!\d)", str(version))
    return None if found is None else (int(found[1]), int(found[2]))


def _name(release: tuple[int, int]) -> str:
    return f"{release[0]}.{release[1]}"


def check_torch_version(version: str) -> None:
    """Refuse a torch older than the supported range; warn about one newer than it.

    Older releases lack private names haloshard needs or trace it differently under
    torch.compile (2.11: a compiled exchange's backward differed from eager), and wrong
    numbers or a later failure are worse than an error now. A newer release usually keeps
    them, so it gets a warning, not an error: the user's training or serving stack chooses
    their torch.

    Raises:
        ImportError: for a release below `SUPPORTED_TORCH` or a version with no release
            number, naming the installed version and the supported range.

    Example::
        >>> check_torch_version("2.13.0+cpu")
        >>> check_torch_version("2.10.0")
        Traceback (most recent call last):
        ImportError: haloshard supports torch 2.12 to 2.14, but torch 2.10.0 is installed...
    """
    oldest, newest = SUPPORTED_TORCH
    supported = f"torch {_name(oldest)} to {_name(newest)}"
    release = torch_release(version)
    if release is None or release < oldest:
        raise ImportError(
            f"haloshard supports {supported}, but torch {version} is installed: haloshard "
            "relies on torch internals (DTensor's op dispatcher, LocalTensorMode, functional "
            "collectives, their tracing by torch.compile) that older releases lack or run "
            f"differently; install torch>={_name(oldest)}")
    if release > newest:
        warnings.warn(
            f"haloshard was tested with {supported}, but torch {version} is installed: it "
            "relies on torch internals that may have changed; run "
            "scripts/torch_versions.sh on this release to check", UserWarning, stacklevel=2)


def torch_before(version: str) -> bool:
    """Whether the installed torch is a release older than `version` ("2.13"): for tests that
    hit a limit of torch's own in older releases (`tests/conftest.py`'s `requires_torch`)."""
    installed, wanted = torch_release(torch.__version__), torch_release(version)
    assert wanted is not None, f"not a torch release: {version!r}"
    return installed is not None and installed < wanted


def renamed(module: ModuleType, new: str, old: str) -> Any:
    """`module.new` where this torch has it, else `module.old` (a predecessor with the same
    signature, from the releases before the rename)."""
    return getattr(module, new) if hasattr(module, new) else getattr(module, old)


check_torch_version(torch.__version__)

from torch.distributed import _functional_collectives as _funcol
from torch.distributed import _local_tensor as _local
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _dtensor_spec as _spec
from torch.distributed.tensor import _op_schema as _schema
from torch.utils import _pytree

# Simulated ranks (`LocalTensorMode`, one process playing every rank):
# the symbolic per-rank int behind a group-local rank (`_comm`);
LocalIntNode = _local.LocalIntNode
# a tensor holding one value per rank (`testing.per_rank`);
LocalTensor = _local.LocalTensor
# the mode that runs every op once per rank (`testing.simulated_mesh`);
LocalTensorMode = _local.LocalTensorMode
# the active mode or None (plain c10d calls only outside simulation);
enabled_local_tensor_mode = _local.enabled_local_tensor_mode
# run a block on plain tensors (probes, per-rank reads);
maybe_disable_local_tensor_mode = _local.maybe_disable_local_tensor_mode
# run a function of the rank once per rank and combine the results.
maybe_run_for_local_tensor = _local.maybe_run_for_local_tensor

# DTensor's sharding propagation types: the pointwise rule for HaloShard inputs
# (`_dtensor_ops`) reads an OpSchema and returns an OutputSharding of a DTensorSpec.
DTensorSpec = _spec.DTensorSpec
TensorMeta = _spec.TensorMeta
OpSchema = _schema.OpSchema
OutputSharding = _schema.OutputSharding


def held(x: DTensor) -> tuple[torch.Tensor, DTensorSpec]:
    """A DTensor's local tensor and spec as it holds them (`to_local` adds an autograd
    node; a layer's steady call, one node of its own, reads them directly)."""
    return x._local_tensor, x._spec


def dtensor_of(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor of `local` on `spec`: torch's own constructor, which its autograd wrappers
    call (`from_local` adds a node and builds the spec anew each call)."""
    return DTensor(local, spec, requires_grad=False)


def clear_sharding_cache() -> None:
    """Forget sharding decisions torch cached for HaloShard inputs before the guards existed:
    the Python propagator's cache and the C++ fast path's. What
    `torch.distributed.tensor.debug._clear_sharding_prop_cache` does, without importing that
    package (it pulls in numpy, which torch does not require, and the compiler)."""
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # type: ignore[attr-defined]
    torch._C._clear_DTensor_sharding_propagator_cache()

# The type of an aten operator overload (`aten.convolution.default`): the key of DTensor's
# custom op handlers, in annotations.
OpOverload = torch._ops.OpOverload

# A device-side assert (no host sync): a peer's error flag on an accelerator (`_comm`).
assert_async = torch._assert_async

# Functional collectives: what torch.compile and LocalTensorMode understand (`_comm` only).
# torch 2.13 renamed three (`*_tensor` -> `*_single`, same signatures) and made the old names
# warn; before 2.13 only the old ones exist.
all_to_all_single = _funcol.all_to_all_single
all_gather_single = renamed(_funcol, "all_gather_single", "all_gather_tensor")
all_gather_single_autograd = renamed(
    _funcol, "all_gather_single_autograd", "all_gather_tensor_autograd")
reduce_scatter_single = renamed(_funcol, "reduce_scatter_single", "reduce_scatter_tensor")
all_reduce = _funcol.all_reduce
functional_broadcast = _funcol.broadcast
wait_tensor = _funcol.wait_tensor

# c10d's eager collectives into one flat tensor, by their 2.13 names, were named
# `all_gather_into_tensor` and `reduce_scatter_tensor` (same signatures) before 2.13.
C10D_RENAMED = {"all_gather_single": "all_gather_into_tensor",
                "reduce_scatter_single": "reduce_scatter_tensor"}


def c10d_name(name: str) -> str:
    """The attribute of `torch.distributed` that holds c10d's `name` (its 2.13 name) in the
    installed torch."""
    return name if hasattr(dist, name) else C10D_RENAMED.get(name, name)


# `_comm`'s eager calls look the function up on `torch.distributed` at each call, as a plain
# `dist.<name>(...)` would, so that a wrapper installed there (`counted_collectives`) sees them.
def dist_all_gather_single(output: torch.Tensor, input: torch.Tensor, *, group: Any = None,
                           async_op: bool = False) -> Any:
    """c10d's `all_gather_single`: every rank's `input`, in rank order, into `output`."""
    fn = getattr(dist, c10d_name("all_gather_single"))
    return fn(output, input, group=group, async_op=async_op)


def dist_reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *, group: Any = None,
                               async_op: bool = False) -> Any:
    """c10d's `reduce_scatter_single`: the sum over ranks of `input`, rank r's block of it
    into `output`."""
    fn = getattr(dist, c10d_name("reduce_scatter_single"))
    return fn(output, input, group=group, async_op=async_op)

# Pytrees: the arguments of an op that a torch function mode sees (ReplicatedArgsParallel).
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map

# The kernel torch's `aten.convolution` picks for given sizes, dtype and device, and the
# kernels of its slow conv3d paths on CPU (`_conv` runs such a window's conv as conv2ds).
select_conv_backend = torch._C._select_conv_backend
SLOW_CONV3D = frozenset({torch._C._ConvBackend.Slow3d, torch._C._ConvBackend.SlowDilated3d})
# oneDNN's conv kernel called directly (`_choice.onednn_direct`): what `aten.convolution`
# dispatches to on CPU where its size rule does not send the conv to the slow path.
onednn_convolution = torch.ops.aten.mkldnn_convolution

# The kind of a profiler record that is an allocation or a free (`testing.peak_bytes` sums
# them from the profiler's event tree).
ALLOCATION_EVENT = torch._C._profiler._EventType.Allocation

# The autograd node whose backward is running (None outside backward): `_dtensor_ops` knows
# by it that a cat is torch's own in a split's backward.
current_autograd_node = torch._C._current_autograd_node

# nn.Conv*'s private record of its padding, read by its forward for non-zeros padding modes:
# `_specs` checks it against `padding` and the hooks keep it in step when they zero one dim.
CONV_PADDING_RECORD = "_reversed_padding_repeated_twice"

Handler = Callable[[OpOverload, tuple[object, ...], dict[str, object]], object]


def custom_op_handlers() -> dict[OpOverload, Handler]:
    """DTensor's table of ops it hands to a Python function instead of its own dispatch
    (torch's loss_parallel and context parallel register there too); the live dict."""
    return DTensor._op_dispatcher._custom_op_handlers  # type: ignore[no-any-return]


def sharding_slow_path() -> Callable[..., Any]:
    """DTensor's sharding propagation for ops outside its cache (the guard wraps it)."""
    return DTensor._op_dispatcher._propagate_op_sharding_dispatch_slow_path  # type: ignore[no-any-return]


def set_sharding_slow_path(fn: Callable[..., Any]) -> None:
    """Replace DTensor's sharding propagation slow path (install and uninstall the guard)."""
    DTensor._op_dispatcher._propagate_op_sharding_dispatch_slow_path = fn


def local_tensor(dt: DTensor) -> torch.Tensor:
    """`dt`'s local tensor without `to_local()`'s autograd node (rank-local checks)."""
    return dt._local_tensor


def local_tensors(t: LocalTensor) -> dict[int, torch.Tensor]:
    """A `LocalTensor`'s value per simulated global rank."""
    return t._local_tensors  # type: ignore[no-any-return]


def fake_store() -> Any:
    """A store for torch's `fake` process group (shapes only, no data moved). Importing the
    module registers the `fake` backend, hence not at import time."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def dtensor_op_dispatcher() -> Any:
    """DTensor's op dispatcher (`_plan_gaps` wraps its mixed-tensor path)."""
    return DTensor._op_dispatcher


def implicit_replication() -> bool:
    """Whether DTensor now takes a plain tensor beside a DTensor as replicated (torch's
    `implicit_replication()` context) instead of refusing the mix."""
    return bool(DTensor._op_dispatcher._allow_implicit_replication)


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a graph task is executing)."""
    return bool(torch._C._current_graph_task_id() != -1)


def forward_pre_hooks(module: torch.nn.Module) -> dict[int, Callable[..., Any]]:
    """`module`'s forward pre-hooks by id, in the order they run (the live dict)."""
    return module._forward_pre_hooks  # type: ignore[no-any-return]


# `nn.Module.__call__`'s body: `_plan_gaps` finds the modules being called in Python's frames.
MODULE_CALL_CODE = torch.nn.Module._call_impl.__code__


def caller_frame() -> Any:
    """The frame of the caller of the function calling this."""
    return sys._getframe(2)


# A process group by the name funcol and dynamo carry (`_comm`'s agreement while tracing).
resolve_process_group = dist.distributed_c10d._resolve_process_group

# The device type a group's small host-side collectives take ("cpu" where the group has a
# CPU backend, else its accelerator's): a group made with `init_process_group("nccl")`
# takes CUDA tensors only.
object_collective_device = dist.distributed_c10d._get_object_coll_device

# CPU's fused (flash) attention kernel, the one `F.scaled_dot_product_attention` runs on CPU,
# which also returns each query's log-sum-exp: blocks of keys attended apart merge exactly.
sdpa_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
