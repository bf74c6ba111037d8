"""One halo conv3d training step: haloshard vs the same conv without communication.

`python -m benchmarks.step` runs 2 gloo ranks (1 thread each) on a `(1, 128, 16, 64, 64)`
float32 input sharded on T, a kernel-3 conv3d (128 -> 128 channels, padding 1 on H and W),
forward + backward, and prints side by side (median of --iters):

- `local`: the conv on the rank's own shard padded locally (no communication: the floor);
- `haloshard`: `halo_conv`, the chunk's own conv while the halo travels, then boundary
  corrections (default);
- `no overlap`: `halo_conv(overlap=False)`: the whole halo first, then one conv;
- `exchange+conv`: `halo_exchange` (default transport) first, then `F.conv3d`;
- `naive`: all-gather T, convolve the whole tensor, keep the own slice (for contrast);
- `compiled`: `torch.compile` (inductor) of the haloshard step, with --compile.

Ratios over `local` do not depend on the machine's absolute speed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import steady_allocator
from haloshard import halo_exchange
from haloshard._attention import gather_along
from haloshard._conv import halo_conv
from haloshard.testing import GlooWorld, shard, worker_mesh

SHAPE = (1, 128, 16, 64, 64)


def _step_ms(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
             w: torch.Tensor) -> float:
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    dist.barrier()
    start = time.perf_counter()
    step(xi, wi).sum().backward()
    return (time.perf_counter() - start) * 1e3


def rank_step(iters: int, compile_step: bool) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = worker_mesh(world)
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(SHAPE, generator=gen)
    w = torch.randn(128, 128, 3, 3, 3, generator=gen) * 0.02
    x = shard(full, 2, world, rank).contiguous()
    length = full.shape[2]

    def local(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv3d(F.pad(x, (0, 0, 0, 0, 1, 1)), w, padding=(0, 1, 1))

    def halo(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return halo_conv(x, w, dim=2, left=1, right=1, group=mesh, padding=(0, 1, 1),
                         global_length=length)

    def no_overlap(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return halo_conv(x, w, dim=2, left=1, right=1, group=mesh, padding=(0, 1, 1),
                         global_length=length, overlap=False)

    def exchange_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv3d(halo_exchange(x, left=1, right=1, dim=2, group=mesh, global_length=length),
                                      w,
                        padding=(0, 1, 1))

    def naive(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = F.conv3d(gather_along(x, 2, mesh, global_length=length), w, padding=1)
        return shard(y, 2, world, rank)

    steps = {"local": local, "haloshard": halo, "no overlap": no_overlap,
             "exchange+conv": exchange_first,
             "naive": naive}
    if compile_step:
        steps["compiled"] = torch.compile(halo, fullgraph=True)
    for fn in steps.values():  # warm-up: plans, buffers, compiled graphs, the heap
        _step_ms(fn, x, w)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):  # round-robin, so a busy spell of the machine hits every step alike
        for name, fn in steps.items():
            times[name].append(_step_ms(fn, x, w))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args(argv)
    steady_allocator()
    with GlooWorld(2, timeout=3600) as world:
        ranks = world.run(rank_step, args.iters, args.compile)
    slowest = {name: max(r[name] for r in ranks) for name in ranks[0]}
    print(f"conv3d k=3 step (fwd+bwd) on {SHAPE} float32, 2 gloo ranks, 1 thread each, "
          f"median of {args.iters}")
    print(f"{'step':<14} {'ms':>9} {'/ local':>8}")
    for name, ms in slowest.items():
        print(f"{name:<14} {ms:>9.1f} {ms / slowest['local']:>8.3f}")
    if "compiled" in slowest:
        print(f"compiled / eager haloshard: {slowest['compiled'] / slowest['haloshard']:.3f}")


if __name__ == "__main__":
    main()
