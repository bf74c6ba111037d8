"""Steady state: after a layer's first call with an input signature, a forward issues exactly
its halo moves (no metadata collective), stays exact, and a mistake on one rank still raises
`HaloError` on every rank at once (its flag rides in the halo move).

Real gloo processes (2 ranks, T=7 splits 4, 3), since simulated ranks take functional
collectives, which this counts separately. Float64; tolerances as in test_hooks.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from haloshard import HaloError, HaloParallel, HaloShard
from haloshard._choice import _TRIAL_MAX_ROUNDS, _TRIAL_ROUNDS
from haloshard.testing import (
    counted_collectives,
    reference_halo,
    seeded_randn,
    shard,
    single_device,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-10}


class _Ops(TorchDispatchMode):
    """The aten ops run inside, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


class Causal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 3, 3, padding=(0, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 0, 0, 0, 2, 0), mode="replicate"))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.SiLU(), Causal(),
                         nn.Conv3d(3, 2, (3, 1, 1), padding=(1, 0, 0))).double()


def _plan() -> dict[str, Any]:
    return {"0": HaloParallel(), "2": HaloParallel(HaloShard(2, left=2, pad="replicate")),
            "3": HaloParallel(overlap=False)}


def steady_state() -> dict[str, Any]:
    rank, mesh = dist.get_rank(), worker_mesh(2)
    with single_device():
        model = _model()
        full = seeded_randn((1, 2, 7, 4, 4), 1).double()
        expected = model(full).detach()
    parallelize_module(model, mesh, _plan())
    local = shard(full, 2, 2, rank).clone()
    counts, errors = [], []
    for _ in range(3):
        leaf = local.clone().requires_grad_()
        x = DTensor.from_local(leaf, mesh, [Shard(2)], shape=full.shape, stride=full.stride())
        with counted_collectives() as forward:
            y = model(x)
        with counted_collectives() as backward, _Ops() as ops:
            y.to_local().sum().backward()
        counts.append((dict(forward), dict(backward)))
        # the causal wrapper runs on the exchanged buffer itself, not a narrow() view of it
        # (whose backward would write the buffer's gradient whole before the exchange's)
        assert "slice_backward" not in ops.names, ops.names
        errors.append((y.to_local() - shard(expected, 2, 2, rank)).abs().max().item())
    # a chunk one frame too long on rank 1 only, with the agreed global shape: rank 1's row
    # differs from the agreed one; it raises, and its flag makes rank 0 raise in the move
    bad = (torch.cat([local, local[:, :, :1]], dim=2) if rank == 1 else local.clone())
    bad.requires_grad_()  # the signature of the calls before: only the length differs
    x = DTensor.from_local(bad, mesh, [Shard(2)], shape=full.shape, stride=full.stride())
    raised, seconds = _outcome(model, x)
    # the group still works: the same model, right input, exact again
    x = DTensor.from_local(local.clone(), mesh, [Shard(2)], shape=full.shape,
                           stride=full.stride())
    after = (model(x).to_local() - shard(expected, 2, 2, rank)).abs().max().item()
    chosen = {i: dict(model[i].forward.chosen) for i in (0, 3)}
    return {"counts": counts, "errors": errors, "raised": raised, "seconds": seconds,
            "after": after, "chosen": chosen, "trials": dict(model[0].forward.trials)}


@pytest.mark.gloo
def test_no_metadata_collective_after_the_first_call(gloo: Callable[[int], Any]) -> None:
    results = gloo(2).run(steady_state, timeout=120)
    for got in results:
        first, *later = got["counts"]
        # first call: each of the 3 halo layers agrees once (one int gather); layer 0
        # (overlap=None) is a float64 conv3d, which torch convolves on its slow path: it
        # exchanges first, its window tap by tap or as torch's conv3d, whichever a trial
        # times faster (two gathers, a forward and a backward move per step, as in
        # test_trial_leaves_no_gradient); it gathers the per-rank settings that choice
        # reads once (test_agreement.py)
        rounds = next(iter(got["trials"].values()))  # the first signature's
        trial = 2 * 2 * (1 + rounds)
        assert first[0] == {"all_gather_single": 6, "all_to_all_single": 3 + trial}, first
        for forward, backward in later:  # then exactly the halo moves, forward and backward
            assert forward == {"all_to_all_single": 3}, forward
            assert backward == {"all_to_all_single": 3}, backward
        assert max(got["errors"]) <= 1e-12 and got["after"] <= 1e-12, got
        assert got["seconds"] < 5.0, got  # at once, not at a timeout (60 s here)
        # overlap=None chose once per input signature (two: the last input does not
        # require grad; its weight does, so that one timed its formulations too),
        # exchange-first; overlap=False never chooses
        assert [c.overlap for c in got["chosen"][0].values()] == [False, False], got
        assert len(got["trials"]) == 2, got["trials"]
        assert got["chosen"][3] == {}, got["chosen"]
    other, bad = (r["raised"] for r in results)
    assert "at this call site's last agreement in ['length']" in bad, bad
    assert "rank(s) [1] of the group passed this halo layer a tensor that differs" in other


