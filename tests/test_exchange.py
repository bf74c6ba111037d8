"""halo_exchange against the single-device reference: forward (bitwise) and every gradient.

Each case is one SPMD body run under simulated ranks (LocalTensorMode, one process) and under
real gloo processes. Forward is a pure data move, compared with atol=rtol=0. Input gradients
are sums of the slice's own gradient and the gradients of its halo copies; the exchange adds
them in another order than autograd through F.pad does. Each reordered add may round once, at
the scale of the summands, so the bound is absolute: eps(dtype) * (left + right + 1) * max|w|
(a slice has at most left + right halo copies; w are the upstream gradients).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from haloshard import PAD_MODES, TRANSPORTS, halo_exchange
from haloshard.testing import (
    assert_close_per_rank,
    rank_map,
    reference_halo,
    shard,
    simulated_mesh,
    single_device,
    worker_mesh,
)

SHAPES = {3: (2, 3, 4), 5: (1, 2, 3, 3, 2)}  # the sharded dim's size is set per case


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def case_exchange(mesh: DeviceMesh, ndim: int, dim: int, length: int, left: int, right: int,
                  pad: str, transport: str, dtype: torch.dtype, seed: int,
                  steady: bool = False) -> None:
    """Forward bitwise equal to F.pad + slice; input gradient equal to autograd through it.

    `steady`: the checked call is a layer's steady state (`agreements=` agreed by a first
    call, so its move carries status flags)."""
    shape = list(SHAPES[ndim])
    shape[dim] = length
    full = _data(tuple(shape), dtype, seed)
    world = mesh.size()
    x = rank_map(mesh, lambda r: shard(full, dim, world, r).clone()).requires_grad_()
    kw: dict = {"global_length": length, "agreements": {}} if steady else {}
    for _ in range(2 if steady else 1):
        y = halo_exchange(x, left=left, right=right, dim=dim, group=mesh, pad=pad,
                          transport=transport, **kw)
    assert_close_per_rank(y, lambda r: reference_halo(full, left, right, dim, world, r, pad),
                          mesh)

    def weight(r: int) -> torch.Tensor:
        return _data(tuple(reference_halo(full, left, right, dim, world, r, pad).shape), dtype,
                     seed + 1 + r)

    (y * rank_map(mesh, weight)).sum().backward()
    with single_device():
        ref = full.detach().clone().requires_grad_()
        sum((reference_halo(ref, left, right, dim, world, r, pad) * weight(r)).sum()
            for r in range(world)).backward()
        biggest = max(float(weight(r).abs().amax()) if weight(r).numel() else 0.0
                      for r in range(world))
    assert ref.grad is not None
    atol = torch.finfo(dtype).eps * (left + right + 1) * biggest
    assert_close_per_rank(x.grad, lambda r: shard(ref.grad, dim, world, r), mesh,
                          atol=atol, rtol=0)


def on_gloo(case: str, *args: object) -> None:
    globals()[case](worker_mesh(dist.get_world_size()), *args)


# (world, ndim, dim, length, left, right): uneven, empty, multi-hop, causal, wider than T.
GEOMETRY = [
    (1, 3, 2, 5, 2, 1),
    (2, 3, 2, 7, 1, 1),
    (3, 5, 2, 7, 2, 0),
    (4, 3, 1, 5, 3, 2),   # T=5 on 4: (2, 2, 1, 0): empty rank, multi-hop
    (4, 5, 2, 6, 0, 4),
    (4, 5, 1, 3, 1, 1),   # ranks 3 is empty, rank 2 holds one slice
]


def _valid(length: int, left: int, right: int, pad: str) -> bool:
    if pad == "reflect":
        return max(left, right) < length
    if pad == "circular":
        return max(left, right) <= length
    return pad == "zeros" or length > 0


def _cases(transports: tuple[str, ...]) -> list[tuple[object, ...]]:
    out = []
    for world, ndim, dim, length, left, right in GEOMETRY:
        for pad in PAD_MODES:
            if not _valid(length, left, right, pad):
                continue
            for transport in transports:
                out.append((world, ndim, dim, length, left, right, pad, transport))
    return out


@pytest.mark.simulated
@pytest.mark.parametrize(("world", "ndim", "dim", "length", "left", "right", "pad", "transport"),
                         _cases(("all_to_all", "allgather")))
def test_simulated(world: int, ndim: int, dim: int, length: int, left: int, right: int,
                   pad: str, transport: str) -> None:
    with simulated_mesh(world) as mesh:
        case_exchange(mesh, ndim, dim, length, left, right, pad, transport, torch.float64, 0)


@pytest.mark.simulated
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", PAD_MODES)
def test_simulated_low_precision(pad: str, dtype: torch.dtype) -> None:
    """The empty-rank, multi-hop geometry in float32 and bfloat16 (gloo runs them all)."""
    with simulated_mesh(4) as mesh:
        case_exchange(mesh, 3, 1, 5, 3, 2 if pad != "reflect" else 1, pad, "all_to_all",
                      dtype, 0)


@pytest.mark.gloo
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gloo(gloo, world: int) -> None:
    """Every geometry of this world size, every pad mode and transport, three dtypes."""
    for w, ndim, dim, length, left, right, pad, transport in _cases(TRANSPORTS):
        if w != world:
            continue
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            gloo(world).run(on_gloo, "case_exchange", ndim, dim, length, left, right, pad,
                            transport, dtype, 7)


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_steady_state(gloo, world: int) -> None:
    """Every geometry of this world size and pad mode through an agreed call site (the
    flagged all-to-all a layer runs after its first call)."""
    for w, ndim, dim, length, left, right, pad, _ in _cases(("all_to_all",)):
        if w == world:
            gloo(world).run(on_gloo, "case_exchange", ndim, dim, length, left, right, pad,
                            "all_to_all", torch.float64, 11, True)


CASE = st.tuples(
    st.integers(1, 4), st.sampled_from([(3, 1), (3, 2), (5, 1), (5, 2)]), st.integers(0, 9),
    st.integers(0, 7), st.integers(0, 7), st.sampled_from(PAD_MODES),
).filter(lambda c: _valid(c[2], c[3], c[4], c[5]))


@pytest.mark.simulated
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASE, transport=st.sampled_from(("all_to_all", "allgather")))
def test_simulated_random(case: tuple, transport: str) -> None:
    world, (ndim, dim), length, left, right, pad = case
    with simulated_mesh(world) as mesh:
        case_exchange(mesh, ndim, dim, length, left, right, pad, transport, torch.float64, 3)


@pytest.mark.gloo
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(case=CASE, transport=st.sampled_from(TRANSPORTS))
def test_gloo_random(gloo, case: tuple, transport: str) -> None:
    world, (ndim, dim), length, left, right, pad = case
    gloo(world).run(on_gloo, "case_exchange", ndim, dim, length, left, right, pad, transport,
                    torch.float64, 5)


@pytest.mark.simulated
def test_simulated_2d_mesh_uneven_batch() -> None:
    """The cp axis of a (dp, cp) mesh whose dp groups hold batches of different sizes."""
    with single_device():
        full = _data((3, 2, 7), torch.float64, 4)
    with simulated_mesh((2, 2), mesh_dim_names=("dp", "cp")) as mesh:

        def local(dp: int, cp: int) -> torch.Tensor:
            return shard(shard(full, 0, 2, dp), 2, 2, cp).clone()

        x = maybe_run_for_local_tensor(local)(mesh.get_local_rank("dp"),
                                              mesh.get_local_rank("cp"))
        y = halo_exchange(x, left=2, right=1, dim=2, group=(mesh, "cp"), pad="replicate")

        def check(out: torch.Tensor, dp: int, cp: int) -> None:
            want = reference_halo(shard(full, 0, 2, dp), 2, 1, 2, 2, cp, "replicate")
            assert torch.equal(out, want), (dp, cp)

        maybe_run_for_local_tensor(check)(y, mesh.get_local_rank("dp"),
                                          mesh.get_local_rank("cp"))


class _Writes(TorchDispatchMode):
    """Counts the elements each aten / c10d op writes (views and empty buffers write none)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name in ("index_copy_", "index_add_"):
            n = args[3].numel()
        elif name == "index_fill_":
            n = args[2].numel() * args[0].numel() // max(args[0].shape[args[1]], 1)
        elif name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            n = args[0].numel()  # copy_, fill_, add_, and c10d ops' output buffers
        elif isinstance(out, torch.Tensor) and not func.is_view and "empty" not in name:
            n = out.numel()
        else:
            n = 0
        self.ops.append((name, n))
        return out


