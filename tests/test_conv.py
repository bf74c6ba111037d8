"""halo_conv (convolving while the halo travels) against the single-device conv.

Every formulation sums the single-device conv's products in another order: the corrected
path adds the halo taps after the chunk's own conv has summed the others, the split path
runs three windows instead of one tensor, and a blocked CPU kernel may round differently,
so float64 results get 1e-12 (the data moves themselves are exact). Weight and bias
gradients are per-rank partial sums, summed over ranks before comparing (reordered sums).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from haloshard import HaloError, _choice, _conv, halo_conv
from haloshard._choice import CORRECTED, SPLIT, WHOLE
from haloshard._conv import _ConvArgs, halo_taps
from haloshard.testing import (
    assert_close_per_rank,
    check_module,
    rank_map,
    reference_pad,
    shard,
    simulated_mesh,
    single_device,
    sum_over_ranks,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-12}
# (ndim, T, kernel, dilation, left, right, pad, groups, bias, overlap)
# Long chunks: halo gradients travel beside the chunk conv's backward (edge ranks; interior
# ones, twice the slices in transit, after it on 3+ ranks).
LONG = (4, 90, 3, 1, 1, 1, "zeros", 1, True, True)
CASES = [
    (3, 17, 3, 1, 1, 1, "zeros", 1, True, True),
    (3, 17, 3, 1, 2, 0, "replicate", 1, True, True),   # causal
    (3, 9, 3, 2, 4, 0, "replicate", 2, False, True),   # dilated causal, grouped, no bias
    (5, 13, 3, 1, 1, 1, "zeros", 4, True, True),       # depthwise conv3d
    (5, 13, 3, 1, 2, 0, "replicate", 1, True, False),  # exchange first
    (4, 5, 3, 1, 1, 1, "reflect", 1, True, True),      # chunks shorter than the kernel
    (3, 2, 3, 1, 1, 1, "zeros", 1, True, True),        # an empty chunk on 3+ ranks
    (3, 3, 1, 1, 0, 0, "zeros", 1, True, True),        # kernel 1: no halo (empty on 4 ranks)
    # equal halos: the chunk's own conv plus boundary corrections, where chunks allow
    (3, 23, 5, 1, 2, 2, "replicate", 4, True, True),   # depthwise conv1d, k5 centred
    (4, 19, 3, 2, 2, 2, "circular", 2, True, True),    # dilated, grouped conv2d
    (5, 13, 3, 1, 1, 1, "replicate", 1, True, True),   # conv3d, replicate
    (4, 9, 3, 1, 1, 1, "reflect", 1, False, True),     # chunks as long as the reach
    (3, 7, 5, 1, 2, 2, "zeros", 1, True, True),        # reach 4: exchange first on 2+ ranks
    LONG,
    # 1-frame conv3d chunks (4 ranks; 3 ranks: 2, 1, 1) as one conv2d per tap (eager)
    (5, 4, 3, 1, 1, 1, "replicate", 1, True, True),
    (5, 5, 3, 2, 2, 2, "zeros", 2, True, False),       # dilated taps skip window frames
    (5, 4, 3, 1, 2, 0, "circular", 1, False, True),    # causal
]
# The formulation each path's backward node names (which one ran).
NODES = {"_CorrectedConvBackward": CORRECTED, "_HaloConvBackward": "split or whole"}


def case_conv(mesh: DeviceMesh, ndim: int, length: int, kernel: int, dilation: int,
              left: int, right: int, pad: str, groups: int, bias: bool, overlap: bool,
              transport: str | None = None, path: str | None = None, x_grad: bool = True
              ) -> str:
    """Forward and every gradient against the single-device conv; returns the name of the
    backward node that ran (see NODES)."""
    world = mesh.size()
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[ndim]
    spatial = (length, 5, 4)[: ndim - 2]
    ks = (kernel, 3, 3)[: ndim - 2]
    with single_device():
        gen = torch.Generator().manual_seed(length + kernel)
        full = torch.randn(2, 4, *spatial, generator=gen, dtype=torch.float64)
        w = torch.randn(8, 4 // groups, *ks, generator=gen, dtype=torch.float64)
        b = torch.randn(8, generator=gen, dtype=torch.float64) if bias else None
        refs = [t.clone().requires_grad_() if t is not None else None for t in (full, w, b)]
        other = (0, 1, 1)[: ndim - 2]
        dil = (dilation, 1, 1)[: ndim - 2]
        ref = conv(reference_pad(refs[0], left, right, 2, pad), refs[1], refs[2],
                   padding=other, dilation=dil, groups=groups)
        upstream = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        (ref * upstream).sum().backward()
    x = rank_map(mesh, lambda r: shard(full, 2, world, r).clone()).requires_grad_(x_grad)
    wl = w.clone().requires_grad_()
    bl = b.clone().requires_grad_() if b is not None else None
    y = halo_conv(x, wl, bl, dim=2, left=left, right=right, group=mesh, padding=other,
                  dilation=dil, groups=groups, pad=pad, overlap=overlap, transport=transport,
                  _path=path)
    (y * rank_map(mesh, lambda r: shard(upstream, 2, world, r))).sum().backward()
    assert_close_per_rank(y, lambda r: shard(ref.detach(), 2, world, r), mesh, **TOL)
    if x_grad:
        assert_close_per_rank(x.grad, lambda r: shard(refs[0].grad, 2, world, r), mesh,
                              **TOL)
    else:
        assert x.grad is None
    torch.testing.assert_close(sum_over_ranks(wl.grad, mesh), refs[1].grad, **TOL)
    if bl is not None:
        torch.testing.assert_close(sum_over_ranks(bl.grad, mesh), refs[2].grad, **TOL)
    return type(y.grad_fn).__name__


def on_gloo() -> set[str]:
    mesh = worker_mesh(dist.get_world_size())
    ran = {case_conv(mesh, *case) for case in CASES}
    if dist.get_world_size() == 4:  # 1-frame chunks: one conv2d per tap ran
        ran.add(f"taps {_taps_ran(mesh, CASES[-3])}")
    # float64 is torch's slow conv3d path: exchanging first, 3- to 7-frame chunks by taps
    ran.add(f"taps of frames {_taps_ran(mesh, CASES[4])}")
    for transport in ("p2p", "allgather"):  # split and corrected over the other transports
        ran.add(case_conv(mesh, *CASES[1], transport=transport))
        ran.add(case_conv(mesh, *CASES[0], transport=transport))
        ran.add(case_conv(mesh, *LONG, transport=transport))  # p2p: gradients sent early
    ran.add(case_conv(mesh, *CASES[0], path=SPLIT))  # equal halos, split on request
    ran.add(case_conv(mesh, *CASES[0], x_grad=False))  # no input gradient: none sent back
    return ran


def _taps_ran(mesh: DeviceMesh, case: tuple) -> int:
    """How many times `case` ran the window's conv3d as one conv2d per tap."""
    calls, original = [], _conv._taps_conv
    _conv._taps_conv = lambda *args: calls.append(1) or original(*args)
    try:
        case_conv(mesh, *case)
    finally:
        _conv._taps_conv = original
    return len(calls)


