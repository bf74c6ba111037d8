"""halo_exchange under torch.compile(fullgraph=True): no graph breaks, same values as eager."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from haloshard import HaloError, halo_exchange
from haloshard.testing import reference_halo, shard, worker_mesh


def compiled_exchange(backend: str) -> list[str]:
    """Compile exchange + a reduction; forward bitwise vs the reference, grad exact too."""
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = worker_mesh(world)
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(1, 3, 7, 4, generator=gen, dtype=torch.float64)
    problems = []
    for left, right, pad in [(2, 1, "zeros"), (3, 0, "replicate"), (1, 1, "circular")]:

        def step(x: torch.Tensor, left: int = left, right: int = right,
                 pad: str = pad) -> torch.Tensor:
            return halo_exchange(x, left=left, right=right, dim=2, group=mesh, pad=pad,
                                 global_length=7) * 2.0

        fn = torch.compile(step, fullgraph=True, backend=backend)
        x = shard(full, 2, world, rank).clone().requires_grad_()
        y = fn(x)
        expected = reference_halo(full, left, right, 2, world, rank, pad) * 2.0
        if not torch.equal(y, expected):
            problems.append(f"forward {left, right, pad}")
        y.sum().backward()
        eager = shard(full, 2, world, rank).clone().requires_grad_()
        step(eager).sum().backward()
        if not torch.equal(x.grad, eager.grad):
            problems.append(f"backward {left, right, pad}")
    return problems


def compile_without_length() -> str:
    mesh = worker_mesh(dist.get_world_size())
    fn = torch.compile(lambda x: halo_exchange(x, left=1, right=0, dim=2, group=mesh),
                       fullgraph=True, backend="eager")
    try:
        fn(torch.ones(1, 1, 2))
    except Exception as exc:  # dynamo wraps the HaloError raised while tracing
        return str(exc)
    return "ok"


@pytest.mark.gloo
def test_compiled_matches_eager(gloo) -> None:
    assert gloo(2).run(compiled_exchange, "aot_eager", timeout=300) == [[], []]


@pytest.mark.gloo
def test_compile_needs_global_length(gloo) -> None:
    for message in gloo(2).run(compile_without_length, timeout=120):
        assert "under torch.compile pass global_length=" in message
    assert issubclass(HaloError, ValueError)


def compiled_model(backend: str) -> list[str]:
    """A parallelized conv model (hooks included) under fullgraph compile equals eager."""
    import copy

    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from haloshard import HaloShard, annotate, halo_plan

    torch._dynamo.reset()
    mesh = worker_mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(3, 4, 3, padding=1), torch.nn.SiLU(),
        torch.nn.Conv3d(4, 4, (3, 1, 1), padding=(2, 0, 0), dilation=(2, 1, 1)),
        torch.nn.Conv3d(4, 2, (3, 3, 3), stride=(2, 1, 1), padding=1),
    ).double()
    annotate(model[0], HaloShard(2, 1, 1))  # explicit spec = the derived halo
    eager = copy.deepcopy(model)
    for m in (model, eager):
        parallelize_module(m, mesh, halo_plan(m, include_convs=True))
    full = torch.randn(1, 3, 9, 4, 4, dtype=torch.float64)
    results = []
    for m, fn in ((eager, eager), (model, torch.compile(model, fullgraph=True,
                                                         backend=backend))):
        x = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
        y = fn(x)
        (y.to_local() ** 2).sum().backward()
        results.append([y.to_local(), x.grad.to_local(), *(p.grad for p in m.parameters())])
    return [f"tensor {i}" for i, (a, b) in enumerate(zip(*results, strict=True))
            if not torch.allclose(a, b, atol=1e-12, rtol=1e-12)]


@pytest.mark.gloo
def test_compiled_model_matches_eager(gloo) -> None:
    # Same ops in the same order; aot_eager does not fuse, 1e-12 covers kernel blocking.
    assert gloo(2).run(compiled_model, "aot_eager", timeout=300) == [[], []]


def compiled_packed(backend: str, documents: bool = True) -> list[str]:
    """A parallelized conv model (depthwise, zeros; dense, replicate) run on packed documents
    (the hooks under `haloshard.packed`) under fullgraph compile: equal to eager, and eager
    equal to each document run alone on one device."""
    import copy
    import itertools

    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from haloshard import HaloParallel, packed
    from haloshard.testing import single_device

    torch._dynamo.reset()
    mesh = worker_mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(4, 4, 3, padding=1, groups=4), torch.nn.SiLU(),
        torch.nn.Conv1d(4, 2, 5, padding=2, padding_mode="replicate")).double()
    cu = [0, 3, 7, 12] if documents else [0, 12]
    full = torch.randn(1, 4, 12, dtype=torch.float64)
    with single_device():
        alone = torch.cat([model(full[..., a:b]) for a, b in itertools.pairwise(cu)], -1)
    eager = copy.deepcopy(model)
    plan = {"0": HaloParallel(), "2": HaloParallel()}
    for m in (model, eager):
        parallelize_module(m, mesh, plan)

    def step(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not documents:
            return m(x)
        with packed(cu):
            return m(x)

    results = []
    for fn, m in ((step, eager), (torch.compile(step, fullgraph=True, backend=backend),
                                  model)):
        x = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
        y = fn(m, x)
        (y.to_local() ** 2).sum().backward()
        results.append([y.to_local(), x.grad.to_local(), *(p.grad for p in m.parameters())])
    bad = [f"tensor {i}" for i, (a, b) in enumerate(zip(*results, strict=True))
           if not torch.allclose(a, b, atol=1e-12, rtol=1e-12)]
    want = alone.tensor_split(
        [sum(len(c) for c in full[0, 0].chunk(dist.get_world_size())[:r])
         for r in range(1, dist.get_world_size())], -1)[dist.get_rank()]
    if not torch.allclose(results[0][0], want, atol=1e-12, rtol=1e-12):
        bad.append("eager against each document alone")
    return bad


@pytest.mark.gloo
def test_compiled_packed_matches_eager(gloo) -> None:
    # Same ops in the same order (aot_eager does not fuse); the documents alone on one
    # device sum the same products in another blocking: 1e-12.
    assert gloo(2).run(compiled_packed, "aot_eager", timeout=300) == [[], []]


class CausalWrapper(torch.nn.Module):
    """`F.pad` of 3 steps on the left, then a depthwise conv (Mamba's short conv)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 4, 4, groups=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.nn.functional.pad(x, (3, 0)))


def compiled_wrapper() -> str:
    """A wrapper with an explicit spec under fullgraph compile: its `F.pad` cannot be
    dropped there, so it raises `HaloError` (never a shifted output)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from haloshard import HaloParallel, HaloShard

    torch._dynamo.reset()
    mesh = worker_mesh(dist.get_world_size())
    module = CausalWrapper().double()
    parallelize_module(module, mesh, HaloParallel(HaloShard(2, left=3)))
    x = distribute_tensor(torch.randn(1, 4, 12, dtype=torch.float64), mesh, [Shard(2)])
    try:
        torch.compile(module, fullgraph=True, backend="aot_eager")(x)
    except Exception as error:  # dynamo wraps the HaloError raised in the graph
        return str(error)
    return "no error"


@pytest.mark.gloo
def test_compiled_wrapper_raises(gloo) -> None:
    for message in gloo(2).run(compiled_wrapper, timeout=300):
        assert "cannot run under torch.compile" in message, message
