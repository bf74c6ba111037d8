"""Exchange alone: each transport vs a local `F.pad` of the same halo, and bytes sent.

`python -m benchmarks.exchange` runs 2 gloo ranks (1 thread each) on a `(1, 128, 16, 64, 64)`
float32 tensor sharded on T (8 frames per rank), halo left=1 right=1 (a centred kernel-3
conv's), and prints per transport: forward and backward time (median of --iters runs) over
the same for `F.pad` of the local shard, and bytes each rank sent over the distinct halo bytes
it owes its neighbours. Ratios are taken side by side in one run, so they do not depend on the
machine's absolute speed.

`F.pad+move` is the floor no exchange can beat on the machine: `F.pad` while a bare c10d
all-to-all of the same halo bytes (prebuilt buffers, no planning, checks or indexing) runs
beside it, forward and backward.
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
from haloshard import TRANSPORTS, halo_exchange
from haloshard._plan import exchange_plan
from haloshard.testing import GlooWorld, shard, worker_mesh

SHAPE = (1, 128, 16, 64, 64)
LEFT = RIGHT = 1


def _median_ms(fn: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class _PadBesideMove(torch.autograd.Function):
    """`F.pad` (backward: its slice) with a bare all-to-all of `send` in flight meanwhile."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.send = send
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, async_op=True)
        out = F.pad(x, (0, 0, 0, 0, LEFT, RIGHT))
        work.wait()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        recv = torch.empty_like(ctx.send)
        work = dist.all_to_all_single(recv, ctx.send, async_op=True)
        g_x = grad.narrow(2, LEFT, grad.shape[2] - LEFT - RIGHT).contiguous()
        work.wait()
        return g_x, None


def _fwd_bwd(make: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
             iters: int) -> tuple[float, float]:
    """Median forward and backward ms; backward ends in a contiguous input gradient, which is
    what any consumer (a conv's backward, a gradient accumulation) reads."""
    leaf = x.clone().requires_grad_()
    for _ in range(5):  # warm-up: plans, buffers, first collectives, the allocator's heap
        out = make(leaf)
        torch.autograd.grad(out, leaf, torch.ones_like(out))
    fwd = _median_ms(lambda: make(leaf), iters)
    outs = [make(leaf) for _ in range(iters)]
    grads = [torch.ones_like(o) for o in outs]
    it = iter(range(iters))

    def backward() -> torch.Tensor:
        i = next(it)
        return torch.autograd.grad(outs[i], leaf, grads[i])[0].contiguous()

    return fwd, _median_ms(backward, iters)


def rank_bench(iters: int) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = worker_mesh(world)
    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    x = shard(full, 2, world, rank).contiguous()
    lengths = tuple(shard(full, 2, world, r).shape[2] for r in range(world))
    plan = exchange_plan(rank, lengths, LEFT, RIGHT, "zeros")
    slice_bytes = full.narrow(2, 0, 1).numel() * full.element_size()
    halo_bytes = sum(plan.send_splits) * slice_bytes  # distinct slices its neighbours need
    sent = {"all_to_all": halo_bytes, "p2p": halo_bytes,
            "allgather": plan.gather_len * (world - 1) * slice_bytes}
    # What each rank sends, as one buffer split evenly (2 ranks: the halo slice to the peer).
    send = torch.randn(world, halo_bytes // full.element_size() // max(world - 1, 1))
    contenders = {"F.pad": lambda t: F.pad(t, (0, 0, 0, 0, LEFT, RIGHT)),
                  "F.pad+move": lambda t: _PadBesideMove.apply(t, send)} | {
        tr: lambda t, tr=tr: halo_exchange(t, LEFT, RIGHT, 2, mesh, transport=tr)
        for tr in TRANSPORTS}
    rows: dict[str, object] = {}
    for measure in (False, True):  # one untimed round first: the heap grows to its steady size
        for name, make in contenders.items():
            times = _fwd_bwd(make, x, iters if measure else 3)
            rows[name] = (*times, sent[name] / halo_bytes) if name in sent else times
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    steady_allocator()
    with GlooWorld(2, timeout=600) as world:
        ranks = world.run(rank_bench, args.iters)
    print(f"exchange of {SHAPE} float32 on 2 gloo ranks (1 thread each), halo {LEFT}+{RIGHT}, "
          f"median of {args.iters}")
    print(f"{'transport':<11} {'fwd ms':>7} {'bwd ms':>7} {'fwd/F.pad':>10} {'bwd/F.pad':>10} "
          f"{'bytes/halo bytes':>17}")
    for name in ("F.pad", "F.pad+move", *TRANSPORTS):
        fwd = max(r[name][0] for r in ranks)  # the slowest rank sets the pace
        bwd = max(r[name][1] for r in ranks)
        base_f = max(r["F.pad"][0] for r in ranks)
        base_b = max(r["F.pad"][1] for r in ranks)
        ratio = " / ".join(f"{r[name][2]:.2f}" for r in ranks) if name in TRANSPORTS else ""
        print(f"{name:<11} {fwd:>7.2f} {bwd:>7.2f} {fwd / base_f:>10.2f} {bwd / base_b:>10.2f} "
              f"{ratio:>17}")


if __name__ == "__main__":
    main()