class _Order(TorchDispatchMode):
    """The convolutions run inside, as `(name, length along T of their input)`, and the
    all-to-alls issued, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []
        self._a2a = dist.all_to_all_single

    def __enter__(self) -> _Order:
        def a2a(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.events.append(("all_to_all", 0))
            return self._a2a(*args, **kwargs)
        dist.all_to_all_single = a2a
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._a2a
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name.split("::")[-1]
        if name in ("convolution", "convolution_backward"):
            x = args[0] if name == "convolution" else args[1]
            self.events.append((name, x.shape[2] if x.ndim == 4 else 1))
        return func(*args, **(kwargs or {}))


def corrected_order(length: int) -> list[tuple[str, int]]:
    """A conv2d (k3, zeros) on the chunk's own conv plus corrections, forward and backward,
    checked against the single device; the convolutions and moves it ran, in order (from
    its halo move: the single-device reference runs first)."""
    mesh = worker_mesh(dist.get_world_size())
    with _Order() as order:
        assert case_conv(mesh, 4, length, 3, 1, 1, 1, "zeros", 1, True, True) == (
            "_CorrectedConvBackward")
    return order.events[order.events.index(("all_to_all", 0)):]


@pytest.mark.gloo
def test_corrected_skips_zero_padding_and_sends_early(gloo) -> None:
    """On 2 ranks each chunk has one neighbour: its other halo side is zero padding, whose
    correction is skipped (one per direction, not two). A chunk at least 10 times the slices
    in transit sends its halo gradients before the chunk conv's backward (they travel beside
    it); a shorter one after it (their buffers would sit beside that backward's)."""
    for length, early in ((90, True), (13, False)):
        for rank, events in enumerate(gloo(2).run(corrected_order, length)):
            chunk = len(shard(torch.empty(length), 0, 2, rank))
            # forward: the halo move, the chunk conv, one correction (one halo frame)
            assert events[:3] == [("all_to_all", 0), ("convolution", chunk),
                                  ("convolution", 1)], events
            # backward: the correction's input and weight gradients, the chunk conv's, and
            # the halo gradients' move before the chunk conv's backward or after it
            backward = events[3:]
            assert sorted(backward) == sorted([("all_to_all", 0), ("convolution_backward", 1),
                                               ("convolution_backward", 1),
                                               ("convolution_backward", chunk)]), events
            sent_first = (backward.index(("all_to_all", 0))
                          < backward.index(("convolution_backward", chunk)))
            assert sent_first == early, (length, events)


def fuzz_corrected(seed: int, count: int) -> list[str]:
    """`count` random centred convs on real ranks (eager tensors: the corrections skip zero
    padding and long chunks send their halo gradients early): 2-D and 3-D, kernel 2 to 5,
    dilation 1 or 2, every edge mode, groups, bias, chunks from the reach to several times
    the early threshold. Exact against one device; returns the backward nodes that ran."""
    rng, mesh = random.Random(seed), worker_mesh(dist.get_world_size())
    ran, original = [], _conv._early
    _conv._early = lambda *args: ran.append(f"early {original(*args)}") or original(*args)
    try:
        _fuzz(rng, mesh, count, ran)
    finally:
        _conv._early = original
    return ran


def _fuzz(rng: random.Random, mesh: DeviceMesh, count: int, ran: list[str]) -> None:
    for _ in range(count):
        k, dilation = rng.choice([(3, 1), (5, 1), (3, 2), (2, 2)])
        reach = dilation * (k - 1)
        length = dist.get_world_size() * rng.choice([reach + 1, 3 * reach, 25, 45])
        ran.append(case_conv(mesh, rng.choice([4, 5]), length, k, dilation, reach // 2,
                             reach // 2, rng.choice(["zeros", "replicate", "reflect",
                                                     "circular"]),
                             rng.choice([1, 2, 4]), rng.random() < 0.5, True))


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_fuzz_corrected(gloo, world: int) -> None:
    for ran in gloo(world).run(fuzz_corrected, world, 24):
        assert ran.count("_CorrectedConvBackward") == 24, ran
        assert "early True" in ran and "early False" in ran, ran  # both orders ran


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo(gloo, world: int) -> None:
    for ran in gloo(world).run(on_gloo):
        assert set(NODES) <= ran, ran  # both autograd Functions ran
        assert world != 4 or "taps 1" in ran, ran
        assert "taps of frames 1" in ran, ran


