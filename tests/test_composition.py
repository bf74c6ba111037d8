"""Halo models inside training stacks: FSDP2, DDP, activation checkpointing, dtypes and
layouts, inference modes, determinism, a rank that differs, fuzzing, and clean removal.

The SPMD bodies (`case_*`) run under 3 simulated ranks (T=7 splits 3, 3, 1) and on the
4-rank gloo world the other test files share (a 1-D mesh, T=7 splits 2, 2, 2, 1: uneven).
DDP runs over that 1-D mesh; FSDP2 over the flattened `(dp, cp)` mesh of shape (2, 2) with
the halo on `cp`. Fuzzing runs under simulated ranks, worlds 1 to 4.

Tolerances (float64): the sharded model computes each output from the same products as the
single-device one but in another blocking (a window, not the whole tensor), and parameter
gradients are sums of per-rank partial sums (DDP/FSDP or `reduce_grads`), another order of
addition. Inputs and weights are O(1) and every reduction has at most a few hundred terms, so
atol=1e-12, rtol=1e-10 bounds those reorderings while catching any misplaced slice, which is
O(1). Observed: at most 1.1e-16 between FSDP2 and single-device parameters after three SGD
steps. Lower-precision tolerances are stated at `LOW_PRECISION`.
"""

from __future__ import annotations

import copy
import io
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed._local_tensor import maybe_run_for_local_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

from haloshard import (
    HaloError,
    HaloParallel,
    HaloShard,
    annotate,
    halo_handles,
    halo_plan,
    reduce_grads,
)
from haloshard.testing import (
    CausalConv3d,
    assert_close_per_rank,
    check_module,
    module_reference,
    rank_map,
    seeded_module,
    seeded_randn,
    shard,
    sharded,
    simulated_mesh,
    single_device,
    unhooked,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-10}
T = 7




def _seeded(module: nn.Module, seed: int) -> nn.Module:
    return seeded_module(module, seed, scale=0.25)




