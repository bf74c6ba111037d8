"""Layers as real models write them: convs with a forward of their own, `(output, cache)`
tuples, channels-last per-token layers, and errors that name the module.

A fast path may only replace a forward it knows: a conv subclass that standardises its
weight runs its own forward on the exchanged window (exact); one that pads T itself with
`F.pad` (diffusers' Wan conv, which also resets `self.padding` after `__init__`) cannot have
its halo derived from attributes and raises until given an explicit spec, which is then
exact. Every case is an SPMD body under simulated ranks and on 3 gloo processes (T=7 splits
3, 3, 1; T=2 leaves a rank empty). Float64, tolerances as in test_hooks.py (sums in another
order; a misplaced slice is O(1)).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import HaloError, HaloParallel, HaloShard, LocalParallel
from haloshard.testing import (
    assert_close_per_rank,
    check_module,
    rank_map,
    seeded_module,
    seeded_randn,
    shard,
    simulated_mesh,
    single_device,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-10}


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    return seeded_module(module, seed)


class StandardisedConv3d(nn.Conv3d):
    """Weight standardisation: the forward uses a function of the weight, not the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3, 4), keepdim=True)) / (w.std(dim=(1, 2, 3, 4),
                                                                 keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class ScaledConv3d(nn.Conv3d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


class WanLikeConv3d(nn.Conv3d):
    """diffusers' `WanCausalConv3d`: causal along T by `F.pad` of 2 * padding frames, with
    `self.padding` reset to 0 after `__init__` (torch's private record goes stale)."""

    def __init__(self, cin: int, cout: int, k: int, padding: int = 1) -> None:
        super().__init__(cin, cout, k, padding=padding)
        self._padding = (padding, padding, padding, padding, 2 * padding, 0)
        self.padding = (0, 0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, self._padding))


class CachedCausalConv3d(nn.Module):
    """CogVideoX's causal conv: replicate-pads T with `torch.cat` of the first frame and
    returns `(output, conv_cache)`."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, padding=(0, 1, 1))

    def forward(self, x: torch.Tensor, conv_cache: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([x[:, :, :1]] * 2 + [x], dim=2)
        return self.conv(x), x[:, :, -2:].clone()


class Tupled(nn.Module):
    """The model around a tuple-returning conv: takes element 0, drops the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = CachedCausalConv3d(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.conv(x)
        return y


class ChannelsLast(nn.Module):
    """LTX's resnet norm: `LayerNorm` over C of `x.movedim(1, -1)`, T at dim 1 there."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.proj = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x.movedim(1, -1))).movedim(-1, 1)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv3d(2, 2, 1), WanLikeConv3d(2, 2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def _sharded(mesh: DeviceMesh, full: torch.Tensor) -> tuple[DTensor, torch.Tensor]:
    world = mesh.size()
    local = rank_map(mesh, lambda r: shard(full, 2, world, r).clone()).requires_grad_()
    return DTensor.from_local(local, mesh, [Shard(2)], shape=full.shape,
                              stride=full.stride()), local


def case_own_forward(mesh: DeviceMesh, length: int, seed: int) -> None:
    """Subclasses with their own forward are exact: run by that forward, never halo_conv."""
    full = seeded_randn((1, 2, length, 3, 3), seed).double()
    for make, plan in [
        (lambda: StandardisedConv3d(2, 3, 3, padding=1), HaloParallel),
        (lambda: ScaledConv3d(2, 3, 3, padding=1, padding_mode="replicate"), HaloParallel),
        (lambda: WanLikeConv3d(2, 3, 3), lambda: HaloParallel(HaloShard(2, left=2))),
        (Tupled, lambda: {"conv": HaloParallel(HaloShard(2, left=2, pad="replicate"))}),
    ]:
        with single_device():
            module = _seeded(make(), seed)
        parallelize_module(module, mesh, plan())
        check_module(mesh, module, full, seed + 1, **TOL)


def case_tuple_output(mesh: DeviceMesh, length: int, seed: int) -> None:
    """The first element of `(output, cache)` is the sharded output; the cache of a window
    is not the single-device cache, so it comes back as None."""
    with single_device():
        conv = _seeded(CachedCausalConv3d(2, 3), seed)
        full = seeded_randn((1, 2, length, 3, 3), seed).double()
        expected, _ = conv(full)
    parallelize_module(conv, mesh, HaloParallel(HaloShard(2, left=2, pad="replicate")))
    y, cache = conv(_sharded(mesh, full)[0])
    assert cache is None and y.placements == (Shard(2),) and y.shape == expected.shape
    assert_close_per_rank(y.to_local(), lambda r: shard(expected, 2, mesh.size(), r), mesh,
                          **TOL)


def case_channels_last(mesh: DeviceMesh, length: int, seed: int) -> None:
    """`LocalParallel(dim=1)` runs per-token layers on channels-last `(B, T, H, W, C)`
    chunks (the model moves C last itself, so DTensor carries Shard(2) to Shard(1)): exact."""
    with single_device():
        module = _seeded(ChannelsLast(4), seed)
        full = seeded_randn((2, 4, length, 3, 2), seed).double()
    parallelize_module(module, mesh, {"norm": LocalParallel(dim=1),
                                      "proj": LocalParallel(dim=1)})
    check_module(mesh, module, full, seed + 1, **TOL)


def case_errors(mesh: DeviceMesh, seed: int) -> None:
    """A derived halo on a conv that pads T itself raises, naming the module by its fqn
    in the model; so does a spec that contradicts a conv's own padding."""
    with single_device():
        model = _seeded(Outer(), seed)
        full = seeded_randn((1, 2, 7, 3, 3), seed).double()
    parallelize_module(model, mesh, {"block.*": HaloParallel()})
    with pytest.raises(HaloError, match=r"^block\.1 \(WanLikeConv3d\): .*pads dim 2 itself "
                       r".*\(2, 0\).*explicit HaloShard spec"):
        model(_sharded(mesh, full)[0])
    with pytest.raises(HaloError, match=r"^0\.0 \(StandardisedConv3d\): spec .* does not "
                       r"match .*padding \(1, 1\)"):
        parallelize_module(nn.Sequential(nn.Sequential(StandardisedConv3d(2, 2, 3, padding=1))),
                           mesh, {"0.0": HaloParallel(HaloShard(2, left=2))})
    stale = WanLikeConv3d(2, 2, 3)
    stale.padding_mode = "replicate"  # torch would now pad by its stale private record
    with pytest.raises(HaloError, match="torch will pad"):
        parallelize_module(stale, mesh, HaloParallel(HaloShard(2, left=2)))


CASES: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
    (case_own_forward, (7, 1)), (case_own_forward, (2, 2)), (case_tuple_output, (7, 3)),
    (case_channels_last, (6, 4)), (case_errors, (6,)),
]
# Uneven chunks under simulated ranks have per-rank strides, which the DTensor backward of
# the model's own movedim cannot hash (a LocalTensorMode limit): those run on gloo only.
UNEVEN = [(case_channels_last, (7, 4)), (case_channels_last, (2, 5))]


@pytest.mark.simulated
def test_simulated() -> None:
    with simulated_mesh(3) as mesh:
        for case, args in CASES:
            case(mesh, *args)


def on_gloo() -> None:
    mesh = worker_mesh(dist.get_world_size())
    for case, args in CASES + UNEVEN:
        case(mesh, *args)


@pytest.mark.gloo
def test_gloo(gloo: Callable[[int], Any]) -> None:
    gloo(3).run(on_gloo, timeout=300)


def waiting_rank_names_the_module(timeout_s: float) -> tuple[str, float]:
    """Rank 1 raises before the model's halo layer; rank 0, waiting in that layer's
    collective, raises HaloError naming the layer by its fqn within the bound."""
    import time
    from collections import OrderedDict

    import haloshard

    rank, mesh = dist.get_rank(), worker_mesh(2)
    haloshard.set_timeout(mesh, timeout_s)
    inner = nn.Sequential(OrderedDict(conv_in=nn.Conv3d(1, 1, 3, padding=1)))
    model = nn.Sequential(OrderedDict(decoder=inner))
    parallelize_module(model, mesh, {"decoder.conv_in": HaloParallel()})
    if rank == 1:
        return "raised in its own code", 0.0
    x = DTensor.from_local(torch.ones(1, 1, 2, 2, 2), mesh, [Shard(2)], shape=(1, 1, 4, 2, 2),
                           stride=(16, 16, 4, 2, 1))
    start = time.perf_counter()
    try:
        model(x)
    except HaloError as error:
        return f"HaloError: {error}", time.perf_counter() - start
    return "ok", time.perf_counter() - start


@pytest.mark.gloo
def test_waiting_rank_names_the_module() -> None:
    from haloshard.testing import GlooWorld

    timeout_s = 2.0
    world = GlooWorld(2, pg_timeout=60, timeout=120)
    try:
        (text, seconds), _ = world.run(waiting_rank_names_the_module, timeout_s)
    finally:
        world.close(force=True)  # a group timed out: it cannot be reused
    assert text.startswith("HaloError: the halo metadata exchange for decoder.conv_in "
                           "(Conv3d) did not complete"), text
    assert seconds < 6 * timeout_s, seconds  # the bound, plus a loaded machine


def bad_input_on_one_rank() -> tuple[str, float]:
    """A hooked conv given a plain input without the sharded dim on rank 1 only: every rank
    raises HaloError at once (the flag rides in the chunk-length gather)."""
    import time

    rank, mesh = dist.get_rank(), worker_mesh(2)
    conv = nn.Conv3d(1, 1, 3, padding=1)
    parallelize_module(conv, mesh, HaloParallel())
    x = torch.zeros(1, 1) if rank == 1 else torch.zeros(1, 1, 2, 2, 2)
    start = time.perf_counter()
    try:
        conv(x)
    except HaloError as error:
        return f"HaloError: {error}", time.perf_counter() - start
    return "ok", time.perf_counter() - start


@pytest.mark.gloo
def test_bad_plain_input_on_one_rank_raises_everywhere(gloo: Callable[[int], Any]) -> None:
    (other, t0), (bad, t1) = gloo(2).run(bad_input_on_one_rank, timeout=120)
    assert "rank(s) [1] of the group passed this halo module an input without dim 2" in other
    assert "first input must be a tensor with dim 2, got a 2-D tensor" in bad
    assert max(t0, t1) < 5.0, (t0, t1)  # at once, not at a timeout (60 s here)
