"""A halo conv on a DTensor runs as one autograd node (`haloshard._steady.sharded_conv`), and
from the call after the first that reuses a layer's agreement as a steady call, which skips
the whole path's lookups. Each formulation it can hold (overlapped corrections,
exchange-first, exchange-first tap by tap; dilated; without bias) against one device over
several calls: output, input gradient, weight and bias gradients, a double backward, and
activation checkpointing (the recomputed forward must save what the first one saved, whichever
path each took); and the calls that must leave the steady state (another signature, a
parameter replaced, a conv attribute changed, a deep copy) take the whole path: exact, or
`HaloError` on every rank.

Real gloo processes: steady calls need eager c10d (simulated ranks never take them). T = 13
on 2 and 3 ranks (7, 6 / 5, 4, 4). Float64: 1e-12 is for sums taken in another order; a
misplaced slice is O(1).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

from haloshard import HaloError, HaloParallel
from haloshard._steady import Steady
from haloshard.testing import (
    seeded_module,
    seeded_randn,
    shard,
    single_device,
    sum_over_ranks,
    unhooked,
    worker_mesh,
)

TOL = {"atol": 1e-12, "rtol": 1e-10}
LENGTH = 13


def _layers() -> dict[str, tuple[nn.Module, HaloParallel, tuple[int, ...]]]:
    """name -> (layer, style, input shape)."""
    return {
        "corrected": (nn.Conv1d(4, 5, 3, padding=1), HaloParallel(overlap=True),
                      (2, 4, LENGTH)),
        "dilated": (nn.Conv1d(3, 3, 3, padding=2, dilation=2), HaloParallel(overlap=True),
                    (1, 3, LENGTH)),
        "whole": (nn.Conv2d(4, 5, 3, padding=1), HaloParallel(overlap=False),
                  (1, 4, LENGTH, 6)),
        "no bias": (nn.Conv2d(3, 2, 3, padding=1, bias=False), HaloParallel(overlap=False),
                    (1, 3, LENGTH, 5)),
        # float64 conv3d: torch's slow path, so exchange-first tap by tap (no trial)
        "taps": (nn.Conv3d(2, 3, 3, padding=1), HaloParallel(), (1, 2, LENGTH, 4, 4)),
    }


def _reference(layer: nn.Module, full: torch.Tensor, gy: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    with single_device():
        twin = unhooked(layer)  # its single-device twin, parallelized or not
        x = full.clone().requires_grad_()
        y = twin(x)
        (y * gy).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad, [p.grad for p in twin.parameters()]  # type: ignore[misc]


def _call(model: nn.Module, full: torch.Tensor, gy: torch.Tensor, *, grad: bool = True
          ) -> dict[str, Any]:
    """One sharded call: this rank's output and input gradient, the parameter gradients
    summed over ranks, and whether it ran as a steady call."""
    mesh, rank, world = worker_mesh(dist.get_world_size()), dist.get_rank(), dist.get_world_size()
    model.zero_grad(set_to_none=True)
    local = shard(full, 2, world, rank).clone().requires_grad_(grad)
    x = DTensor.from_local(local, mesh, [Shard(2)], shape=full.shape, stride=full.stride())
    runs: list[bool] = []
    run = Steady.run

    def counted(self: Steady, *args: Any) -> Any:
        runs.append(True)
        return run(self, *args)

    Steady.run = counted  # type: ignore[method-assign]
    try:
        with torch.set_grad_enabled(grad):
            y = model(x)
    finally:
        Steady.run = run  # type: ignore[method-assign]
    out = {"y": y.to_local().detach(), "steady": bool(runs)}
    if grad:
        (y.to_local() * shard(gy, 2, world, rank)).sum().backward()
        out["gx"] = local.grad
        out["gp"] = [sum_over_ranks(p.grad, mesh) for p in model.parameters()]
    return out


def _check(got: dict[str, Any], y: torch.Tensor, gx: torch.Tensor | None,
           gp: list[torch.Tensor] | None, what: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.testing.assert_close(got["y"], shard(y, 2, world, rank), **TOL, msg=what)
    if gx is not None:
        torch.testing.assert_close(got["gx"], shard(gx, 2, world, rank), **TOL, msg=what)
    for p, q in zip(got.get("gp", []), gp or [], strict=True):
        torch.testing.assert_close(p, q, **TOL, msg=what)


def steady_layers() -> dict[str, list[bool]]:
    """Inside a worker: each layer over five calls; which of them ran steady."""
    steady: dict[str, list[bool]] = {}
    for i, (name, (layer, style, shape)) in enumerate(_layers().items()):
        layer = seeded_module(layer, 10 * i)
        full, gy = seeded_randn(shape, 10 * i + 5), seeded_randn(
            (shape[0], layer.out_channels, *shape[2:]), 10 * i + 6)
        y, gx, gp = _reference(layer, full, gy)
        parallelize_module(layer, worker_mesh(dist.get_world_size()), style)
        steady[name] = []
        for call in range(5):
            got = _call(layer, full, gy)
            _check(got, y, gx, gp, f"{name}, call {call}")
            steady[name].append(got["steady"])
    return steady


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 3])
def test_steady_calls_exact(gloo: Callable[[int], Any], world: int) -> None:
    for got in gloo(world).run(steady_layers, timeout=180):
        # the first call agrees, the second reuses the agreement (and keeps its steady
        # state), every later one is a steady call
        assert got == {name: [False, False, True, True, True] for name in _layers()}, got


def inference_calls() -> dict[str, Any]:
    """Inside a worker: each layer, and a float32 conv3d whose window torch would send to
    its slow path, over four calls under no_grad (parameters requiring grad, as a model in
    eval): which ran steady, and which conv kernels ran (the float32 one on oneDNN's kernel
    directly, `_choice.onednn_direct`; float64 tap by tap, as with gradients)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if "conv" in func.__name__:
                self.names.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    layers = {**_layers(), "float32": (nn.Conv3d(8, 6, 3, padding=1), HaloParallel(),
                                        (1, 8, LENGTH, 6, 6))}
    out: dict[str, Any] = {}
    for i, (name, (layer, style, shape)) in enumerate(layers.items()):
        dtype = torch.float32 if name == "float32" else torch.float64
        layer = seeded_module(layer, 10 * i).to(dtype)
        full = seeded_randn(shape, 10 * i + 5, dtype)
        with single_device(), torch.no_grad():
            y = unhooked(layer)(full)
        parallelize_module(layer, worker_mesh(dist.get_world_size()), style)
        steady, tol = [], TOL if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-5}
        with Kernels() as kernels:
            for call in range(4):
                got = _call(layer, full, full, grad=False)
                torch.testing.assert_close(got["y"], shard(y, 2, dist.get_world_size(),
                                                           dist.get_rank()),
                                           **tol, msg=f"{name}, call {call}")
                steady.append(got["steady"])
        out[name] = (steady, sorted(kernels.names))
    return out