class Net(nn.Module):
    """Symmetric, causal (replicate) and dilated temporal convs with residual adds.

    `ckpt=True` runs the causal wrapper and the temporal conv under non-reentrant activation
    checkpointing, so their halos are exchanged again when backward recomputes them.
    `inplace=True` scales the first conv's output in place (valid single-device code).
    """

    def __init__(self, ckpt: bool = False, inplace: bool = False) -> None:
        super().__init__()
        self.ckpt, self.inplace = ckpt, inplace
        self.conv_in = nn.Conv3d(2, 3, 3, padding=1)
        self.causal = CausalConv3d(3)
        self.temporal = nn.Conv3d(3, 3, (3, 1, 1), dilation=(2, 1, 1), padding=(2, 0, 0))
        self.conv_out = nn.Conv3d(3, 2, (1, 3, 3), padding=(0, 1, 1))

    def _run(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            return checkpoint(module, x, use_reentrant=False)
        return module(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        if self.inplace:
            h.mul_(0.5)
        h = h + self._run(self.causal, F.silu(h))
        h = h + self._run(self.temporal, h)
        return self.conv_out(h)


def _net(seed: int, *, ckpt: bool = False, inplace: bool = False,
         dtype: torch.dtype = torch.float64) -> Net:
    with single_device():  # plain parameters, not one per simulated rank
        model = _seeded(Net(ckpt, inplace), seed).to(dtype)
    annotate(model.causal, HaloShard(2, left=2, pad="replicate"))
    return model


def _parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """A parallelized deep copy (the original stays the single-device reference)."""
    par = copy.deepcopy(model)
    parallelize_module(par, mesh, halo_plan(par, include_convs=True))
    return par




def _chunks(mesh: DeviceMesh, full: torch.Tensor) -> torch.Tensor:
    world = mesh.size()
    return rank_map(mesh, lambda r: shard(full, 2, world, r).clone())








# ---------------------------------------------------------------- SPMD bodies, 1-D mesh
def case_checkpoint(mesh: DeviceMesh, seed: int) -> None:
    """Non-reentrant checkpointing inside the model (per halo layer) and around the whole
    parallelized model: backward recomputes the forward, halo exchanges included."""
    full = seeded_randn((2, 2, T, 3, 3), seed)
    inner = _parallel(_net(seed + 1, ckpt=True), mesh)
    check_module(mesh, inner, full, seed + 2, inner)
    outer = _parallel(_net(seed + 1), mesh)
    check_module(mesh, outer, full, seed + 2,
                 lambda x: checkpoint(outer, x, use_reentrant=False))


# Lower precision, against the float64 single-device output (the truth), with the bound the
# single-device model in that dtype must meet too: max |error| <= k * eps * max |y|. Each
# layer rounds its output to the dtype (k = 4 covers 4 layers with residual adds for the
# half types; float32 convs also block their sums by shape: k = 16). Measured (T=7, 2-4
# ranks, |y| up to ~9): the single-device model errs by up to 0.6 eps * max|y| in float16 and
# bfloat16 and 1.6 in float32; the sharded one adds at most one ulp of the largest output
# (halo_conv adds the bias after the conv: one more rounding) and stays below 1.5. A
# misplaced halo slice is an O(1) error and fails every bound.
LOW_PRECISION = {torch.float16: 4, torch.bfloat16: 4, torch.float32: 16}


def case_dtypes(mesh: DeviceMesh, seed: int) -> None:
    """float32 / float16 / bfloat16 forward against the float64 single-device model."""
    world = mesh.size()
    truth = _net(seed)
    for dtype, k in LOW_PRECISION.items():
        model = _net(seed, dtype=dtype)
        full = seeded_randn((1, 2, T, 3, 3), seed + 1, dtype)
        with single_device():
            expected = unhooked(truth)(full.double()).detach()
            atol = k * torch.finfo(dtype).eps * expected.abs().max().item()
            torch.testing.assert_close(unhooked(model)(full).double(), expected, atol=atol,
                                       rtol=0)  # the dtype's own accuracy meets the bound
        y = _parallel(model, mesh)(sharded(mesh, full)[0].detach())
        assert y.dtype == dtype
        assert_close_per_rank(y.to_local().double(),
                              lambda r, e=expected: shard(e, 2, world, r), mesh,
                              atol=atol, rtol=0)


def case_layouts(mesh: DeviceMesh, seed: int) -> None:
    """channels_last_3d chunks, and chunks that are strided views: same values and grads."""
    model = _parallel(_net(seed), mesh)
    full = seeded_randn((2, 2, T, 3, 3), seed + 1)

    def channels_last(x: DTensor) -> DTensor:
        local = x.to_local().contiguous(memory_format=torch.channels_last_3d)
        assert not local.is_contiguous()
        return model(DTensor.from_local(local, mesh, [Shard(2)], shape=x.shape,
                                        stride=x.stride()))

    check_module(mesh, model, full, seed + 2, channels_last)
    model.zero_grad()

    def strided(x: DTensor) -> DTensor:
        # H and W swapped twice: the same values through a non-contiguous view
        local = x.to_local().transpose(3, 4).contiguous().transpose(3, 4)
        assert not local.is_contiguous()
        return model(DTensor.from_local(local, mesh, [Shard(2)], shape=x.shape,
                                        stride=x.stride()))

    check_module(mesh, model, full, seed + 2, strided)


def case_modes(mesh: DeviceMesh, seed: int) -> None:
    """eval() under no_grad and inference_mode; batch 1 and 0; inputs without grad."""
    world = mesh.size()
    reference = _net(seed)
    model = _parallel(reference, mesh).eval()
    for batch in (1, 0):
        full = seeded_randn((batch, 2, T, 3, 3), seed + batch)
        with single_device(), torch.no_grad():
            expected = unhooked(reference)(full)
        for mode in (torch.no_grad, torch.inference_mode):
            x = sharded(mesh, full)[0].detach()
            with mode():
                y = model(x)
            assert not y.requires_grad and y.shape == expected.shape, (mode, y.shape)
            assert_close_per_rank(y.to_local(), lambda r, e=expected: shard(e, 2, world, r),
                                  mesh, **TOL)
    # requires_grad=False input: the parameter gradients alone, summed over the ranks
    model = _parallel(reference, mesh).train()
    full = seeded_randn((1, 2, T, 3, 3), seed + 2)
    _, gy, _, grads = module_reference(reference, full, seed + 3)
    y = model(sharded(mesh, full)[0].detach())
    (y.to_local() * rank_map(mesh, lambda r: shard(gy, 2, world, r))).sum().backward()
    reduce_grads(model, mesh)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert_close_per_rank(p.grad, lambda r, g=g: g, mesh, **TOL)


def case_determinism(mesh: DeviceMesh, seed: int) -> None:
    """Two runs with the same inputs: bitwise-identical outputs, input and weight grads."""
    full = seeded_randn((2, 2, T, 3, 3), seed)
    gy = seeded_randn((2, 2, T, 3, 3), seed + 1)
    runs = []
    for _ in range(2):
        model = _parallel(_net(seed + 2), mesh)
        x, local = sharded(mesh, full)
        y = model(x).to_local()
        (y * _chunks(mesh, gy)).sum().backward()
        runs.append([y.detach(), local.grad, *(p.grad for p in model.parameters())])
    for a, b in zip(*runs, strict=True):
        _same(a, b)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    maybe_run_for_local_tensor(lambda u, v: _assert_bitwise(u, v))(a, b)


def _assert_bitwise(u: torch.Tensor, v: torch.Tensor) -> None:
    assert u.dtype == v.dtype and u.shape == v.shape
    assert torch.equal(u.view(torch.int64), v.view(torch.int64)), "runs differ bitwise"


def case_no_leak(mesh: DeviceMesh, seed: int) -> None:
    """After removing every handle: state_dict, forward and save/load are as before."""
    world = mesh.size()
    model = _net(seed)
    # torch classes only, so that the whole pickled module loads in any process
    plain = _torch_only(seed)
    full = seeded_randn((1, 2, T, 3, 3), seed + 1)
    with single_device():
        before = {k: v.clone() for k, v in model.state_dict().items()}
        y_before, y_plain = model(full).detach(), plain(full).detach()
        saved_before, pickled_before = _saved(model), _save(plain)
    for m in (model, plain):
        parallelize_module(m, mesh, halo_plan(m, include_convs=True))
        assert len(halo_handles(m)) >= 3
    assert list(model.state_dict()) == list(before)  # hooks add no parameter or buffer
    y = model(sharded(mesh, full)[0])
    assert_close_per_rank(y.to_local(), lambda r: shard(y_before, 2, world, r), mesh, **TOL)
    (y.to_local().sum() + plain(sharded(mesh, full)[0]).to_local().sum()).backward()
    for m in (model, plain):
        m.zero_grad(set_to_none=True)
        for handle in halo_handles(m).values():
            handle.remove()
        assert halo_handles(m) == {}
    with single_device():
        after = model.state_dict()
        assert list(after) == list(before)
        assert all(torch.equal(after[k], v) for k, v in before.items())
        assert torch.equal(model(full), y_before)  # bitwise: the very same computation
        assert _saved(model) == saved_before
        assert _save(plain) == pickled_before  # the whole module pickles to the same bytes
        loaded = torch.load(io.BytesIO(_save(plain)), weights_only=False)
        assert torch.equal(loaded(full), y_plain)


def _torch_only(seed: int) -> nn.Module:
    with single_device():
        return _seeded(nn.Sequential(
            annotate(nn.Conv3d(2, 3, 3, padding=1, padding_mode="replicate")),
            nn.Conv3d(3, 3, (3, 1, 1), dilation=(2, 1, 1), padding=(2, 0, 0)),
            nn.SiLU(), nn.Conv3d(3, 2, (5, 3, 3), padding=(4, 1, 1))), seed)


def _save(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _saved(model: nn.Module) -> tuple[bytes, list[str], list[bytes]]:
    """The state_dict as torch.save writes it, and its keys and raw bytes after torch.load."""
    data = _save(model.state_dict())
    state = torch.load(io.BytesIO(data), weights_only=True)
    raw = [bytes(v.contiguous().view(torch.uint8).reshape(-1).tolist()) for v in state.values()]
    return data, list(state), raw


ONE_D = [("case_checkpoint", 31), ("case_dtypes", 32), ("case_layouts", 33),
         ("case_modes", 34), ("case_determinism", 35), ("case_no_leak", 36)]


@pytest.mark.simulated
@pytest.mark.parametrize(("name", "seed"), ONE_D)
def test_simulated(name: str, seed: int) -> None:
    with simulated_mesh(3) as mesh:
        globals()[name](mesh, seed)


# ---------------------------------------------------------------- FSDP2 and DDP, (dp, cp)
# Three SGD steps at this rate take the reference loss from ~10 to ~1.3 and move parameters
# by up to ~0.5: a wrong gradient scale or a missing partial sum shows as an O(0.1) error.
LR = 0.1


def _train_reference(model: nn.Module, full: torch.Tensor, target: torch.Tensor,
                     steps: int) -> nn.Module:
    """Single-device SGD on the full batch, loss = mean squared error over every element."""
    ref = unhooked(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(ref(full), target, reduction="sum").div(full.numel())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2, losses  # it trains (the loss is not diverging)
    moved = max((p - q).abs().max().item()
                for p, q in zip(ref.parameters(), model.parameters(), strict=True))
    assert moved > 0.1, moved  # every check below would catch a wrong step
    return ref


def _train(model: nn.Module, x: torch.Tensor, target: torch.Tensor, numel: int,
           scale: int, steps: int) -> None:
    """Local SGD steps on this rank's chunk of the batch.

    The single-device loss is a sum over every element / numel; this rank's loss is the sum
    over its own elements / numel, so the single-device gradient is the SUM over all ranks of
    the per-rank gradients. DDP and FSDP average (divide by the group size) instead: `scale`
    (the group size) multiplies the local loss to undo that.
    """
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        y = model(x)
        y = y.to_local() if isinstance(y, DTensor) else y
        (F.mse_loss(y, target, reduction="sum") * (scale / numel)).backward()
        opt.step()
        opt.zero_grad()


def run_fsdp(seed: int, steps: int, inplace: bool = False) -> None:
    """FSDP2 over the flattened (dp, cp) mesh; the halo on cp; each dp row its batch half.

    Gradients are reduced (averaged) over all 4 ranks: over cp that sums the partial
    gradients of one sample's T chunks, over dp it adds the two batch halves. Both inputs are
    tried: plain local chunks, and Shard(2) DTensors on mesh["cp"].
    """
    mesh = worker_mesh((2, 2), mesh_dim_names=("dp", "cp"))
    d = mesh.get_local_rank("dp")
    full, target = seeded_randn((4, 2, T, 3, 3), seed), seeded_randn((4, 2, T, 3, 3), seed + 1)
    rows, trows = full[2 * d : 2 * d + 2], target[2 * d : 2 * d + 2]
    ref = _train_reference(_net(seed + 2, inplace=inplace), full, target, steps)
    for as_dtensor in (False, True):
        # FSDP2 warns that a wrapped module returned a view: a halo module's output is a
        # narrow() of its local result (no copy). Nothing here modifies an output in place.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
            model = _fsdp_trained(mesh, rows, trows, full.numel(), steps, seed, as_dtensor,
                                  inplace)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), q.detach(), **TOL,
                                       msg=lambda m, n=name, a=as_dtensor: f"{n} ({a=}): {m}")
        with pytest.raises(HaloError, match="DTensor parameters"):  # FSDP reduces them
            reduce_grads(model, mesh, mesh_axis="cp")


def _fsdp_trained(mesh: DeviceMesh, rows: torch.Tensor, trows: torch.Tensor, numel: int,
                  steps: int, seed: int, as_dtensor: bool, inplace: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    cp, dp_cp = mesh["cp"], mesh["dp", "cp"]._flatten("dp_cp")
    c = mesh.get_local_rank("cp")
    model = _net(seed + 2, inplace=inplace)
    parallelize_module(model, cp, halo_plan(model, include_convs=True))
    for layer in (model.conv_in, model.causal, model.temporal, model.conv_out):
        fully_shard(layer, mesh=dp_cp)
    fully_shard(model, mesh=dp_cp)
    # outside forward the parameters are DTensor shards; the hooks never touch them
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),)
               for p in model.parameters())
    x = shard(rows, 2, cp.size(), c).clone()
    if as_dtensor:
        x = DTensor.from_local(x, cp, [Shard(2)], shape=rows.shape, stride=rows.stride())
    _train(model, x, shard(trows, 2, cp.size(), c), numel, dp_cp.size(), steps)
    return model


