"""`frame_attention` against `scaled_dot_product_attention` over all T*S tokens on one
device, with the dense block-causal mask built there (and without a mask), forward and
gradients of q, k and v, on simulated ranks with uneven and empty shards.

Float64 at 1e-12: the same sums (a softmax over T*S keys) in another order; a key from a
wrong frame changes the output by O(0.1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from haloshard import HaloError, frame_attention
from haloshard._layout import shard_sizes
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

TOL = {"atol": 1e-12, "rtol": 1e-12}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
              ) -> tuple[torch.Tensor, ...]:
    """Output and the gradients of q, k, v for a sum-of-output loss, on one device."""
    b, h, t, s, e = q.shape
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    flat = [x.reshape(b, h, t * s, e) for x in leaves]
    frames = torch.arange(t).repeat_interleave(s)
    mask = frames[None, :] <= frames[:, None] if causal else None
    out = F.scaled_dot_product_attention(*flat, attn_mask=mask).reshape(b, h, t, s, e)
    out.sum().backward()
    return (out.detach(), *(x.grad for x in leaves))


@pytest.mark.simulated
@pytest.mark.parametrize(("frames", "world"), [(5, 2), (5, 3), (3, 4)])  # 3 on 4: empty
@pytest.mark.parametrize("causal", [True, False])
def test_frame_attention(frames: int, world: int, causal: bool) -> None:
    q, k, v = (seeded_randn((1, 2, frames, 4, 3), seed) for seed in range(3))
    with single_device():
        out, gq, gk, gv = reference(q, k, v, causal)
    with simulated_mesh(world) as mesh:
        local = [rank_map(mesh, lambda r, x=x: shard(x, 2, world, r).clone()).requires_grad_()
                 for x in (q, k, v)]
        y = frame_attention(*local, mesh, global_length=frames, causal=causal)
        assert_close_per_rank(y, lambda r: shard(out, 2, world, r), mesh, **TOL)
        y.sum().backward()
        # each rank's dK, dV are its chunk's: reduce-scattered by the gather's backward
        for leaf, grad in zip(local, (gq, gk, gv), strict=True):
            assert_close_per_rank(leaf.grad, lambda r, g=grad: shard(g, 2, world, r), mesh,
                                  **TOL)
        with pytest.raises(HaloError, match="one shape"):
            frame_attention(local[0], local[1][..., :2], local[2], mesh, global_length=frames)


def frame_attention_steady_state() -> dict[str, Any]:
    """With a style's agreements (`_reuse`), K and V are agreed at the first call, then
    gathered with no metadata collective; exact against one device each time."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = worker_mesh(world)
    q, k, v = (seeded_randn((1, 2, 5, 4, 3), seed) for seed in range(3))
    with single_device():
        out, gq, gk, gv = reference(q, k, v, True)
    store: dict[Any, Any] = {}
    counts, errors = [], []
    for _ in range(2):
        local = [shard(x, 2, world, rank).clone().requires_grad_() for x in (q, k, v)]
        with counted_collectives(by_dtype=True) as calls:
            y = frame_attention(*local, mesh, global_length=5, _reuse=(store, "signature"))
        y.sum().backward()
        counts.append(dict(calls))
        wants = [(y, out), *((x.grad, g) for x, g in zip(local, (gq, gk, gv), strict=True))]
        errors.append(max((a - shard(b, 2, world, rank)).abs().max().item() for a, b in wants))
    return {"counts": counts, "errors": errors}


@pytest.mark.gloo
def test_frame_attention_steady_state(gloo: Callable[[int], Any]) -> None:
    for got in gloo(2).run(frame_attention_steady_state, timeout=120):
        first, later = got["counts"]
        assert first == {"all_gather_single (metadata)": 1, "all_gather_single": 1}, first
        assert later == {"all_gather_single": 1}, later  # K and V in one gather, no metadata
        assert max(got["errors"]) <= 1e-12, got


def one_token_inference(frames: int, causal: bool, dtype: torch.dtype) -> dict[str, Any]:
    """Inference with one token per frame (Mochi's per-pixel attention along T): each K/V
    block through CPU's fused kernel, merged by its log-sum-exp, on q, k, v that are strided
    views (heads split off a linear's output, as the Mochi plan passes them)."""
    import haloshard._masked_attention as masked

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = worker_mesh(world)
    # (B, pixels, T, heads * E) -> (B, pixels, heads, T, 1, E) views
    qkv = [seeded_randn((2, 3, frames, 2 * 4), seed, dtype) for seed in range(3)]
    views = [x.unflatten(-1, (2, 4)).transpose(-3, -2).unsqueeze(-2) for x in qkv]
    with single_device():
        out = reference(*(x.flatten(0, 1).to(torch.float64) for x in views), causal)[0]
    calls = []
    fused = masked.sdpa_flash_cpu
    masked.sdpa_flash_cpu = lambda *a, **k: calls.append(1) or fused(*a, **k)
    try:
        local = [shard(x, 2, world, rank) for x in qkv]
        heads = [x.unflatten(-1, (2, 4)).transpose(-3, -2).unsqueeze(-2) for x in local]
        with torch.no_grad():
            y = frame_attention(*heads, mesh, global_length=frames, causal=causal)
    finally:
        masked.sdpa_flash_cpu = fused
    expected = shard(out.unflatten(0, (2, 3)), 3, world, rank).to(dtype)
    return {"shape": tuple(y.shape) == tuple(heads[0].shape), "calls": len(calls),
            "error": (y - expected).abs().max().item() if y.numel() else 0.0}


@pytest.mark.gloo
@pytest.mark.parametrize(("frames", "causal", "dtype"), [
    (5, True, torch.float64),  # 2, 2, 1 frames: causal within the own block, earlier seen
    (5, False, torch.float64),
    (2, True, torch.float64),  # 1, 1, 0: a rank without frames
    (7, True, torch.float32),
])
def test_one_token_inference_gloo(gloo: Callable[[int], Any], frames: int, causal: bool,
                                  dtype: torch.dtype) -> None:
    """Float64 at 1e-12 as above; float32 at 1e-6 (the fused kernel's float32 sums, merged
    across blocks, against float64 on one device; a wrong key is O(0.1))."""
    rows = gloo(3).run(one_token_inference, frames, causal, dtype, timeout=120)
    sizes = shard_sizes(frames, 3)
    for rank, got in enumerate(rows):
        assert got["shape"], got
        assert got["error"] <= (1e-12 if dtype == torch.float64 else 1e-6), (rank, got)
        # the blocks this rank's queries see: its own, and (causal) only the earlier ones
        seen = [s for s in range(3) if sizes[s] and sizes[rank]
                and (not causal or s <= rank)]
        assert got["calls"] == len(seen), (rank, got, seen)