@pytest.mark.gloo
def test_inference_calls_exact(gloo: Callable[[int], Any]) -> None:
    """Under no_grad a halo conv runs its formulation's steps with no autograd node, steady
    from its third call, against one device (float64: 1e-12; float32: sums of 27 * 8
    products of O(1) values, 1e-5); a float32 conv3d whose window torch would run on its
    slow path calls oneDNN's kernel instead (no `aten.convolution`: neither the slow path nor
    the taps run), the float64 one its conv2d taps."""
    for got in gloo(2).run(inference_calls, timeout=180):
        for name, (steady, _) in got.items():
            assert steady == [False, False, True, True], (name, steady)
        assert got["float32"][1] == ["mkldnn_convolution"], got["float32"]
        assert got["taps"][1] == ["convolution"], got["taps"]  # its conv2d taps


def leaving_steady() -> dict[str, Any]:
    """Inside a worker: a layer in its steady state, then calls that must leave it."""
    layer = seeded_module(nn.Conv2d(3, 4, 3, padding=1), 1)
    full, gy = seeded_randn((1, 3, LENGTH, 5), 2), seeded_randn((1, 4, LENGTH, 5), 3)
    y, gx, gp = _reference(layer, full, gy)
    parallelize_module(layer, worker_mesh(dist.get_world_size()), HaloParallel(overlap=True))
    seen = []
    for _ in range(3):
        got = _call(layer, full, gy)
        _check(got, y, gx, gp, "before")
    seen.append(got["steady"])
    # another signature (no gradient; another length) takes the whole path, exactly; then
    # the first signature agrees afresh and turns steady again
    got = _call(layer, full, gy, grad=False)
    _check(got, y, None, None, "no_grad")
    seen.append(got["steady"])
    short = full.narrow(2, 0, 9).contiguous()
    short_y = _reference(layer, short, gy.narrow(2, 0, 9).contiguous())[0]
    got = _call(layer, short, gy.narrow(2, 0, 9).contiguous(), grad=False)
    _check(got, short_y, None, None, "shorter")
    seen.append(got["steady"])
    for _ in range(3):
        got = _call(layer, full, gy)
        _check(got, y, gx, gp, "again")
        seen.append(got["steady"])
    # a parameter replaced by another of the same shape: the steady call reads the new one
    with torch.no_grad():
        layer.weight = nn.Parameter(layer.weight * 2)
    y2, gx2, gp2 = _reference(layer, full, gy)
    got = _call(layer, full, gy)
    _check(got, y2, gx2, gp2, "new weight")
    seen.append(got["steady"])
    # a conv attribute changed on every rank: the halo no longer fits, HaloError everywhere
    layer.dilation = (2, 1)
    try:
        _call(layer, full, gy)
        raised = ""
    except HaloError as error:
        raised = str(error)
    layer.dilation = (1, 1)
    got = _call(layer, full, gy)
    _check(got, y2, gx2, gp2, "dilation back")
    # a deep copy starts afresh (its own agreements), exact
    twin = copy.deepcopy(layer)
    copied = [_call(twin, full, gy) for _ in range(3)]
    for got in copied:
        _check(got, y2, gx2, gp2, "deep copy")
    return {"seen": seen, "raised": raised, "copied": [got["steady"] for got in copied]}