def function_steady_state() -> dict[str, Any]:
    """`halo_exchange(..., agreements=store, global_length=T)`: agreed at the first call,
    then only the halo all-to-all; a chunk of the wrong length on rank 1 still raises on
    both ranks."""
    from haloshard import halo_exchange

    rank, mesh = dist.get_rank(), worker_mesh(2)
    full = seeded_randn((1, 2, 7, 3), 1).double()
    local, store = shard(full, 2, 2, rank).clone(), {}
    counts, errors = [], []
    for _ in range(3):
        leaf = local.clone().requires_grad_()
        with counted_collectives() as calls:
            y = halo_exchange(leaf, left=2, right=1, dim=2, group=mesh, pad="replicate",
                              global_length=7, agreements=store)
            y.sum().backward()
        counts.append(dict(calls))
        want = reference_halo(full, 2, 1, 2, 2, rank, "replicate")
        errors.append((y - want).abs().max().item())
    bad = torch.cat([local, local[:, :, :1]], dim=2) if rank == 1 else local
    try:
        halo_exchange(bad, left=2, right=1, dim=2, group=mesh, pad="replicate",
                      global_length=7, agreements=store)
        raised = "ok"
    except HaloError as error:
        raised = f"HaloError: {error}"
    return {"counts": counts, "errors": errors, "raised": raised}


@pytest.mark.gloo
def test_function_agreements(gloo: Callable[[int], Any]) -> None:
    results = gloo(2).run(function_steady_state, timeout=120)
    for got in results:
        first, *later = got["counts"]
        assert first == {"all_gather_single": 1, "all_to_all_single": 2}, first
        assert all(c == {"all_to_all_single": 2} for c in later), later  # fwd + bwd moves
        assert max(got["errors"]) == 0.0, got  # a data move: exact
        assert got["raised"].startswith("HaloError"), got


def test_agreements_needs_global_length() -> None:
    from haloshard import halo_exchange
    from haloshard.testing import simulated_mesh

    with simulated_mesh(2) as mesh, pytest.raises(HaloError, match="needs a dict and "
                                                                   "global_length"):
        halo_exchange(torch.ones(1, 2, 3), left=1, right=1, dim=2, group=mesh,
                      agreements={})