@pytest.mark.simulated
@pytest.mark.parametrize("case", CASES)
def test_simulated(case: tuple) -> None:
    with simulated_mesh(3) as mesh:
        case_conv(mesh, *case)


@pytest.mark.simulated
@pytest.mark.parametrize("path", [CORRECTED, SPLIT])
@pytest.mark.parametrize("x_grad", [True, False])
def test_simulated_paths(path: str, x_grad: bool) -> None:
    """Equal halos, each overlapped formulation, with and without an input gradient."""
    with simulated_mesh(3) as mesh:
        ran = case_conv(mesh, *CASES[0], path=path, x_grad=x_grad)
    assert NODES[ran] == (CORRECTED if path == CORRECTED else "split or whole"), ran


@pytest.mark.simulated
def test_exchange_first_keeps_chunk_and_halos() -> None:
    """Exchanging first keeps for backward what the single-device conv keeps (its input and
    weight) plus the halo slices, not a window copying the chunk: backward rebuilds the
    window, so it never holds the window and its gradient at once. A second backward
    (retain_graph) sees the same saved tensors and gives the same gradients."""
    with simulated_mesh(2) as mesh:
        x = rank_map(mesh, lambda r: torch.randn(1, 4, 6, 5, 5, dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(r)))
        x.requires_grad_()
        w = torch.randn(3, 4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
        saved: list[torch.Size] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                      lambda t: t):
            y = halo_conv(x, w, dim=2, left=1, right=1, group=mesh, padding=(0, 1, 1),
                          overlap=False)
        assert saved == [x.shape, w.shape, (1, 4, 2, 5, 5)], saved
        upstream = rank_map(mesh, lambda r: torch.ones(1, 3, 6, 5, 5, dtype=torch.float64))
        (y * upstream).sum().backward(retain_graph=True)
        first = (x.grad.clone(), w.grad.clone())
        x.grad, w.grad = None, None
        (y * upstream).sum().backward()
        assert_close_per_rank(x.grad - first[0], lambda r: torch.zeros(
            1, 4, 6, 5, 5, dtype=torch.float64), mesh)
        torch.testing.assert_close(w.grad, first[1], atol=0, rtol=0)


