"""The simulated-mesh harness itself: it must give the numbers real processes give.

`simulated_mesh` (a fake process group under LocalTensorMode, one process) is what the fast
tests and the notebooks trust, so here the same SPMD body runs under it and under real gloo
processes and every rank's values are compared: the exchange's outputs and its all_to_all /
p2p input gradients bit for bit; allgather's gradients and a parallelized conv stack within
the rounding bounds stated on each test. The rest checks the helper's contract: its errors,
its teardown and the per-rank read-back.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._local_tensor import (
    enabled_local_tensor_mode,
    maybe_run_for_local_tensor,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import (
    TRANSPORTS,
    HaloError,
    HaloShard,
    annotate,
    halo_exchange,
    halo_plan,
    reduce_grads,
)
from haloshard.testing import (
    GlooWorld,
    WorkerDied,
    assert_close_per_rank,
    per_rank,
    rank_map,
    reference_halo,
    shard,
    simulated_mesh,
    single_device,
    worker_mesh,
)

Result = tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]


def body_exchange(mesh: DeviceMesh, length: int, left: int, right: int, pad: str,
                  transport: str, dtype: torch.dtype) -> Result:
    """Exchange a seeded `(2, 3, T, 4)` tensor along dim 2, back-propagate seeded weights.

    Returns every rank's output and input gradient (only this rank's in a real process).
    """
    world = mesh.size()
    with single_device():  # one plain tensor, not one per simulated rank
        full = torch.randn(2, 3, length, 4, generator=torch.Generator().manual_seed(length),
                           dtype=torch.float64).to(dtype)

    def weight(r: int) -> torch.Tensor:
        shape = reference_halo(full, left, right, 2, world, r, pad).shape
        return _weight(shape, dtype, r)

    x = rank_map(mesh, lambda r: shard(full, 2, world, r).clone()).requires_grad_()
    y = halo_exchange(x, left=left, right=right, dim=2, group=mesh, pad=pad, transport=transport)
    (y * rank_map(mesh, weight)).sum().backward()
    assert x.grad is not None
    return per_rank(y), per_rank(x.grad)


def _weight(shape: torch.Size, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Rank's upstream gradient for its output of `shape`, seeded per rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _weights(outputs: dict[int, torch.Tensor], dtype: torch.dtype) -> dict[int, torch.Tensor]:
    return {r: _weight(y.shape, dtype, r) for r, y in outputs.items()}


def on_gloo_exchange(*args: object) -> Result:
    return body_exchange(worker_mesh(dist.get_world_size()), *args)  # type: ignore[arg-type]


class _Causal(nn.Module):
    """Replicate-pads T by 2 itself, then a conv with no T padding (annotated explicitly)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, (3, 3, 1), padding=(0, 1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 0, 0, 0, 2, 0), mode="replicate"))


def _conv_model(dtype: torch.dtype) -> nn.Module:
    model = nn.Sequential(annotate(_Causal(), HaloShard(2, left=2, pad="replicate")), nn.SiLU(),
                          nn.Conv3d(2, 3, (3, 1, 1), stride=(2, 1, 1), padding=(1, 0, 0)))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model.to(dtype)


def body_conv(mesh: DeviceMesh, length: int, dtype: torch.dtype
              ) -> tuple[Result, list[dict[int, torch.Tensor]]]:
    """A parallelized causal conv stack on plain local chunks; outputs and all gradients.

    Returns the per-rank output and input gradient, and every parameter's per-rank gradient
    after `reduce_grads`.
    """
    world = mesh.size()
    with single_device():
        model = _conv_model(dtype)
        full = torch.randn(1, 2, length, 3, 2, generator=torch.Generator().manual_seed(length),
                           dtype=torch.float64).to(dtype)
    parallelize_module(model, mesh, halo_plan(model, include_convs=True))
    x = rank_map(mesh, lambda r: shard(full, 2, world, r).clone()).requires_grad_()
    y = model(x)
    upstream = maybe_run_for_local_tensor(lambda t, r: _weight(t.shape, dtype, r))
    (y * upstream(y.detach(), mesh.get_local_rank())).sum().backward()
    reduce_grads(model, mesh)
    assert x.grad is not None
    return (per_rank(y), per_rank(x.grad)), [per_rank(p.grad) for p in model.parameters()]


