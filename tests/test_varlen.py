"""`varlen_conv` and `packed` against each document convolved alone on one device.

The reference cuts the global tensor at `cu_seqlens`, pads each document along the sequence
dim by (left, right) in the pad mode (F.pad), convolves it with `F.conv1d/2d` and
concatenates. Every case checks the forward, the input gradient and the weight and bias
gradients (summed over ranks). Float64 throughout. Tolerances: the sharded conv adds the
same products as the reference in another order (taps folded into the channels of one
conv; weight and bias gradients are sums of per-rank partial sums), with O(1) values and at
most a few hundred terms per sum, so atol=1e-12, rtol=1e-10 bounds the reordering while a
slice read across a boundary or from the wrong place is an O(1) error.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import HaloError, HaloParallel, HaloShard, annotate, halo_plan, packed, varlen_conv
from haloshard._varlen import active_boundaries
from haloshard.testing import (
    CausalConv3d,
    assert_close_per_rank,
    rank_map,
    seeded_randn,
    shard,
    sharded,
    simulated_mesh,
    single_device,
    sum_over_ranks,
    unhooked,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-10}
_MODE = {"zeros": "constant", "replicate": "replicate", "reflect": "reflect",
         "circular": "circular"}


class Case(NamedTuple):
    """One conv over one packing: conv1d `(B, C, L)` or conv2d `(B, C, L, W)`, L at dim 2."""

    cu: tuple[int, ...]
    kernel: int
    pad: str = "zeros"
    causal: bool = True
    dilation: int = 1
    conv2d: bool = False
    depthwise: bool = False
    seed: int = 0

    @property
    def lr(self) -> tuple[int, int]:
        reach = self.dilation * (self.kernel - 1)
        return (reach, 0) if self.causal else (reach // 2, reach - reach // 2)


def reference(full: torch.Tensor, w: torch.Tensor, b: torch.Tensor, case: Case
              ) -> torch.Tensor:
    """Each document alone: padded along dim 2 by (left, right) and along W by 1, then
    convolved without padding; the outputs concatenated."""
    left, right = case.lr
    groups = full.shape[1] if case.depthwise else 1
    outs = []
    for s, e in zip(case.cu, case.cu[1:], strict=False):
        if e == s:
            continue
        doc = full.narrow(2, s, e - s)
        widths = [1, 1, left, right] if case.conv2d else [left, right]
        doc = F.pad(doc, widths, mode=_MODE[case.pad])
        conv = F.conv2d if case.conv2d else F.conv1d
        dilation = (case.dilation, 1) if case.conv2d else case.dilation
        outs.append(conv(doc, w, b, dilation=dilation, groups=groups))
    return torch.cat(outs, 2)


def _tensors(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    channels = 3
    out, per_group = (channels, 1) if case.depthwise else (4, channels)
    kernel = (case.kernel, 3) if case.conv2d else (case.kernel,)
    shape = (2, channels, case.cu[-1], 4) if case.conv2d else (2, channels, case.cu[-1])
    return (seeded_randn(shape, case.seed), seeded_randn((out, per_group, *kernel),
                                                         case.seed + 1),
            seeded_randn((out,), case.seed + 2))


def sharded_conv(mesh: DeviceMesh, case: Case, x: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor) -> torch.Tensor:
    left, right = case.lr
    return varlen_conv(x, w, b, dim=2, cu_seqlens=list(case.cu), group=mesh, left=left,
                       right=right, padding=(0, 1) if case.conv2d else 0, pad=case.pad,
                       dilation=(case.dilation, 1) if case.conv2d else case.dilation,
                       groups=x.shape[1] if case.depthwise else 1)


def case_varlen(mesh: DeviceMesh, case: Case) -> None:
    """The SPMD body: one rank's chunk, forward and every gradient against `reference`."""
    world = mesh.size()
    full, w, b = _tensors(case)
    with single_device():
        xr, wr, br = (t.clone().requires_grad_() for t in (full, w, b))
        y_ref = reference(xr, wr, br, case)
        gy = seeded_randn(y_ref.shape, case.seed + 3)
        (y_ref * gy).sum().backward()
    x = rank_map(mesh, lambda r: shard(full, 2, world, r).clone()).requires_grad_()
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = sharded_conv(mesh, case, x, wl, bl)
    assert_close_per_rank(y, lambda r: shard(y_ref.detach(), 2, world, r), mesh, **TOL)
    (y * rank_map(mesh, lambda r: shard(gy, 2, world, r))).sum().backward()
    assert_close_per_rank(x.grad, lambda r: shard(xr.grad, 2, world, r), mesh, **TOL)
    for got, want in ((wl.grad, wr.grad), (bl.grad, br.grad)):
        torch.testing.assert_close(sum_over_ranks(got, mesh), want, **TOL)


