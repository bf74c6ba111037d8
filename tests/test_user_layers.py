"""Torch layers as users bring them: subclassed where torch's forward looks untouched, and edited
after planning. Each either gives one device's numbers (output, input, weight and bias
gradients, float64: equal up to the formulations' summation order) or raises `HaloError`.

- a conv that overrides `_conv_forward` (weight standardisation, as timm's StdConv) keeps
  `nn.Conv*.forward`: its own code runs, never torch's conv on the raw weight;
- a GroupNorm subclass with a forward of its own (GroupNorm + activation, as timm's
  GroupNormAct) is refused by `GroupNormParallel` and by `halo_plan(include_norms=True)`;
- a conv's `padding_mode` set after `parallelize_module`, before the first call or after the
  steady state: the halo pads as the conv now does; on one rank only: every rank raises;
- a parametrized weight (`spectral_norm` in training: one power-iteration step per read)
  is computed once per call, as one device computes it;
- BatchNorm under `LocalParallel` with batch statistics (training, or no running statistics)
  raises; in eval with running statistics it is per-slice and exact;
- `LocalParallel` on a block: a conv or pooling along T inside, an InstanceNorm, a
  batch-statistics BatchNorm, a GroupNorm or softmax whose input still holds T raises,
  naming it; per-frame layers (T folded into the batch) and layers with entries of their own
  run, exactly.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

from haloshard import (
    GroupNormParallel,
    HaloError,
    HaloParallel,
    LocalParallel,
    halo_exchange,
    halo_plan,
)
from haloshard._specs import known_forward
from haloshard.testing import (
    GlooWorld,
    assert_close_per_rank,
    check_plan,
    shard,
    sharded,
    simulated_mesh,
    single_device,
    worker_mesh,
)

# the halo formulations sum a conv's taps in another order than one device's conv
F64 = {"atol": 1e-12, "rtol": 1e-10}


class StdConv1d(nn.Conv1d):
    """Weight standardisation in `_conv_forward`: `forward` is torch's."""

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        w = (weight - weight.mean((1, 2), keepdim=True)) / (weight.std((1, 2), keepdim=True)
                                                            + 1e-5)
        return super()._conv_forward(x, w, bias)


class StdConv3d(nn.Conv3d):
    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        return super()._conv_forward(x, weight - weight.mean((1, 2, 3, 4), keepdim=True), bias)


class GroupNormAct(nn.GroupNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(super().forward(x))


def test_known_forward_asks_the_methods_forward_calls() -> None:
    assert known_forward(nn.Conv1d(2, 2, 3)) and not known_forward(StdConv1d(2, 2, 3))
    conv = nn.Conv1d(2, 2, 3)
    conv._conv_forward = lambda x, w, b: x  # type: ignore[method-assign]
    assert not known_forward(conv)


@pytest.mark.parametrize("overlap", [None, True, False])
@pytest.mark.parametrize("kind", ["1d same", "1d reflect", "3d"])
def test_conv_forward_override_runs_its_own_code(kind: str, overlap: bool | None) -> None:
    torch.manual_seed(0)
    if kind == "3d":
        conv: nn.Module = StdConv3d(3, 4, 3, padding=1)
        full = torch.randn(1, 3, 11, 4, 4, dtype=torch.float64)
    else:
        conv = StdConv1d(3, 4, 3, padding="same",
                         padding_mode="reflect" if "reflect" in kind else "zeros")
        full = torch.randn(2, 3, 13, dtype=torch.float64)
    model = nn.Sequential(conv).double()
    with simulated_mesh(2) as mesh:
        check_plan(mesh, model, {"0": HaloParallel(overlap=overlap)}, full, 1)


def test_halo_plan_covers_a_standardised_conv_exactly() -> None:
    model = nn.Sequential(StdConv1d(3, 4, 3, padding=1), nn.SiLU(),
                          StdConv1d(4, 4, 5, padding=2)).double()
    full = torch.randn(1, 3, 14, dtype=torch.float64)
    with simulated_mesh(2) as mesh:
        check_plan(mesh, model, halo_plan(model, include_convs=True), full, 2)


def test_group_norm_with_its_own_forward_is_refused() -> None:
    with simulated_mesh(2) as mesh, pytest.raises(HaloError, match="GroupNormAct has a forward"):
        parallelize_module(GroupNormAct(2, 4), mesh, GroupNormParallel())
    model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), GroupNormAct(2, 4))
    with pytest.raises(HaloError, match=r"1 \(GroupNormAct: a GroupNorm with a forward"):
        halo_plan(model, include_convs=True, include_norms=True)
    with pytest.raises(HaloError, match="GroupNormAct"):  # without include_convs too
        halo_plan(model, include_norms=True)
    plain = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4))
    assert list(halo_plan(plain, include_convs=True, include_norms=True)) == ["0", "1"]
    with simulated_mesh(2) as mesh:  # planned already: the plan's entries say so, not its forward
        parallelize_module(plain, mesh, halo_plan(plain, include_convs=True, include_norms=True))
        assert list(halo_plan(plain, include_convs=True, include_norms=True)) == ["0", "1"]
        with pytest.raises(HaloError, match="already applied"):
            parallelize_module(plain, mesh, {"1": GroupNormParallel()})


