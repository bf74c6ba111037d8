"""Every private torch name haloshard touches, in one place, for one torch release.

haloshard extends DTensor where torch offers no public hook (custom op handlers, the
sharding-propagation slow path), simulates ranks with `LocalTensorMode`, and moves halos
with functional collectives; all of these live in torch's private modules and change between
releases. This module checks the installed torch at import, then imports each private name
once and gives it a stable local name; every other module imports it from here. Moving to a
new torch release means editing this file (and `SUPPORTED_TORCH`), nowhere else.

Importing it changes nothing in torch: it only reads names (the `fake` backend, which
registers itself on import, is imported by `fake_store()` when called).
"""

# ruff: noqa: E402  (the version check must run before the private imports can fail)

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

# The torch release (major.minor) whose private names this module was written against.
SUPPORTED_TORCH = "2.13"


def check_torch_version(version: str) -> None:
    """Raise `ImportError` unless `version` is a release of `SUPPORTED_TORCH` (any patch,
    local build tag or pre-release of it).

    Raises:
        ImportError: naming the installed version and the supported one.

    Example::
        >>> check_torch_version("2.13.0+cpu")
        >>> check_torch_version("2.14.0")
        Traceback (most recent call last):
        ImportError: haloshard supports torch 2.13.x, but torch 2.14.0 is installed ...
    """
    found = re.match(r"(\d+)\.(\d+)(?!\d)", str(version))
    if found is None or f"{found[1]}.{found[2]}" != SUPPORTED_TORCH:
        raise ImportError(
            f"haloshard supports torch {SUPPORTED_TORCH}.x, but torch {version} is installed: "
            "haloshard relies on torch internals (DTensor's op dispatcher, LocalTensorMode, "
            f"functional collectives) that change between releases; install "
            f"torch=={SUPPORTED_TORCH}.*")


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
all_to_all_single = _funcol.all_to_all_single
all_gather_single = _funcol.all_gather_single
all_gather_single_autograd = _funcol.all_gather_single_autograd
reduce_scatter_single = _funcol.reduce_scatter_single
all_reduce = _funcol.all_reduce
functional_broadcast = _funcol.broadcast
wait_tensor = _funcol.wait_tensor

# Pytrees: the arguments of an op that a torch function mode sees (ReplicatedArgsParallel).
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten

# The kernel torch's `aten.convolution` picks for given sizes, dtype and device, and the
# kernels of its slow conv3d paths on CPU (`_conv` runs such a window's conv as conv2ds).
select_conv_backend = torch._C._select_conv_backend
SLOW_CONV3D = frozenset({torch._C._ConvBackend.Slow3d, torch._C._ConvBackend.SlowDilated3d})

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
