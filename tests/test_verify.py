"""`verify_plan` on toy models: a correct plan is ok, a broken one names the broken module.

Float64 throughout; tolerance 1e-10 (absolute and relative to the value's scale): the
sharded run adds the same products in another order (GroupNorm statistics combined across
ranks, parameter gradients summed over ranks), a few ulps apart, while a wrong plan is O(1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from haloshard import (
    CausalConvParallel,
    GroupNormParallel,
    HaloParallel,
    LocalParallel,
    PlanReport,
    verify_plan,
)
from haloshard.testing import CausalConv3d, seeded_randn, simulated_mesh, single_device, worker_mesh

TOL = {"atol": 1e-10, "rtol": 1e-10}


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv3d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.causal = CausalConv3d(4)
        self.proj = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.norm(self.conv_in(x)))
        return self.proj(self.causal(h) + h)


class PaddedShift(nn.Module):
    """A causal mix of frames written with functional ops: no conv or pooling module
    inside for a style to check, so a per-slice plan of it is silently wrong (each shard
    pads its own first frame), which only a comparison with one device finds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 1, 0), mode="replicate")
        return padded[:, :, 1:] - padded[:, :, :-1]


def toy(seed: int, frames: int = 5) -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
    with single_device():
        torch.manual_seed(seed)
        model = Toy().double()
    plan = {"conv_in": HaloParallel(), "norm": GroupNormParallel(),
            "causal": CausalConvParallel(), "proj": LocalParallel()}
    return model, seeded_randn((1, 2, frames, 3, 3), seed), plan


def case_toy(mesh: Any) -> None:
    model, x, plan = toy(0)
    report = verify_plan(model, plan, x, mesh, **TOL)
    assert isinstance(report, PlanReport) and report.ok, report
    assert {d.fqn for d in report.outputs} == {"conv_in", "norm", "causal", "proj", ""}
    assert "plan ok" in str(report)
    # per-frame statistics where GroupNorm needs all frames: LocalParallel refuses it
    wrong = {**plan, "norm": LocalParallel()}
    report = verify_plan(model, wrong, x, mesh, **TOL)
    assert not report.ok and report.error_fqn == "norm", report
    assert "normalizes over every spatial dim" in str(report.error), report
    # a causal wrapper run per shard: LocalParallel finds its conv reading along T
    wrong = {**plan, "causal": LocalParallel()}
    report = verify_plan(model, wrong, x, mesh, **TOL)
    assert not report.ok and report.error_fqn == "causal", report
    assert "reads kernel 3, stride 1, padding 0 along dim 2" in str(report.error), report
    # a functional shift run per shard pads every shard's first frame: wrong from there
    shifted = nn.Sequential(model, PaddedShift())
    report = verify_plan(shifted, {f"0.{k}": v for k, v in plan.items()} | {
        "1": LocalParallel()}, x, mesh, **TOL)
    assert report.first is not None and report.first.fqn == "1", report
    assert "first difference: output of 1" in str(report)
    # a conv left out of the plan raises inside it
    report = verify_plan(model, {k: v for k, v in plan.items() if k != "proj"}, x, mesh)
    assert report.error is not None and report.error_fqn == "proj", report
    # a style that refuses the module: the plan entry is named
    report = verify_plan(model, {**plan, "conv_in": LocalParallel()}, x, mesh)
    assert report.error_fqn == "conv_in" and "plan entry 'conv_in'" in str(report)
    assert not model.conv_in.__dict__.get("forward"), "the model itself is not changed"


@pytest.mark.simulated
@pytest.mark.parametrize("world", [2, 3, 4, 6])  # T=5 on 6 ranks: an empty last shard
def test_verify_simulated(world: int) -> None:
    with simulated_mesh(world) as mesh:
        case_toy(mesh)


@pytest.mark.simulated
def test_verify_cp_axis_of_2d_mesh() -> None:
    """On the cp axis of a (dp, cp) mesh: the input is Replicate on dp, Shard(2) on cp."""
    model, x, plan = toy(2)
    with simulated_mesh((2, 3), mesh_dim_names=("dp", "cp")) as mesh:
        assert verify_plan(model, plan, x, mesh, mesh_axis="cp", **TOL).ok
        shifted = nn.Sequential(model, PaddedShift())
        report = verify_plan(shifted, {f"0.{k}": v for k, v in plan.items()} | {
            "1": LocalParallel()}, x, mesh, mesh_axis="cp", **TOL)
    assert report.first is not None and report.first.fqn == "1", report


class Backward(torch.autograd.Function):
    """Identity forward, doubled gradient: wrong only in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return 2 * g


class GradTwice(ParallelStyle):
    """A style exact in forward whose backward doubles the gradient."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def hook(m: nn.Module, args: Any, y: DTensor) -> DTensor:
            return DTensor.from_local(Backward.apply(y.to_local()), y.device_mesh,
                                      y.placements, run_check=False, shape=y.shape,
                                      stride=y.stride())
        module.register_forward_hook(hook)
        return module


@pytest.mark.simulated
def test_verify_names_backward_only_difference() -> None:
    """A module exact in forward but wrong in backward is named by its input gradient."""
    model, x, plan = toy(1, frames=4)  # even shards: the test hook's to_local needs them
    model.proj = nn.Sequential(nn.Identity(), model.proj)
    proj = plan.pop("proj")
    plan = {**plan, "proj.0": GradTwice(), "proj.1": proj}
    with simulated_mesh(2) as mesh:
        report = verify_plan(model, plan, x, mesh, **TOL)
    assert report.first is not None, report
    assert (report.first.fqn, report.first.kind) == ("proj.0", "input grad"), report
    assert all(d.ok for d in report.outputs)


def on_gloo() -> None:
    case_toy(worker_mesh(dist.get_world_size()))


@pytest.mark.gloo
def test_verify_gloo(gloo: Callable[[int], Any]) -> None:
    gloo(3).run(on_gloo, timeout=120)
