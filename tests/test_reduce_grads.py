"""`reduce_grads` sums gradients in buckets, as DDP does: the same sums as one flat
all-reduce, at most two buckets held beside the gradients, and a bucket size every rank
must share (agreed, `HaloError` on every rank otherwise).

Two real gloo ranks. Each rank's gradients are seeded per rank; the reference is their sum
computed here from both ranks' seeds. A sum of two float32 values is the same in either
order, so every comparison is exact.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from haloshard import HaloError, reduce_grads
from haloshard.testing import counted_collectives, peak_bytes, worker_mesh

KIB = 2**-10  # bucket_cap_mb of one KiB


def _model() -> nn.Module:
    """Gradients of 56 KiB and 36 KiB (dense, larger than the small buckets below: each
    summed alone, in place) and small ones that share buckets, one of them in channels-last
    (packed in its logical order)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(32, 64, 7), nn.Conv1d(64, 48, 3), nn.Conv2d(8, 8, 3),
                         nn.Linear(64, 32), nn.Linear(8, 4), nn.Conv1d(4, 4, 1))


def _grads(model: nn.Module, rank: int) -> None:
    gen = torch.Generator().manual_seed(10 + rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
        if p.ndim == 4 and rank == 0:  # one rank's in channels-last, the other's not
            p.grad = p.grad.contiguous(memory_format=torch.channels_last)


def _expected() -> list[torch.Tensor]:
    models = [_model() for _ in range(2)]
    for rank, m in enumerate(models):
        _grads(m, rank)
    return [a.grad + b.grad for a, b in zip(*(m.parameters() for m in models), strict=True)]


def bucketed(cap_mb: float) -> dict[str, Any]:
    rank, mesh = dist.get_rank(), worker_mesh(2)
    model = _model()
    _grads(model, rank)
    reduce_grads(model, mesh, bucket_cap_mb=cap_mb)  # once untimed: the agreement's rows
    _grads(model, rank)
    with counted_collectives() as calls:
        peak, _ = peak_bytes(lambda: reduce_grads(model, mesh, bucket_cap_mb=cap_mb))
    return {"grads": [p.grad.clone() for p in model.parameters()],
            "layout": model[2].weight.grad.is_contiguous(memory_format=torch.channels_last),
            "calls": dict(calls), "peak": peak}


@pytest.mark.gloo
@pytest.mark.parametrize("cap_mb", [16 * KIB, 25.0])
def test_buckets_sum_exactly_holding_at_most_two(gloo, cap_mb: float) -> None:
    expected = _expected()
    total = sum(g.numel() * g.element_size() for g in expected)
    for rank, got in enumerate(gloo(2).run(bucketed, cap_mb)):
        for i, (g, want) in enumerate(zip(got["grads"], expected, strict=True)):
            torch.testing.assert_close(g, want, rtol=0, atol=0, msg=lambda m, i=i: f"{i}: {m}")
        assert got["layout"] == (rank == 0)  # summed in place, each rank's in its layout
        if cap_mb == 25.0:  # everything in one bucket: one all-reduce, one flat copy
            assert got["calls"]["all_reduce"] == 1, got["calls"]
            assert got["peak"] <= total + 4096, (got["peak"], total)
        else:  # 56 and 36 KiB alone, in place; the rest in buckets of at most 16 KiB
            # ([56 KiB], [its bias], [36 KiB], [the other nine, 11 KiB])
            assert got["calls"]["all_reduce"] == 4, got["calls"]
            assert got["peak"] <= 2 * 16 * 1024 + 4096, got["peak"]


def bad_cap(case: str) -> str:
    rank, mesh = dist.get_rank(), worker_mesh(2)
    model = _model()
    _grads(model, rank)
    cap = {"zero on rank 1": [25.0, 0], "differs": [25.0, 1.0], "nan": [float("nan")] * 2,
           "text": ["25"] * 2, "huge on rank 1": [25.0, 1e30]}[case][rank]
    with pytest.raises(HaloError) as caught:
        reduce_grads(model, mesh, bucket_cap_mb=cap)
    return str(caught.value)


@pytest.mark.gloo
@pytest.mark.parametrize(("case", "message"), [
    ("zero on rank 1", r"bucket_cap_mb must be a positive number of MiB, got 0|rank\(s\) "
                       r"\[1\] of the group rejected their reduce_grads arguments"),
    ("differs", r"ranks disagree on bucket_cap_mb \(in bytes\): \[26214400, 1048576\]"),
    ("nan", r"bucket_cap_mb must be a positive number of MiB, got nan"),
    ("text", r"bucket_cap_mb must be a positive number of MiB, got '25'"),
    # past int64 in bytes: held at 2**62 bytes, so the ranks disagree (no overflow on one)
    ("huge on rank 1", r"ranks disagree on bucket_cap_mb \(in bytes\): \[26214400, "
                       r"4611686018427387904\]"),
])
def test_a_bad_or_differing_bucket_raises_on_every_rank(gloo, case: str, message: str) -> None:
    for rank, text in enumerate(gloo(2).run(bad_cap, case)):
        assert re.search(message, text), (rank, text)


@pytest.mark.simulated
def test_buckets_on_simulated_ranks() -> None:
    """The same bucketed sums on simulated ranks (functional collectives): a conv net's
    parameter gradients, reduced in buckets of 1 KiB (the weights of 1.5 and 3 KiB each
    alone, the last bias with the last conv's weight and bias packed), against one
    device's."""
    from torch.distributed.tensor.parallel import parallelize_module

    from haloshard import HaloParallel
    from haloshard.testing import (
        assert_close_per_rank,
        module_reference,
        rank_map,
        shard,
        sharded,
        simulated_mesh,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(8, 8, 3, padding=1), nn.Conv1d(8, 16, 3, padding=1),
                          nn.Conv1d(16, 4, 1))
    full = torch.randn(2, 8, 11, dtype=torch.float64)
    model = model.double()
    with simulated_mesh(3) as mesh:
        parallelize_module(model, mesh, {n: HaloParallel() for n in ("0", "1", "2")})
        _, gy, _, grads = module_reference(model, full, 5)
        x, _ = sharded(mesh, full)
        y = model(x)
        (y.to_local() * rank_map(mesh, lambda r: shard(gy, 2, 3, r))).sum().backward()
        reduce_grads(model, mesh, bucket_cap_mb=KIB)
        for p, g in zip(model.parameters(), grads, strict=True):
            # float64 sums of three ranks' partial sums in another order than one device's
            assert_close_per_rank(p.grad, lambda r, g=g: g, mesh, atol=1e-12, rtol=1e-10)