# ---------------------------------------------------------------- named layouts
# T=10 on 4 ranks splits (3, 3, 3, 1); T=5 splits (2, 2, 1, 0) and T=3 (1, 1, 1, 0).
LAYOUTS = {
    "inside_shards": (0, 2, 7, 10),
    "on_shard_edges": (0, 3, 6, 9, 10),
    "one_document_spans_all_ranks": (0, 10),
    "documents_shorter_than_kernel": (0, 1, 2, 3, 5, 6, 10),
    "empty_documents": (0, 0, 4, 4, 10, 10),
    "empty_shard": (0, 2, 5),
    "empty_shard_short_documents": (0, 1, 3),
}


def too_short(case: Case) -> bool:
    """A document that reflect / circular cannot pad (F.pad refuses it too)."""
    shortest = min((e - s for s, e in zip(case.cu, case.cu[1:], strict=False) if e > s))
    wide = max(case.lr)
    return (case.pad == "reflect" and shortest <= wide) or (
        case.pad == "circular" and shortest < wide)


@pytest.mark.simulated
@pytest.mark.parametrize("pad", ["zeros", "replicate", "reflect", "circular"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_simulated(layout: str, pad: str) -> None:
    """Causal depthwise conv1d (k=4, Mamba-like, a multi-hop halo over chunks of 3 or
    fewer) and a centred dense conv2d (k=3, dilation 2), 4 ranks."""
    cu = LAYOUTS[layout]
    cases = [Case(cu, 4, pad, depthwise=True, seed=1),
             Case(cu, 3, pad, causal=False, dilation=2, conv2d=True, seed=2)]
    with simulated_mesh(4) as mesh:
        for case in cases:
            if too_short(case):
                full, w, b = _tensors(case)
                x = rank_map(mesh, lambda r, full=full: shard(full, 2, 4, r))
                with pytest.raises(HaloError, match=f"document \\d+ .*pad='{pad}'"):
                    sharded_conv(mesh, case, x, w, b)
            else:
                case_varlen(mesh, case)


# ---------------------------------------------------------------- property sweep
@st.composite
def cases(draw: st.DrawFn) -> tuple[int, Case]:
    world = draw(st.integers(2, 4))
    kernel, dilation = draw(st.integers(2, 5)), draw(st.integers(1, 2))
    causal, pad = draw(st.booleans()), draw(st.sampled_from(["zeros", "replicate",
                                                             "reflect", "circular"]))
    reach = dilation * (kernel - 1)
    # reflect needs documents longer than the widest padding, circular at least as long
    need = {"reflect": reach + 1, "circular": reach}.get(pad, 0) if causal else {
        "reflect": reach - reach // 2 + 1, "circular": reach - reach // 2}.get(pad, 0)
    sizes = draw(st.lists(st.integers(max(need, 0), max(need, 0) + 6), min_size=1,
                          max_size=5))
    if pad not in ("reflect", "circular"):
        sizes += draw(st.lists(st.integers(0, 3), max_size=2))  # empty and short documents
        sizes = draw(st.permutations(sizes))
    if sum(sizes) == 0:
        sizes = [*sizes, 1]
    cu = tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))
    return world, Case(cu, kernel, pad, causal, dilation, draw(st.booleans()),
                       draw(st.booleans()), draw(st.integers(0, 99)))


@pytest.mark.simulated
@settings(max_examples=40, deadline=None)
@given(cases())
def test_sweep_simulated(drawn: tuple[int, Case]) -> None:
    world, case = drawn
    with simulated_mesh(world) as mesh:
        case_varlen(mesh, case)


# ---------------------------------------------------------------- argument errors
def _call(**over: Any) -> Callable[[DeviceMesh], torch.Tensor]:
    def run(mesh: DeviceMesh) -> torch.Tensor:
        x = rank_map(mesh, lambda r: torch.ones(1, 2, 3 if r == 0 else 2, dtype=torch.float64))
        kw: dict[str, Any] = {"dim": 2, "cu_seqlens": [0, 2, 5], "group": mesh, "left": 2}
        kw.update(over)
        weight = kw.pop("weight", torch.ones(2, 2, 3, dtype=torch.float64))
        return varlen_conv(x, weight, **kw)

    return run


@pytest.mark.simulated
@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"cu_seqlens": [1, 5]}, r"must start at 0 .* got \[1, 5\]"),
        ({"cu_seqlens": [0, 3, 2, 5]}, r"non-decreasing, got \[0, 3, 2, 5\] \(entry 2 is 2"),
        ({"cu_seqlens": [0, 2, 6]}, r"cu_seqlens ends at 6 but the chunks .* add up to 5"),
        ({"cu_seqlens": [0, 2.0, 5]}, r"list or tuple of ints .* got \[0, 2.0, 5\]"),
        ({"cu_seqlens": torch.tensor([0.0, 5.0])}, r"1-D integer tensor, got torch.float"),
        ({"global_length": 7}, r"global_length=7 but cu_seqlens ends at 5"),
        ({"weight": torch.ones(2, 2, 3, 3)},
         r"same rank >= 3, got a 3-D x and a weight of shape \(2, 2, 3, 3\)"),
        ({"weight": torch.ones(2, 1, 3)}, r"groups=1 expects 1 input channels, x has 2"),
        ({"left": 1}, r"left \+ right = dilation \* \(kernel - 1\) = 2; got stride 1, "
                      r"padding \(1, 0\)"),
        ({"left": None, "padding": 2}, r"= 2; got stride 1, padding \(2, 2\)"),
        ({"padding": 1}, r"either as left/right or in padding"),
        ({"stride": 2}, r"needs stride 1 there"),
        ({"pad": "wrap"}, r"pad must be one of .* got 'wrap'"),
        ({"pad": "reflect", "cu_seqlens": [0, 2, 5]}, r"document 0 \(slices 0:2\): "
                                                     r"pad='reflect' needs halos shorter"),
        ({"dim": 1}, r"needs a spatial dim \(2 to 2\)"),
    ],
)
def test_errors_simulated(over: dict[str, Any], match: str) -> None:
    with simulated_mesh(2) as mesh, pytest.raises(HaloError, match=match):
        _call(**over)(mesh)