@st.composite
def taps_problems(draw: st.DrawFn) -> tuple:
    """A window conv3d run tap by tap: sharded dim, frames, batch, groups, dilations,
    strides and paddings of the other dims, bias."""
    dim, length, batch = draw(st.integers(2, 4)), draw(st.integers(1, 4)), draw(
        st.integers(1, 2))
    groups, kernel = draw(st.sampled_from([1, 2])), draw(st.integers(1, 3))
    dilation = [draw(st.integers(1, 2)) for _ in range(3)]
    stride = [1 if d == dim - 2 else draw(st.integers(1, 2)) for d in range(3)]
    padding = [0 if d == dim - 2 else draw(st.integers(0, 1)) for d in range(3)]
    left = draw(st.integers(0, dilation[dim - 2] * (kernel - 1)))
    return (dim, length, batch, groups, kernel, dilation, stride, padding, left,
            draw(st.booleans()))


@settings(max_examples=30, deadline=None)
@given(taps_problems())
def test_taps_match_window_conv(problem: tuple) -> None:
    """The window's conv3d as one conv2d per tap (`_taps_conv`, `_taps_backward`), along
    any spatial dim, against `F.conv3d` of the window and its autograd gradients: output,
    window and weight gradients (float64; the taps sum the same products in another
    order, so within 1e-12)."""
    dim, length, batch, groups, kernel, dilation, stride, padding, left, bias = problem
    reach = dilation[dim - 2] * (kernel - 1)
    gen = torch.Generator().manual_seed(length * 7 + kernel)
    sizes = [5, 4, 6]
    sizes[dim - 2] = length
    x = torch.randn(batch, 4, *sizes, generator=gen, dtype=torch.float64)
    ks = [3, 2, 3]
    ks[dim - 2] = kernel
    w = torch.randn(6, 4 // groups, *ks, generator=gen, dtype=torch.float64)
    b = torch.randn(6, generator=gen, dtype=torch.float64) if bias else None
    halo_shape = list(x.shape)
    halo_shape[dim] = reach
    halos = torch.randn(halo_shape, generator=gen, dtype=torch.float64)
    args = _ConvArgs(dim, left, reach - left, stride, padding, dilation, groups, WHOLE, False)
    window = torch.cat([halos.narrow(dim, 0, left), x, halos.narrow(dim, left, reach - left)],
                       dim).requires_grad_()
    refs = [t.clone().requires_grad_() for t in (w, b) if t is not None]
    ref = F.conv3d(window, refs[0], refs[1] if bias else None, stride, padding, dilation,
                   groups)
    upstream = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * upstream).sum().backward()
    frames, view = _conv._frames_first(x, args)
    view.copy_(window.detach())
    torch.testing.assert_close(_conv._taps_conv(frames, w, b, args, length), ref.detach(),
                               **TOL)
    g_window, g_w = _conv._taps_backward(upstream, x, w, halos, args)
    torch.testing.assert_close(g_window, window.grad, **TOL)
    torch.testing.assert_close(g_w, refs[0].grad, **TOL)


