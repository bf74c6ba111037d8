"""haloshard: halo layouts and differentiable neighbour exchange for context parallelism.

Importing the package initialises no process group and no device, and changes nothing in
torch. Building the first `HaloShard` placement registers guards for DTensors that carry one
(`haloshard._dtensor_ops`): DTensor's own redistribute and op dispatch would otherwise
mishandle that placement silently.
"""

__version__ = "0.1.0.dev0"  # the one place it is set: pyproject.toml reads it

from haloshard import _dtensor_ops, _layout
from haloshard._annotation import annotate
from haloshard._attention import attention, gather_along
from haloshard._comm import set_timeout
from haloshard._conv import halo_conv
from haloshard._errors import HaloError
from haloshard._exchange import TRANSPORTS, halo_exchange
from haloshard._forward import (
    HaloHandle,
)
from haloshard._layer_styles import (
    AttentionParallel,
    CausalConvParallel,
    FirstFrameParallel,
    FirstFrameStencil,
    GroupNormParallel,
    LocalParallel,
    ReplicatedArgsParallel,
)
from haloshard._layout import PAD_MODES, HaloShard, PadMode, shard_size_and_offset, shard_sizes
from haloshard._masked_attention import frame_attention
from haloshard._norms import group_norm
from haloshard._redistribute import redistribute
from haloshard._segments import frame_batches
from haloshard._specs import ConvStencil, ResampleStencil, Stencil, TransposeStencil
from haloshard._styles import HaloParallel, halo_handles, halo_plan, reduce_grads
from haloshard._varlen import packed, varlen_conv
from haloshard._verify import PlanReport, verify_plan

# The DTensor guards install with the first HaloShard built, not here (see _layout).
_layout.call_when_built(_dtensor_ops.install)

__all__ = [
    # layout
    "PAD_MODES",
    "PadMode",
    "HaloShard",
    "shard_size_and_offset",
    "shard_sizes",
    # exchange
    "TRANSPORTS",
    "halo_exchange",
    "halo_conv",
    # DTensors
    "redistribute",
    # modules and plans
    "HaloParallel",
    "annotate",
    "halo_plan",
    "halo_handles",
    "HaloHandle",
    "reduce_grads",
    "Stencil",
    "ConvStencil",
    "TransposeStencil",
    "ResampleStencil",
    # styles for the other layers of a video model
    "GroupNormParallel",
    "LocalParallel",
    "AttentionParallel",
    "CausalConvParallel",
    "FirstFrameParallel",
    "FirstFrameStencil",
    "ReplicatedArgsParallel",
    # layers that need more than a halo
    "group_norm",
    "attention",
    "frame_attention",
    "gather_along",
    # packed variable-length sequences; models run as loops over frame batches
    "varlen_conv",
    "packed",
    "frame_batches",
    # checking a plan against one device
    "verify_plan",
    "PlanReport",
    # errors and bounded failures
    "HaloError",
    "set_timeout",
]