def on_gloo_conv(*args: object) -> tuple[Result, list[dict[int, torch.Tensor]]]:
    return body_conv(worker_mesh(dist.get_world_size()), *args)  # type: ignore[arg-type]


def _merge(results: list[Result]) -> Result:
    ys = {r: t for y, _ in results for r, t in y.items()}
    grads = {r: t for _, g in results for r, t in g.items()}
    return ys, grads


def _assert_bitwise(actual: dict[int, torch.Tensor], expected: dict[int, torch.Tensor],
                    what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: ranks {sorted(actual)}"
    for r in expected:
        a, e = actual[r], expected[r]
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what} rank {r}: {a.shape} {e.shape}"
        # Bits, not values: -0.0 and 0.0 (or two NaNs) are told apart.
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8)), f"{what} rank {r} differs"


# (world, T, left, right, pad): multi-hop, uneven and empty chunks, every pad mode.
GEOMETRY = [
    (4, 5, 3, 2, "zeros"),       # split (2, 2, 1, 0): rank 3 empty, halos span 2 ranks
    (4, 7, 2, 1, "replicate"),
    (3, 7, 2, 2, "reflect"),
    (4, 6, 0, 4, "circular"),    # split (2, 2, 2, 0): right halo wraps around
    (2, 6, 1, 1, "zeros"),
]
DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.gloo
@pytest.mark.parametrize(("world", "length", "left", "right", "pad"), GEOMETRY)
def test_simulated_equals_gloo_exchange(gloo, world: int, length: int, left: int, right: int,
                                        pad: str) -> None:
    """Simulated ranks give gloo's outputs and input gradients, transport by transport.

    Outputs are copies: bit-identical for every transport. Input gradients of all_to_all and
    p2p are sums formed on the owning rank in the same order: bit-identical too. allgather's
    backward is a reduce-scatter, which adds the ranks' halo gradients in the backend's own
    order (LocalTensorMode: rank order; gloo: its algorithm's), so those may differ in the
    last bits. Each side is within eps * (left + right + 1) * max|w| of the exact sum (the
    bound of test_exchange.py), so they are within twice that of each other.
    """
    for dtype in DTYPES:
        sim: dict[str, Result] = {}
        for transport in ("all_to_all", "allgather"):
            with simulated_mesh(world) as mesh:
                sim[transport] = body_exchange(mesh, length, left, right, pad, transport, dtype)
        for transport in TRANSPORTS:
            real = _merge(gloo(world).run(on_gloo_exchange, length, left, right, pad,
                                          transport, dtype))
            # p2p cannot run under LocalTensorMode; it must give simulated all_to_all's numbers.
            expected = sim.get(transport, sim["all_to_all"])
            _assert_bitwise(real[0], expected[0], f"{transport} {dtype} output")
            if transport != "allgather":
                _assert_bitwise(real[1], expected[1], f"{transport} {dtype} input grad")
                continue
            biggest = max(float(w.abs().max()) for w in _weights(real[0], dtype).values())
            atol = 2 * torch.finfo(dtype).eps * (left + right + 1) * biggest
            for r, grad in real[1].items():
                torch.testing.assert_close(grad, expected[1][r], atol=atol, rtol=0)


@pytest.mark.gloo
@pytest.mark.parametrize(("world", "length"), [(2, 7), (3, 7), (4, 5)])
def test_simulated_equals_gloo_parallel_conv(gloo, world: int, length: int) -> None:
    """A parallelized conv stack gives the same numbers in simulated ranks and gloo processes.

    Not bit for bit: under LocalTensorMode every rank's conv window has the same length (the
    shorter ones are zero-filled; per-rank shapes would be symbolic), so a conv may block its
    reduction differently than on the exact window of a real process, and `reduce_grads`
    all-reduces parameter gradients in each backend's own order. Such reorderings move a
    value by a few eps of the largest value (seen: under 4 eps); the bound 16 eps * max|value|
    (times the world size for parameter gradients, summed once more over the ranks) leaves
    room, while a misplaced frame would be off by O(max|value|).
    """
    for dtype in DTYPES:
        with simulated_mesh(world) as mesh:
            (y, dx), summed = body_conv(mesh, length, dtype)
        results = gloo(world).run(on_gloo_conv, length, dtype)
        real_y, real_dx = _merge([r[0] for r in results])
        eps = torch.finfo(dtype).eps
        for r in range(world):
            for what, got, want in (("output", real_y[r], y[r]),
                                    ("input grad", real_dx[r], dx[r])):
                scale = float(want.abs().max()) if want.numel() else 0.0
                torch.testing.assert_close(got, want, atol=16 * eps * scale, rtol=0,
                                           msg=lambda m, r=r, w=what: f"rank {r} {w}: {m}")
        for i, total in enumerate(summed):
            for r in range(world):
                got = results[r][1][i][r]
                scale = float(total[r].abs().max())
                torch.testing.assert_close(got, total[r], atol=16 * world * eps * scale, rtol=0,
                                           msg=lambda m, r=r, i=i: f"param {i}, rank {r}: {m}")