def double_backward() -> None:
    """Inside a worker: gradients of a gradient through steady calls, against one device."""
    mesh, rank, world = worker_mesh(dist.get_world_size()), dist.get_rank(), dist.get_world_size()
    layer = seeded_module(nn.Conv1d(3, 3, 3, padding=1), 4)
    full, gy = seeded_randn((1, 3, LENGTH), 5), seeded_randn((1, 3, LENGTH), 6)
    with single_device():
        twin = copy.deepcopy(layer)
        x = full.clone().requires_grad_()
        (g,) = torch.autograd.grad((twin(x) * gy).sum(), x, create_graph=True)
        (g * g).sum().backward()
        expected = [p.grad for p in twin.parameters()]
    parallelize_module(layer, mesh, HaloParallel(overlap=True))
    for call in range(4):
        layer.zero_grad(set_to_none=True)
        local = shard(full, 2, world, rank).clone().requires_grad_()
        x = DTensor.from_local(local, mesh, [Shard(2)], shape=full.shape, stride=full.stride())
        y = layer(x)
        (g,) = torch.autograd.grad((y.to_local() * shard(gy, 2, world, rank)).sum(), local,
                                   create_graph=True)
        (g * g).sum().backward()
        for p, q in zip(layer.parameters(), expected, strict=True):
            if q is None:  # the bias: the input gradient does not depend on it
                assert p.grad is None, call
                continue
            torch.testing.assert_close(sum_over_ranks(p.grad, mesh), q, **TOL,
                                       msg=f"call {call}")


def checkpointed() -> list[bool]:
    """Inside a worker: non-reentrant activation checkpointing around a layer over four
    calls; its backward recomputes the forward (the steady call too) and must save what the
    original saved."""
    seen = []
    for i, style in enumerate((HaloParallel(overlap=True), HaloParallel(overlap=False))):
        layer = seeded_module(nn.Conv2d(3, 4, 3, padding=1), 20 + i)
        full, gy = seeded_randn((1, 3, LENGTH, 5), 22), seeded_randn((1, 4, LENGTH, 5), 23)
        y, gx, gp = _reference(layer, full, gy)
        parallelize_module(layer, worker_mesh(dist.get_world_size()), style)
        model = _Checkpointed(layer)
        for call in range(4):
            got = _call(model, full, gy)
            _check(got, y, gx, gp, f"checkpointed {style}, call {call}")
            seen.append(got["steady"])
    return seen


class _Checkpointed(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: DTensor) -> Any:
        return checkpoint(self.layer, x, use_reentrant=False)


@pytest.mark.gloo
def test_leaving_the_steady_state(gloo: Callable[[int], Any]) -> None:
    world = gloo(3)
    for got in world.run(leaving_steady, timeout=180):
        # steady; no_grad and a shorter input take the whole path; the first signature
        # agrees afresh (two calls) and is steady again; a new weight stays steady
        assert got["seen"] == [True, False, False, False, False, True, True], got
        assert "needs stride 1 and padding 0 there and left + right" in got["raised"], got
        assert got["copied"] == [False, False, True], got
    world.run(double_backward, timeout=180)
    for seen in world.run(checkpointed, timeout=180):
        assert seen == [False, False, True, True] * 2, seen