class Attention(nn.Module):
    """A VAE mid-block: GroupNorm, then single-head attention over all T*H*W tokens."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, channels)
        self.q, self.k, self.v = (nn.Conv3d(channels, channels, 1) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = (f(h).flatten(2).transpose(1, 2) for f in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v)
        return x + o.transpose(1, 2).reshape(x.shape)


def attention_steady_state() -> dict[str, Any]:
    """A conv and an attention block with its norm: after the first forward, only data
    collectives (the halo move, the norm's statistics, the K/V gather); a chunk one frame
    too long on rank 1 still raises on both ranks, at once."""
    from haloshard import AttentionParallel, GroupNormParallel

    rank, mesh = dist.get_rank(), worker_mesh(2)
    with single_device():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), Attention(4)).double()
        full = seeded_randn((1, 2, 7, 3, 3), 1).double()
        expected = model(full).detach()
    parallelize_module(model, mesh, {"0": HaloParallel(overlap=False), "1": AttentionParallel(),
                                     "1.norm": GroupNormParallel()})
    local = shard(full, 2, 2, rank).clone()
    counts, errors = [], []
    for _ in range(3):
        x = DTensor.from_local(local.clone().requires_grad_(), mesh, [Shard(2)],
                               shape=full.shape, stride=full.stride())
        with counted_collectives(by_dtype=True) as forward:
            y = model(x)
        y.to_local().sum().backward()
        counts.append(dict(forward))
        errors.append((y.to_local() - shard(expected, 2, 2, rank)).abs().max().item())
    block = model[1]
    inner = shard(seeded_randn((1, 4, 7, 3, 3), 2).double(), 2, 2, rank)
    for call in range(2):  # agreed at the first call, then a mistake on rank 1
        bad = torch.cat([inner, inner[:, :, :1]], dim=2) if rank == 1 and call else inner
        x = DTensor.from_local(bad, mesh, [Shard(2)], shape=(1, 4, 7, 3, 3),
                               stride=(252, 63, 9, 3, 1))
        raised, seconds = _outcome(block, x)
    return {"counts": counts, "errors": errors, "raised": raised, "seconds": seconds}


def _outcome(module: nn.Module, x: DTensor) -> tuple[str, float]:
    """What calling `module(x)` raised ("ok" if nothing), and how long it took."""
    start = time.perf_counter()
    try:
        module(x)
        raised = "ok"
    except HaloError as error:
        raised = f"HaloError: {error}"
    return raised, time.perf_counter() - start


@pytest.mark.gloo
def test_attention_no_metadata_collective_after_the_first_call(
        gloo: Callable[[int], Any]) -> None:
    results = gloo(2).run(attention_steady_state, timeout=120)
    for got in results:
        first, *later = got["counts"]
        assert first["all_gather_single (metadata)"] == 2, first  # the conv's and the K/V's
        for forward in later:  # the halo move, the norm's statistics, the K/V gather
            assert forward == {"all_to_all_single": 1, "all_gather_single": 2}, forward
        assert max(got["errors"]) <= 1e-12, got
        assert got["seconds"] < 5.0, got
    other, bad = (r["raised"] for r in results)
    assert "differ from those agreed at this attention block's last agreement" in bad, bad
    assert "rank(s) [1] of the group passed this attention block" in other, other


def long_chunks() -> dict[str, Any]:
    """A conv at its first call with overlap=None, with gradients: the trial times both
    formulations forward and backward on detached copies, so the model's parameters get no
    gradient from it and the call's own output is exact."""
    rank, mesh = dist.get_rank(), worker_mesh(2)
    with single_device():
        torch.manual_seed(0)
        # a conv1d: a float64 conv3d (its slow path) would time its window tap by tap
        # against its conv3d, not these two formulations
        conv = nn.Conv1d(2, 2, 3, padding=1).double()
        full = seeded_randn((1, 2, 32), 2).double()
        expected = conv(full).detach()
    parallelize_module(conv, mesh, HaloParallel())
    leaf = shard(full, 2, 2, rank).clone().requires_grad_()
    x = DTensor.from_local(leaf, mesh, [Shard(2)], shape=full.shape, stride=full.stride())
    with counted_collectives() as forward:
        y = conv(x)
    grads = [p.grad for p in conv.parameters()] + [leaf.grad]
    error = (y.to_local() - shard(expected, 2, 2, rank)).abs().max().item()
    return {"forward": dict(forward), "chosen": len(conv.forward.chosen), "grads": grads,
            "error": error, "trials": next(iter(conv.forward.trials.values()))}


@pytest.mark.gloo
def test_trial_leaves_no_gradient(gloo: Callable[[int], Any]) -> None:
    for got in gloo(2).run(long_chunks, timeout=120):
        # both formulations, warm-up and rounds (as many as the ranks agreed on), a forward
        # and a backward move each
        assert _TRIAL_ROUNDS <= got["trials"] <= _TRIAL_MAX_ROUNDS, got["trials"]
        trials = 2 * 2 * (1 + got["trials"])
        # the exchange's agreement, the choice's settings, the trial's two gathers, the
        # trial's moves and the call's
        assert got["forward"] == {"all_gather_single": 4, "all_to_all_single": 1 + trials}, got
        assert got["chosen"] == 1 and got["grads"] == [None] * 3, got
        assert got["error"] <= 1e-12, got


def _exchanged_first(conv: nn.Module, full: torch.Tensor, upstream: torch.Tensor,
                     reference: list[torch.Tensor], mesh: Any, *, taps: bool,
                     scale: float | None = None) -> tuple[float, int]:
    """One step of `conv` exchanged first on this rank's shard of `full` (its window tap by
    tap where `taps`; then `y.mul_(scale)` in place where given), backward from `upstream`:
    the largest difference to `reference` (one device's output, input, weight and bias
    gradients) and how many times the taps ran."""
    from haloshard import _conv
    from haloshard._conv import conv_call

    rank, calls, taps_conv = dist.get_rank(), [0], _conv._taps_conv

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return taps_conv(*args)

    _conv._taps_conv = counted
    try:
        leaf = shard(full.detach(), 2, 2, rank).clone().requires_grad_()
        weight, bias = (p.detach().clone().requires_grad_() for p in conv.parameters())
        y = conv_call(leaf, weight, bias, dim=2, left=1, right=1, group=mesh,
                      padding=(0, 1, 1), overlap=False, _taps=taps).apply(leaf, weight, bias)
        if scale is not None:
            y.mul_(scale)
        (y * shard(upstream, 2, 2, rank)).sum().backward()
    finally:
        _conv._taps_conv = taps_conv
    weight_grad, bias_grad = (t.clone() for t in (weight.grad, bias.grad))
    dist.all_reduce(weight_grad)
    dist.all_reduce(bias_grad)
    got = [y, leaf.grad, weight_grad, bias_grad]
    want, input_grad, *param_grads = reference
    ref = [shard(want, 2, 2, rank), shard(input_grad, 2, 2, rank), *param_grads]
    return max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True)), calls[0]


