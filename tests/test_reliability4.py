"""Issue #26, the two limits the third pass left open.

- a GroupNorm, LayerNorm, Linear (any torch layer with plain parameters whose forward is
  torch's own) left out of a hand-written plan is named by fqn with its missing entry, as
  a `HaloError` that is also a `RuntimeError`, on every rank (DTensor's unnamed "got mixed
  torch.Tensor and DTensor" from C++ before); a user's module, a layer whose parameters
  are DTensors, a model without haloshard styles and torch's `implicit_replication()` keep
  torch's behaviour;
- one rank running an extra forward (under `no_grad`, or with grad) while the others call
  `reduce_grads` raises on every rank at once (every rank waited for the process group's
  timeout before), and the ranks can go on training, exactly.
Every distributed case records what each rank raised and how long it took, on real gloo
processes with uneven shards, 2 and 4 ranks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    parallelize_module,
)

from haloshard import (
    GroupNormParallel,
    HaloError,
    HaloParallel,
    reduce_grads,
    set_timeout,
    verify_plan,
)
from haloshard.testing import (
    GlooWorld,
    counted_collectives,
    shard,
    simulated_mesh,
    worker_mesh,
)

# A mistake every rank sees raises at once: well under a second of work, 5 s with margin for
# a loaded 2-core machine. The process group's timeout here is 60 s, so a wait would show.
AT_ONCE_S = 5.0


def _outcome(fn: Callable[[], object]) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        fn()
    except HaloError as exc:
        kind = "MissingEntryError" if isinstance(exc, RuntimeError) else "HaloError"
        return f"{kind}: {exc}", time.perf_counter() - start
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    return "ok", time.perf_counter() - start


# ---------------------------------------------------------------- a layer left out
class Block(nn.Module):
    """A conv (planned) and the layer under test (left out), nested one level."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.conv, self.layer = nn.Conv3d(4, 4, 3, padding=1), layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.conv(x))


LAYERS: dict[str, Callable[[], nn.Module]] = {
    "GroupNorm": lambda: nn.GroupNorm(2, 4),
    "LayerNorm": lambda: nn.LayerNorm(3),  # over W: per slice, but its parameters are plain
    "Linear": lambda: nn.Linear(3, 3),
    "RMSNorm": lambda: nn.RMSNorm(3),
    "BatchNorm3d": lambda: nn.BatchNorm3d(4),
    "PReLU": lambda: nn.PReLU(4),
}


def _left_out(name: str, mesh: DeviceMesh, length: int) -> nn.Module:
    """`decoder.layer` of a model whose plan covers only `decoder.conv`, on the input of
    `length` frames sharded over `mesh`."""
    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential()
    model.add_module("decoder", Block(LAYERS[name]()))
    parallelize_module(model, mesh, {"decoder.conv": HaloParallel()})
    x = distribute_tensor(torch.randn(1, 4, length, 3, 3), mesh, [Shard(2)])
    return model(x)


def _named(name: str) -> str:
    return (rf"^decoder\.layer \({name}\) has no plan entry: its input is a sharded DTensor, "
            rf"and torch's own {name} forward would mix it with the plain tensors \['weight'"
            r".*got mixed torch\.Tensor and DTensor.* Add an entry for 'decoder\.layer' ")


@pytest.mark.simulated
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_left_out_layer_is_named(name: str) -> None:
    """Named by fqn, with its missing entry: a HaloError that is also a RuntimeError (code
    catching DTensor's own refusal still catches it)."""
    with simulated_mesh(2) as mesh:
        with pytest.raises(HaloError, match=_named(name)) as got:
            _left_out(name, mesh, 7)
        assert isinstance(got.value, RuntimeError)
    assert not torch.nn.modules.module._global_forward_pre_hooks  # no process-wide hook