@pytest.mark.parametrize("calls_before", [0, 3])
@pytest.mark.parametrize("mode", ["replicate", "reflect", "circular"])
def test_padding_mode_set_after_planning_pads_the_halo_alike(mode: str, calls_before: int
                                                             ) -> None:
    """Before the first call, or once the layer runs its steady state: the conv's new mode
    is the one its halo pads with, as one device's conv does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1)).double()
    full = torch.randn(2, 3, 12, dtype=torch.float64)

    def reference(twin: nn.Module, x: torch.Tensor) -> torch.Tensor:
        twin[0].padding_mode = mode
        return twin(x)

    def run(planned: nn.Module, x: DTensor) -> DTensor:
        for _ in range(calls_before):  # the steady state: zeros padding
            planned(sharded(mesh, full)[0]).to_local().sum().backward()
        planned.zero_grad(set_to_none=True)
        planned[0].padding_mode = mode
        return planned(x)

    with simulated_mesh(2) as mesh:
        check_plan(mesh, model, {"0": HaloParallel()}, full, 1, run=run, reference=reference)


@pytest.mark.parametrize("norm", [nn.BatchNorm3d(4), nn.BatchNorm3d(4, track_running_stats=False)],
                         ids=["running stats", "no running stats"])
def test_batch_norm_per_slice_only_without_batch_statistics(norm: nn.Module) -> None:
    torch.manual_seed(0)
    full = torch.randn(2, 4, 9, 3, 3, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if norm.running_mean is not None:
            norm.running_mean.uniform_(-1, 1)
            norm.running_var.uniform_(0.5, 2)
    model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), norm).double()
    plan = {"0": HaloParallel(), "1": LocalParallel()}
    with simulated_mesh(2) as mesh:
        planned = parallelize_module(copy.deepcopy(model), mesh, plan)
        with pytest.raises(HaloError, match="BatchNorm3d normalizes with batch statistics"):
            planned(sharded(mesh, full)[0])  # training: batch statistics
        model.eval()
        if norm.running_mean is None:  # eval without running statistics: batch statistics
            planned.eval()
            with pytest.raises(HaloError, match="BatchNorm3d normalizes with batch"):
                planned(sharded(mesh, full)[0])
        else:
            check_plan(mesh, model, plan, full, 1)


def _mode_on_one_rank(world: int) -> tuple[str, float]:
    """Three steady calls, then rank 1 alone sets `padding_mode`: what the next call raises
    on this rank, and how long it took."""
    torch.manual_seed(0)
    mesh = worker_mesh(world)
    conv = parallelize_module(nn.Conv1d(3, 4, 3, padding=1), mesh, HaloParallel())
    full = torch.randn(1, 3, 11)
    rank = dist.get_rank()

    def call() -> None:
        x = DTensor.from_local(shard(full, 2, world, rank).requires_grad_(), mesh, [Shard(2)],
                               shape=full.shape, stride=full.stride())
        conv(x).to_local().sum().backward()

    for _ in range(3):
        call()
    if rank == 1:
        conv.padding_mode = "replicate"
    start = time.perf_counter()
    try:
        call()
    except HaloError as exc:
        return str(exc), time.perf_counter() - start
    return "no error", time.perf_counter() - start


@pytest.fixture(scope="module")
def two() -> Iterator[GlooWorld]:
    with GlooWorld(2, pg_timeout=60, timeout=180) as world:
        yield world


@pytest.mark.gloo
def test_padding_mode_set_on_one_rank_raises_on_every_rank(two: GlooWorld) -> None:
    outcomes = two.run(_mode_on_one_rank, 2)
    for message, seconds in outcomes:
        assert "no error" not in message and seconds < 5.0, outcomes  # not the pg timeout
    assert "in ['pad']" in outcomes[1][0] and "rank(s) [1]" in outcomes[0][0], outcomes
    assert "'pad': 'replicate'" in outcomes[1][0] and "'pad': 'zeros'" in outcomes[1][0]


def _exchange_disagreeing(field: str) -> str:
    """`halo_exchange` with `field` (pad or transport) differing between the two ranks."""
    rank, mesh = dist.get_rank(), worker_mesh(2)
    kwargs: dict[str, Any] = {field: (("zeros", "replicate") if field == "pad"
                                      else ("all_to_all", "p2p"))[rank]}
    try:
        halo_exchange(torch.randn(1, 2, 3), left=1, right=1, dim=2, group=mesh, **kwargs)
    except HaloError as exc:
        return str(exc)
    return "no error"


@pytest.mark.gloo
@pytest.mark.parametrize("field, names", [("pad", "['zeros', 'replicate']"),
                                          ("transport", "['all_to_all', 'p2p']")])
def test_disagreeing_modes_are_named(two: GlooWorld, field: str, names: str) -> None:
    """Ranks that disagree on a pad mode or transport read their names, not row codes."""
    for message in two.run(_exchange_disagreeing, field):
        assert f"ranks disagree on {field}: {names}" in message, message


@pytest.mark.parametrize("parametrization", [spectral_norm, weight_norm])
def test_parametrized_weight_is_computed_once_per_call(parametrization: Any) -> None:
    """Three training calls, each against one device's: spectral_norm's power iteration
    steps once per call on both (its `_u` buffer ends equal)."""
    torch.manual_seed(0)
    model = nn.Sequential(parametrization(nn.Conv1d(3, 4, 3, padding=1))).double()
    full = torch.randn(2, 3, 12, dtype=torch.float64)
    with simulated_mesh(2) as mesh:
        with single_device():
            twin = copy.deepcopy(model)
        planned = parallelize_module(copy.deepcopy(model), mesh, {"0": HaloParallel()})
        for _ in range(3):
            with single_device():
                y_ref = twin(full)
            y = planned(sharded(mesh, full)[0])
            assert_close_per_rank(y.to_local(), lambda r, y_ref=y_ref: shard(y_ref, 2, 2, r),
                                  mesh, **F64)
        if parametrization is spectral_norm:
            u = planned[0].parametrizations.weight[0]._u
            with single_device():
                u_ref = twin[0].parametrizations.weight[0]._u.clone()
            assert_close_per_rank(u, lambda r: u_ref, mesh, **F64)
        check_plan(mesh, model, {"0": HaloParallel()}, full, 1)  # gradients, one call


def test_a_conv_changed_after_planning_is_named_so() -> None:
    """A kernel and padding set after planning: the error says the conv changed since it was
    planned, with what it was planned for and what it holds now."""
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1)).double()
    full = torch.randn(1, 3, 12, dtype=torch.float64)
    with simulated_mesh(2) as mesh:
        parallelize_module(model, mesh, {"0": HaloParallel()})
        model(sharded(mesh, full)[0])
        model[0].weight = nn.Parameter(torch.randn(4, 3, 5, dtype=torch.float64))
        model[0].padding = (2,)
        with pytest.raises(HaloError, match=r"0 \(Conv1d\): its kernel, dilation, stride or "
                           r"padding along dim 2 changed after parallelize_module: planned "
                           r"for a kernel span of 3, stride 1 and padding \(1, 1\).*now a span"
                           r" of 5, stride 1 and padding \(2, 2\)"):
            model(sharded(mesh, full)[0])


class PerFrame(nn.Module):
    """A per-slice block that folds T into the batch: its Conv2d and GroupNorm see frames."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[2]
        frames = x.transpose(1, 2).flatten(0, 1)
        y = self.norm(self.conv(frames))
        return y.unflatten(0, (b, t)).transpose(1, 2)