@pytest.mark.simulated
def test_cu_seqlens_tensor_simulated() -> None:
    """A 1-D int tensor is read like the list (causal k=3 on documents (2, 3))."""
    with simulated_mesh(2) as mesh:
        y = _call(cu_seqlens=torch.tensor([0, 2, 5]))(mesh)
        with single_device():
            ref = reference(torch.ones(1, 2, 5, dtype=torch.float64),
                            torch.ones(2, 2, 3, dtype=torch.float64), None,  # type: ignore[arg-type]
                            Case((0, 2, 5), 3))
        assert_close_per_rank(y, lambda r: shard(ref, 2, 2, r), mesh)


# ---------------------------------------------------------------- through the hooks
def _model(seed: int) -> nn.Module:
    """Convs along L=dim 2 of `(B, 4, L, 3)`: centred dense, a depthwise 'same' even kernel
    in replicate mode, a dilated reflect conv, and a kernel-1 conv."""
    return nn.Sequential(
        nn.Conv2d(4, 4, 3, padding=1), nn.SiLU(),
        nn.Conv2d(4, 4, (4, 1), padding="same", padding_mode="replicate", groups=4),
        nn.Conv2d(4, 4, (3, 3), padding=(2, 1), dilation=(2, 1), padding_mode="reflect"),
        nn.Conv2d(4, 2, 1),
    ).double()


def case_packed_model(mesh: DeviceMesh, cu: tuple[int, ...], seed: int) -> None:
    """`with packed(cu): model(x)` on a Shard(2) DTensor against the model run on each
    document alone: a model of plain convs, and a causal wrapper (F.pad + conv) annotated
    with its spec; then a halo layer that cannot honour boundaries refuses them."""
    with single_device():
        model = _model(seed)
        full = seeded_randn((1, 4, cu[-1], 3), seed + 10)
    check_packed(mesh, model, full, cu, seed)
    x, _ = sharded(mesh, full)
    with single_device():
        wrapper = annotate(CausalConv3d(2), HaloShard(2, left=2, pad="replicate")).double()
        pool = nn.MaxPool2d((3, 1), 1, (1, 0))
    check_packed(mesh, wrapper, seeded_randn((1, 2, cu[-1], 3, 3), seed + 20), cu, seed)
    parallelize_module(pool, mesh, HaloParallel())
    with pytest.raises(HaloError, match="MaxPool2d would mix documents"), packed(cu):
        pool(x)
    assert pool(x).shape == x.shape  # outside the context: one sequence