def run_ddp(seed: int, steps: int) -> None:
    """DDP over the 4 ranks of a plain 1-D mesh, all of them cp ranks (T=7 splits 2, 2, 2,
    1): DDP's all-reduce sums the partial gradients, divided by 4, undone by `scale`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = worker_mesh(dist.get_world_size())
    rank, world = mesh.get_local_rank(), mesh.size()
    full, target = seeded_randn((2, 2, T, 3, 3), seed), seeded_randn((2, 2, T, 3, 3), seed + 1)
    ref = _train_reference(_net(seed + 2), full, target, steps)
    model = _net(seed + 2)
    parallelize_module(model, mesh, halo_plan(model, include_convs=True))
    ddp = DDP(model, process_group=mesh.get_group())
    _train(ddp, shard(full, 2, world, rank).clone(), shard(target, 2, world, rank),
           full.numel(), world, steps)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)


# ---------------------------------------------------------------- a rank that differs
def bad_rank(case: str) -> str:
    """Rank 1 calls the parallelized model differently; every rank reports what it raised,
    and how long it took."""
    mesh = worker_mesh(dist.get_world_size())
    rank, world = mesh.get_local_rank(), mesh.size()
    model = _net(41)
    if case == "other_spec" and rank == 1:  # a different model: an undilated temporal conv
        model.temporal = _seeded(nn.Conv3d(3, 3, (3, 1, 1), padding=(1, 0, 0)), 42)
    parallelize_module(model, mesh, halo_plan(model, include_convs=True))
    full = seeded_randn((1, 2, T, 3, 3), 43)
    x = shard(full, 2, world, rank).clone()
    if case == "other_shape" and rank == 1:
        x = torch.cat([x, x], dim=3)  # H = 6 instead of 3 on one rank
    if case == "other_length" and rank == 1:
        x = torch.cat([x, x], dim=2)  # T chunks that are not a Shard(2) split
    start = time.perf_counter()
    try:
        model(x).sum().backward()
    except HaloError as exc:
        return f"HaloError after {time.perf_counter() - start:.1f}s: {exc}"
    return "ok"


BAD_RANK = {
    "other_shape": r"ranks disagree on size of dim 3: \[3, 6, 3, 3\]",
    "other_spec": r"ranks disagree on (left|right): ",
    "other_length": r"chunk lengths along dim 2 are \[2, 4, 2, 1\]",
}


@pytest.mark.gloo
def test_gloo(gloo: Callable[[int], Any]) -> None:
    """Every body on one 4-rank world: the 1-D cases, a rank that differs, DDP and FSDP2."""
    world = gloo(4)
    world.run(run_cases, ONE_D, timeout=240)
    for case, message in BAD_RANK.items():
        outcomes = world.run(bad_rank, case, timeout=60)
        for rank, got in enumerate(outcomes):
            assert got.startswith("HaloError after "), (case, rank, got)
            assert float(got.split()[2].rstrip("s:")) < 30, got
            assert pytest.importorskip("re").search(message, got), (case, rank, got)
        assert world.run(bad_rank, "none", timeout=60) == ["ok"] * 4  # the group still works
    world.run(run_ddp, 51, 3, timeout=120)
    # four steps: the last two run the convs' steady calls (`haloshard._steady`) on the cp
    # sub-mesh with FSDP2's hooks around them
    world.run(run_fsdp, 52, 4, timeout=240)


@pytest.mark.gloo
def test_gloo_fsdp_inplace(gloo: Callable[[int], Any]) -> None:
    """Valid single-device code (an in-place scale of a conv output) under FSDP2: the halo
    module returns its own output, not a narrow() view that would drop FSDP2's hook."""
    gloo(4).run(run_fsdp, 53, 2, True, timeout=120)