@pytest.mark.parametrize("inner, match", [
    (nn.Conv3d(4, 4, 3, padding=1), r"its 1 \(Conv3d\) reads kernel 3, stride 1, padding 1"),
    (nn.AvgPool3d((3, 1, 1), stride=1, padding=(1, 0, 0)), r"its 1 \(AvgPool3d\) reads kernel 3"),
    (nn.InstanceNorm3d(4), r"\(its 1\).*InstanceNorm3d normalizes over every spatial dim"),
    (nn.BatchNorm3d(4), r"\(its 1\).*BatchNorm3d normalizes with batch statistics"),
    (nn.GroupNorm(2, 4), r"its 1 \(GroupNorm\) gets an input of the block's rank and batch"),
    (nn.Softmax(dim=2), r"its 1 \(Softmax\) gets an input .* takes a softmax along dim 2"),
], ids=["conv", "pool", "instance norm", "batch norm", "group norm", "softmax"])
def test_local_parallel_checks_the_layers_inside(inner: nn.Module, match: str) -> None:
    full = torch.randn(2, 4, 9, 3, 3, dtype=torch.float64)
    model = nn.Sequential(nn.Sequential(nn.Conv3d(4, 4, 1), inner)).double()
    with simulated_mesh(2) as mesh:
        parallelize_module(model, mesh, {"0": LocalParallel()})
        with pytest.raises(HaloError, match=match):
            model(sharded(mesh, full)[0])


