"""The CUDA path: CUDA tensors on simulated ranks, and real NCCL processes, against one device.

On a machine with a GPU the tests run on CUDA (`python -m pytest -q tests/test_cuda.py`); CI
has none, so there the same checks run on CPU with gloo in place of NCCL, which keeps them
working (`HALOSHARD_TEST_DEVICE` picks the device; the diffusers VAE parts run on a GPU
only: `test_diffusers` covers them on CPU). Real processes: one per GPU (NCCL refuses two
ranks on one GPU), under each backend spelling a user writes: `"nccl"` alone (its groups take
CUDA tensors only, so haloshard's own metadata must travel on the GPU too) and
`"cpu:gloo,cuda:nccl"`. `HALOSHARD_TEST_WORLD` and `HALOSHARD_TEST_BACKENDS` override the
world size and the backends (e.g. 2 gloo processes on one GPU's CUDA tensors).

Tolerances: float64 at 1e-10 (the sharded run adds the same products in another order; a
misplaced frame is O(1)); halo exchanges are data moves, compared with `torch.equal`;
float32 at 1e-4 (cuDNN picks its algorithm per shape, so the sharded convs round
differently; TF32 is switched off, which would otherwise round inputs to 10 bits).
"""

from __future__ import annotations

import copy
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from haloshard import TRANSPORTS, halo_exchange, halo_plan, reduce_grads, verify_plan
from haloshard.testing import (
    assert_close_per_rank,
    check_plan,
    counted_collectives,
    rank_map,
    reference_halo,
    seeded_randn,
    shard,
    simulated_mesh,
    single_device,
)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not installed
    sys.path.insert(0, str(ROOT))

DEVICE = os.environ.get("HALOSHARD_TEST_DEVICE",
                        "cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE == "cuda"
PADS = ("zeros", "replicate", "reflect", "circular")
TOL = {"atol": 1e-10, "rtol": 1e-10}
F32_TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(autouse=True)
def _no_tf32() -> Any:
    if not ON_GPU:
        yield
        return
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul


def quickstart_model(dtype: torch.dtype = torch.float64) -> nn.Module:
    """The README's quickstart model: kernels of 3 and 5 along T."""
    with single_device():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv3d(3, 8, 3, padding=1), nn.SiLU(),
            nn.Conv3d(8, 8, (5, 3, 3), padding=(2, 1, 1)), nn.SiLU(),
            nn.Conv3d(8, 3, 1),
        ).to(DEVICE, dtype)


def hunyuan_decoder() -> nn.Module:
    """The tiny HunyuanVideo VAE decoder `benchmarks.vae` runs (causal convs, GroupNorm,
    mid-block attention), float64 on DEVICE."""
    from benchmarks import vae_models

    with single_device():
        return vae_models.build("hunyuan", "tiny").to(DEVICE, torch.float64).decoder


# --- simulated ranks (LocalTensorMode over a fake group), tensors on DEVICE ---

@pytest.mark.parametrize("transport", ["all_to_all", "allgather"])
@pytest.mark.parametrize("pad", PADS)
def test_exchange_simulated(pad: str, transport: str) -> None:
    """7 frames on 3 ranks (3, 2, 2), halo 3 | 1: rank 2's left halo spans two neighbours."""
    full = seeded_randn((1, 3, 7, 4, 4), 1, torch.float32, DEVICE)
    with simulated_mesh(3, device_type=DEVICE) as mesh:
        x = rank_map(mesh, lambda r: shard(full, 2, 3, r).contiguous())
        y = halo_exchange(x, left=3, right=1, dim=2, group=mesh, pad=pad, transport=transport)
        assert y.device.type == DEVICE
        assert_close_per_rank(y, lambda r: reference_halo(full, 3, 1, 2, 3, r, pad), mesh,
                              atol=0, rtol=0)


@pytest.mark.parametrize(("world", "dtype"), [(2, torch.float64), (4, torch.float64),
                                              (3, torch.float32)])
def test_plan_simulated(world: int, dtype: torch.dtype) -> None:
    """The quickstart model through `halo_plan`: output, input and parameter gradients."""
    model = quickstart_model(dtype)
    full = seeded_randn((1, 3, 9, 6, 6), 2, dtype, DEVICE)
    with simulated_mesh(world, device_type=DEVICE) as mesh:
        check_plan(mesh, model, halo_plan(model, include_convs=True), full, 3,
                   **(TOL if dtype == torch.float64 else F32_TOL))


@pytest.mark.skipif(not ON_GPU, reason="on CPU: test_diffusers")
def test_vae_simulated() -> None:
    """A diffusers VAE decoder on 3 simulated ranks, module by module (`verify_plan`)."""
    pytest.importorskip("diffusers")
    from haloshard.integrations.diffusers import plan_for

    decoder = hunyuan_decoder()
    z = seeded_randn((1, 4, 3, 2, 2), 1, torch.float64, DEVICE)
    with simulated_mesh(3, device_type=DEVICE) as mesh:
        report = verify_plan(decoder, plan_for(decoder), z, mesh, **TOL)
    assert report.ok, report
    assert len(report.outputs) > 20, report


# --- real processes: NCCL on CUDA (gloo on CPU) ---