def run_cases(cases: list[tuple[str, int]]) -> None:
    mesh = worker_mesh(dist.get_world_size())
    for name, seed in cases:
        globals()[name](mesh, seed)


# ---------------------------------------------------------------- fuzzing
class CausalConv1d(nn.Module):
    """A causal wrapper: pads T by the dilated kernel reach itself, in any pad mode."""

    def __init__(self, k: int, dilation: int, mode: str) -> None:
        super().__init__()
        self.reach, self.mode = dilation * (k - 1), mode
        self.conv = nn.Conv1d(2, 2, k, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.reach, 0), mode=self.mode))


_F_PAD = {"zeros": "constant", "replicate": "replicate", "reflect": "reflect",
          "circular": "circular"}


@st.composite
def conv_cases(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...], int]:
    """A conv (1-D, or 2-D sharded on its first spatial dim) or a causal wrapper, a global
    length and a world size."""
    world = draw(st.integers(1, 4))
    k, dilation = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    mode = draw(st.sampled_from(["zeros", "replicate", "reflect", "circular"]))
    kind = draw(st.sampled_from(["conv1d", "conv2d", "causal"]))
    length = draw(st.integers(1, 12))
    if kind == "causal":
        module = annotate(CausalConv1d(k, dilation, _F_PAD[mode]),
                          HaloShard(2, left=dilation * (k - 1), pad=mode))
        return module, (1, 2, length), world
    stride = draw(st.integers(1, 3))
    padding: int | str = draw(st.one_of(st.integers(0, 4), st.sampled_from(["same", "valid"])))
    if padding == "same":
        stride = 1
    if kind == "conv1d":
        module = nn.Conv1d(2, 2, k, stride=stride, padding=padding, dilation=dilation,
                           padding_mode=mode)
        return module, (1, 2, length), world
    module = nn.Conv2d(2, 2, (k, 3), stride=(stride, 1), dilation=(dilation, 1),
                       padding=padding if isinstance(padding, str) else (padding, 1),
                       padding_mode=mode)
    return module, (2, 2, length, 3), world