def test_taps_where_the_window_conv_is_slow() -> None:
    """Taps replace the window's conv3d where torch runs it on its slow path (few channels
    and frames, a batch of one, or float64), or the chunk is one frame long; oneDNN's
    windows (C256 over 32x32, channels_last) and other ranks keep the conv3d."""
    def by_taps(shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                channels_last: bool = False) -> bool:
        x = torch.zeros(shape, dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        w = torch.zeros(shape[1], shape[1], *(3,) * (len(shape) - 2), dtype=dtype)
        n = len(shape) - 2
        args = _ConvArgs(2, 1, 1, [1] * n, [0] + [1] * (n - 1), [1] * n, 1, WHOLE, False)
        return _choice.by_taps(x, w, args)

    assert by_taps((1, 32, 2, 32, 32)) and by_taps((1, 64, 4, 48, 48))
    assert by_taps((1, 8, 9, 6, 6), torch.float64)
    assert by_taps((1, 256, 1, 32, 32))  # one frame
    assert not by_taps((1, 256, 2, 32, 32))  # oneDNN's window: 4 frames of C256
    assert not by_taps((1, 32, 2, 32, 32), channels_last=True)
    assert not by_taps((1, 32, 64, 32))  # conv2d


@st.composite
def conv_problems(draw: st.DrawFn) -> tuple[int, ...]:
    """A `case_conv` problem: rank, length, kernel, dilation, centred or causal halo, edge
    mode, groups, bias, and a world size. Lengths reach a few times the halo per rank, so
    chunks both shorter and longer than the reach come up."""
    ndim, k, dilation = draw(st.integers(3, 5)), draw(st.integers(2, 5)), draw(
        st.integers(1, 3))
    world = draw(st.integers(1, 4))
    reach = dilation * (k - 1)
    left = reach // 2 if reach % 2 == 0 and draw(st.integers(0, 2)) else reach
    pad = draw(st.sampled_from(["zeros", "replicate", "reflect", "circular"]))
    chunk = draw(st.integers(0, 2 * reach + 1))  # then 0 .. world-1 chunks one longer
    length = world * chunk + draw(st.integers(0, world - 1))
    length = max(length, reach + 1 if pad == "reflect" else reach, 1)  # one device's limits
    return (ndim, length, k, dilation, left, reach - left, pad,
            draw(st.sampled_from([1, 2, 4])), draw(st.booleans()), draw(st.booleans()), world)


@pytest.mark.simulated
@settings(max_examples=40, deadline=None)
@given(conv_problems())
def test_fuzz_halo_conv(problem: tuple[int, ...]) -> None:
    """Random kernels, dilations, centred or causal halos, edge modes, groups, lengths and
    worlds: every formulation the chunks allow, exact against one device."""
    *case, world = problem
    with simulated_mesh(world) as mesh:
        event(NODES[case_conv(mesh, *case)])


def test_halo_taps() -> None:
    """Each boundary output reads the halo at exactly the taps a padded conv would: the
    taps listed, and no others, for every output of a chunk `left + right` long."""
    for left, right, dilation, k in [(1, 1, 1, 3), (2, 2, 1, 5), (2, 2, 2, 3), (3, 3, 3, 3),
                                     (2, 2, 4, 2)]:
        length = left + right
        expected = set()
        for o in range(length):
            for t in range(k):
                at = o + t * dilation  # index into [left halo ++ chunk ++ right halo]
                if at < left:
                    expected.add((o, t, at))
                elif at >= left + length:
                    expected.add((o - length, t, at - length))
        assert set(halo_taps(left, right, dilation, k)) == expected
    assert halo_taps(1, 1, 1, 3) == ((0, 0, 0), (-1, 2, 1))


@pytest.mark.simulated
@pytest.mark.parametrize(("world", "length"), [(2, 8), (3, 2)])  # (3, 2): an empty chunk
def test_exchange_first_output_takes_inplace_ops(world: int, length: int) -> None:
    """Exchange-first's output is a tensor of its own, not a view of the window's conv
    output: an in-place op after it (a model's `h.mul_(0.5)`) runs, and the gradients
    match one device's (float64, exact but for the order of the sums)."""
    with single_device():
        gen = torch.Generator().manual_seed(5)
        full = torch.randn(1, 2, length, generator=gen, dtype=torch.float64)
        w = torch.randn(3, 2, 3, generator=gen, dtype=torch.float64)
        ref_x, ref_w = full.clone().requires_grad_(), w.clone().requires_grad_()
        ref = F.conv1d(ref_x, ref_w, padding=1)
        ref.mul_(0.5)
        ref.sum().backward()
    with simulated_mesh(world) as mesh:
        x = rank_map(mesh, lambda r: shard(full, 2, world, r).clone()).requires_grad_()
        wl = w.clone().requires_grad_()
        y = halo_conv(x, wl, dim=2, left=1, right=1, group=mesh, overlap=False)
        y.mul_(0.5)
        y.sum().backward()
        assert_close_per_rank(y, lambda r: shard(ref.detach(), 2, world, r), mesh, **TOL)
        assert_close_per_rank(x.grad, lambda r: shard(ref_x.grad, 2, world, r), mesh, **TOL)
        torch.testing.assert_close(sum_over_ranks(wl.grad, mesh), ref_w.grad, **TOL)


def test_bad_halo_for_kernel() -> None:
    with simulated_mesh(2) as mesh:
        x = rank_map(mesh, lambda r: torch.ones(1, 2, 4))
        with pytest.raises(HaloError, match=r"left \+ right = dilation \* \(kernel - 1\) = 2"):
            halo_conv(x, torch.ones(2, 2, 3), dim=2, left=1, right=0, group=mesh)


def case_styles(mesh: DeviceMesh) -> None:
    """HaloParallel runs a stride-1 conv as halo_conv (overlap=True; a padding mode other
    than zeros pads the other dims by F.pad first) or exchange-first (overlap=False); both
    give the single-device conv and its gradients (float64, 1e-12 as above)."""
    import copy

    from torch.distributed.tensor.parallel import parallelize_module

    from haloshard import HaloParallel

    for seed, mode in enumerate(("zeros", "replicate", "reflect", "circular")):
        with single_device():
            gen = torch.Generator().manual_seed(seed)
            conv = torch.nn.Conv3d(4, 6, (3, 3, 3), padding=(1, 1, 1), padding_mode=mode,
                                   dtype=torch.float64)
            with torch.no_grad():  # the same weights on every rank
                for param in conv.parameters():
                    param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype))
            full = torch.randn(2, 4, 11, 5, 4, generator=gen, dtype=torch.float64)
        for overlap in (True, False):
            model = parallelize_module(copy.deepcopy(conv), mesh, HaloParallel(overlap=overlap))
            check_module(mesh, model, full, seed)


def on_gloo_styles() -> None:
    case_styles(worker_mesh(dist.get_world_size()))


@pytest.mark.gloo
def test_styles_gloo(gloo) -> None:
    gloo(3).run(on_gloo_styles)


@pytest.mark.simulated
def test_styles_simulated() -> None:
    with simulated_mesh(4) as mesh:
        case_styles(mesh)
