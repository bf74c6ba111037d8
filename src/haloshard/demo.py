"""`python -m haloshard.demo`: halo exchange on 4 gloo ranks, checked against one device.

Shards a video-shaped tensor `(B, C, T, H, W)` along T (T=13 on 4 ranks: 4, 4, 4, 1),
exchanges a halo (left=5, right=1, replicate padding: rank 3's left halo spans
two neighbours) with every transport, checks each rank's result against `F.pad` on the full
tensor, and prints what moved where and how long it took.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from haloshard import TRANSPORTS, halo_exchange
from haloshard._plan import exchange_plan, gather_plan
from haloshard.testing import GlooWorld, reference_halo, shard, worker_mesh

SHAPE = (1, 8, 13, 32, 32)
LEFT, RIGHT, PAD = 5, 1, "replicate"


def _sent_slices(transport: str, rank: int, lengths: tuple[int, ...]) -> int:
    if transport == "allgather":  # every rank's contribution reaches the P-1 others
        return gather_plan(rank, lengths, LEFT, RIGHT, PAD).length * (len(lengths) - 1)
    return sum(exchange_plan(rank, lengths, LEFT, RIGHT, PAD).send_splits)


def rank_report(transport: str) -> dict[str, object]:
    """On every rank: exchange, check against the single-device reference, time it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = worker_mesh(world)
    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    x = shard(full, 2, world, rank).contiguous()
    halo_exchange(x, left=LEFT, right=RIGHT, dim=2, group=mesh, pad=PAD,
                  transport=transport)  # warm-up
    dist.barrier()
    start = time.perf_counter()
    y = halo_exchange(x, left=LEFT, right=RIGHT, dim=2, group=mesh, pad=PAD, transport=transport)
    elapsed = time.perf_counter() - start
    lengths = tuple(shard(full, 2, world, r).shape[2] for r in range(world))
    plan = exchange_plan(rank, lengths, LEFT, RIGHT, PAD)
    slice_bytes = full.narrow(2, 0, 1).numel() * full.element_size()
    return {
        "rank": rank, "T_local": x.shape[2], "out": y.shape[2],
        "from": {q: n for q, n in enumerate(plan.recv_splits) if n},
        "sent_bytes": _sent_slices(transport, rank, lengths) * slice_bytes,
        "ms": elapsed * 1e3,
        "exact": torch.equal(y, reference_halo(full, LEFT, RIGHT, 2, world, rank, PAD)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args(argv)
    print(f"global {SHAPE} sharded on T over {args.ranks} gloo ranks; halo left={LEFT} "
          f"right={RIGHT} pad={PAD!r}")
    ok = True
    with GlooWorld(args.ranks) as world:
        for transport in TRANSPORTS:
            print(f"\ntransport={transport}")
            print(f"{'rank':>4} {'T_local':>7} {'out':>4} {'frames from (rank: n)':<24}"
                  f"{'sent KiB':>9} {'ms':>7}  exact")
            for r in world.run(rank_report, transport):
                print(f"{r['rank']:>4} {r['T_local']:>7} {r['out']:>4} {r['from']!s:<24}"
                      f"{r['sent_bytes'] / 1024:>9.1f} {r['ms']:>7.2f}  {r['exact']}")
                ok = ok and bool(r["exact"])
    print("\nall ranks match the single-device F.pad reference" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