@pytest.mark.simulated
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_cases(), st.integers(0, 2**16))
def test_fuzz_convs(case: tuple[nn.Module, tuple[int, ...], int], seed: int) -> None:
    """Any valid conv / causal wrapper, length and world: exact shards of the single-device
    output and gradients. Where the single-device module itself fails (padding wider than
    the input for reflect/circular, no output), the parallel one raises HaloError."""
    module, shape, world = case
    module = _seeded(module, seed)
    full = seeded_randn(shape, seed + 1)
    try:
        module_reference(module, full, seed + 2)
    except RuntimeError:
        event("the single-device module raises")
        with simulated_mesh(world) as mesh, pytest.raises(HaloError):
            parallelize_module(module, mesh, HaloParallel())
            module(sharded(mesh, full)[0])
        return
    with simulated_mesh(world) as mesh:
        parallelize_module(module, mesh, HaloParallel())
        check_module(mesh, module, full, seed + 2, module)


@pytest.mark.simulated
def test_short_reflect_conv() -> None:
    """T=3 on 2 ranks, kernel 3, dilation 3, padding 2, reflect: the single-device conv
    gives one output; the plan asks every rank for right=3 >= T, which reflect cannot fill,
    but no window reads those slices: they are exchanged as zeros."""
    conv = _seeded(nn.Conv1d(1, 1, 3, dilation=3, padding=2, padding_mode="reflect"), 1)
    full = seeded_randn((1, 1, 3), 2)
    with simulated_mesh(2) as mesh:
        parallelize_module(conv, mesh, HaloParallel())
        check_module(mesh, conv, full, 3, conv)


