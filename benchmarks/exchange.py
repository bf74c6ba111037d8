"""Exchange alone: each transport vs a local `F.pad` of the same halo, and bytes sent.

`python -m benchmarks.exchange` runs 2 gloo ranks (1 thread each) on a `(1, 128, 16, 64, 64)`
float32 tensor sharded on T (8 frames per rank), halo left=1 right=1 (a centred kernel-3
conv's), and prints per transport: forward and backward time (median of --iters runs) over
the same for `F.pad` of the local shard, and bytes each rank sent over the distinct halo bytes
it owes its neighbours. Ratios are taken side by side in one run (contenders round-robin), so
they do not depend on the machine's absolute speed.

`F.pad+move` is the floor no exchange can beat on the machine: `F.pad` while a bare c10d
all-to-all of the same halo bytes (prebuilt buffers, no planning, checks or indexing) runs
beside it, forward and backward; `/floor` columns are over it. `all_to_all` is the steady
state (`agreements=`, as every `HaloParallel` layer runs after its first call: checks local,
a mistake flagged inside the move); `all_to_all (agree)` validates on every rank with a
metadata all-gather at every call, as a bare `halo_exchange` call does.
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
from haloshard._plan import exchange_plan, gather_plan
from haloshard.testing import GlooWorld, shard, worker_mesh

SHAPE = (1, 128, 16, 64, 64)
LEFT = RIGHT = 1


def _timed_ms(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


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


def _fwd_bwd(contenders: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor,
             iters: int) -> dict[str, tuple[float, float]]:
    """Median forward and backward ms per contender, taken round-robin (a busy spell of the
    machine hits every contender alike); backward ends in a contiguous input gradient, which
    is what any consumer (a conv's backward, a gradient accumulation) reads."""
    leaf = x.clone().requires_grad_()
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in contenders}
    for _ in range(iters):
        for name, make in contenders.items():
            box: list[torch.Tensor] = []
            times[name][0].append(_timed_ms(lambda make=make, box=box: box.append(make(leaf))))
            out, grad = box[0], torch.ones_like(box[0])
            times[name][1].append(_timed_ms(
                lambda out=out, grad=grad: torch.autograd.grad(out, leaf, grad)[0].contiguous()))
    return {name: (statistics.median(f), statistics.median(b)) for name, (f, b) in times.items()}


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
            "allgather": gather_plan(rank, lengths, LEFT, RIGHT, "zeros").length * (world - 1)
            * slice_bytes}
    # What each rank sends, as one buffer split evenly (2 ranks: the halo slice to the peer).
    send = torch.randn(world, halo_bytes // full.element_size() // max(world - 1, 1))
    store: dict[object, object] = {}  # the steady state: agreed once, then checked locally
    contenders = {"F.pad": lambda t: F.pad(t, (0, 0, 0, 0, LEFT, RIGHT)),
                  "F.pad+move": lambda t: _PadBesideMove.apply(t, send),
                  "all_to_all": lambda t: halo_exchange(
                      t, left=LEFT, right=RIGHT, dim=2, group=mesh, global_length=SHAPE[2],
                      agreements=store)} | {
        f"{tr} (agree)" if tr == "all_to_all" else tr:
        lambda t, tr=tr: halo_exchange(t, left=LEFT, right=RIGHT, dim=2, group=mesh,
                                       transport=tr)
        for tr in TRANSPORTS}
    sent["all_to_all (agree)"] = sent["all_to_all"]
    _fwd_bwd(contenders, x, 5)  # untimed: plans, buffers, first collectives, the heap
    return {name: (*times, sent[name] / halo_bytes) if name in sent else times
            for name, times in _fwd_bwd(contenders, x, iters).items()}


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
          f"{'fwd/floor':>10} {'bwd/floor':>10} {'bytes/halo bytes':>17}")
    slowest = {name: [max(r[name][i] for r in ranks) for i in (0, 1)]  # it sets the pace
               for name in ("F.pad", "F.pad+move", "all_to_all", "all_to_all (agree)",
                            *TRANSPORTS[1:])}
    (pad_f, pad_b), (floor_f, floor_b) = slowest["F.pad"], slowest["F.pad+move"]
    for name, (fwd, bwd) in slowest.items():
        ratios = (fwd / pad_f, bwd / pad_b, fwd / floor_f, bwd / floor_b)
        sent = " / ".join(f"{r[name][2]:.2f}" for r in ranks) if name in TRANSPORTS else ""
        print(f"{name:<11} {fwd:>7.2f} {bwd:>7.2f} "
              + " ".join(f"{v:>10.2f}" for v in ratios) + f" {sent:>17}")


if __name__ == "__main__":
    main()