def _quickstart_on(mesh: Any) -> dict[str, float]:
    """The quickstart model parallelized on `mesh` (1-D), against this rank's own
    single-device run of the whole clip: output, input gradient, parameter gradients."""
    world, rank = mesh.size(), mesh.get_local_rank()
    model = quickstart_model()
    single = copy.deepcopy(model)
    video = seeded_randn((1, 3, 9, 6, 6), 2, device=DEVICE)
    parallelize_module(model, mesh, halo_plan(model, include_convs=True))
    local = shard(video, 2, world, rank).clone().requires_grad_()
    x = DTensor.from_local(local, mesh, [Shard(2)], shape=video.shape, stride=video.stride())
    y = model(x)
    gy = seeded_randn(y.shape, 3, device=DEVICE)
    (y.to_local() * shard(gy, 2, world, rank)).sum().backward()
    reduce_grads(model, mesh)
    ref_x = video.clone().requires_grad_()
    ref = single(ref_x)
    (ref * gy).sum().backward()
    assert y.to_local().device.type == DEVICE
    torch.testing.assert_close(y.to_local(), shard(ref.detach(), 2, world, rank), **TOL)
    assert local.grad is not None and ref_x.grad is not None
    torch.testing.assert_close(local.grad, shard(ref_x.grad, 2, world, rank), **TOL)
    for p, q in zip(model.parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    return {"out_max": float(ref.detach().abs().max())}


def real_checks() -> dict[str, Any]:
    """On every rank of a real world: every transport and pad mode, the quickstart model on
    a 1-D mesh and on the `cp` axis of a `(dp, cp)` mesh, a diffusers decoder; the
    collectives each part ran (so a log shows what crossed the backend)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(DEVICE, (world,), mesh_dim_names=("cp",))
    full = seeded_randn((1, 3, 7, 4, 4), 1, torch.float32, DEVICE)
    report: dict[str, Any] = {"backend": str(dist.get_backend()), "world": world}
    with counted_collectives() as counts:
        for transport in TRANSPORTS:
            for pad in PADS:
                x = shard(full, 2, world, rank).contiguous()
                y = halo_exchange(x, left=3, right=1, dim=2, group=mesh, pad=pad,
                                  transport=transport)
                assert y.device == full.device, (transport, pad, y.device)
                assert torch.equal(y, reference_halo(full, 3, 1, 2, world, rank, pad)), \
                    (transport, pad)
    report["exchange"] = dict(counts)
    with counted_collectives() as counts:
        _quickstart_on(mesh)
    report["quickstart"] = dict(counts)
    two_d = init_device_mesh(DEVICE, (1, world), mesh_dim_names=("dp", "cp"))
    _quickstart_on(two_d["cp"])
    try:
        from haloshard.integrations.diffusers import plan_for
    except ImportError:
        report["vae"] = "diffusers not installed"
        return report
    if not ON_GPU:  # test_diffusers covers it on gloo
        return report
    decoder = hunyuan_decoder()
    z = seeded_randn((1, 4, 3, 2, 2), 1, torch.float64, DEVICE)
    with counted_collectives() as counts:
        vae_report = verify_plan(decoder, plan_for(decoder), z, mesh, **TOL)
    assert vae_report.ok, str(vae_report)
    report["vae"] = dict(counts)
    return report


def _worker(rank: int, world: int, backend: str, init: str, out: Any) -> None:
    try:
        if ON_GPU:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        try:
            out.put((rank, real_checks()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the parent
        out.put((rank, traceback.format_exc()))


def _world() -> int:
    if "HALOSHARD_TEST_WORLD" in os.environ:
        return int(os.environ["HALOSHARD_TEST_WORLD"])
    return torch.cuda.device_count() if ON_GPU else 2


def _backends() -> list[str]:
    if "HALOSHARD_TEST_BACKENDS" in os.environ:
        return os.environ["HALOSHARD_TEST_BACKENDS"].split()
    return ["nccl", "cpu:gloo,cuda:nccl"] if ON_GPU else ["gloo"]


def _collect(out: Any, procs: list[Any], timeout: float = 300.0) -> dict[int, Any]:
    """Every rank's report; fails at once when a process dies without one (a backend
    abort, e.g. gloo's TCP transport handed CUDA memory), instead of waiting out `timeout`."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            rank, value = out.get(timeout=2)
            results[rank] = value
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in results and p.exitcode not in (None, 0)]
            assert not dead, f"ranks {dead} died (exit codes " \
                f"{[procs[r].exitcode for r in dead]}) without a report"
    assert len(results) == len(procs), f"no report from ranks " \
        f"{sorted(set(range(len(procs))) - set(results))} within {timeout:.0f} s"
    return results


@pytest.mark.gloo
@pytest.mark.parametrize("backend", _backends())
def test_real_ranks(backend: str, gloo: Callable[[int], Any]) -> None:
    world = _world()
    if backend == "gloo" and not ON_GPU:  # the suite's own gloo world, already started
        print(f"\ngloo x {world}: {gloo(world).run(real_checks, timeout=300)}")
        return
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        procs = [ctx.Process(target=_worker, args=(r, world, backend, init, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            results = _collect(out, procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    assert not failed, "\n".join(f"rank {r}:\n{v}" for r, v in failed.items())
    print(f"\n{backend} x {world}: {results}")