def case_writes(mesh: DeviceMesh, transport: str, steady: bool) -> None:
    """On 2 ranks with a 1+1 halo: forward writes the chunk once plus four halo slices (send,
    receive, its place in the output, the zero halo at the global edge); backward writes the
    chunk's gradient once plus two slices (send, receive: a received gradient is added as its
    slice of the chunk's gradient is written). No `cat`, no zero-filled buffers that are
    overwritten. `steady`: an agreed call site (its move also carries one
    status element per peer, and no metadata)."""
    chunk = torch.randn(1, 16, 8, 4, 4, requires_grad=True)
    slice_ = chunk.numel() // chunk.shape[2]
    kw: dict = {"global_length": 16, "agreements": {}} if steady else {}
    # plans, cached index tensors (and the agreement)
    y = halo_exchange(chunk, left=1, right=1, dim=2, group=mesh, transport=transport, **kw)
    grad = torch.ones_like(y)
    with _Writes() as fwd:
        y = halo_exchange(chunk, left=1, right=1, dim=2, group=mesh, transport=transport, **kw)
    with _Writes() as bwd:
        torch.autograd.grad(y, chunk, grad)
    # the agreement's int rows, tagged and padded to 32 ints (test_agreement.py): the row
    # (written once, then its 21 fields) and 2 ranks x 32 gathered, less than a slice
    metadata = 128
    for mode, bound in ((fwd, chunk.numel() + 4 * slice_ + metadata),
                        (bwd, chunk.numel() + 2 * slice_)):
        names = [name for name, _ in mode.ops]
        assert not {"cat", "zeros", "new_zeros", "zeros_like", "zero_"} & set(names), names
        assert sum(n for _, n in mode.ops) <= bound, mode.ops


@pytest.mark.gloo
def test_gloo_writes_each_byte_once(gloo) -> None:
    for transport, steady in (("all_to_all", False), ("p2p", False), ("all_to_all", True)):
        gloo(2).run(on_gloo, "case_writes", transport, steady)