def test_local_parallel_passes_per_frame_layers_inside() -> None:
    """A Conv2d and a GroupNorm on frames (T folded into the batch), a 1x1x1 conv and a
    BatchNorm in eval: per-slice, exact."""
    torch.manual_seed(0)
    norm = nn.BatchNorm3d(4).eval()
    model = nn.Sequential(nn.Sequential(nn.Conv3d(4, 4, 1), PerFrame(), norm)).double()
    full = torch.randn(2, 4, 9, 3, 3, dtype=torch.float64)
    with simulated_mesh(2) as mesh:
        check_plan(mesh, model, {"0": LocalParallel()}, full, 1)


def test_local_parallel_leaves_the_layers_with_entries_of_their_own() -> None:
    """A GroupNorm and a conv inside the block with their own entries run sharded
    themselves: exact. On chunks the block pads with zero slices (simulated ranks of unequal
    lengths) they would take those as frames: refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4),
                                        nn.SiLU())).double()
    plan = {"0": LocalParallel(), "0.0": HaloParallel(), "0.1": GroupNormParallel()}
    with simulated_mesh(2) as mesh:
        check_plan(mesh, copy.deepcopy(model), plan, torch.randn(1, 4, 10, 3, 3).double(), 1)
        with pytest.raises(HaloError, match=r"unequal lengths\) padded with zero slices, but its "
                           r"0 has an entry of its own"):
            check_plan(mesh, model, plan, torch.randn(1, 4, 9, 3, 3).double(), 1)