def _bad_halo(draw: st.DrawFn) -> Callable[[], object]:
    field = draw(st.sampled_from(["dim", "left", "right"]))
    value = draw(st.one_of(st.integers(-5, -1), st.booleans(), st.floats(0.5, 3.5),
                           st.just("1"), st.none()))
    return lambda: HaloShard(**{"dim": 2, field: value})


def _bad_pad(draw: st.DrawFn) -> Callable[[], object]:
    pad = draw(st.sampled_from(["constant", "mirror", "Zeros", "", "wrap", None, 0]))
    return lambda: HaloShard(2, left=1, pad=pad)  # type: ignore[arg-type]


def _dim_mismatch(draw: st.DrawFn) -> Callable[[], object]:
    spec_dim, dim = draw(st.sampled_from([(2, 3), (3, 2), (4, 2), (0, 2)]))
    spec = HaloShard(spec_dim, left=1)
    if draw(st.booleans()):
        return lambda: HaloParallel(spec, dim=dim)
    return lambda: annotate(nn.Conv3d(1, 1, 3), spec, dim=dim)


def _too_small(draw: st.DrawFn) -> Callable[[], object]:
    k, dilation = draw(st.integers(2, 5)), draw(st.integers(1, 3))
    reach = dilation * (k - 1)
    left = draw(st.integers(0, reach - 1))
    right = draw(st.integers(0, reach - 1 - left))
    return lambda: annotate(CausalConv1d(k, dilation, "replicate"),
                            HaloShard(2, left=left, right=right, pad="replicate"))