@pytest.mark.simulated
def test_only_unstyled_known_layers_carry_the_hook() -> None:
    """The hook sits on torch layers the plan left out, not on planned ones (a later plan
    entry drops it), nor on layers it does not know."""
    with simulated_mesh(2) as mesh:
        model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4),
                              nn.Linear(3, 3), ToLocalNorm(2, 4), nn.SiLU())
        parallelize_module(model, mesh, {"0": HaloParallel(), "1": GroupNormParallel()})
    hooked = [i for i, m in enumerate(model) if any(
        getattr(h, "haloshard_gap", False) for h in m._forward_pre_hooks.values())]
    assert hooked == [2]


@pytest.mark.simulated
def test_left_out_before_every_styled_module_is_named() -> None:
    """A layer that meets the sharded input before any styled module has run (the guard
    comes with the plan, not with a styled module's first call)."""
    with simulated_mesh(2) as mesh:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Conv3d(4, 4, 3, padding=1))
        parallelize_module(model, mesh, {"1": HaloParallel()})
        x = distribute_tensor(torch.randn(1, 4, 5, 3, 3), mesh, [Shard(2)])
        with pytest.raises(HaloError, match=r"^0 \(Linear\) has no plan entry"):
            model(x)


@pytest.mark.simulated
def test_left_out_outside_the_planned_submodule_is_named() -> None:
    """The plan was applied to a submodule only; the left-out norm sits in the model
    around it, found from the running model at the styled module's first call."""
    with simulated_mesh(2) as mesh:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Conv3d(4, 4, 3, padding=1)), nn.GroupNorm(2, 4))
        parallelize_module(model[0], mesh, {"0": HaloParallel()})
        x = distribute_tensor(torch.randn(1, 4, 5, 3, 3), mesh, [Shard(2)])
        with pytest.raises(HaloError, match=r"^1 \(GroupNorm\) has no plan entry"):
            model(x)


