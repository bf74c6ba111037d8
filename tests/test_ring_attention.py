"""Inference attention over K/V one source rank's block at a time (`blocks_many`, online
softmax) against `scaled_dot_product_attention` over all T*S tokens on one device, under
`torch.no_grad()`: `frame_attention` directly, HunyuanVideo's mid-block and Mochi's block.

Float64 at 1e-10: the same sums (a softmax over T*S keys) merged block by block in another
order; a key from a wrong frame, or a block counted twice or not at all, changes the output
by O(0.1).
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

from haloshard import HaloError, frame_attention
from haloshard.integrations.diffusers import plan_for
from haloshard.testing import (
    assert_close_per_rank,
    counted_collectives,
    rank_map,
    seeded_randn,
    shard,
    simulated_mesh,
    single_device,
    worker_mesh,
)

TOL = {"atol": 1e-10, "rtol": 1e-10}
# A mistake on one rank raises on every rank at once: well under a second of work, 5 s with
# margin for a loaded 2-core machine (the process group's timeout is 60 s).
AT_ONCE_S = 5.0


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
              ) -> torch.Tensor:
    """The attention output over every T*S token on one device (dense block-causal mask)."""
    *batch, t, s, e = q.shape
    flat = [x.reshape(*batch, t * s, e) for x in (q, k, v)]
    frames = torch.arange(t).repeat_interleave(s)
    mask = frames[None, :] <= frames[:, None] if causal else None
    return F.scaled_dot_product_attention(*flat, attn_mask=mask).reshape(q.shape)


@pytest.mark.simulated
@pytest.mark.parametrize(("frames", "world"), [(5, 2), (5, 3), (3, 4), (1, 2)])  # empty
@pytest.mark.parametrize("causal", [True, False])
def test_frame_attention_blocks(frames: int, world: int, causal: bool) -> None:
    q, k, v = (seeded_randn((1, 2, frames, 4, 3), seed) for seed in range(3))
    with single_device():
        out = reference(q, k, v, causal)
    with simulated_mesh(world) as mesh, torch.no_grad():
        local = [rank_map(mesh, lambda r, x=x: shard(x, 2, world, r).clone())
                 for x in (q, k, v)]
        y = frame_attention(*local, mesh, global_length=frames, causal=causal)
        assert_close_per_rank(y, lambda r: shard(out, 2, world, r), mesh, **TOL)


@pytest.mark.simulated
def test_frame_attention_blocks_query_gradient() -> None:
    """With grad enabled but K and V frozen, the blocks path still runs and its output is
    differentiable in q (K/V blocks are constants there): exact against one device."""
    q, k, v = (seeded_randn((1, 2, 5, 4, 3), seed) for seed in range(3))
    with single_device():
        leaf = q.clone().requires_grad_()
        reference(leaf, k, v, True).sum().backward()
    with simulated_mesh(3) as mesh:
        local_q = rank_map(mesh, lambda r: shard(q, 2, 3, r).clone()).requires_grad_()
        local_k, local_v = (rank_map(mesh, lambda r, x=x: shard(x, 2, 3, r).clone())
                            for x in (k, v))
        y = frame_attention(local_q, local_k, local_v, mesh, global_length=5)
        assert_close_per_rank(y, lambda r: shard(reference(q, k, v, True), 2, 3, r), mesh,
                              **TOL)
        y.sum().backward()
        assert_close_per_rank(local_q.grad, lambda r: shard(leaf.grad, 2, 3, r), mesh, **TOL)


def test_frame_attention_blocks_gathers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad K and V never travel whole: the gathered path is not taken."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("K/V all-gathered under no_grad")

    monkeypatch.setattr("haloshard._masked_attention.gather_many", refuse)
    q = seeded_randn((1, 2, 5, 4, 3), 0)
    with simulated_mesh(2) as mesh, torch.no_grad():
        local = rank_map(mesh, lambda r: shard(q, 2, 2, r).clone())
        frame_attention(local, local, local, mesh, global_length=5)


def _outcome(fn: Callable[[], object]) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        fn()
    except HaloError as exc:
        return f"HaloError: {exc}", time.perf_counter() - start
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    return "ok", time.perf_counter() - start


def blocks_steady_state(frames: int, causal: bool, case: str) -> dict[str, Any]:
    """Three no_grad calls with a style's agreements (`_reuse`): the first agrees, the
    second runs on broadcasts alone, the third has rank 1 change per `case`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = worker_mesh(world)
    q, k, v = (seeded_randn((1, 2, frames, 4, 3), seed) for seed in range(3))
    with single_device():
        out = reference(q, k, v, causal)
    store: dict[Any, Any] = {}
    counts, errors = [], []
    for _ in range(2):
        local = [shard(x, 2, world, rank).clone() for x in (q, k, v)]
        with torch.no_grad(), counted_collectives(by_dtype=True) as calls:
            y = frame_attention(*local, mesh, global_length=frames, causal=causal,
                                _reuse=(store, "signature"))
        counts.append(dict(calls))
        errors.append((y - shard(out, 2, world, rank)).abs().max().item() if y.numel() else 0)
    local = [shard(x, 2, world, rank).clone() for x in (q, k, v)]
    if case == "grad" and rank == 1:  # peers run blocks, rank 1 the gathered path
        local = [x.requires_grad_() for x in local]
    if case == "frames" and rank == 1:  # one frame short of its split
        local = [x.narrow(2, 0, max(x.shape[2] - 1, 0)) for x in local]

    def third() -> None:
        with torch.enable_grad():
            frame_attention(*local, mesh, global_length=frames, causal=causal,
                            _reuse=(store, "signature"))

    def fresh() -> None:  # no agreement yet: the metadata row compares requires_grad
        with torch.enable_grad():
            frame_attention(*local, mesh, global_length=frames, causal=causal, _reuse=({}, 0))

    return {"counts": counts, "errors": errors, "outcome": _outcome(third),
            "fresh": _outcome(fresh) if case == "grad" else ("HaloError", 0.0)}