def _not_derived(draw: st.DrawFn) -> Callable[[], object]:
    k = draw(st.integers(1, 5))
    left, right = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    conv = nn.Conv1d(1, 1, k, padding=(k - 1) // 2)
    if left == right == (k - 1) // 2 and k % 2:
        left += 1  # the derived halo would match: make it differ
    return lambda: annotate(conv, HaloShard(2, left=left, right=right))


def _not_a_spec(draw: st.DrawFn) -> Callable[[], object]:
    spec = draw(st.sampled_from([1, (1, 1), "causal", Shard(2), {"left": 1}]))
    if draw(st.booleans()):
        return lambda: HaloParallel(spec)  # type: ignore[arg-type]
    return lambda: annotate(nn.Conv1d(1, 1, 3), spec)  # type: ignore[arg-type]


def _underivable(draw: st.DrawFn) -> Callable[[], object]:
    module = draw(st.sampled_from([nn.Linear(2, 2), nn.GroupNorm(1, 2), nn.Identity(),
                                   nn.MaxPool1d(2, ceil_mode=True)]))
    return lambda: annotate(module)


def _not_spatial(draw: st.DrawFn) -> Callable[[], object]:
    module, dim = draw(st.sampled_from([(nn.Conv1d(1, 1, 3), 3), (nn.Conv2d(1, 1, 3), 4),
                                        (nn.Conv3d(1, 1, 3), 1), (nn.Conv1d(1, 1, 3), 0)]))
    return lambda: annotate(module, dim=dim)


def _attached_twice(draw: st.DrawFn) -> Callable[[], object]:
    conv = nn.Conv1d(1, 1, draw(st.integers(1, 5)))

    def twice() -> None:
        with simulated_mesh(2) as mesh:
            parallelize_module(conv, mesh, HaloParallel())
            parallelize_module(conv, mesh, HaloParallel())

    return twice


MALFORMED = [_bad_halo, _bad_pad, _dim_mismatch, _too_small, _not_derived, _not_a_spec,
             _underivable, _not_spatial, _attached_twice]


@pytest.mark.parametrize("maker", MALFORMED, ids=lambda m: m.__name__.strip("_"))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_fuzz_malformed_specs(maker: Callable[[Any], Callable[[], object]],
                              data: st.DataObject) -> None:
    """Every malformed spec or annotation raises HaloError (never another error, never
    silently accepted); each kind of mistake gets its own examples."""
    make = maker(data.draw)
    with pytest.raises(HaloError):
        make()


@pytest.mark.simulated
def test_annotate_attached_module() -> None:
    """Annotating a module that has a halo attached raises (its padding is the halo's while
    attached, so a derived halo would be wrong); after remove() it derives the true one."""
    conv = _seeded(nn.Conv1d(1, 1, 3, padding=1), 1)
    full = seeded_randn((1, 1, 6), 2)
    with simulated_mesh(2) as mesh:
        parallelize_module(conv, mesh, HaloParallel())
        with pytest.raises(HaloError, match="has a halo attached"):
            annotate(conv)
        for handle in halo_handles(conv).values():
            handle.remove()
        annotate(conv)
        parallelize_module(conv, mesh, halo_plan(nn.Sequential(conv))["0"])
        check_module(mesh, conv, full, 3, conv)