class ToLocalNorm(nn.GroupNorm):
    """A user's norm with a forward of its own (it takes the local chunk itself)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to_local() if isinstance(x, DTensor) else x)


@pytest.mark.simulated
def test_what_it_does_not_know_keeps_its_own_behaviour() -> None:
    """Not claimed: a subclass with its own forward (runs it), a layer under torch's
    `implicit_replication()` (DTensor takes the mix), a layer whose parameters are
    DTensors (a torch style), a layer whose input a torch style converts in a hook added
    after the guard's, and a model without haloshard styles (DTensor's own error)."""
    with simulated_mesh(2) as mesh:
        torch.manual_seed(0)
        # 4 frames: DTensor's own ops below flatten the sharded dim, which needs even shards
        x = distribute_tensor(torch.randn(1, 4, 4, 3, 3), mesh, [Shard(2)])
        model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), ToLocalNorm(2, 4))
        parallelize_module(model, mesh, {"0": HaloParallel()})
        assert not isinstance(model(x), DTensor)  # its own forward ran, on the local chunk
        model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.Linear(3, 3))
        parallelize_module(model, mesh, {"0": HaloParallel()})
        with implicit_replication():
            assert model(x).shape == (1, 4, 4, 3, 3)
        model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.Linear(3, 6))
        parallelize_module(model, mesh, {"0": HaloParallel(), "1": ColwiseParallel(
            input_layouts=Shard(2), output_layouts=Shard(2), use_local_output=False)})
        assert model(x).shape == (1, 4, 4, 3, 6)
        model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.Linear(3, 3))
        parallelize_module(model, mesh, {"0": HaloParallel()})
        parallelize_module(model, mesh, {"1": PrepareModuleInput(
            input_layouts=Shard(2), desired_input_layouts=Replicate(), use_local_output=True)})
        assert model(x).shape == (1, 4, 4, 3, 3)  # the Linear ran on the gathered input
        plain = nn.Sequential(nn.GroupNorm(2, 4))
        with pytest.raises(RuntimeError, match=r"got mixed torch\.Tensor and DTensor") as got:
            plain(x)
        assert not isinstance(got.value, HaloError)
        assert not plain[0]._forward_pre_hooks


@pytest.mark.simulated
def test_verify_plan_names_the_left_out_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4))
    with simulated_mesh(2) as mesh:
        report = verify_plan(model, {"0": HaloParallel()}, torch.randn(1, 4, 5, 3, 3), mesh)
    assert not report.ok and report.error_fqn == "1", report
    assert re.match(r"1 \(GroupNorm\) has no plan entry: .* Add an entry for '1'",
                    report.error or ""), report.error


def left_out_on_every_rank(world: int, name: str) -> tuple[str, float]:
    """Every rank runs the same model and each raises on its own, promptly."""
    return _outcome(lambda: _left_out(name, worker_mesh(world), 7))  # 4+3, 2+2+2+1 frames


@pytest.fixture(scope="module")
def two() -> Iterator[GlooWorld]:
    with GlooWorld(2, pg_timeout=60, timeout=180) as w:
        yield w


@pytest.fixture(scope="module")
def four() -> Iterator[GlooWorld]:
    with GlooWorld(4, pg_timeout=60, timeout=180) as w:
        yield w


def _world(request: pytest.FixtureRequest, size: int) -> GlooWorld:
    return request.getfixturevalue("two" if size == 2 else "four")


@pytest.mark.gloo
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", ["GroupNorm", "LayerNorm", "Linear"])
def test_left_out_layer_named_on_every_rank(request: pytest.FixtureRequest, size: int,
                                            name: str) -> None:
    results = _world(request, size).run(left_out_on_every_rank, size, name)
    for rank, (text, seconds) in enumerate(results):
        assert re.match(f"MissingEntryError: {_named(name)[1:]}", text), (rank, text)
        assert seconds < AT_ONCE_S, (rank, seconds)


# ---------------------------------------------------------------- an extra forward
def _model() -> nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Conv1d(3, 2, 3, padding=1)).double()


def _full() -> torch.Tensor:
    # 7 frames: 4+3 on 2 ranks, 2+2+2+1 on 4 (uneven)
    return torch.randn(1, 2, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _reference() -> list[torch.Tensor]:
    """The parameter gradients of one single-device step."""
    model = _model()
    model(_full()).sum().backward()
    return [p.grad for p in model.parameters()]


def extra_forward_then_reduce_grads(world: int, case: str, steps: int) -> dict[str, object]:
    """`steps` agreed training steps, then the last rank (or, `case` "two_extra", the
    last two) runs one more forward while the others call reduce_grads; then one agreed
    step more. What each rank raised and how long it took; the later step's gradients
    against one device; the collectives a steady forward and reduce_grads issue.
    `case` "fresh": set_timeout first, as a fresh run does (after it, the first step's
    forward tells reduce_grads which move opens it; otherwise the step before does)."""
    rank, mesh = dist.get_rank(), worker_mesh(world)
    if case == "fresh":
        set_timeout(mesh, 60)
    model = _model()
    parallelize_module(model, mesh, {"0": HaloParallel(), "1": HaloParallel()})
    full = _full()

    def forward() -> torch.Tensor:
        local = shard(full, 2, world, rank)
        x = DTensor.from_local(local, mesh, [Shard(2)], shape=full.shape, stride=full.stride())
        return model(x).to_local()

    counts = {}
    for step in range(steps):
        model.zero_grad()
        with counted_collectives() as calls:
            y = forward()
        counts[f"forward {step}"] = dict(calls)
        y.sum().backward()
        with counted_collectives() as calls:
            reduce_grads(model, mesh)
        counts[f"reduce_grads {step}"] = dict(calls)
    extra = {rank for rank in range(world)[-2 if case == "two_extra" else -1:]}

    def wrong_step() -> None:
        if rank in extra:
            with torch.no_grad() if case != "with_grad" else torch.enable_grad():
                forward()
        reduce_grads(model, mesh)

    got = _outcome(wrong_step)
    model.zero_grad()
    forward().sum().backward()
    reduce_grads(model, mesh)
    # reduced: sums over ranks of partial sums, in float64; one device sums in another order
    exact = all(torch.allclose(p.grad, g, rtol=1e-12, atol=1e-12)
                for p, g in zip(model.parameters(), _reference(), strict=True))
    return {"outcome": got, "afterwards exact": exact, "counts": counts}


@pytest.mark.gloo
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("case, steps", [("no_grad", 2), ("with_grad", 2), ("two_extra", 2)])
def test_extra_forward_before_reduce_grads_raises_at_once(
        request: pytest.FixtureRequest, size: int, case: str, steps: int) -> None:
    if case == "two_extra" and size == 2:
        pytest.skip("two extra ranks of two: no rank calls reduce_grads")
    results = _world(request, size).run(extra_forward_then_reduce_grads, size, case, steps)
    extra = range(size)[-2 if case == "two_extra" else -1:]
    wants = {True: r"rank\(s\) \[.*\] of the group called reduce_grads while this rank runs "
                   "this halo layer's forward",
             False: r"reduce_grads: rank\(s\) \[.*\] of the group ran a forward \(0 "
                    r"\(Conv1d\) layer's halo move\) while this rank called reduce_grads"}
    for rank, got in enumerate(results):
        text, seconds = got["outcome"]
        assert text.startswith("HaloError: ") and re.search(wants[rank in extra], text), (
            rank, text)
        assert seconds < AT_ONCE_S, (rank, seconds, text)
        assert got["afterwards exact"], rank


@pytest.mark.gloo
def test_extra_forward_after_the_first_step_raises_at_once() -> None:
    """A fresh world, set_timeout, one training step, then the extra forward."""
    with GlooWorld(2, pg_timeout=60, timeout=180) as fresh:
        results = fresh.run(extra_forward_then_reduce_grads, 2, "fresh", 1)
    for rank, got in enumerate(results):
        text, seconds = got["outcome"]
        assert re.match(r"HaloError: .*rank\(s\) \[[01]\] of the group", text), (rank, text)
        assert seconds < AT_ONCE_S, (rank, seconds, text)
        assert got["afterwards exact"], rank


@pytest.mark.gloo
def test_reduce_grads_costs_one_move_and_forwards_none(two: GlooWorld) -> None:
    """A steady forward issues only its halo moves; reduce_grads one all-to-all more than
    before (placeholder rows of the first layer's halo), then its gathers and all-reduce."""
    for got in two.run(extra_forward_then_reduce_grads, 2, "no_grad", 2):
        assert got["counts"]["forward 1"] == {"all_to_all_single": 2}, got["counts"]
        assert got["counts"]["reduce_grads 1"] == {
            "all_to_all_single": 1, "all_gather_single": 2, "all_reduce": 1}, got["counts"]


def plain_input_extra_forward() -> tuple[str, float]:
    """A plain-chunk input (each call gathers a row first): the extra forward's gather meets
    reduce_grads' own, which raises at once as before (no move joined)."""
    rank, mesh = dist.get_rank(), worker_mesh(2)
    model = _model()
    parallelize_module(model, mesh, {"0": HaloParallel(), "1": HaloParallel()})
    local = shard(_full(), 2, 2, rank)
    for _ in range(2):
        model(local).sum().backward()
        reduce_grads(model, mesh)

    def wrong_step() -> None:
        if rank == 1:
            with torch.no_grad():
                model(local)
        reduce_grads(model, mesh)

    return _outcome(wrong_step)


@pytest.mark.gloo
def test_extra_forward_of_a_plain_input_raises_at_once(two: GlooWorld) -> None:
    for rank, (text, seconds) in enumerate(two.run(plain_input_extra_forward)):
        assert re.search(r"ranks are in different collectives", text), (rank, text)
        assert seconds < AT_ONCE_S, (rank, seconds)