def check_packed(mesh: DeviceMesh, module: nn.Module, full: torch.Tensor,
                 cu: tuple[int, ...], seed: int) -> None:
    """`module` (seeded here, parallelized, run under `packed(cu)`) against its twin run on
    each document alone: forward, input and parameter gradients."""
    world = mesh.size()
    with single_device():
        for i, p in enumerate(module.parameters()):
            p.data.copy_(seeded_randn(tuple(p.shape), seed + i))
        twin = unhooked(module)
        xr = full.clone().requires_grad_()
        y_ref = torch.cat([twin(xr.narrow(2, s, e - s))
                           for s, e in itertools.pairwise(cu) if e > s], 2)
        gy = seeded_randn(y_ref.shape, seed + 11)
        (y_ref * gy).sum().backward()
    parallelize_module(module, mesh, halo_plan(module, include_convs=True))
    x, local = sharded(mesh, full)
    with packed(list(cu)):
        y = module(x)
    assert active_boundaries() is None
    assert isinstance(y, DTensor) and y.placements == (Shard(2),) and y.shape == y_ref.shape
    assert_close_per_rank(y.to_local(), lambda r: shard(y_ref.detach(), 2, world, r), mesh,
                          **TOL)
    (y.to_local() * rank_map(mesh, lambda r: shard(gy, 2, world, r))).sum().backward()
    assert_close_per_rank(local.grad, lambda r: shard(xr.grad, 2, world, r), mesh, **TOL)
    for p, q in zip(module.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(sum_over_ranks(p.grad, mesh), q.grad, **TOL)


@pytest.mark.simulated
@pytest.mark.parametrize(("world", "cu"), [(3, (0, 3, 6, 10)), (4, (0, 3, 7))])
def test_packed_model_simulated(world: int, cu: tuple[int, ...]) -> None:
    with simulated_mesh(world) as mesh:
        case_packed_model(mesh, cu, 30)


# ---------------------------------------------------------------- gloo processes
GLOO_CASES = [
    Case((0, 3, 4, 9), 4, "zeros", depthwise=True, seed=5),
    Case((0, 1, 9), 3, "replicate", causal=False, conv2d=True, seed=6),
    Case((0, 4, 9), 3, "reflect", causal=False, dilation=2, seed=7),
    Case((0, 5, 9), 4, "circular", conv2d=True, depthwise=True, seed=8),
]


def run_gloo(cases: list[tuple[Any, ...]]) -> str:
    """Inside a worker: every case (sent as plain tuples: the worker loads this file by
    path, so its classes cannot be unpickled), then boundaries that differ between ranks."""
    mesh = worker_mesh(dist.get_world_size())
    for fields in cases:
        case_varlen(mesh, Case(*fields))
    case_packed_model(mesh, (0, 3, 9), 40)
    rank = dist.get_rank()
    x = torch.ones(1, 1, 3 if rank < 9 % dist.get_world_size() else 2, dtype=torch.float64)
    try:
        varlen_conv(x, torch.ones(1, 1, 2, dtype=torch.float64), dim=2, group=mesh, left=1,
                    cu_seqlens=[0, 4 + rank % 2, 9])
    except HaloError as error:
        return str(error)
    return "no error"


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
def test_gloo(gloo: Callable[[int], Any], world: int) -> None:
    for message in gloo(world).run(run_gloo, [tuple(c) for c in GLOO_CASES]):
        assert "ranks disagree on cu_seqlens" in message


def compiled_varlen(fields: tuple[Any, ...]) -> None:
    """Inside a worker: `varlen_conv` under torch.compile(fullgraph=True, aot_eager) against
    eager, forward and every gradient (the same kernels: exact up to TOL)."""
    torch._dynamo.reset()
    case, mesh = Case(*fields), worker_mesh(dist.get_world_size())
    world, rank = dist.get_world_size(), dist.get_rank()
    full, w, b = _tensors(case)

    def step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        left, right = case.lr
        return varlen_conv(x, w, b, dim=2, cu_seqlens=list(case.cu), group=mesh, left=left,
                           right=right, pad=case.pad, dilation=case.dilation,
                           groups=x.shape[1] if case.depthwise else 1,
                           global_length=case.cu[-1])

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        x = shard(full, 2, world, rank).clone().requires_grad_()
        wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
        y = fn(x, wl, bl)
        (y * seeded_randn(y.shape, case.seed + 3)).sum().backward()
        results.append((y, x.grad, wl.grad, bl.grad))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, **TOL)


@pytest.mark.gloo
@pytest.mark.parametrize("case", [Case((0, 3, 4, 9), 4, "zeros", depthwise=True, seed=9),
                                  Case((0, 5, 9), 3, "circular", causal=False, seed=10)])
def test_compiled_gloo(gloo: Callable[[int], Any], case: Case) -> None:
    gloo(2).run(compiled_varlen, tuple(case), timeout=300)
