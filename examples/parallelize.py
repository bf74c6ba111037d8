"""Parallelize an existing model: write its plan, check it on simulated ranks, then run it.

    python examples/parallelize.py                                # check the plan, 4 ranks
    torchrun --standalone --nproc-per-node 2 examples/parallelize.py  # run it for real

The model's code is not edited. Its plan names a style for every layer that looks along T:
causal convs that pad T themselves (their halo is stated: `F.pad` cannot be seen from
outside), GroupNorms (statistics over all of T), and a 1x1 conv (no halo, but its output must
stay sharded). `verify_plan` runs the model on one device and parallelized, forward and
backward, and names the first module that differs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import (
    GroupNormParallel,
    HaloParallel,
    HaloShard,
    LocalParallel,
    reduce_grads,
    verify_plan,
)
from haloshard.testing import simulated_mesh


class CausalConv3d(nn.Module):
    """Replicate-pads 2 frames before T itself, then a 3x3x3 conv: output t sees frames <= t."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, padding=(0, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 0, 0, 0, 2, 0), mode="replicate"))


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, channels)
        self.conv = CausalConv3d(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(F.silu(self.norm(x)))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(CausalConv3d(3, 16), Block(16), Block(16), nn.Conv3d(16, 3, 1)).double()


CAUSAL = HaloShard(2, left=2, pad="replicate")  # what the wrapper's own F.pad supplies
PLAN = {
    "0": HaloParallel(CAUSAL),
    "1.norm": GroupNormParallel(), "1.conv": HaloParallel(CAUSAL),
    "2.norm": GroupNormParallel(), "2.conv": HaloParallel(CAUSAL),
    "3": LocalParallel(),
}


def check() -> None:
    video = torch.randn(1, 3, 10, 16, 16, dtype=torch.float64)  # T=10 over 4: 3, 3, 3, 1
    with simulated_mesh(4) as mesh:  # 4 ranks in this one process
        report = verify_plan(build(), PLAN, video, mesh)
    print(report)  # "plan ok (...)", or the first module whose output or gradient differs
    assert report.ok


def run() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    model = parallelize_module(build(), mesh, PLAN)
    video = torch.randn(1, 3, 10, 16, 16, dtype=torch.float64)  # the same clip on every rank
    y = model(distribute_tensor(video, mesh, [Shard(2)]))  # a Shard(2) DTensor, exact
    y.to_local().sum().backward()
    reduce_grads(model, mesh)  # or let DDP/FSDP over the cp ranks reduce them
    # one write per line: the ranks share the terminal
    print(f"rank {dist.get_rank()}: output frames {y.to_local().shape[2]} of {y.shape[2]}\n",
          end="", flush=True)
    dist.barrier()  # no rank tears gloo down while a peer still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    run() if "LOCAL_RANK" in os.environ else check()
