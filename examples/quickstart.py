"""Quickstart: a small video conv net, context-parallel over its frames, checked on one device.

    torchrun --standalone --nproc-per-node 2 examples/quickstart.py

Every rank builds the same model and clip (same seed). The clip's frames (T, dim 2) are
sharded over the ranks; `parallelize_module` with a `halo_plan` gives every conv its halo
frames from the neighbouring ranks. Each rank then checks its chunk of the output, of the input
gradient and the parameter gradients (summed over the ranks) against the model run on the whole
clip on one device, and prints the largest difference.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import halo_plan, reduce_grads

# Float64: a rank sums the same products as one device, in another order where its halo is
# added (and parameter gradients are sums of the ranks' partial sums), so each value may round
# differently by a few ulps of the largest term; 1e-12 of the largest reference value bounds
# that with wide margin, while a misplaced frame would show as an O(1) relative error.
RTOL = 1e-12


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets the rank, world size and address
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))

    torch.manual_seed(0)
    model = nn.Sequential(  # kernels of 3 and 5 along T: halos of 1 and 2 frames a side
        nn.Conv3d(3, 16, 3, padding=1), nn.SiLU(),
        nn.Conv3d(16, 16, (5, 3, 3), padding=(2, 1, 1)), nn.SiLU(),
        nn.Conv3d(16, 3, 1),
    ).double()
    single = copy.deepcopy(model)  # the one-device reference, same weights
    video = torch.randn(1, 3, 17, 32, 32, dtype=torch.float64)  # (B, C, T, H, W)

    # The whole integration: a plan naming every conv, applied on the cp mesh.
    parallelize_module(model, mesh, halo_plan(model, include_convs=True))
    x = distribute_tensor(video, mesh, [Shard(2)]).requires_grad_()  # this rank's frames
    y = model(x)  # a Shard(2) DTensor: this rank's frames of the output
    y.to_local().square().sum().backward()  # the ranks' losses add up to one device's
    reduce_grads(model, mesh)  # parameter gradients: sum the ranks' partial sums

    ref_x = video.clone().requires_grad_()
    ref_y = single(ref_x)
    ref_y.square().sum().backward()
    # one write per line: the ranks share the terminal
    print(f"rank {dist.get_rank()}: {compare(x, y, model, ref_x, ref_y, single)}\n", end="",
          flush=True)
    dist.barrier()  # no rank tears gloo down while a peer still uses it
    dist.destroy_process_group()


def compare(x: torch.Tensor, y: torch.Tensor, model: nn.Module, ref_x: torch.Tensor,
            ref_y: torch.Tensor, single: nn.Module) -> str:
    """Assert this rank's chunks and the parameter gradients match one device; describe it."""
    rank, size = dist.get_rank(), dist.get_world_size()
    pairs = [(y.to_local().detach(), ref_y.detach().tensor_split(size, dim=2)[rank]),
             (x.grad.to_local(), ref_x.grad.tensor_split(size, dim=2)[rank])]
    pairs += [(p.grad, q.grad) for p, q in zip(model.parameters(), single.parameters(),
                                              strict=True)]
    worst = max(float((got - want).abs().max() / want.abs().max())
                for got, want in pairs if want.numel())
    assert worst <= RTOL, f"rank {rank}: differs from one device by {worst:.1e} (relative)"
    frames = y.to_local().shape[2]
    return (f"frames {frames} of {ref_y.shape[2]}; output, input grad and "
            f"{len(pairs) - 2} param grads match one device (max rel diff {worst:.1e})")


if __name__ == "__main__":
    main()