@pytest.mark.gloo
@pytest.mark.parametrize(("world", "frames", "causal", "case"),
                         [(2, 5, True, "frames"), (2, 5, False, "grad"),
                          (3, 2, True, "grad"), (3, 7, False, "frames")])  # 2 on 3: empty
def test_frame_attention_blocks_gloo(gloo: Callable[[int], Any], world: int, frames: int,
                                     causal: bool, case: str) -> None:
    got = gloo(world).run(blocks_steady_state, frames, causal, case, timeout=120)
    for rank, result in enumerate(got):
        first, later = result["counts"]
        assert first == {"all_gather_single (metadata)": 1, "broadcast": world}, first
        assert later == {"broadcast": world}, later  # one block per source, no metadata
        assert max(result["errors"]) <= 1e-10, result
        message, seconds = result["outcome"]
        assert message.startswith("HaloError"), (rank, message)
        assert seconds < AT_ONCE_S, (rank, seconds)
        message, seconds = result["fresh"]
        assert message.startswith("HaloError"), (rank, message)
        assert seconds < AT_ONCE_S, (rank, seconds)


def hunyuan() -> nn.Module:
    """tests/test_diffusers.py's tiny HunyuanVideo VAE (float64)."""
    from diffusers import AutoencoderKLHunyuanVideo

    with single_device():
        torch.manual_seed(0)
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3,
            block_out_channels=(8, 8, 8), layers_per_block=1, norm_num_groups=2,
            spatial_compression_ratio=4, temporal_compression_ratio=4)
        return vae.double().eval()


def mochi() -> nn.Module:
    """tests/test_diffusers.py's tiny Mochi VAE (float64; attention needs 32 channels)."""
    from diffusers import AutoencoderKLMochi

    with single_device():
        torch.manual_seed(0)
        vae = AutoencoderKLMochi(
            encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
            latent_channels=4, layers_per_block=(1,) * 5)
        return vae.double().eval()


# model: (factory, encoder input shape, decoder input shape), as in tests/test_diffusers.py
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], tuple[int, ...]]] = {
    "hunyuan": (hunyuan, (1, 3, 9, 8, 8), (1, 4, 3, 2, 2)),
    "mochi": (mochi, (1, 3, 7, 16, 16), (1, 4, 3, 2, 2)),
}


def _sharded_forward(name: str, part: str, mesh: Any, world: int) -> tuple[Any, Any]:
    """`part` of the tiny diffusers model `name` on one device and T-sharded, under no_grad:
    (reference output, this rank's output: a DTensor's local tensor)."""
    factory, enc_shape, dec_shape = MODELS[name]
    module = getattr(factory(), part)
    full = seeded_randn(enc_shape if part == "encoder" else dec_shape, 1)
    first = (lambda out: out[0]) if name == "mochi" else (lambda out: out)
    with torch.no_grad():
        with single_device():
            ref = first(module(full))
        parallelize_module(module, mesh, plan_for(module))
        local = rank_map(mesh, lambda r: shard(full, 2, world, r).clone())
        x = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=full.shape,
                               stride=full.stride())
        return ref, first(module(x)).to_local()


@pytest.mark.simulated
@pytest.mark.parametrize(("name", "part", "world"), [
    ("hunyuan", "encoder", 2),  # mid-block at 3 frames: 2, 1
    ("hunyuan", "decoder", 4),  # 1, 1, 1, 0
    ("mochi", "encoder", 3),  # causal attention along T at 2, 2, 0 and 1, 1, 0 frames
    ("mochi", "encoder", 2),  # (Mochi's decoder has no attention)
])
def test_diffusers_blocks_simulated(monkeypatch: pytest.MonkeyPatch, name: str, part: str,
                                    world: int) -> None:
    """HunyuanVideo's mid-block and Mochi's blocks attend block by block under no_grad."""
    pytest.importorskip("diffusers")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("K/V all-gathered under no_grad")

    monkeypatch.setattr("haloshard._masked_attention.gather_many", refuse)
    with simulated_mesh(world) as mesh:
        ref, y = _sharded_forward(name, part, mesh, world)
        assert_close_per_rank(y, lambda r: shard(ref, 2, world, r), mesh, **TOL)


def diffusers_blocks_on_gloo(name: str, part: str) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    with counted_collectives(by_dtype=True) as calls:
        ref, y = _sharded_forward(name, part, worker_mesh(world), world)
    error = (y - shard(ref, 2, world, rank)).abs().max().item() if y.numel() else 0.0
    return {"error": error, "calls": dict(calls)}


@pytest.mark.gloo
@pytest.mark.parametrize(("name", "part"), [("hunyuan", "decoder"), ("mochi", "encoder")])
def test_diffusers_blocks_gloo(gloo: Callable[[int], Any], name: str, part: str) -> None:
    """On real ranks under no_grad: HunyuanVideo's mid-block attends block by block
    (broadcasts, no K/V all-gather); Mochi's attention along T moves its rows by
    all-to-all instead (`haloshard._swap`), with no K/V block broadcast."""
    for got in gloo(2).run(diffusers_blocks_on_gloo, name, part, timeout=300):
        assert got["error"] <= 1e-10, got
        if name == "mochi":
            assert got["calls"].get("all_to_all_single", 0) > 0, got  # the rows moved
            assert got["calls"].get("broadcast", 0) == 0, got
        else:
            assert got["calls"].get("broadcast", 0) > 0, got  # the block path ran