def killed_rank_one() -> None:
    """Rank 1 dies by SIGKILL (as the OOM killer ends a process); rank 0 waits for it in a
    barrier its group would hold for 60 s."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.gloo
def test_gloo_world_reports_a_dead_worker_at_once() -> None:
    """A worker killed during a call: `WorkerDied` names it and the signal within seconds,
    where the world used to wait for its timeout (an hour in `benchmarks.vae`)."""
    world = GlooWorld(2, pg_timeout=60, timeout=120)
    start = time.monotonic()
    with pytest.raises(WorkerDied, match=r"rank 1 \(killed by SIGKILL \(the kernel's OOM "
                       r"killer sends it\)\) died during killed_rank_one; ranks \[1\] had not "
                       r"answered"):
        world.run(killed_rank_one)
    assert time.monotonic() - start < 15
    assert not world.alive


@pytest.mark.simulated
def test_simulated_mesh_tears_down() -> None:
    assert not dist.is_initialized()
    with simulated_mesh(4) as mesh:
        assert dist.is_initialized() and dist.get_backend() == "fake"
        assert mesh.size() == 4 and enabled_local_tensor_mode() is not None
    assert not dist.is_initialized() and enabled_local_tensor_mode() is None
    with pytest.raises(RuntimeError, match="boom"), simulated_mesh(2):
        raise RuntimeError("boom")
    assert not dist.is_initialized() and enabled_local_tensor_mode() is None
    with simulated_mesh(3):  # usable again after an error
        pass


@pytest.mark.simulated
def test_simulated_mesh_refuses_a_real_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(HaloError, match=r"found backend 'gloo' with 1 ranks"), \
                simulated_mesh(4):
            pass
        assert dist.is_initialized() and dist.get_backend() == "gloo"  # left alone
    finally:
        dist.destroy_process_group()


@pytest.mark.simulated
def test_simulated_mesh_reuses_a_fake_group_of_its_size() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        with pytest.raises(HaloError, match=r"simulated_mesh\(\(2,\)\) needs .* 2 ranks, found "
                           r"backend 'fake' with 4 ranks"), simulated_mesh(2):
            pass
        with simulated_mesh((2, 2)) as mesh:
            assert mesh.shape == (2, 2)
        assert dist.is_initialized()  # not its group: not destroyed
    finally:
        dist.destroy_process_group()


@pytest.mark.simulated
def test_simulated_mesh_2d_axis() -> None:
    """On a (dp, cp) mesh each dp row exchanges along cp only, with cp-local ranks."""
    full = torch.randn(1, 2, 5, 3, generator=torch.Generator().manual_seed(1))
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "cp")) as mesh:
        x = rank_map(mesh, lambda r: shard(full, 2, 2, r), mesh_axis="cp")
        y = halo_exchange(x, left=2, right=1, dim=2, group=(mesh, "cp"), pad="replicate")
        assert_close_per_rank(y, lambda r: reference_halo(full, 2, 1, 2, 2, r, "replicate"),
                              mesh, mesh_axis="cp")
    values = per_rank(y)
    assert sorted(values) == [0, 1, 2, 3]
    assert torch.equal(values[0], values[2]) and torch.equal(values[1], values[3])


@pytest.mark.simulated
def test_per_rank() -> None:
    plain = torch.arange(3.0)
    assert list(per_rank(plain)) == [0] and torch.equal(per_rank(plain)[0], plain)
    with simulated_mesh(3) as mesh:
        x = rank_map(mesh, lambda r: torch.full((2,), float(r)))
        inside = per_rank(x)
    after = per_rank(x)  # the LocalTensor outlives its mode
    for values in (inside, after):
        assert {r: t.tolist() for r, t in values.items()} == {r: [r, r] for r in range(3)}
        assert all(type(t) is torch.Tensor for t in values.values())
