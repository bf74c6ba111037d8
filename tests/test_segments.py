"""`frame_batches`: a loop over batches of frames computed in one sharded call.

The numerics against diffusers' own loops are in tests/test_diffusers.py (CogVideoX) and
per-segment `group_norm` against `F.group_norm` per segment in tests/test_norms.py; here the
bookkeeping and its refusals.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import GroupNormParallel, HaloError, HaloParallel, frame_batches
from haloshard._segments import local_segments
from haloshard.testing import seeded_randn, sharded, simulated_mesh


@pytest.mark.parametrize(("lengths", "world", "rank", "ids"), [
    ((3, 2), 2, 0, [0, 0, 0]),
    ((3, 2), 2, 1, [1, 1]),
    ((1, 1, 1), 4, 3, []),  # an empty shard
    ((2, 5), 3, 1, [1, 1, 1]),
])
def test_local_segments(lengths: tuple[int, ...], world: int, rank: int, ids: list[int]
                        ) -> None:
    seg = local_segments(lengths, rank, world, 2, torch.device("cpu"))
    assert seg.ids.tolist() == ids and seg.count == len(lengths)


def test_bad_lengths() -> None:
    with (pytest.raises(HaloError, match=r"positive batch lengths, got \(3, 0\)"),
          frame_batches((3, 0))):
        pass


@pytest.mark.simulated
def test_layer_that_maps_batches_otherwise_raises() -> None:
    """A valid kernel-3 conv gives 1 + 2 frames from batches 3 and 4, 5 from one call."""
    with simulated_mesh(2) as mesh:
        conv = parallelize_module(nn.Conv1d(1, 1, 3).double(), mesh, HaloParallel(dim=2))
        x, _ = sharded(mesh, seeded_randn((1, 1, 7), 1))
        with frame_batches((3, 4)), pytest.raises(HaloError, match=r"give \(1, 2\) frames"):
            conv(x)


@pytest.mark.simulated
def test_norm_at_unknown_length_raises() -> None:
    with simulated_mesh(2) as mesh:
        norm = parallelize_module(nn.GroupNorm(1, 2).double(), mesh, GroupNormParallel())
        x, _ = sharded(mesh, seeded_randn((1, 2, 5, 2), 1))
        with frame_batches((3, 4)), pytest.raises(HaloError, match="no frame batches known"):
            norm(x)
