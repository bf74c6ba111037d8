"""Issue #26, item 3: haloshard under torch.compile raises its own errors and prints nothing.

- `halo_exchange` takes `left`, `right`, `dim`, `group` as required keywords (the positional
  shim called `warnings.warn`, which fullgraph compile cannot trace);
- a `HaloError` found while dynamo traces reaches the user as `HaloError` with its own text,
  with `fullgraph=True` and without (dynamo's `Unsupported: Observed exception` before);
- a compiled model prints no warning (dynamo warned, on every rank, about each
  `functools.lru_cache`-wrapped planner it traced).
Real gloo processes: compile needs real process groups.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import HaloError, HaloParallel, HaloShard, halo_exchange, packed
from haloshard.testing import reference_halo, shard, worker_mesh


def _fresh_dynamo() -> None:
    """Forget compiled code and the warnings dynamo printed once per process (its
    `warn_once` would hide a warning that an earlier test in this worker printed)."""
    torch._dynamo.reset()
    torch._dynamo.utils.warn_once_cache.clear()


def _conv_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return torch.nn.Sequential(
        torch.nn.Conv1d(4, 4, 3, padding=1, groups=4), torch.nn.SiLU(),
        torch.nn.Conv1d(4, 2, 5, padding=2, padding_mode="replicate")).double()


def compiled_warnings() -> list[str]:
    """Every warning a compiled exchange and a compiled HaloParallel model (plain, and on
    packed documents) print while compiling and running, forward and backward."""
    _fresh_dynamo()
    mesh = worker_mesh(dist.get_world_size())
    eager, model = _conv_model(), _conv_model()
    for m in (eager, model):
        parallelize_module(m, mesh, {"0": HaloParallel(), "2": HaloParallel()})
    full = torch.randn(1, 4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def exchange(x: torch.Tensor) -> torch.Tensor:
        return halo_exchange(x, left=2, right=1, dim=2, group=mesh, global_length=12)

    def documents(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with packed([0, 3, 7, 12]):
            return m(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local = shard(full, 2, dist.get_world_size(), dist.get_rank()).requires_grad_()
        torch.compile(exchange, fullgraph=True, backend="aot_eager")(local).sum().backward()
        for fn in (torch.compile(model, fullgraph=True, backend="aot_eager"),
                   lambda x: torch.compile(documents, fullgraph=True, backend="aot_eager")(
                       model, x)):
            x = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
            fn(x).to_local().sum().backward()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.mark.gloo
def test_compiled_model_prints_no_warning(gloo) -> None:
    for rank, caught in enumerate(gloo(2).run(compiled_warnings, timeout=300)):
        assert caught == [], (rank, caught)


class PadThenConv(torch.nn.Module):
    """A causal conv of its own: `F.pad` of 2 steps on the left, then a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.nn.functional.pad(x, (2, 0)))


def compile_outcomes(case: str) -> list[str]:
    """What the caller catches from a compiled call, with fullgraph=True and without."""
    mesh = worker_mesh(dist.get_world_size())
    x = torch.ones(1, 2, 4)  # T = 8 split (4, 4)
    if case == "wrong_global_length":  # wrong on every rank: (5, 5) expected
        def fn(t: torch.Tensor) -> torch.Tensor:
            return halo_exchange(t, left=1, right=1, dim=2, group=mesh, global_length=10)
    elif case == "no_global_length":
        def fn(t: torch.Tensor) -> torch.Tensor:
            return halo_exchange(t, left=1, right=1, dim=2, group=mesh)
    else:  # a module with an explicit spec, which refuses compile (named in the message)
        module = torch.nn.Sequential(PadThenConv())
        parallelize_module(module, mesh, {"0": HaloParallel(HaloShard(2, left=2))})
        x = distribute_tensor(torch.ones(1, 2, 8), mesh, [Shard(2)])
        fn = module
    got = []
    for fullgraph in (True, False):
        _fresh_dynamo()
        try:
            torch.compile(fn, fullgraph=fullgraph, backend="eager")(x)
            got.append("ok")
        except HaloError as error:
            got.append(f"HaloError: {error}")
        except Exception as error:
            got.append(f"{type(error).__name__}: {error}")
    return got


@pytest.mark.gloo
@pytest.mark.parametrize("case, message", [
    ("wrong_global_length", "HaloError: global_length=10 splits as [5, 5] over 2 ranks, so "
                            "rank {rank} must hold 5 slices along dim 2, but its chunk has 4"),
    ("no_global_length", "HaloError: under torch.compile pass global_length="),
    ("explicit_spec", "HaloError: 0 (PadThenConv): a module whose own padding of dim 2 the halo "
                      "replaces"),
])
def test_compile_raises_halo_error(gloo, case: str, message: str) -> None:
    for rank, got in enumerate(gloo(2).run(compile_outcomes, case, timeout=300)):
        want = message.format(rank=rank)
        for fullgraph, text in zip((True, False), got, strict=True):
            assert text.startswith(want), (rank, fullgraph, text)


def compiled_exchange_values() -> list[str]:
    """The keyword form under fullgraph compile: forward and input gradient exact."""
    _fresh_dynamo()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = worker_mesh(world)
    full = torch.randn(1, 3, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def step(x: torch.Tensor) -> torch.Tensor:
        return halo_exchange(x, left=3, right=1, dim=2, group=mesh, pad="replicate",
                             global_length=7)

    x = shard(full, 2, world, rank).clone().requires_grad_()
    y = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    ref = full.clone().requires_grad_()  # every rank's loss on one device
    outs = [reference_halo(ref, 3, 1, 2, world, r, "replicate") for r in range(world)]
    sum((o * torch.arange(o.numel(), dtype=o.dtype).reshape(o.shape)).sum()
        for o in outs).backward()
    bad = [] if torch.equal(y, outs[rank]) else ["forward"]
    # A data move and its adjoint: the gradient sums the same integer weights, exactly.
    if not torch.equal(x.grad, shard(ref.grad, 2, world, rank)):
        bad.append("input gradient")
    return bad


@pytest.mark.gloo
def test_keyword_form_compiles_fullgraph(gloo) -> None:
    assert gloo(2).run(compiled_exchange_values, timeout=300) == [[], []]


def test_eager_module_copy_still_names_errors() -> None:
    """`named` (used by every halo module) still puts the module in front, once."""
    from haloshard._errors import named

    inner = HaloError("got 3 slices, expected 4")
    outer = named(inner, "enc.conv (Conv3d)")
    assert str(outer) == "enc.conv (Conv3d): got 3 slices, expected 4"
    assert str(named(copy.copy(outer), "enc (Encoder)")) == str(outer)