def taps_or_window() -> dict[str, Any]:
    """A float64 conv3d that torch convolves on its slow path, exchanged first: its window
    tap by tap (`_taps=True`) or as torch's conv3d (`_taps=False`), each exact against one
    device (output, input, weight and bias gradients); and `overlap=None` choosing between
    them by a trial at its first call with gradients."""
    rank, mesh = dist.get_rank(), worker_mesh(2)
    with single_device():
        torch.manual_seed(0)
        conv = nn.Conv3d(3, 4, 3, padding=1).double()
        full = seeded_randn((1, 3, 7, 5, 5), 3).double().requires_grad_()
        upstream = seeded_randn((1, 4, 7, 5, 5), 4).double()
        (conv(full) * upstream).sum().backward()
        expected = [full.grad, conv.weight.grad, conv.bias.grad]
        want = conv(full).detach()
    errors, used = {}, {}
    for taps in (True, False):
        errors[taps], used[taps] = _exchanged_first(conv, full, upstream, [want, *expected],
                                                    mesh, taps=taps)
    layer = nn.Conv3d(3, 4, 3, padding=1).double()
    layer.load_state_dict(conv.state_dict())
    parallelize_module(layer, mesh, HaloParallel())
    leaf = shard(full.detach(), 2, 2, rank).clone().requires_grad_()
    x = DTensor.from_local(leaf, mesh, [Shard(2)], shape=full.shape, stride=full.stride())
    y = layer(x)
    (y.to_local() * shard(upstream, 2, 2, rank)).sum().backward()
    chosen = list(layer.forward.chosen.values())
    error = max((y.to_local() - shard(want, 2, 2, rank)).abs().max().item(),
                (leaf.grad - shard(expected[0], 2, 2, rank)).abs().max().item())
    return {"errors": errors, "used": used, "chosen": chosen, "error": error,
            "trials": list(layer.forward.trials.values())}


@pytest.mark.gloo
def test_window_tap_by_tap_or_whole(gloo: Callable[[int], Any]) -> None:
    results = gloo(2).run(taps_or_window, timeout=120)
    for got in results:
        assert got["used"] == {True: 1, False: 0}, got  # the taps ran only where allowed
        assert max(got["errors"].values()) <= 1e-12, got
        (choice,) = got["chosen"]  # exchange-first, taps or not as the trial timed them
        assert not choice.overlap and got["error"] <= 1e-12, got
        assert len(got["trials"]) == 1 and got["trials"][0] >= _TRIAL_ROUNDS, got
    assert results[0]["chosen"] == results[1]["chosen"]  # every rank took the same choice


def one_frame_taps_take_inplace_ops() -> dict[str, Any]:
    """A float64 conv3d on one frame a rank, its window tap by tap, then an in-place op on
    its output: the output is a tensor of its own (a one-frame chunk's rearranged taps
    output was already contiguous, and `contiguous()` returned the view), exact against one
    device (output, input, weight and bias gradients)."""
    with single_device():
        torch.manual_seed(0)
        conv = nn.Conv3d(3, 4, 3, padding=1).double()
        full = seeded_randn((1, 3, 2, 5, 5), 3).double().requires_grad_()
        upstream = seeded_randn((1, 4, 2, 5, 5), 4).double()
        want = conv(full).mul_(0.5)
        (want * upstream).sum().backward()
        reference = [want.detach(), full.grad, conv.weight.grad, conv.bias.grad]
    error, taps = _exchanged_first(conv, full, upstream, reference, worker_mesh(2), taps=True,
                                   scale=0.5)
    return {"taps": taps, "error": error}


@pytest.mark.gloo
def test_one_frame_taps_take_inplace_ops(gloo: Callable[[int], Any]) -> None:
    for got in gloo(2).run(one_frame_taps_take_inplace_ops, timeout=120):
        assert got["taps"] == 1 and got["error"] <= 1e-12, got  # float64: exact


def test_exchange_first_only_when_clearly_faster() -> None:
    from haloshard._choice import _overlap_kept

    # per rank: (overlapped conv's fastest round, exchange-first's fastest round), in us
    assert _overlap_kept([[1000, 950], [1000, 930]])  # 6% faster: within the margin
    assert not _overlap_kept([[1000, 850], [1000, 880]])  # 13% faster: exchange first
    assert _overlap_kept([[1000, 700], [1000, 1400]])  # one rank's gain is the other's loss


def test_taps_kept_unless_slower() -> None:
    from haloshard._choice import _sum_first

    # per rank: (window tap by tap, window's conv3d), in us: summed over ranks
    assert _sum_first([[100, 100], [100, 100]]) and _sum_first([[90, 200], [150, 100]])
    assert not _sum_first([[210, 100], [100, 200]])
